"""Run the selected checks on one model and collect a Report. Loaders build, checks judge, renderers show."""

from __future__ import annotations

import dataclasses
import inspect
import platform
import re
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from fwdcheck.errors import CheckLoadError, ModelRaised, SkipCheck
from fwdcheck.model import ModelUnderTest
from fwdcheck.registry import CheckEntry
from fwdcheck.paths import PATH_CHECKS, CodePath, path_cells, path_view, plain_view
from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Finding, Status, worst
from fwdcheck.session import Session, Settings


def run_model(model: ModelUnderTest, settings: Settings, entries: list[CheckEntry], *, config_path=None,
              fail_on: str = "fail", progress: Callable[[str], None] | None = None) -> Report:
    """Every check on one session; the model is restored when this returns, however it returns."""
    import torch

    session = Session(model, settings)
    results: list[CheckResult] = []
    interrupted = False
    try:
        with session.active():
            for entry in entries:
                if progress:
                    progress(f"{entry.name}")
                results.append(run_one(entry, model, session))
    except KeyboardInterrupt:  # Ctrl-C: the model is restored by now; report what ran, mark the rest
        interrupted = True
        results += [CheckResult(e.name, Status.ERROR, "interrupted before it finished") for e in entries[len(results):]]
    cells = [] if interrupted else path_cells(model, settings.paths, settings.batch_size)
    if cells:
        if progress:
            progress(f"{len(cells)} code paths")
        results = [run_over_paths(entry, model, settings, cells, result)
                   if entry.name in PATH_CHECKS and result.status not in (Status.SKIP, Status.ERROR) else result
                   for entry, result in zip(entries, results)]
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


def run_over_paths(entry: CheckEntry, model: ModelUnderTest, settings: Settings, cells: list[CodePath],
                   default: CheckResult) -> CheckResult:
    """The check once per code path; one result that lists every cell and carries the failing cells' findings."""
    from fwdcheck.hf import using_attn_implementation

    cell_results = []
    for cell in cells:
        view = path_view(model, cell)
        session = Session(view, dataclasses.replace(settings, batch_size=cell.batch_size))
        if view.padding:
            session.unpadded = plain_view(model, cell)
        try:
            with using_attn_implementation(model.module, cell.attn_implementation), session.active():
                result = run_one(entry, view, session)
        except Exception as exc:  # switching the implementation itself failed
            result = CheckResult(entry.name, Status.ERROR, f"{type(exc).__name__}: {exc}")
        cell_results.append((cell, result))
    return merge_cells(default, cell_results)


def merge_cells(default: CheckResult, cells: list[tuple[CodePath, CheckResult]]) -> CheckResult:
    """Keep the default path's detail (leak map, mask table); add one row per cell and, for each finding code that
    failed somewhere, one finding naming the cells."""
    rows = [{"path": cell.label, "status": r.status.value, "summary": r.summary,
             "codes": sorted({f.code for f in r.findings if f.status not in (Status.PASS, Status.SKIP)})}
            for cell, r in cells]
    by_code: dict[str, tuple[Finding, list[str]]] = {}
    for cell, r in cells:
        for f in r.findings:
            if f.status in (Status.PASS, Status.SKIP):
                continue
            first, where = by_code.setdefault(f.code, (f, []))
            where.append(cell.label)
    findings = [f for f in default.findings if f.code not in by_code]
    for code, (first, where) in by_code.items():
        shown = "; ".join(where[:4]) + (f"; and {len(where) - 4} more" if len(where) > 4 else "")
        findings.append(Finding(code, first.status, first.message,
                                f"{len(where)} of {len(cells)} code paths: {shown}" +
                                (f" (first at {first.where})" if first.where else "")))
    failing = [(cell, r) for cell, r in cells if r.status in (Status.FAIL, Status.ERROR)]
    status = worst([default.status, *(r.status for _, r in cells)])
    if failing:
        summary = f"{len(failing)} of {len(cells)} code paths fail; first {failing[0][0].label}: {failing[0][1].summary}"
    else:
        summary = f"{len(cells)} code paths pass; {default.summary}"
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
