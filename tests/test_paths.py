"""The code-path matrix: a bug that lives on one path is found on that path, and named by it."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import pytest

from fwdcheck.checks.mask_audit import MaskAudit
from fwdcheck.result import CheckResult, Finding, PathMatrix, PathRow, Shared, Status
from fwdcheck.run.code_paths import CodePath
from fwdcheck.run.matrix import CellRun, merge_cells
from tests.conftest import run_checks

CHECKS = ["future-token", "mask-audit"]


def failing_paths(report, check: str) -> set[str]:
    return {row.path for row in report.result(check).paths.rows if row.status.value == "fail"}


def run_path_bug(bug: str):
    return run_checks(
        {"source": "python", "factory": "tests.models:path_bug", "kwargs": {"bug": bug}},
        CHECKS,
        code_paths={"enabled": True},
        inputs={"batch_size": 2, "seq_len": 8},
    )


def test_matrix_covers_masks_weights_and_batch_sizes():
    report = run_path_bug("none")
    rows = report.result("future-token").paths.rows
    assert len(rows) == 2 * 3 * 2 + 1  # output_attentions x attention_mask x batch size, and the train path
    assert rows[-1].path == "train mode, default attention, mask absent, B=2"
    assert {r.status.value for r in rows} == {"pass"}
    assert report.exit_code == 0


# (planted bug, check, finding code, which cells must fail): each path bug fails on exactly its cells.
PATH_BUG_CELLS = [
    # The causal mask is dropped as soon as an attention_mask is passed: every masked path leaks.
    ("mask-drops-causal", "future-token", "FWD101", lambda p: "mask absent" not in p),
    ("mask-drops-causal", "mask-audit", "FWD201", lambda p: "mask absent" not in p),
    # The padding mask is ignored: only left padding shows it, as pads read by the real tokens.
    ("mask-ignored", "future-token", "FWD107", lambda p: "left-pad" in p),
    ("mask-ignored", "mask-audit", "FWD208", lambda p: "left-pad" in p),
    # A shortcut for batch size 1 forgets the mask: the batch-size-1 cells show it, and only they.
    ("batch1-no-mask", "future-token", "FWD101", lambda p: "B=1" in p),
    ("batch1-no-mask", "mask-audit", "FWD201", lambda p: "B=1" in p),
    # The eager fallback used when attention weights are requested forgets the mask.
    ("eager-no-mask", "future-token", "FWD101", lambda p: "output_attentions=True" in p),
    ("eager-no-mask", "mask-audit", "FWD201", lambda p: "output_attentions=True" in p),
]


@pytest.mark.parametrize("bug, check, code, fails_on", PATH_BUG_CELLS)
@pytest.mark.slow
def test_path_bug_fails_exactly_on_its_paths(bug, check, code, fails_on):
    report = run_path_bug(bug)
    result = report.result(check)
    rows = result.paths.rows
    assert {r.path for r in rows if code in r.codes} == {r.path for r in rows if fails_on(r.path)}
    assert result.status.value == "fail" and report.exit_code == 1
    finding = next(f for f in result.findings if f.code == code)
    assert f"of {len(rows)} code paths" in finding.where


def ran_in_full(rows: Sequence[PathRow]) -> list[str]:
    """The cells whose row is their own comparisons, not a verdict shared from another cell."""
    return [r.path for r in rows if r.shares is None]


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["refuses-weights", "mask-ignored,refuses-weights"])
def test_a_cell_the_model_cannot_run_is_not_judged_and_the_others_still_count(bug):
    """A model that raises on one code path (here: asked for attention weights it does not compute) is not judged on
    those cells, with its reason; the other cells still count, a padding bug on them included."""
    report = run_path_bug(bug)
    for check in CHECKS:
        result = report.result(check)
        rows = result.paths.rows
        refused = [r for r in rows if "output_attentions=True" in r.path]
        assert refused and all(r.status.value == "skip" for r in refused)
        assert all("not judged: the model cannot run this code path" in r.summary for r in refused)
        assert all("computes no weights" in r.summary for r in refused)
        judged = [r for r in rows if r not in refused]
        if bug == "refuses-weights":
            assert result.status.value == "pass" and {r.status.value for r in judged} == {"pass"}
            assert "not judged (the model cannot run them)" in result.summary
        else:  # the padding bug still fails on its cells
            assert result.status.value == "fail"
            assert {r.path for r in judged if r.status.value == "fail"} == {
                r.path for r in judged if "left-pad" in r.path
            }


def test_cells_computing_the_logits_of_a_pass_share_it():
    """On a correct model future-token runs its comparisons on the first cell only: every other cell computes the
    same logits from the same tokens (batch size 1 is the first row of 2, left padding leaves the real tokens' logits,
    output_attentions changes nothing) and takes that pass, saying from where and by how much. mask-audit, which
    reads each cell's own observation, judges every cell itself unless the cell took another's very code path."""
    report = run_path_bug("none")
    rows = report.result("future-token").paths.rows
    first = "default attention, mask absent, output_attentions=False, B=2"
    assert ran_in_full(rows) == [first] and rows[0].path == first
    for row in rows[1:]:
        assert row.status.value == "pass"
        assert row.shares is not None, row
        if row.shares.by == "logits":
            assert row.summary.startswith(f"the same logits as {first} (max difference "), row
        assert row.shares == Shared(first, "logits") or row.shares.by == "code path"
    audit = report.result("mask-audit").paths.rows  # its own, or a cell's on the very same code path
    assert all((r.shares.by if r.shares else "code path") == "code path" for r in audit)


def test_a_cell_with_other_logits_runs_its_own_comparisons():
    """An eager path (output_attentions=True) that computes other logits, causally: its first cell cannot take the
    other path's pass and runs its comparisons in full, passing on its own; the eager cells after it share that."""
    report = run_path_bug("eager-rescaled")
    rows = report.result("future-token").paths.rows
    assert {r.status.value for r in rows} == {"pass"} and report.exit_code == 0
    first, eager = (
        "default attention, mask absent, output_attentions=False, B=2",
        "default attention, mask absent, output_attentions=True, B=2",
    )
    assert ran_in_full(rows) == [first, eager]
    for row in rows:
        if row.path not in (first, eager):  # an eager cell takes an eager cell's verdict, the others the first's
            assert row.shares is not None, row
            by_logits = row.shares.by == "logits"
            source = eager if "output_attentions=True" in row.path else first
            assert (
                row.shares.cell == source
                if by_logits
                else ("output_attentions=True" in row.shares.cell) == ("output_attentions=True" in row.path)
            ), row


