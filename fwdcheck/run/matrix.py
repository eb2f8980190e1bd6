"""The verdicts of the code-path matrix's cells: a cell that takes another's (the same code path, by the signature
of its observation pass; the same logits, for a check whose verdict follows from them: code_paths.py says why
both hold), and each per-path check's cells merged into one result that lists every cell."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fwdcheck.config.registry import CheckEntry
from fwdcheck.errors import Own
from fwdcheck.result import CheckResult, Finding, PathMatrix, PathRow, Shared, Status, worst
from fwdcheck.run.code_paths import CodePath, SameLogits, path_signature
from fwdcheck.run.limits import CheckTimeout, time_limit
from fwdcheck.run.session import Session


@dataclass
class CellRun:
    """One cell of the matrix: each per-path check's result there, and the forward tokens (rows x positions) each
    ran, the cell's shared passes counted on the first check that asked for them."""

    cell: CodePath
    seq_len: int  # tokens per row of the cell's inputs
    results: list[CheckResult]
    forward_tokens: list[int]
    note: str | None = None  # how the cell came to run as it did, when not as planned
    shares: str | None = None  # the cell whose verdicts it took, having taken the same code path
    refused: bool = False  # the model could not run the cell's path at all (the train path: train mode raised)


def not_judged_where_refused(run: CellRun) -> CellRun:
    """A check the model could not run on this cell, its forward raising there (FWD002 and nothing else: XLNet's
    causal attention on any attention_mask over two rows, Reformer on left padding), is not judged on the cell, with
    the model's reason: the cell's path is one the model does not take, and the default path and the other cells
    still count. The model raising on the default path stays an error (the run made it first)."""
    results = []
    for r in run.results:
        raised = [f for f in r.findings if f.code == Own.MODEL_RAISED]
        others = [f for f in r.findings if f.code != Own.MODEL_RAISED and f.status not in (Status.PASS, Status.SKIP)]
        if r.status == Status.ERROR and raised and not others and not r.internal_error:
            why = f"not judged: the model cannot run this code path ({raised[0].message})"
            r = CheckResult(r.name, Status.SKIP, why, duration_s=r.duration_s, data={"not_judged": why})
            run.refused = True
        results.append(r)
    run.results = results
    return run


def same_logits_verdict(entry: CheckEntry, same: SameLogits, train: bool = False) -> CheckResult:
    """A check's pass on an earlier cell, taken by a cell whose logits are that cell's: this cell's measurement is
    the comparison that vouches for it; the pass it takes is named, its numbers not copied. On the train path's cell
    (`train`) the comparison is also the train path held to the eval path's logits."""
    anchor, passed = same.anchor, same.anchor.result
    summary = (
        f"{'train vs eval: ' if train else ''}the same logits as {anchor.label} (max difference "
        f"{same.difference:.2g} vs tolerance {same.tolerance:.2g}): its verdict, {passed.summary}"
    )
    metrics = {"same_logits_difference": same.difference, "same_logits_tolerance": same.tolerance}
    if train:
        metrics["train_eval_change"] = same.difference
    return CheckResult(
        entry.name,
        passed.status,
        summary,
        metrics=metrics,
        data={"same_logits_as": anchor.label},
        key_number=f"{same.difference:.2g} / {same.tolerance:.2g}",
    )


def observed_signature(session: Session) -> str | None:
    """The path_signature of the session's observation pass, which this runs (and the session keeps for its
    checks); None when the pass cannot vouch for anything. A pass that raised or hung is left to the checks, which
    ask for it again and report it as they would have (the model's error is kept; a hang costs its time limit
    once more, in the first check)."""
    try:
        with time_limit(session.settings.timeout_s):
            return path_signature(session.observation(), session.observed_logits, session.inputs)
    except (CheckTimeout, Exception):
        return None


