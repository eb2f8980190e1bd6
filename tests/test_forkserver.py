"""From its second job on, a process runs each model in a worker forked from a server that has imported torch already
(fwdcheck/forkserver.py). What a model can observe of its process is what it observes in a new interpreter, and a
fork is refused where it could differ. What a forked worker does when the model misbehaves (exits, crashes, hangs,
is interrupted, outlives a supervisor killed with SIGKILL) is tested case by case beside the new interpreter's in
tests/test_supervisor.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fwdcheck import forkserver
from fwdcheck.cli import app

pytestmark = pytest.mark.skipif(not forkserver.supported(), reason="fork server: Linux only")

OBSERVING = '''
import json, os, random, signal, sys, threading
import torch, torch.nn as nn


def observe():
    """A correct causal model whose construction writes down what it can see of its process."""
    seen = {
        "cwd": os.getcwd(),
        "environment": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "argv": sys.argv,
        "path": sys.path,
        "leads its session": os.getsid(0) == os.getpid() == os.getpgid(0),
        "handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                                                signal.SIGCHLD)},
        "descriptors": len(os.listdir("/proc/self/fd")),
        "main": os.path.basename(getattr(sys.modules["__main__"], "__file__", "")),
        "threads": threading.active_count(),
        "random": random.random(),
        "torch seed": torch.initial_seed(),
        "torch threads": torch.get_num_threads(),
        "parent": os.getppid(),
    }
    with open(os.path.join(os.environ["OBSERVATIONS"], f"{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    return model
'''


@pytest.fixture
def observing(tmp_path) -> Path:
    (tmp_path / "observing_model.py").write_text(OBSERVING)
    config = tmp_path / "observe.yaml"
    config.write_text(textwrap.dedent("""\
        model: {source: python, factory: "observing_model:observe", path: ["."], vocab_size: 16}
        checks: [shape-ledger]
        """))
    (tmp_path / "seen").mkdir()
    return config


def test_a_forked_worker_sees_what_a_new_interpreter_sees(observing, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "fwdcheck", "run", observing.name, observing.name, "-q"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OBSERVATIONS": str(tmp_path / "seen")})
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    new, forked = sorted((json.loads(p.read_text()) for p in (tmp_path / "seen").iterdir()),
                         key=lambda seen: seen["parent"] != proc.pid)
    assert new["parent"] == proc.pid and forked["parent"] != proc.pid  # the second is the fork server's child
    assert new["random"] != forked["random"]  # each draws its own seed
    for key in ("parent", "random"):
        del new[key], forked[key]
    assert forked == new


def in_process(*args: str) -> int:
    return CliRunner().invoke(app, ["run", *args, "-q"]).exit_code


def test_an_environment_that_changes_gets_a_server_started_in_it(observing, tmp_path, monkeypatch):
    """OMP_NUM_THREADS (and any variable an import could read) differs from the server's: a new server, started
    in the new environment, forks the worker."""
    monkeypatch.setenv("OBSERVATIONS", str(tmp_path / "seen"))
    monkeypatch.chdir(tmp_path)
    assert in_process(observing.name) == 0  # this process's first job, or a fork
    before = forkserver.server()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert in_process(observing.name) == 0
    after = forkserver.server()
    assert after is not None and after is not before and after.forked == 1
    seen = [json.loads(p.read_text()) for p in (tmp_path / "seen").iterdir()]
    last = next(s for s in seen if s["parent"] == after.process.pid)
    assert last["torch threads"] == 2 and last["environment"]["OMP_NUM_THREADS"] == "2"


def test_a_server_that_died_is_replaced(observing, tmp_path, monkeypatch):
    monkeypatch.setenv("OBSERVATIONS", str(tmp_path / "seen"))
    monkeypatch.chdir(tmp_path)
    assert in_process(observing.name) == 0
    assert in_process(observing.name) == 0
    dead = forkserver.server()
    dead.process.kill()
    dead.process.wait()
    assert in_process(observing.name) == 0
    assert forkserver.server() is not dead and forkserver.server().alive()


def test_variables_read_only_later_do_not_restart_the_server(observing, tmp_path, monkeypatch):
    monkeypatch.setenv("OBSERVATIONS", str(tmp_path / "seen"))
    monkeypatch.chdir(tmp_path)
    assert in_process(observing.name) == 0
    assert in_process(observing.name) == 0
    server = forkserver.server()
    monkeypatch.setenv("COLUMNS", "77")
    assert in_process(observing.name) == 0
    assert forkserver.server() is server and server.forked >= 2
    newest = max((tmp_path / "seen").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert json.loads(newest.read_text())["environment"]["COLUMNS"] == "77"  # the fork has the value all the same
