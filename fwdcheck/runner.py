"""Run the selected checks on one model and collect a Report. Loaders build, checks judge, renderers show."""

from __future__ import annotations

import inspect
import platform
import re
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fwdcheck.errors import CheckLoadError, ModelRaised, SkipCheck
from fwdcheck.model import ModelUnderTest
from fwdcheck.registry import CheckEntry
from fwdcheck.paths import CodePath, cell_settings, path_cells, path_view, plain_view, runs_per_code_path
from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Finding, Status, worst
from fwdcheck.session import Session, Settings


def run_model(model: ModelUnderTest, settings: Settings, entries: list[CheckEntry], *, config_path=None,
              fail_on: str = "fail", progress: Callable[[str], None] | None = None) -> Report:
    """Every check on one session, then the per-path checks over the code-path matrix; the model is restored when
    this returns, however it returns."""
    import torch

    session = Session(model, settings)
    cells = path_cells(model, settings.paths, settings.batch_size)
    results: list[CheckResult] = []
    interrupted = False
    try:
        # One placement of the model for the whole run: the cells' sessions find it on the device and in eval mode.
        with session.active():
            for entry in entries:
                if progress:
                    progress(f"{entry.name}")
                results.append(run_one(entry, model, session))
            if cells:
                results = run_code_paths(entries, results, model, settings, cells, session, progress)
    except ModelRaised as exc:  # the model could not be prepared (eval() raised): no check can run on it
        results += [CheckResult(e.name, Status.ERROR, str(exc), [Finding("FWD002", Status.ERROR, str(exc), exc.where)])
                    for e in entries[len(results):]]
    except KeyboardInterrupt:  # Ctrl-C: the model is restored by now; report what ran, mark the rest
        interrupted = True
        if cells and len(results) == len(entries):
            session.notes.append("interrupted during the code-path matrix: the results cover the default path only")
        results += [CheckResult(e.name, Status.ERROR, "interrupted before it finished") for e in entries[len(results):]]
    for result in results:
        result.apply_ignores(settings.ignore)
        for finding in result.findings:
            finding.source = finding.source or locate(finding.where, model)
    parameters = sum(p.numel() for p in model.module.parameters())
    return Report(
        results=results,
        model={"label": model.label, "source": model.source, "parameters": parameters, "vocab_size": model.vocab_size,
               "max_positions": model.max_positions, "causal": model.causal, "dims": dict(model.dims)},
        environment={"torch": torch.__version__, "python": platform.python_version(), "device": str(session.device),
                     "dtype": settings.dtype, "seed": settings.seed, "batch_size": settings.batch_size,
                     "seq_len": settings.seq_len},
        notes=[*model.extra.get("notes", []), *session.notes],
        config_path=str(config_path) if config_path else None,
        fail_on=fail_on,
        interrupted=interrupted,
    )


def locate(where: str | None, model: ModelUnderTest) -> str | None:
    """'file:line' of the model code a finding's `where` names: the class of the first module path in it, or the
    frame a model exception came from."""
    if not where:
        return None
    frame = re.match(r"^(.+?):(\d+) in ", where)
    if frame:
        return _relative(frame.group(1)) + f":{frame.group(2)}"
    modules = dict(model.module.named_modules())
    for token in re.findall(r"[A-Za-z_][\w.]*", where):
        if token in modules and token:
            try:
                cls = type(modules[token])
                return f"{_relative(inspect.getsourcefile(cls))}:{inspect.getsourcelines(cls)[1]}"
            except (TypeError, OSError):
                return None
    return None


def _relative(path: str) -> str:
    """Relative to the working directory when under it, as CI annotations want; absolute otherwise."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


@dataclass
class CellRun:
    """One cell of the matrix: each per-path check's result there, and the forward tokens (rows x positions) each
    ran, the cell's shared passes counted on the first check that asked for them."""

    cell: CodePath
    seq_len: int  # tokens per row of the cell's inputs
    results: list[CheckResult]
    forward_tokens: list[int]
    note: str | None = None  # how the cell came to run as it did, when not as planned


