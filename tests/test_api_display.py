"""The Python API's report as a reader meets it: print(report) is the terminal table, rich draws it, and
raise_for_failures() fails a test at the test's own line with the findings' file:line in its message."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import fwdcheck
from fwdcheck.model.reference import build

pytest_plugins = ["pytester"]


def small(**kw):
    return build(vocab_size=32, d_model=16, n_heads=4, **kw)


def test_str_is_the_terminal_report_not_a_dataclass():
    report = fwdcheck.check_model(small(bugs=["no-causal-mask"]))
    text = str(report)
    assert not text.startswith("Report(")
    lines = text.splitlines()
    assert lines[0].startswith("fwdcheck · ")
    assert any(line.startswith("future-token") and " fail " in line for line in lines)
    assert "short summary" in text and lines[-1] == "failed (exit 1)"
    assert "…" not in text and all(line == line.rstrip() for line in lines)
    assert "\x1b[" not in text  # no colour codes in a string
    assert str(fwdcheck.check_model(small())).splitlines()[-1] == "passed (exit 0)"


def test_the_report_is_a_rich_renderable():
    report = fwdcheck.check_model(small(bugs=["no-causal-mask"]))
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(report)
    drawn = console.file.getvalue()
    assert "future-token" in drawn and "short summary" in drawn and drawn.rstrip().endswith("failed (exit 1)")
    assert all(len(line) <= 100 for line in drawn.splitlines())


TEST_FILE = """
import fwdcheck
from fwdcheck.model.reference import build


def test_clean_model():
    fwdcheck.check_model(build(vocab_size=32, d_model=16, n_heads=4)).raise_for_failures()


def test_leaky_model():
    report = fwdcheck.check_model(build(vocab_size=32, d_model=16, n_heads=4, bugs=["no-causal-mask"]))
    report.raise_for_failures()
"""


@pytest.mark.slow
def test_raise_for_failures_points_at_the_test_not_at_fwdcheck(pytester: pytest.Pytester):
    pytester.makepyfile(test_model=TEST_FILE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    output = result.stdout.str()
    # the traceback ends at the test's line; fwdcheck's own frame is hidden
    result.stdout.fnmatch_lines([">*report.raise_for_failures()", "E*ChecksFailed: fwdcheck: failed (exit 1)"])
    assert "def raise_for_failures" not in output and "raise ChecksFailed(" not in output
    # the findings, each with where to look
    result.stdout.fnmatch_lines(["E*mask-audit FWD201: *(at layers.0.attn *reference.py:*)"])
