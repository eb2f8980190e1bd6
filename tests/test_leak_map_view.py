"""The leak map as a reader sees it: drawn only where something moved, runs of still rows as one line, its height
capped; a passing model's -v shows no map of dots."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fwdcheck.checks.future_token_view import MAP_ROWS, leak_map
from fwdcheck.cli import app
from fwdcheck.result import CheckResult, Status

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def drawn(result: CheckResult) -> list[str]:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(leak_map(result))
    return console.file.getvalue().splitlines()


def token_map(T: int, leaking: set[int]) -> CheckResult:
    """An exhaustive map of T positions where the queries in `leaking` moved when any later token changed."""
    columns = [{"k": k, "sample": 0, "change": [1.0 if q in leaking else 0.0 for q in range(k)]} for k in range(1, T)]
    data = {"leak_map": {"kind": "token", "threshold": 1e-5, "columns": columns}}
    return CheckResult("future-token", Status.FAIL if leaking else Status.PASS, "", data=data)


def test_an_all_still_map_is_one_line():
    lines = drawn(token_map(32, set()))
    assert lines == ["leak map: every earlier position still (31 query rows)"]


def test_runs_of_still_rows_collapse_around_the_rows_that_moved():
    lines = drawn(token_map(32, {3, 20}))
    rows = [line for line in lines if re.match(r"\s+\d+\s", line)]
    assert [line.split()[0] for line in rows] == ["0", "3", "4", "20", "21"]
    assert "… to 2: still" in rows[0] and "… to 19: still" in rows[2] and "… to 30: still" in rows[4]
    assert "#" in rows[1] and "#" in rows[3]
    assert len(lines) < 10  # instead of 31 rows of dots


def test_a_single_still_row_between_leaks_stays_a_row():
    rows = [line for line in drawn(token_map(8, {1, 3})) if re.match(r"\s+\d+\s", line)]
    assert [line.split()[0] for line in rows] == ["0", "1", "2", "3", "4"]
    assert "still" not in rows[2] and "." in rows[2]


def test_a_tall_map_is_capped_and_says_what_it_left_out():
    lines = drawn(token_map(64, set(range(63))))
    rows = [line for line in lines if re.match(r"\s+(\d+\s|…)", line)]
    assert len(rows) == MAP_ROWS
    assert rows[-1].strip() == "… 40 more lines, 40 with a leak (the JSON report holds the map)"


@pytest.mark.slow
def test_cli_exhaustive_leak_at_t64_is_capped(tmp_path):
    config = tmp_path / "leak.yaml"
    config.write_text(
        "model: {source: reference, vocab_size: 16, d_model: 8, n_heads: 2, n_layers: 1, max_seq_len: 128,"
        " bugs: [no-causal-mask]}\n"
        "inputs: {batch_size: 2, seq_len: 64}\nchecks: [future-token]\n"
        "options: {future-token: {exhaustive: true}}\n"
    )
    result = runner.invoke(app, ["run", str(config)], env={"COLUMNS": "100"}, catch_exceptions=False)
    assert result.exit_code == 1
    start = result.stdout.index("query\\k")
    map_lines = [line for line in result.stdout[start:].split("# moved beyond")[0].splitlines()[1:] if "│ " != line]
    assert len(map_lines) == MAP_ROWS and "more lines" in map_lines[-1]


@pytest.mark.slow
def test_verbose_on_a_passing_model_draws_no_map():
    result = runner.invoke(
        app, ["run", "-v", str(ROOT / "sample_configs/toy.yaml")], env={"COLUMNS": "100"}, catch_exceptions=False
    )
    assert result.exit_code == 0
    assert "query\\k" not in result.stdout and "leak map: every earlier position still" in result.stdout
