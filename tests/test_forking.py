"""Workers forked from the fork server run as a new interpreter would: the run's environment and working directory,
a process group of their own; a variable the preloaded libraries read as they load, changed since the server
started, gets a new interpreter instead. Driven in-process (typer's CliRunner), as a test suite drives the CLI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fwdcheck import forking
from fwdcheck.cli import app

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux only")


def where_am_i() -> torch.nn.Module:
    """A correct causal model that writes down the process it was built in: its parent, its process group, what the
    environment and the working directory hold, torch's thread count."""
    torch.manual_seed(0)
    seen = {"pid": os.getpid(), "parent": os.getppid(), "group": os.getpgid(0), "mark": os.environ.get("FWDCHECK_MARK"),
            "here": Path("here.txt").read_text() if Path("here.txt").exists() else None,
            "threads": torch.get_num_threads(), "arguments": sys.argv[1:]}
    Path(os.environ["FWDCHECK_SEEN"]).write_text(json.dumps(seen))
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))  # per-token: causal


def run(tmp_path: Path, monkeypatch) -> dict:
    seen = tmp_path / f"seen-{len(list(tmp_path.glob('seen-*')))}.json"
    monkeypatch.setenv("FWDCHECK_SEEN", str(seen))
    result = CliRunner().invoke(app, ["run", "--model", "tests.test_forking:where_am_i", "--check", "future-token",
                                      "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(seen.read_text())


def test_a_forked_worker_has_the_runs_environment_and_directory(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    first = run(tmp_path, monkeypatch)  # starts this process's fork server, if it has none yet
    assert forking.usable()
    monkeypatch.setenv("FWDCHECK_MARK", "second run")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.txt").write_text("the run's directory")
    second = run(tmp_path, monkeypatch)
    assert second["parent"] != os.getpid()  # forked from the fork server, not started by this process
    assert second["parent"] == first["parent"] or first["parent"] == os.getpid()
    assert second["mark"] == "second run" and second["here"] == "the run's directory"
    assert second["group"] == second["pid"]  # it leads a process group of its own, as a new interpreter's worker does
    assert first["arguments"] == second["arguments"] == []  # model code parsing arguments as it imports sees none


def test_a_variable_read_as_torch_loads_gets_a_new_interpreter(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    run(tmp_path, monkeypatch)
    threads = 2 if torch.get_num_threads() == 1 else 1  # within the cores: torch holds it to them
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    assert not forking.usable()
    seen = run(tmp_path, monkeypatch)
    assert seen["parent"] == os.getpid() and seen["threads"] == threads
    assert seen["group"] == seen["pid"] and seen["arguments"] == []
