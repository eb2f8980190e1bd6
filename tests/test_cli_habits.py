"""The command line's habits, as pytest and ruff users expect them: a default config, several configs in one run,
-q/-v, -V, `explain CODE`, `schema`, a help text that shows flags as flags, `list`/`explain` without torch, a reader
that stops early (`| head`), COLUMNS honoured off a terminal."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fwdcheck import __version__
from fwdcheck.cli import app, paragraphs
from fwdcheck.report.formats import shortest_names
from fwdcheck.run_command import signals_deferred, worst_exit

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "sample_configs" / "toy.yaml"
BROKEN = REPO / "sample_configs" / "broken" / "inverted-bool-mask.yaml"

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def fwdcheck(*args, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fwdcheck", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_run_without_a_config_uses_fwdcheck_yaml_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = invoke("run")
    assert missing.exit_code == 2 and "fwdcheck init" in missing.stderr and "fwdcheck.yaml" in missing.stderr
    shutil.copy(TOY, tmp_path / "fwdcheck.yaml")
    result = invoke("run", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"] == "fwdcheck.yaml"


@pytest.mark.slow
def test_several_configs_make_one_report_and_the_worst_exit_code(tmp_path):
    result = invoke("run", TOY, BROKEN, "--format", "json", "--junit", tmp_path / "report.xml")
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    assert document["exit_code"] == 1
    assert [r["exit_code"] for r in document["reports"]] == [0, 1]
    suites = ET.parse(tmp_path / "report.xml").getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == [str(TOY), str(BROKEN)]
    terminal = invoke("run", TOY, BROKEN, "-q")
    lines = terminal.stdout.strip().splitlines()
    assert lines[0].startswith("fwdcheck toy.yaml: passed (exit 0)")
    assert lines[1].startswith("fwdcheck inverted-bool-mask.yaml: failed (exit 1)")
    assert lines[-1] == "2 configs: toy.yaml passed, inverted-bool-mask.yaml failed → exit 1"


def test_configs_of_one_name_are_told_apart_by_their_folders(tmp_path):
    """A monorepo's `fwdcheck.yaml` in two folders (the name `init` and the pre-commit hook default to): each is
    named by the shortest path that tells them apart."""
    for folder, source in [("a", TOY), ("b", BROKEN)]:
        (tmp_path / "models" / folder).mkdir(parents=True)
        shutil.copy(source, tmp_path / "models" / folder / "fwdcheck.yaml")
    a, b = (tmp_path / "models" / f / "fwdcheck.yaml" for f in "ab")
    lines = invoke("run", a, b, "-q", "--in-process").stdout.strip().splitlines()
    assert lines[0].startswith("fwdcheck a/fwdcheck.yaml: passed (exit 0)")
    assert lines[1].startswith("fwdcheck b/fwdcheck.yaml: failed (exit 1)")
    assert lines[-1] == "2 configs: a/fwdcheck.yaml passed, b/fwdcheck.yaml failed → exit 1"


def test_shortest_names():
    assert shortest_names(["x/toy.yaml", "y/other.yaml"]) == {"x/toy.yaml": "toy.yaml", "y/other.yaml": "other.yaml"}
    assert shortest_names(["r/a/c/f.yaml", "r/b/c/f.yaml", "f.yaml"]) == {
        "r/a/c/f.yaml": "a/c/f.yaml",
        "r/b/c/f.yaml": "b/c/f.yaml",
        "f.yaml": "f.yaml",
    }


@pytest.mark.slow
def test_a_config_that_cannot_run_does_not_stop_the_others(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text('model: {source: python, factory: "no_such_module_here:build"}\n')
    result = invoke("run", bad, TOY, "--format", "json")
    document = json.loads(result.stdout)
    assert document["exit_code"] == 2  # a config that cannot be built outranks a pass
    assert [n["config"] for n in document["not_run"]] == [str(bad)] and len(document["reports"]) == 1
    assert result.exit_code == 2 and "no_such_module_here" in result.stderr


def test_ledger_options_take_one_config(tmp_path):
    result = invoke("run", TOY, TOY, "--save-ledger", tmp_path / "ledger.json")
    assert result.exit_code == 2 and "one config" in result.stderr


def test_worst_exit_order():
    assert worst_exit([0, 5, 1]) == 1
    assert worst_exit([1, 2, 0]) == 2
    assert worst_exit([1, 3]) == 3
    assert worst_exit([3, 130]) == 130
    assert worst_exit([130, 143]) == 143
    assert worst_exit([]) == 0


@pytest.mark.slow
def test_quiet_is_one_line_and_verbose_shows_every_panel():
    quiet = invoke("run", TOY, "-q")
    assert quiet.exit_code == 0 and quiet.stdout.strip().count("\n") == 0
    assert quiet.stdout.startswith("fwdcheck: passed (exit 0)")
    default = invoke("run", TOY).stdout
    verbose = invoke("run", TOY, "-v").stdout
    assert "╭─ shape-ledger" not in default and "╭─ shape-ledger" in verbose  # a passing check's panel
    assert default.rstrip().endswith("passed (exit 0)") and verbose.rstrip().endswith("passed (exit 0)")


def test_version_short_flag():
    assert invoke("-V").stdout.strip() == f"fwdcheck {__version__}"


def test_explain_a_finding_code():
    mine = invoke("explain", "FWD202")
    assert mine.exit_code == 0 and mine.stdout.startswith("FWD202 (mask-audit):")
    assert "convention" in mine.stdout
    own = invoke("explain", "fwd005")
    assert own.exit_code == 0 and "FWD005 (fwdcheck itself)" in own.stdout
    unknown = invoke("explain", "FWD999")
    assert unknown.exit_code == 2 and "unknown finding code FWD999" in unknown.stderr


def test_explain_text_is_wrapped_by_the_terminal_not_the_source():
    """A paragraph wrapped at the source's width joins into one line; items and labelled paragraphs stay apart."""
    text = (
        "Why: " + "word " * 25 + "\n" + "more words.\nHow to fix: do this.\n  (a) an item that goes on\n"
        "      deeper indented.\n  (b) the next item."
    )
    assert paragraphs(text).splitlines() == [
        "Why: " + "word " * 25 + "more words.",
        "How to fix: do this.",
        "  (a) an item that goes on deeper indented.",
        "  (b) the next item.",
    ]
    result = fwdcheck("explain", "rope", env={"COLUMNS": "80"})
    assert result.returncode == 0 and max(len(line) for line in result.stdout.splitlines()) <= 80