def merge_cells(default: CheckResult, cells: list[tuple[CellRun, CheckResult]]) -> CheckResult:
    """Keep the default path's detail (leak map, mask table): its `data` and `metrics` are the check's own, as it
    returned them; add one row per cell (its path, length and verdict) in `paths` and, for each finding code that
    failed somewhere, one finding naming the cells. `cells`: each cell's run with this check's result there."""
    rows = tuple(
        PathRow(
            path=run.cell.label,
            status=r.status,
            summary=r.summary,
            codes=tuple(sorted({f.code for f in r.findings if f.status not in (Status.PASS, Status.SKIP)})),
            seq_len=run.seq_len,
            note=run.note,
            shares=shared_from(run, r),
        )
        for run, r in cells
    )
    failing = [(run.cell, r) for run, r in cells if r.status in (Status.FAIL, Status.ERROR)]
    return dataclasses.replace(
        default,
        status=worst([default.status, *(r.status for _, r in cells)]),
        summary=_merged_summary(default, cells, failing),
        findings=_merged_findings(default, cells),
        paths=PathMatrix(rows, failing=len(failing), default_fails=default.status in (Status.FAIL, Status.ERROR)),
        duration_s=default.duration_s + sum(r.duration_s for _, r in cells),
        internal_error=default.internal_error or any(r.internal_error for _, r in cells),
    )


def _merged_findings(default: CheckResult, cells: list[tuple[CellRun, CheckResult]]) -> list[Finding]:
    """The default path's findings, then one finding per code that failed only on other cells, each saying on which
    cells it was seen."""
    by_code: dict[str, tuple[Finding, list[str]]] = {}
    for run, r in cells:
        for f in r.findings:
            if f.status in (Status.PASS, Status.SKIP):
                continue
            first, where = by_code.setdefault(f.code, (f, []))
            if run.cell.label not in where:  # a cell with the code at several calls (layers) counts once
                where.append(run.cell.label)
    # A code the default path found too keeps the default path's finding (its measurement at the run's own length,
    # the module and line it names), with the cells that fail the same way added to where it was seen.
    # (The first of each code: the others, at other calls or layers, stay as they are.)
    on_default: dict[str, Finding] = {}
    for f in default.findings:
        if f.status not in (Status.PASS, Status.SKIP):
            on_default.setdefault(f.code, f)
    seen_where = {}
    for code, (_, where) in by_code.items():
        shown = "; ".join(where[:4]) + (f"; and {len(where) - 4} more" if len(where) > 4 else "")
        seen_where[code] = f"{len(where)} of {len(cells)} code paths: {shown}"
    findings = [
        f
        if f is not on_default.get(f.code) or f.code not in by_code
        else dataclasses.replace(f, where="; also on ".join(filter(None, [f.where, seen_where[f.code]])))
        for f in default.findings
    ]
    for code, (first, _) in by_code.items():
        cells_where = seen_where[code]
        if code in on_default:
            continue
        findings.append(
            Finding(
                code,
                first.status,
                first.message,
                cells_where + (f" (first at {first.where})" if first.where else ""),
                source=first.source,
                module=first.module,
            )
        )
    return findings


def _merged_summary(
    default: CheckResult, cells: list[tuple[CellRun, CheckResult]], failing: list[tuple[CodePath, CheckResult]]
) -> str:
    """The default path's summary leads when it fails; else the first failing cell's, or how many cells passed."""
    lengths = sorted({run.seq_len for run, _ in cells})
    at = f"T={lengths[0]}" if len(lengths) == 1 else f"T={lengths[0]} to {lengths[-1]}"
    train_only = len(cells) == 1 and cells[0][0].cell.train
    if failing and default.status in (Status.FAIL, Status.ERROR):  # the default path's own verdict leads
        also = "the train path fails too" if train_only else f"{len(failing)} of {len(cells)} code paths fail too"
        return f"{default.summary}; {also}"
    if failing:
        first_path, first_result = failing[0]
        return f"{len(failing)} of {len(cells)} code paths fail; first {first_path.label}: {first_result.summary}"
    unjudged = sum(r.status == Status.SKIP for _, r in cells)
    passed = "the train path passes" if train_only else f"{len(cells) - unjudged} code paths pass"
    if unjudged and not train_only:
        passed += f", {unjudged} not judged (the model cannot run them)"
    return f"{default.summary}; {passed} ({at})"


def shared_from(run: CellRun, result: CheckResult) -> Shared | None:
    """A check's `shares` on a cell: the cell whose verdict it took and by which rule; None when it ran its own.
    (`same_logits_as`: what same_logits_verdict writes into the result it makes in the check's place.)"""
    if run.shares:
        return Shared(run.shares, "code path")
    if "same_logits_as" in result.data:
        return Shared(result.data["same_logits_as"], "logits")
    return None