def run_code_paths(entries: list[CheckEntry], results: list[CheckResult], model: ModelUnderTest, settings: Settings,
                   cells: list[CodePath], session: Session,
                   progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """The checks that declare per_code_path, once per cell, each merged into one result that lists every cell. A
    check that skipped or could not run on the default path is left as it is. Cells outside, checks inside: a cell's
    session (its observation pass, its baseline) is shared by every per-path check."""
    chosen = [i for i, (entry, result) in enumerate(zip(entries, results))
              if result.status not in (Status.SKIP, Status.ERROR) and _per_code_path(entry)]
    if not chosen:
        return results
    if progress:
        progress(f"{len(cells)} code paths")
    per_path = [entries[i] for i in chosen]
    runs = [run_path(cell, per_path, model, settings, session) for cell in cells]
    merged = list(results)
    for j, i in enumerate(chosen):
        merged[i] = merge_cells(results[i], [(run, run.results[j]) for run in runs])
    return merged


def run_path(cell: CodePath, entries: list[CheckEntry], model: ModelUnderTest, settings: Settings,
             session: Session) -> CellRun:
    """One cell as a run does it, given the run's own session: at the cell's short length, and again at
    inputs.seq_len if the model raised there. A model may refuse short sequences (a length it needs at least,
    undeclared); the default run showed that it takes inputs.seq_len, so the path gets a verdict all the same."""
    run = run_cell(cell, entries, model, settings, shortest=session.min_seq_len, max_rows=session.max_rows)
    if run.seq_len < settings.seq_len and _model_raised(run):
        again = run_cell(cell, entries, model, settings, shortest=settings.seq_len, max_rows=session.max_rows)
        again.forward_tokens = [a + b for a, b in zip(run.forward_tokens, again.forward_tokens)]
        again.note = f"the model raised at T={run.seq_len}; the cell ran at T={again.seq_len}"
        return again
    return run


def _model_raised(run: CellRun) -> bool:
    """Whether some check of the cell could not run at all because the model raised (FWD002)."""
    return any(f.code == "FWD002" for result in run.results for f in result.findings)


def _per_code_path(entry: CheckEntry) -> bool:
    try:
        return runs_per_code_path(entry.load())
    except CheckLoadError:  # it loaded for the default run; if it no longer does, it runs once, as it did
        return False


def run_cell(cell: CodePath, entries: list[CheckEntry], model: ModelUnderTest, settings: Settings, *,
             shortest: int = 1, max_rows: int | None = None) -> CellRun:
    """Every given check on one cell, in one session: the model's forward takes the cell's path, on inputs of the
    cell's batch size and length (paths.cell_settings). A left-padded cell also holds the same path without padding,
    whose logits the real tokens must reproduce. `shortest` and `max_rows` are the run's own session's."""
    from fwdcheck.hf import using_attn_implementation

    results: list[CheckResult] = []
    tokens: list[int] = []
    own = cell_settings(settings, model, cell, shortest, max_rows)  # the cell's batch size and length
    try:
        view = path_view(model, cell)
        session = Session(view, own)
        if view.padding:
            session.unpadded = plain_view(model, cell)
        with using_attn_implementation(model.module, cell.attn_implementation), session.active():
            for entry in entries:
                before = session.forward_tokens
                results.append(run_one(entry, view, session))
                tokens.append(session.forward_tokens - before)
    except Exception as exc:  # the cell could not be set up (switching the implementation, its inputs)
        message = f"{type(exc).__name__}: {exc}"
        for entry in entries[len(results):]:
            results.append(CheckResult(entry.name, Status.ERROR, message))
            tokens.append(0)
    return CellRun(cell, own.seq_len, results, tokens)


def merge_cells(default: CheckResult, cells: list[tuple[CellRun, CheckResult]]) -> CheckResult:
    """Keep the default path's detail (leak map, mask table); add one row per cell (its path, length and verdict)
    and, for each finding code that failed somewhere, one finding naming the cells. `cells`: each cell's run with
    this check's result there."""
    rows = [{"path": run.cell.label, "status": r.status.value, "summary": r.summary,
             "codes": sorted({f.code for f in r.findings if f.status not in (Status.PASS, Status.SKIP)}),
             "seq_len": run.seq_len, **({"note": run.note} if run.note else {})}
            for run, r in cells]
    by_code: dict[str, tuple[Finding, list[str]]] = {}
    for run, r in cells:
        for f in r.findings:
            if f.status in (Status.PASS, Status.SKIP):
                continue
            first, where = by_code.setdefault(f.code, (f, []))
            where.append(run.cell.label)
    findings = [f for f in default.findings if f.code not in by_code]
    for code, (first, where) in by_code.items():
        shown = "; ".join(where[:4]) + (f"; and {len(where) - 4} more" if len(where) > 4 else "")
        findings.append(Finding(code, first.status, first.message,
                                f"{len(where)} of {len(cells)} code paths: {shown}" +
                                (f" (first at {first.where})" if first.where else "")))
    failing = [(run.cell, r) for run, r in cells if r.status in (Status.FAIL, Status.ERROR)]
    status = worst([default.status, *(r.status for _, r in cells)])
    lengths = sorted({run.seq_len for run, _ in cells})
    at = f"T={lengths[0]}" if len(lengths) == 1 else f"T={lengths[0]} to {lengths[-1]}"
    if failing:
        first_path, first_result = failing[0]
        summary = f"{len(failing)} of {len(cells)} code paths fail; first {first_path.label}: {first_result.summary}"
    else:
        summary = f"{len(cells)} code paths pass ({at}); {default.summary}"
    return CheckResult(default.name, status, summary, findings, dict(default.metrics, code_paths=len(cells),
                       failing_code_paths=len(failing)), {**default.data, "paths": rows},
                       default.duration_s + sum(r.duration_s for _, r in cells),
                       default.internal_error or any(r.internal_error for _, r in cells))


class CheckTimeout(BaseException):
    """Raised inside a check that ran past its time limit. A BaseException, so that a model's own
    `except Exception` cannot swallow it."""

    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.seconds = seconds


# Longer limits (inf included) are no limit: setitimer cannot count them on every platform (OverflowError).
_LONGEST_LIMIT = 1e8  # seconds, three years


@contextmanager
def time_limit(seconds: float | None):
    """Interrupt the block after `seconds` with CheckTimeout. It uses SIGALRM, so it works in the main thread of
    a Unix process and reaches Python code (a hung kernel returns control only when it ends); elsewhere no limit."""
    usable = (seconds and seconds < _LONGEST_LIMIT and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_one(entry: CheckEntry, model: ModelUnderTest, session: Session) -> CheckResult:
    """One check, whatever happens: skip raised, model errors and fwdcheck's own errors become results."""
    start = time.perf_counter()
    try:
        check = entry.load()
        if session.device.type == "meta" and getattr(check, "needs_values", True):
            raise SkipCheck("needs values; on the meta device only shapes exist: run on a shrunk config "
                            "(`fwdcheck shrink CONFIG`)")
        with time_limit(session.settings.timeout_s):
            result = check.run(model, session)
    except CheckTimeout as timeout:
        message = f"timed out after {timeout.seconds:g} s (timeout_s in the config); a forward that hangs?"
        result = CheckResult(entry.name, Status.ERROR, message, [Finding("FWD004", Status.ERROR, message)])
    except SkipCheck as skip:
        result = CheckResult(entry.name, Status.SKIP, str(skip))
    except CheckLoadError as exc:
        result = CheckResult(entry.name, Status.ERROR, str(exc), [Finding("FWD001", Status.ERROR, str(exc))])
    except ModelRaised as exc:
        result = CheckResult(entry.name, Status.ERROR, str(exc), [Finding("FWD002", Status.ERROR, str(exc), exc.where)])
    except Exception as exc:  # a bug of fwdcheck's (or of a plugin's), not of the model: exit 3
        message = f"internal error in check {entry.label}: {type(exc).__name__}: {exc}"
        result = CheckResult(entry.name, Status.ERROR, message, [Finding("FWD003", Status.ERROR, message)],
                             data={"traceback": traceback.format_exc()}, internal_error=True)
    result.duration_s = time.perf_counter() - start
    return result
