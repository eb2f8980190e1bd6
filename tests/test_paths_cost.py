"""The code-path matrix at its cost: checks declare that they run per cell, a cell is one short shape with one session
shared by its checks, and what a cell runs does not grow with inputs.seq_len. Costs are counted in forward tokens
(session.forward_tokens), never timed."""

from __future__ import annotations

import pytest
import torch

from fwdcheck.config.registry import direct, select
from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.result import Check, CheckResult, Status
from fwdcheck.run.code_paths import CELL_LENGTH, CodePath, cell_length, path_cells, runs_per_code_path
from fwdcheck.run.runner import run_cell
from fwdcheck.run.settings import Settings
from tests.conftest import run_checks
from tests.models import PathBugModel
from tests.test_paths import PATH_BUG_CELLS

PATH_BUG = {"source": "python", "factory": "tests.models:path_bug"}
PROBE = "tests.test_paths_cost:CellProbe"


class CellProbe(Check):
    """A plugin-style check that runs per cell and reports what it saw there."""

    name = "cell-probe"
    description = "what a per-path check sees in a cell"
    explain = "test helper"
    per_code_path = True

    def run(self, model, session) -> CheckResult:
        before = session.forward_tokens
        session.observation()
        B, T = session.inputs.shape
        return CheckResult(
            self.name,
            Status.PASS,
            f"B={B}, T={T}",
            metrics={
                "rows": B,
                "length": T,
                "observation_tokens": session.forward_tokens - before,
                "padding": model.padding,
                "shortest": session.min_seq_len,
            },
        )


class OnceProbe(CellProbe):
    name = "once-probe"
    per_code_path = False


class InterruptedInCells(CellProbe):
    """Ctrl-C arrives while the matrix runs (the cells are shorter than the run's inputs)."""

    name = "interrupted-in-cells"

    def run(self, model, session) -> CheckResult:
        if session.inputs.shape[1] < 32:
            raise KeyboardInterrupt
        return super().run(model, session)


class LongOnly(PathBugModel):
    """A correct model that refuses sequences shorter than 16 tokens, without declaring it."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, output_attentions=False):
        assert input_ids.shape[1] >= 16, f"needs at least 16 tokens, got {input_ids.shape[1]}"
        return super().forward(input_ids, attention_mask, position_ids, output_attentions)


def long_only() -> torch.nn.Module:
    torch.manual_seed(0)
    return LongOnly("none")


def setup(model: dict, seq_len: int = 32, **top):
    config = config_from_dict(
        {
            "model": model,
            "inputs": {"batch_size": 2, "seq_len": seq_len},
            "code_paths": {"enabled": True, **top.pop("code_paths", {})},
            **top,
        }
    )
    return load_model(config), Settings.from_config(config)


def test_the_checks_say_whether_they_run_per_code_path():
    declared = {entry.name: runs_per_code_path(entry.load()) for entry in select(None)}
    assert declared["future-token"] and declared["mask-audit"]
    assert not declared["shape-ledger"] and not declared["rope"]
    assert not runs_per_code_path(object())  # a plugin that predates the attribute runs once


def test_a_plugin_check_runs_over_the_matrix_when_it_declares_so():
    report = run_checks(
        PATH_BUG,
        [PROBE, "tests.test_paths_cost:OnceProbe"],
        code_paths={"enabled": True},
        inputs={"batch_size": 2, "seq_len": 32},
    )
    rows = report.result("cell-probe").paths.rows
    assert len(rows) == 12 + 1 and {r.status.value for r in rows} == {"pass"}  # and the train path
    assert {r.summary for r in rows} == {f"B=1, T={CELL_LENGTH}", f"B=2, T={CELL_LENGTH}"}
    assert {r.seq_len for r in rows} == {CELL_LENGTH}
    assert report.result("once-probe").paths is None


def test_one_session_per_cell_shared_by_its_checks():
    """The cell's observation pass is run once, by the first check that asks; the others get it for free."""
    model, settings = setup(PATH_BUG)
    cell = CodePath(None, True, "left-pad", 2)
    entries = [*select(["future-token", "mask-audit"]), direct(PROBE)]
    run = run_cell(cell, entries, model, settings)
    assert [r.status for r in run.results] == [Status.PASS] * 3
    future, audit, probe = run.forward_tokens
    assert future > 0 and audit == 0 and probe == 0
    assert run.results[2].metrics["observation_tokens"] == 0
    alone = run_cell(cell, [direct(PROBE)], model, settings)
    assert alone.results[0].metrics["observation_tokens"] == 2 * CELL_LENGTH  # what the probe saved beside the others
    assert alone.results[0].metrics["padding"] == 3  # the left-pad view


@pytest.mark.parametrize(
    "top, declared, expected",
    [
        ({}, {}, CELL_LENGTH),
        ({"code_paths": {"seq_len": 12}}, {}, 12),  # the config widens the cells
        ({"code_paths": {"seq_len": 64}}, {}, 32),  # never beyond inputs.seq_len
        ({}, {"min_seq_len": 12}, 12),  # never below what the model accepts
    ],
)
def test_cell_length(top, declared, expected):
    config = config_from_dict({"model": PATH_BUG, "inputs": {"batch_size": 2, "seq_len": 32, **declared}, **top})
    model, settings = load_model(config), Settings.from_config(config)
    for cell in path_cells(model, settings.code_paths.model_copy(update={"enabled": True}), 2):
        assert cell_length(settings, model, cell, shortest=settings.inputs.min_seq_len or 1) == expected