def test_schema_prints_the_json_report_schema_by_default():
    result = invoke("schema")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["properties"]["exit_code"]["enum"][-1] == 143


def test_help_shows_flags_as_flags_and_exit_codes_one_a_line():
    result = fwdcheck("run", "--help", env={"COLUMNS": "80"})
    text = result.stdout
    assert result.returncode == 0
    assert "<bool>" not in text and "--exhaustive <" not in text
    assert "9223372036854775808" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for code in ("0 ", "1 ", "2 ", "3 ", "5 ", "130 "):
        assert any(line.strip().startswith(code) for line in text.splitlines()), code
    assert "-v, --verbose" in text and "-q, --quiet" in text


def test_seed_out_of_range_is_one_line():
    result = invoke("run", TOY, "--seed", str(2**64))
    assert result.exit_code == 2 and "--seed" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_list_and_explain_do_not_import_torch():
    script = (
        "import sys\nfrom typer.testing import CliRunner\nfrom fwdcheck.cli import app\n"
        "for args in (['list'], ['explain', 'rope'], ['explain', 'FWD301']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.slow
def test_a_reader_that_stops_early_is_a_clean_exit():
    """`fwdcheck run toy.yaml | head -1`: the exit code is the report's, nothing on stderr."""
    for fmt in ("rich", "json"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "fwdcheck", "run", str(TOY), "-v", "--format", fmt],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        proc.stdout.readline()
        proc.stdout.close()  # the reader goes away
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 0, stderr
        assert stderr == ""


@pytest.mark.slow
def test_columns_is_honoured_off_a_terminal():
    proc = fwdcheck("run", BROKEN, env={"COLUMNS": "80"})
    assert proc.returncode == 1
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    wide = fwdcheck("run", BROKEN, env={"COLUMNS": ""})
    assert max(len(line) for line in wide.stdout.splitlines()) > 80  # a CI log: 120 wide


def test_ctrl_c_while_the_reports_are_written_is_deferred():
    # Ctrl-C as a command line starts with it, whatever the test process was left with
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)  # ignored: no KeyboardInterrupt here
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # outside it, Ctrl-C is Ctrl-C again
            # A process of several threads (a pytest-xdist worker's) may take the signal on another thread: Python then
            # raises it in the main thread at its next check, which the wait gives it.
            for _ in range(100):
                time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.mark.slow
def test_terminal_findings_name_the_model_codes_file_and_line():
    """The attention call that misbehaved, as file:line, in the terminal as in every other report."""
    out = invoke("run", BROKEN, "--check", "mask-audit").stdout
    assert re.search(r"fwdcheck/model/reference\.py:\d+", out), out


@pytest.mark.slow
@pytest.mark.parametrize("command", ["list", "explain mask-audit", "explain FWD002"])
def test_list_and_explain_piped_end_cleanly_and_without_trailing_spaces(command):
    """`fwdcheck list | head -1` exited 1 in about half the tries (rich's exit on a broken pipe), and every line
    piped ended in the spaces rich pads a table with."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(3):
        piped = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {shlex.quote(sys.executable)} -m fwdcheck {command} | head -1"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    whole = fwdcheck(*command.split())
    assert whole.returncode == 0
    assert [line for line in whole.stdout.splitlines() if line != line.rstrip()] == []
