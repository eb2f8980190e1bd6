"""The process the model runs in: `fwdcheck run` starts it and supervises it (fwdcheck/supervisor.py).

Model code can print, exit, hang, crash or swallow signals here without ending the run, deciding its exit code or
spoiling a report on stdout: the supervisor owns all three. The worker reads one job (JSON) on stdin and writes its
events, one JSON object a line, on the descriptor named on its command line:

    {"event": "plan", "checks": [...], "per_code_path": [...]}    the checks, in order, before the model loads
    {"event": "model", "model": {...}}                              the model loaded (the report's `model` section)
    {"event": "progress", "description": "..."}                      a check or a code-path cell begins
    {"event": "result", "result": {...}, "internal_error": false}    a check's default-path result
    {"event": "report", "report": {...}, ...}                        the whole report: the last event of a run
    {"event": "error", "exit_code": 2, "message": "...", ...}        the run could not be made (a usage error)

Its stdout is its stderr: whatever model code prints never reaches the supervisor's stdout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fwdcheck.errors import ExitCode, FwdcheckError, about_config, exception_text, first_line
from fwdcheck.lifetime import die_with_parent
from fwdcheck.overrides import Overrides


@dataclass
class Job:
    """What to run: the command line's choices once the supervisor has validated them."""

    config: str | None  # the config file, or None with `factory`
    factory: str | None  # --model pkg.module:factory
    overrides: Overrides  # the command line's flags, its check selection validated
    sys_path: list[str] = field(default_factory=list)  # the supervisor's import path, so modules resolve alike

    def __post_init__(self):
        if isinstance(self.overrides, dict):  # as it arrives on the worker's stdin
            self.overrides = Overrides(**self.overrides)

    @property
    def label(self) -> str:
        """What the model is called before it has loaded (a partial report of a run that died early)."""
        return self.factory or Path(self.config or "model").stem


def execute(
    job: Job,
    *,
    progress: Callable[[str], None] | None = None,
    on_model: Callable[[dict], None] | None = None,
    on_result=None,
):
    """Load the model and run the checks: the Report. Warnings (torch's, the model's) become the report's notes;
    on an error they travel on the exception as `warning_notes`, for --debug."""
    from fwdcheck.config import config_for
    from fwdcheck.runner import Run, model_summary

    config_path = Path(job.config) if job.config is not None else None
    run = Run.build(config_for(config_path, job.factory), job.overrides)
    if run.config.distributed.nproc > 1:  # the ranks load the model, each its own copy
        from fwdcheck.distributed import launch

        with about_config(config_path):
            return launch(run, job, progress=progress, on_model=on_model, on_result=on_result)
    with warnings.catch_warnings(record=True) as caught:
        try:
            with about_config(config_path):
                loaded = run.load()
            if on_model:
                on_model(model_summary(loaded))
            with about_config(config_path):
                report = run.check(loaded, config_path=config_path, progress=progress, on_result=on_result)
        except BaseException as exc:
            # on whatever exception escaped, read back with getattr(exc, "warning_notes", [])
            exc.warning_notes = warning_notes(caught)  # type: ignore[attr-defined]
            raise
    report.notes += [n for n in warning_notes(caught) if n not in report.notes]
    return report


def warning_notes(caught: list[warnings.WarningMessage]) -> list[str]:
    """Each distinct warning once, as one line: `warning: UserWarning: ... (torch/serialization.py:2221)`."""
    notes: list[str] = []
    for w in caught:
        text = first_line(w.message)
        note = f"warning: {w.category.__name__}: {text} ({Path(w.filename).name}:{w.lineno})"
        if note not in notes:
            notes.append(note)
    return notes


class Events:
    """The worker's end of the event pipe. A write the supervisor can no longer read (it was killed) ends the worker:
    nobody is left to report to."""

    def __init__(self, fd: int):
        self.stream = os.fdopen(fd, "w", encoding="utf-8", buffering=1)
        self.lock = threading.Lock()

    def send(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, default=str)
        with self.lock:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                os._exit(ExitCode.INTERNAL)


def main(argv: list[str]) -> None:
    events_fd, parent = int(argv[0]), int(argv[1])
    sys.argv = [__file__]  # model code that parses arguments as it imports sees none of the worker's
    die_with_parent(parent)
    # Model code's prints go where the supervisor relays them (its stderr), never onto a report on stdout.
    os.dup2(2, 1)
    job = Job(**json.loads(sys.stdin.read()))
    sys.stdin.close()
    for entry in reversed(job.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    events = Events(events_fd)
    try:
        from fwdcheck.registry import select
        from fwdcheck.runner import per_code_path

        entries = select(job.overrides.checks)
        events.send(
            "plan", checks=[e.name for e in entries], per_code_path=[e.name for e in entries if per_code_path(e)]
        )
        report = execute(
            job,
            progress=lambda description: events.send("progress", description=description),
            on_model=lambda model: events.send("model", model=model),
            on_result=lambda r: events.send("result", result=r.to_dict(), internal_error=r.internal_error),
        )
        events.send(
            "report",
            report=report.to_dict(),
            internal_errors=[r.internal_error for r in report.results],
            interrupted=report.interrupted,
        )
    except FwdcheckError as exc:
        events.send(
            "error",
            exit_code=exc.exit_code,
            message=exception_text(exc),
            detail=traceback.format_exc(),
            notes=getattr(exc, "warning_notes", []),
        )
    except KeyboardInterrupt:  # while the model loaded: the supervisor sent it, and reports what it has
        events.send("error", exit_code=ExitCode.INTERRUPTED, message="interrupted", detail="", notes=[])
    except BaseException as exc:  # a bug of fwdcheck's; the supervisor prints it as one
        events.send(
            "error",
            exit_code=ExitCode.INTERNAL,
            message=f"{type(exc).__name__}: {exception_text(exc)}",
            detail=traceback.format_exc(),
            notes=getattr(exc, "warning_notes", []),
        )
    # Model code may have left threads running or exit hooks registered: none of them may delay or change the end.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