def test_cells_keep_the_left_padding_within_the_models_positions():
    model, settings = setup({**PATH_BUG, "max_positions": 10}, seq_len=10, code_paths={"seq_len": 10})
    lengths = {
        cell.attention_mask: cell_length(settings, model, cell) for cell in path_cells(model, settings.code_paths, 2)
    }
    assert lengths == {"absent": 10, "ones": 10, "left-pad": 7}
    run = run_cell(CodePath(None, False, "left-pad", 2), [*select(["future-token"])], model, settings)
    assert run.seq_len == 7 and run.results[0].status == Status.PASS


def test_a_cell_runs_no_shorter_pass_than_its_own_length():
    """The cell's session declares its length as the shortest: a prefix ladder stays with the default run."""
    model, settings = setup(PATH_BUG)
    run = run_cell(CodePath(None, False, "absent", 1), [direct(PROBE)], model, settings)
    assert run.results[0].metrics["shortest"] == CELL_LENGTH


def test_what_a_cell_runs_does_not_grow_with_the_inputs():
    """The default run pays for inputs.seq_len; the matrix pays for its cells' short shape only."""
    entries = select(["future-token", "mask-audit"])
    tokens = {}
    for seq_len in (32, 128):
        model, settings = setup(PATH_BUG, seq_len=seq_len)
        cells = path_cells(model, settings.code_paths, settings.inputs.batch_size)
        runs = [run_cell(cell, entries, model, settings) for cell in cells]
        assert all(r.status == Status.PASS for run in runs for r in run.results)
        tokens[seq_len] = [sum(run.forward_tokens) for run in runs]
    assert tokens[32] == tokens[128]
    # A cell holds a handful of rows of its own length (the observation, the cut rows, the unpadded twin), never a
    # pass at the run's full length.
    assert max(tokens[128]) <= 16 * CELL_LENGTH


def test_ctrl_c_during_the_matrix_keeps_the_default_results():
    report = run_checks(
        PATH_BUG,
        ["future-token", "tests.test_paths_cost:InterruptedInCells"],
        code_paths={"enabled": True},
        inputs={"batch_size": 2, "seq_len": 32},
    )
    assert report.interrupted
    assert [r.status for r in report.results] == [Status.PASS, Status.PASS]
    assert report.result("future-token").paths is None
    assert any("code-path matrix" in note for note in report.notes)


def test_a_cell_the_model_refuses_at_the_short_length_runs_at_the_full_one():
    report = run_checks(
        {"source": "python", "factory": "tests.test_paths_cost:long_only"},
        ["future-token", "mask-audit"],
        code_paths={"enabled": True},
        inputs={"batch_size": 2, "seq_len": 32},
    )
    for check in ("future-token", "mask-audit"):
        rows = report.result(check).paths.rows
        assert {r.status.value for r in rows} == {"pass"}, rows
        assert {r.seq_len for r in rows} == {32}
        assert all(f"raised at T={CELL_LENGTH}" in r.note for r in rows)
    assert report.exit_code == 0


@pytest.mark.parametrize("bug, check, code, fails_on", PATH_BUG_CELLS)
@pytest.mark.slow
def test_short_cells_of_a_long_run_fail_exactly_on_their_paths(bug, check, code, fails_on):
    """inputs.seq_len 64, cells of 8 tokens: every path bug still fails on exactly its cells."""
    report = run_checks(
        {**PATH_BUG, "kwargs": {"bug": bug}},
        ["future-token", "mask-audit"],
        code_paths={"enabled": True},
        inputs={"batch_size": 2, "seq_len": 64},
    )
    rows = report.result(check).paths.rows
    assert {r.seq_len for r in rows} == {CELL_LENGTH}
    assert {r.path for r in rows if code in r.codes} == {r.path for r in rows if fails_on(r.path)}


@pytest.mark.slow
def test_falcon_output_attentions_leak_shows_in_short_cells_of_a_long_run():
    """The run's inputs are 32 tokens, its cells 8: the Falcon cells flagged are exactly those whose path leaks at 8
    tokens by a direct measurement (output_attentions=True up to transformers 5.24, none from 5.25)."""
    pytest.importorskip("transformers")
    from tests import compat

    leaks = compat.falcon_leaks(CELL_LENGTH)
    report = run_checks(compat.FALCON, ["future-token", "mask-audit"], inputs={"batch_size": 2, "seq_len": 32})
    rows = report.result("future-token").paths.rows
    assert len(rows) == 24 + 1 and {r.seq_len for r in rows} == {CELL_LENGTH}  # and the train path
    flagged = {r.path for r in rows if "FWD101" in r.codes}
    assert flagged == {r.path for r in rows if leaks["output_attentions=True" in r.path]}
