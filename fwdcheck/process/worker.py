"""The process the model runs in: `fwdcheck run` starts it and supervises it (fwdcheck/process/supervisor.py).

Model code can print, exit, hang, crash or swallow signals here without ending the run, deciding its exit code or
spoiling a report on stdout: the supervisor owns all three. The worker reads one job (JSON, events.Job) on stdin and
writes its events (fwdcheck/process/events.py), one JSON object a line, on the descriptor named on its command line.

Its stdout is its stderr: whatever model code prints never reaches the supervisor's stdout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from fwdcheck.errors import ExitCode, FwdcheckError, about_config, exception_text, first_line, interrupts_heard
from fwdcheck.process.events import (
    CheckDone,
    Compared,
    Event,
    Finished,
    Job,
    ModelLoaded,
    Plan,
    Progress,
    RunError,
    encode,
)
from fwdcheck.process.lifetime import die_with_parent
from fwdcheck.process.warnings_heard import Heard, warnings_heard
from fwdcheck.report.text import clean


def execute(
    job: Job,
    *,
    progress: Callable[[str], None] | None = None,
    on_model: Callable[[dict], None] | None = None,
    on_result=None,
):
    """Load the model and run the checks: the Report. Warnings (torch's, the model's) become the report's notes;
    on an error they travel on the exception as `warning_notes`, for --debug."""
    from fwdcheck.run.runner import Run, model_summary

    assert job.plan is not None  # a run's job carries its plan (a diff job's goes to compare_files)
    config_path = Path(job.config) if job.config is not None else None
    run = Run.build(job.plan)
    if job.launched is not None:  # this process is a rank of the user's launcher: it joins, it launches nothing
        from fwdcheck.process.launched import join

        with about_config(config_path):
            return join(run, job, job.launched, progress=progress, on_model=on_model, on_result=on_result)
    if run.config.distributed.nproc > 1:  # the ranks load the model, each its own copy
        from fwdcheck.process.launch import launch

        with about_config(config_path):
            return launch(run, job, progress=progress, on_model=on_model, on_result=on_result)
    with warnings_heard() as caught:
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
    report.notes += [clean(n) for n in warning_notes(caught) if clean(n) not in report.notes]
    return report


def warning_notes(caught: list[Heard]) -> list[str]:
    """Each distinct warning once, as one line: `warning: UserWarning: ... (torch/serialization.py:2221)`. A warning
    fwdcheck's own code raised is not the model's: it is left out (tests/test_own_warnings.py holds the sample
    configs and the planted bugs to raising none)."""
    notes: list[str] = []
    for w in caught:
        if w.own:
            continue
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

    def send(self, event: Event) -> None:
        line = json.dumps(encode(event), default=str)
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
    message = json.loads(sys.stdin.read())
    sys.stdin.close()
    for entry in reversed(message["sys_path"]):  # before the plan is read: a plugin's options model imports from it
        if entry not in sys.path:
            sys.path.insert(0, entry)
    events = Events(events_fd)
    with interrupts_heard():  # a KeyboardInterrupt the model raises itself is its error, not an interruption
        run_job(message, events)
    # Model code may have left threads running or exit hooks registered: none of them may delay or change the end.
    sys.stderr.flush()
    os._exit(0)


def run_job(message: dict, events: Events) -> None:
    """The job's run (or `fwdcheck diff`'s comparison), its events sent; whatever it raises, reading the job (the
    message on stdin, events.Job.to_wire) included, becomes an event too."""
    try:
        job = Job.from_wire(message)
        if job.compare_with is not None:
            from fwdcheck.run.diff import STEPS, compare_files

            events.send(Plan(list(STEPS), []))
            assert job.config is not None  # a diff job names both configs
            compared = compare_files(job.config, job.compare_with, job.rename, lambda step: events.send(Progress(step)))
            events.send(Compared(compared))
            return
        from fwdcheck.run.runner import per_code_path

        assert job.plan is not None
        entries = job.plan.entries
        events.send(Plan([e.name for e in entries], [e.name for e in entries if per_code_path(e)]))
        report = execute(
            job,
            progress=lambda description: events.send(Progress(description)),
            on_model=lambda model: events.send(ModelLoaded(model)),
            on_result=lambda r: events.send(CheckDone(r.to_dict(), r.internal_error)),
        )
        events.send(Finished(report.to_dict(), [r.internal_error for r in report.results], report.interrupted))
    except FwdcheckError as exc:
        events.send(
            RunError(exc.exit_code, exception_text(exc), traceback.format_exc(), getattr(exc, "warning_notes", []))
        )
    except KeyboardInterrupt:  # while the model loaded: the supervisor sent it, and reports what it has
        events.send(RunError(ExitCode.INTERRUPTED, "interrupted"))
    except BaseException as exc:  # a bug of fwdcheck's; the supervisor prints it as one
        events.send(
            RunError(
                ExitCode.INTERNAL,
                f"{type(exc).__name__}: {exception_text(exc)}",
                traceback.format_exc(),
                getattr(exc, "warning_notes", []),
            )
        )


if __name__ == "__main__":
    main(sys.argv[1:])
