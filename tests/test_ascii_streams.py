"""A stream that holds only ASCII gets the nearest text, never an encoding error (fwdcheck/report/stream_text.py).

Under PYTHONIOENCODING=ascii the report's "·" raised UnicodeEncodeError and every run exited 2, a correct model
failing CI. Each format, the verbose report of a failing model, an error line on stderr and the other commands run
here in a new interpreter whose streams are ASCII; the nearest-text rule and XML's exact character references are
tested on their own below.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fwdcheck.report.stream_text import exact_for_xml, fit_stream, nearest

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "sample_configs" / "toy.yaml"
LEAK = "model: {source: reference, bugs: [no-causal-mask]}\ninputs: {seq_len: 6}\n"


def fwdcheck_ascii(*args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "fwdcheck", *map(str, args)], capture_output=True, env=env, timeout=300, cwd=cwd
    )


def ascii_text(data: bytes) -> str:
    return data.decode("ascii")  # raises on any byte beyond ASCII


@pytest.mark.slow  # a new interpreter per case
@pytest.mark.parametrize("fmt", ["rich", "json", "junit", "markdown", "github"])
@pytest.mark.ordinary
def test_every_format_of_a_passing_run_exits_0_on_an_ascii_stream(fmt):
    proc = fwdcheck_ascii("run", TOY, "--format", fmt)
    assert proc.returncode == 0, proc.stderr.decode("ascii", "replace")
    assert ("passed" if fmt == "github" else "shape-ledger") in ascii_text(proc.stdout)  # github: annotations only
    ascii_text(proc.stderr)


@pytest.mark.slow
def test_a_failing_models_verbose_report_exits_1_on_an_ascii_stream(tmp_path):
    (tmp_path / "leak.yaml").write_text(LEAK)
    proc = fwdcheck_ascii("run", tmp_path / "leak.yaml", "-v")
    assert proc.returncode == 1, proc.stderr.decode("ascii", "replace")
    out = ascii_text(proc.stdout)
    assert "FWD101" in out and "+-" in out  # the finding, in a panel drawn with ASCII corners


@pytest.mark.slow
def test_an_error_line_and_the_other_commands_on_an_ascii_stream(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: {source: reference}\ntolerance: {atol: .inf}\n")
    proc = fwdcheck_ascii("run", tmp_path / "bad.yaml")
    assert proc.returncode == 2 and "tolerance.atol" in ascii_text(proc.stderr)
    for command in (["list"], ["explain", "future-token"], ["init", tmp_path / "new.yaml"]):
        proc = fwdcheck_ascii(*command)
        assert proc.returncode == 0, (command, proc.stderr.decode("ascii", "replace"))
        ascii_text(proc.stdout), ascii_text(proc.stderr)


def test_the_nearest_text_of_what_fwdcheck_writes():
    assert [nearest(c) for c in "·—→…×é"] == ["-", "--", "->", "...", "x", "e"]
    assert [nearest(c) for c in "─│┌╇"] == ["-", "|", "+", "+"]
    assert nearest("\N{SNOWMAN}") == "?"


def ascii_stream(errors: str = "strict") -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors=errors)


def test_an_ascii_stream_writes_the_nearest_text_and_a_utf8_one_is_left_alone():
    stream = ascii_stream()
    fit_stream(stream)
    stream.write("pass · 2 calls → ok — café")
    stream.flush()
    assert stream.buffer.getvalue() == b"pass - 2 calls -> ok -- cafe"  # type: ignore[attr-defined]
    utf8 = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    fit_stream(utf8)
    assert utf8.errors == "strict"
    chosen = ascii_stream("replace")  # PYTHONIOENCODING=ascii:replace: the user's own choice stands
    fit_stream(chosen)
    assert chosen.errors == "replace"


def test_xml_keeps_every_character_as_a_reference():
    text = "<?xml version='1.0'?>\n<testsuite name=\"future-token · café\"><failure>0.37 → 1e-05</failure></testsuite>"
    fitted = exact_for_xml(text, ascii_stream())
    assert fitted.isascii()
    root = ET.fromstring(fitted.split("\n", 1)[1])
    assert root.get("name") == "future-token · café" and root[0].text == "0.37 → 1e-05"