def test_a_failure_is_never_shared_by_logits():
    """Cells whose logits are a failing cell's run their own comparisons: each failure rests on its own evidence."""
    rows = run_path_bug("mask-drops-causal").result("future-token").paths.rows
    failing = [r.path for r in rows if r.status.value == "fail"]
    assert failing and set(failing) <= set(ran_in_full(rows))


def test_a_model_whose_path_changes_under_the_observer_shares_nothing():
    """torch's own nn.MultiheadAttention takes a fast path that steps aside under a torch function mode (the
    observer): a cell's observed logits need not be what its untouched forwards compute, so no cell takes another's
    verdict, and each runs its comparisons on untouched forwards."""
    report = run_checks(
        {"source": "python", "factory": "tests.models:torch_mha"},
        CHECKS,
        code_paths={"enabled": True},
        inputs={"batch_size": 2, "seq_len": 8},
    )
    rows = report.result("future-token").paths.rows
    assert len(rows) == 3 and ran_in_full(rows) == [r.path for r in rows]  # B=2, B=1, the train path
    assert ran_in_full(report.result("mask-audit").paths.rows) == [r.path for r in rows]
    assert report.exit_code == 0


def test_matrix_is_off_by_default_for_python_models_and_narrowable():
    default = run_checks({"source": "python", "factory": "tests.models:path_bug"}, CHECKS)
    # the train path alone: every source trains
    assert [r.path for r in default.result("future-token").paths.rows] == [
        "train mode, default attention, mask absent, B=2"
    ]
    narrowed = run_checks(
        {"source": "python", "factory": "tests.models:path_bug", "kwargs": {"bug": "mask-ignored"}},
        CHECKS,
        code_paths={"enabled": True, "attention_mask": ["ones"], "batch_size": [2]},
    )
    assert [r.path for r in narrowed.result("future-token").paths.rows] == [
        "default attention, mask ones, output_attentions=False, B=2",
        "default attention, mask ones, output_attentions=True, B=2",
        "train mode, default attention, mask absent, B=2",
    ]
    assert narrowed.exit_code == 0  # the bug needs padding to show, and the narrowed matrix has none


