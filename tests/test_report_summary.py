"""What a reader sees at the end of a run, from the user's side: a failing run ends with a short summary, one line a
finding; a model that raises is said once; off a terminal nothing is cut and no line ends in spaces; on one the table
keeps its shape; with several configs the quiet lines name their file."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.report.terminal import render

ROOT = Path(__file__).resolve().parent.parent
BROKEN = ROOT / "sample_configs/broken/no-causal-mask.yaml"
TOY = ROOT / "sample_configs/toy.yaml"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
runner = CliRunner()

RAISES = """\
import torch.nn as nn


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, input_ids):
        raise RuntimeError("shapes do not match: 3 vs 4")


def build():
    return Raises()
"""


def run(*args, columns: int = 80, **env):
    return runner.invoke(app, ["run", *map(str, args)], env={"COLUMNS": str(columns), **env}, catch_exceptions=False)


@pytest.fixture
def raising(tmp_path, monkeypatch):
    """A python-source config whose model raises in its forward."""
    (tmp_path / "raising_model.py").write_text(RAISES)
    monkeypatch.delitem(sys.modules, "raising_model", raising=False)
    config = tmp_path / "raises.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            model:
              source: python
              factory: "raising_model:build"
              python_path: ["."]
              vocab_size: 16
            inputs: {batch_size: 2, seq_len: 4}
            """
        )
    )
    yield config
    sys.modules.pop("raising_model", None)


@pytest.mark.slow
def test_a_failing_run_ends_with_one_line_per_finding():
    result = run(BROKEN)
    assert result.exit_code == 1
    lines = ANSI.sub("", result.stdout).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("short summary"))
    summary = " ".join(lines[start + 1 : -1]).split("FAIL ")[1:]
    summary = ["FAIL " + line for line in summary]
    assert lines[-1] == "failed (exit 1)"
    # every finding that failed the run, and nothing else: check, code, then the module and file:line when known
    assert [line.split(" - ")[0] for line in summary] == [
        "FAIL future-token FWD101 layers.0.attn fwdcheck/model/reference.py:227",  # the call the leak comes through
        "FAIL future-token FWD105",
        "FAIL mask-audit FWD201 layers.0.attn fwdcheck/model/reference.py:227",
        "FAIL kv-cache FWD503",  # the cached decode reads the future too
        "FAIL kv-cache FWD501",
        # torch's nn.Linear: the model's code that calls it
        "FAIL grad-causality FWD121 layers.0.attn.o_proj fwdcheck/model/reference.py:190",
    ]


@pytest.mark.slow
def test_a_passing_run_has_no_summary():
    result = run(TOY)
    assert result.exit_code == 0
    assert "short summary" not in result.stdout
    assert ANSI.sub("", result.stdout).splitlines()[-1] == "passed (exit 0)"


def test_on_a_terminal_each_summary_line_fits_the_window():
    from tests.test_terminal_width import report_of

    report = report_of(BROKEN)
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    render(report, console)
    text = console.file.getvalue()
    summary = text.split("short summary")[1].splitlines()[1:-1]
    # future-token's two codes, mask-audit's, kv-cache's two and grad-causality's: a mask lost everywhere
    assert len(summary) == 6 and all(len(line) <= 80 for line in summary)
    assert summary[0].endswith("…")  # cut to the window: the panels above hold the whole message
    # and a passing check's summary row is cut to one line, as before
    assert re.search(r"^shape-ledger\s+pass\b.*…$", text, re.MULTILINE)


@pytest.mark.slow
def test_off_a_terminal_nothing_is_cut_and_no_line_ends_in_spaces():
    for columns in (80, 120):
        out = ANSI.sub("", run(BROKEN, columns=columns).stdout)
        assert "…" not in out
        assert not [line for line in out.splitlines() if line != line.rstrip()]
        assert all(len(line) <= columns for line in out.splitlines())
        # the passing shape-ledger row's summary is whole, wrapped in its column
        assert "softmax over the keys" in re.sub(r"\s+", " ", out)
        # the summary lines are whole, wrapped
        assert "every query of 9 reads every key" in re.sub(r"\s+", " ", out.split("short summary")[1])


@pytest.mark.slow
def test_output_file_is_whole_and_stripped(tmp_path):
    target = tmp_path / "report.txt"
    assert run(BROKEN, "--output", target).exit_code == 1
    text = target.read_text()
    assert "…" not in text and "short summary" in text
    assert not [line for line in text.splitlines() if line != line.rstrip()]


@pytest.mark.slow
def test_a_model_that_raises_is_said_once(raising):
    result = run(raising)
    assert result.exit_code == 1
    out = ANSI.sub("", result.stdout)
    assert out.count("shapes do not match") == 2  # its panel, and its summary line
    # the seven checks that apply to it; kv-cache, packing, label-shift and rope-precision do not
    assert "every check needs a forward: 7 checks not run" in out
    summary = [" ".join(out.split("short summary")[1].split("\n")[1:-2])]
    assert summary[0].startswith("ERROR FWD002 the model raised RuntimeError: shapes do not match: 3 vs 4 at ")
    assert "".join(summary[0].split()).endswith("raising_model.py:10inforward;everycheckneedsaforward:7checksnotrun")
    assert "shape-ledger   error" not in out  # no row a check, each repeating it


@pytest.mark.slow
def test_quiet_shows_the_exception_once(raising):
    result = run("-q", raising)
    assert result.exit_code == 1
    line = ANSI.sub("", result.stdout).strip()
    assert line.count("\n") == 0
    assert "the model raised RuntimeError: shapes do not match: 3 vs 4 at " in line
    assert "raising_model.py:10 in forward; 7 checks not run" in line
    assert "; did not apply: kv-cache, packing, label-shift, rope-precision" in line
    assert "FWD002, " not in line


@pytest.mark.slow
def test_a_model_error_in_one_check_only_stays_in_its_row(raising):
    result = run(raising, "--check", "rope")
    out = ANSI.sub("", result.stdout)
    assert result.exit_code == 1
    assert re.search(r"^rope\s+error", out, re.MULTILINE)
    assert "not run" not in out


@pytest.mark.slow
def test_quiet_with_several_configs_names_each_file(raising):
    result = run("-q", raising, TOY)
    lines = ANSI.sub("", result.stdout).splitlines()
    assert lines[0].startswith("fwdcheck raises.yaml: failed (exit 1)")
    assert lines[1].startswith("fwdcheck toy.yaml: passed (exit 0)")
    assert lines[2] == "2 configs: raises.yaml failed, toy.yaml passed → exit 1"


@pytest.mark.slow
def test_quiet_with_one_config_stays_as_it_was():
    line = ANSI.sub("", run("-q", TOY).stdout)
    assert line.startswith("fwdcheck: passed (exit 0)")


@pytest.mark.slow
def test_a_run_starts_without_set_up_noise():
    """torch warns "Failed to initialize NumPy" at import when numpy is missing: fwdcheck depends on numpy."""
    from importlib.metadata import requires

    assert any(r.split(">")[0].split("=")[0].strip() == "numpy" for r in requires("fwdcheck") or [])
    proc = subprocess.run(
        [sys.executable, "-m", "fwdcheck", "run", str(TOY), "-q"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr and "numpy" not in proc.stderr.lower(), proc.stderr
