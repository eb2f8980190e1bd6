"""An interruption leaves no temporary file beside an output, and the previous file whole.

A SIGTERM while an output file was written killed the run and left `.NAME.*.tmp` beside it; a SIGINT at start-up
once left `.fwdcheck-probe.*.tmp`. Here a real signal reaches a `fwdcheck run` process at chosen moments: the
process's own tempfile.mkstemp and os.replace send it to the process the moment they are called, so each moment is hit
every time (a signal from outside would land at a random one). fwdcheck holds signals while a temporary file exists
(fwdcheck/report/outputs.py: signals_held) and SIGTERM raises instead of killing (fwdcheck/errors.py:
terminate_raises), so the run ends with its exit code through its cleanup.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "sample_configs" / "toy.yaml"
PREVIOUS = '{"previous": "report"}\n'

# The command line in a process whose mkstemp (for files named PREFIX*) or os.replace signals the process itself.
DRIVER = """
import os, signal, sys, tempfile
moment, signum = sys.argv[1], getattr(signal, sys.argv[2])
mkstemp, replace = tempfile.mkstemp, os.replace

def signalling_mkstemp(*args, **kwargs):
    made = mkstemp(*args, **kwargs)
    if kwargs.get("prefix", "").startswith(moment):
        os.kill(os.getpid(), signum)
    return made

def signalling_replace(*args, **kwargs):
    if moment == "replace":
        os.kill(os.getpid(), signum)
    return replace(*args, **kwargs)

tempfile.mkstemp, os.replace = signalling_mkstemp, signalling_replace
sys.argv = ["fwdcheck", *sys.argv[3:]]
from fwdcheck.cli import main
main()
"""

MOMENTS = [
    # (where the signal lands, the signal, the exit code, whether the output holds the new report)
    (".fwdcheck-probe.", "SIGINT", 130, False),  # at start-up: the output's directory probed
    (".fwdcheck-probe.", "SIGTERM", 143, False),
    (".report.json.", "SIGTERM", 143, True),  # the report's temporary file just made: it is written whole first
    ("replace", "SIGTERM", 143, True),  # as it is renamed over the previous report
    (".report.json.", "SIGINT", 0, True),  # Ctrl-C while reports are written is ignored: the verdict stands
]


@pytest.mark.slow  # a new interpreter per moment
@pytest.mark.parametrize("moment, signame, exit_code, replaced", MOMENTS)
@pytest.mark.ordinary
def test_an_interruption_leaves_no_temporary_file_and_a_whole_output(tmp_path, moment, signame, exit_code, replaced):
    output = tmp_path / "report.json"
    output.write_text(PREVIOUS)
    args = ["run", str(TOY), "--check", "shape-ledger", "--format", "json", "--output", str(output)]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, moment, signame, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == exit_code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary file left beside it
    text = output.read_text()
    assert (text != PREVIOUS) is replaced
    if replaced:
        assert text.rstrip().endswith("}") and '"exit_code"' in text  # the new report, whole