def test_shorter_passes_stay_with_the_default_run():
    """A cell is one shape: the prefix pass (one row, shorter than the cell) runs in the default run only. Its finding
    for the batch-size-1 shortcut stands in the merged result, and no cell is blamed for a pass it did not run."""
    result = run_path_bug("batch1-no-mask").result("future-token")
    assert not any("FWD105" in row.codes for row in result.paths.rows)
    prefix = next(f for f in result.findings if f.code == "FWD105")
    assert "code paths" not in prefix.where


def test_the_run_leaves_a_checks_data_and_metrics_as_it_returned_them(monkeypatch):
    """The matrix's rows are the result's `paths`, filled in when the cells are merged: the run adds nothing to a
    check's data or metrics, and writes nothing into what the check returned, on any path. The JSON report still
    has the rows under data.paths and the counts under metrics, and reads them back into `paths`."""
    returned: list[tuple[CheckResult, dict, dict]] = []  # each result mask-audit handed over, and copies made then
    run = MaskAudit.run

    def recorded(self, model, session) -> CheckResult:
        result = run(self, model, session)
        returned.append((result, copy.deepcopy(result.data), copy.deepcopy(result.metrics)))
        return result

    monkeypatch.setattr(MaskAudit, "run", recorded)
    report = run_checks(
        {"source": "python", "factory": "tests.models:path_bug", "kwargs": {"bug": "batch1-no-mask"}},
        ["mask-audit"],
        code_paths={"enabled": True},
        inputs={"batch_size": 2, "seq_len": 8},
    )
    result = report.result("mask-audit")
    assert len(returned) > 1  # the default path, and the cells that ran it in full
    for handed, data, metrics in returned:
        assert handed.data == data and handed.metrics == metrics and handed.paths is None
    (_, data, metrics), *_ = returned
    assert result.data == data and result.metrics == metrics  # the default path's own, nothing added
    assert result.paths is not None and not result.paths.default_fails
    failing = [row.path for row in result.paths.rows if row.status == Status.FAIL]
    assert failing and all("B=1" in path for path in failing) and result.paths.failing == len(failing)

    document = result.to_dict()
    assert list(document["data"]) == [*data, "paths"]
    assert document["data"]["paths"] == [row.to_dict() for row in result.paths.rows]
    counts = {"code_paths": len(result.paths.rows), "failing_code_paths": len(failing), "default_path_fails": 0}
    assert document["metrics"] == {**metrics, **counts} and list(document["metrics"])[-3:] == list(counts)
    back = CheckResult.from_dict(document)
    assert (back.paths, back.data, back.metrics) == (result.paths, result.data, result.metrics)
    assert back.to_dict() == document


def test_merged_cells_keep_the_checks_own_data_and_metrics_objects():
    """merge_cells builds the merged result around the default path's data and metrics, as they are."""
    default = CheckResult("c", Status.PASS, "clean", data={"calls": [1]}, metrics={"judged": 1})
    cell = CodePath(None, None, "absent", 1)
    failed = CheckResult("c", Status.FAIL, "leaks", [Finding("X1", Status.FAIL, "reads the future")])
    merged = merge_cells(default, [(CellRun(cell, 8, [failed], [0], note="ran at T=8"), failed)])
    assert merged.data is default.data and merged.metrics is default.metrics
    assert merged.data == {"calls": [1]} and merged.metrics == {"judged": 1}
    assert merged.paths == PathMatrix(
        (PathRow(cell.label, Status.FAIL, "leaks", ("X1",), 8, note="ran at T=8"),), failing=1, default_fails=False
    )
    ignored = dataclasses.replace(merged, findings=list(merged.findings))
    ignored.apply_ignores({"X1": "known"})
    assert ignored.paths is not None and ignored.paths.rows[0].status == Status.PASS
    assert ignored.paths.rows[0].summary == "leaks [ignored: X1]" and ignored.paths.failing == 1
