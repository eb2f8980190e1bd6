"""What a run's events say: the record the supervisor keeps of its worker, and a distributed run's launcher of its
rank 0, from which the report of a run that did not finish is made."""

from __future__ import annotations

from collections.abc import Callable

from fwdcheck.errors import FwdcheckError, Own
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
    decode,
    sent_by,
)
from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Finding, Status

GRACE_S = 10.0  # at most, past timeout_s, before a silent worker is killed; for a signalled worker to report
# At least this long for the worker's start and the model's load (importing torch and the model's code, building it):
# timeout_s limits each check, and a short one (a test's 1 s) must not kill a worker that a busy machine starts slowly.
LOAD_FLOOR_S = 60.0
# The report's row for what follows the last check: the model's state compared with what it was (FWD006), the model
# restored, the report sent, the worker's end. Not a check's name (no check is named in brackets).
END_OF_RUN = "(end of run)"


class WorkerError(FwdcheckError):
    """The worker could not make the run (a usage error, fwdcheck's own bug): its line and exit code, and the
    traceback and warnings that --debug shows."""

    def __init__(self, message: str, exit_code: int, detail: str = "", notes: list[str] | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.detail = detail
        self.warning_notes = notes or []


class Heard:
    """What has been heard from a worker so far (the supervisor hears its worker; a distributed run's launcher
    hears rank 0): enough to make the report of a run that did not finish."""

    def __init__(self, job: Job):
        self.job = job
        self.checks: list[str] = list(job.overrides.checks or [])
        self.per_code_path: list[str] = []
        self.model: dict = {"label": job.label}
        self.results: dict[str, CheckResult] = {}
        self.current: str | None = None  # the check (or "code paths") running now; None while the model loads
        self.report: Report | None = None
        self.compared: dict | None = None  # `fwdcheck diff`'s result
        self.error: WorkerError | None = None
        self.environment: dict | None = None  # the report's, where the listener knows it before the worker ends
        self.strangers: set[int] = set()  # processes other than the one started that sent events: not heard

    def hear_message(self, message: dict, sender: int | None, progress: Callable[[str], None] | None) -> None:
        """An encoded event, heard when the process that was started sent it (`sender`), else set aside."""
        sent = sent_by(message)
        if sender is not None and sent != sender:
            self.strangers.add(sent if sent is not None else -1)
            return
        self.hear(decode(message), progress)

    def stranger_note(self) -> list[str]:
        """What the report says of events no started process sent."""
        if not self.strangers:
            return []
        who = ", ".join(str(pid) for pid in sorted(self.strangers) if pid >= 0) or "an unknown process"
        return [
            f"events from process {who}, not the model's process, were ignored: a process the model forked (or "
            "one that forged them) carried on with the run; only the process fwdcheck started reports"
        ]

    def hear(self, event: Event, progress: Callable[[str], None] | None) -> None:
        if isinstance(event, Plan):
            self.checks, self.per_code_path = event.checks, event.per_code_path
        elif isinstance(event, ModelLoaded):
            self.model = event.model
        elif isinstance(event, Progress):
            description = event.description  # a check's name, or "code path 3/24: <cell>"
            self.current = description if description in self.checks else "code paths"
            if progress and description in self.checks:
                progress(f"check {self.checks.index(description) + 1}/{len(self.checks)}: {description}")
            elif progress:
                progress(description)
        elif isinstance(event, CheckDone):
            result = CheckResult.from_dict(event.result, event.internal_error)
            self.results[result.name] = result
        elif isinstance(event, Finished):
            self.report = Report.from_dict(
                event.report,
                internal_errors=event.internal_errors,
                fail_on=self.job.overrides.fail_on,
                interrupted=event.interrupted,
            )
        elif isinstance(event, Compared):
            self.compared = event.result
        elif isinstance(event, RunError):
            self.error = WorkerError(event.message, event.exit_code, event.detail, event.notes)

    @property
    def finished(self) -> bool:
        """The worker has said its last word: a report, a comparison, or why it could make neither."""
        return self.report is not None or self.compared is not None or self.error is not None

    def step_limit(self, timeout_s: float) -> float:
        """How long the worker may stay silent: each check, and each code-path cell's checks, run under timeout_s
        in the worker; starting the worker and loading the model get timeout_s too, and at least LOAD_FLOOR_S."""
        if self.current is None:
            return max(timeout_s, LOAD_FLOOR_S) + grace(timeout_s)
        checks_in_step = max(1, len(self.per_code_path)) if self.current == "code paths" else 1
        return timeout_s * checks_in_step + grace(timeout_s)

    def partial_report(self, how: str, code: str, status: Status = Status.ERROR) -> Report:
        """The report of a run the worker did not finish: every finished check as it was streamed; the check that
        was running, and those that never started, an error `code` saying how the worker ended."""
        results = []
        for name in self.checks:
            if name in self.results:
                result = self.results[name]
                if (
                    self.current == "code paths"
                    and name in self.per_code_path
                    and result.status not in (Status.SKIP, Status.ERROR)
                ):
                    message = f"the code-path matrix did not finish: {how}; the default path's result is kept"
                    result.findings.append(Finding(code, status, message))
                    result.status, result.summary = status, f"{result.summary}; {message}"
                results.append(result)
            elif name == self.current:
                message = f"while this check ran, {how}"
                results.append(CheckResult(name, status, message, [Finding(code, status, message)]))
            else:
                message = f"not run: {how} " + (
                    "before the model loaded" if self.current is None else "before this check began"
                )
                results.append(CheckResult(name, status, message, [Finding(code, status, message)]))
        if self.checks and self.current != "code paths" and all(name in self.results for name in self.checks):
            # every check reported, and still no report: the end of the run is part of the run
            results.append(end_of_run(f"{how}: the model's state was not compared with what it was", code, status))
        job = self.job
        environment = self.environment or {
            "device": job.overrides.device or "config",
            "dtype": job.overrides.dtype or "config",
            "seed": job.overrides.seed,
        }
        return Report(
            results=results,
            model=self.model,
            environment=environment,
            notes=[f"{how}", *self.stranger_note()],
            config_path=job.config,
            fail_on=job.overrides.fail_on,
        )


def end_of_run(how: str, code: str = Own.PROCESS_DIED, status: Status = Status.ERROR) -> CheckResult:
    """An error on what follows the last check: the results streamed before it are no verdict of a run that did not
    end cleanly."""
    message = f"after the last check, {how}"
    return CheckResult(END_OF_RUN, status, message, [Finding(code, status, message)])


def grace(timeout_s: float | None) -> float:
    """The time a worker gets past a limit before it is killed: short limits get short grace (a test's 2 s)."""
    return min(GRACE_S, max(1.0, timeout_s or GRACE_S))
