"""The messages between the processes of a run, typed: the job the supervisor hands its worker
(fwdcheck/process/worker.py), and the events the worker, or a distributed run's rank 0, sends back as the run goes.

On the wire an event is one JSON object a line (a worker's event pipe) or one pickled dict (a rank's connection to
its launcher), led by its kind:

    {"event": "plan", "checks": [...], "per_code_path": [...]}    the checks, in order, before the model loads
    {"event": "model", "model": {...}}                              the model loaded (the report's `model` section)
    {"event": "progress", "description": "..."}                      a check or a code-path cell begins
    {"event": "result", "result": {...}, "internal_error": false}    a check's default-path result
    {"event": "report", "report": {...}, ...}                        the whole report: the last event of a run
    {"event": "error", "exit_code": 2, "message": "...", ...}        the run could not be made (a usage error)
    {"event": "diff", "result": {...}}                               `fwdcheck diff`'s comparison: its last event

`encode` and `decode` turn one into the other; everything that sends or hears an event uses these classes, never
the dicts. Free of torch and pydantic: the supervisor imports it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from fwdcheck.run.overrides import Overrides
from fwdcheck.run.plan import RunPlan


@dataclass
class Job:
    """What to run: the run's plan, resolved and validated by the process that hands it over (the command line,
    the pytest plugin), which the worker takes as it is."""

    config: str | None  # the config file (what errors and the report name), or None with `factory`
    factory: str | None  # --model pkg.module:factory
    plan: RunPlan | None  # the run (None: a `fwdcheck diff` job, which reads its two configs itself)
    sys_path: list[str] = field(default_factory=list)  # the supervisor's import path, so modules resolve alike
    # `fwdcheck diff`: `config` is A, this is B's config and these are --rename's rules; the worker compares them
    compare_with: str | None = None
    rename: list[str] = field(default_factory=list)
    # a rank an outside launcher started (torchrun, srun): fwdcheck/process/launched.py's job_fields
    launched: dict | None = None

    @property
    def overrides(self) -> Overrides:
        """What the caller asked of the run, as it asked it (a diff job asks nothing): the report of a run that ends
        before the model loads says so."""
        return self.plan.overrides if self.plan is not None else Overrides()

    @property
    def label(self) -> str:
        """What the model is called before it has loaded (a partial report of a run that died early)."""
        return self.factory or Path(self.config or "model").stem

    def to_wire(self) -> dict[str, Any]:
        """The job as JSON takes it, for the worker's stdin: the plan as RunPlan.to_wire's text."""
        return {**asdict(replace(self, plan=None)), "plan": self.plan.to_wire() if self.plan is not None else None}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Job:
        """The job to_wire sent; the plan is read where the job's import path is in place (a plugin's options model
        imports from it)."""
        plan = message.get("plan")
        return cls(**{**message, "plan": RunPlan.from_wire(plan) if plan is not None else None})


@dataclass(frozen=True)
class Plan:
    """The checks, in order, before the model loads; those that also run on every cell of the code-path matrix."""

    kind: ClassVar[str] = "plan"
    checks: list[str]
    per_code_path: list[str]


@dataclass(frozen=True)
class ModelLoaded:
    """The model has loaded: the report's `model` section (runner.model_summary)."""

    kind: ClassVar[str] = "model"
    model: dict[str, Any]


@dataclass(frozen=True)
class Progress:
    """A check begins (its name), or a cell of the code-path matrix ("code path 3/24: <cell>")."""

    kind: ClassVar[str] = "progress"
    description: str


@dataclass(frozen=True)
class CheckDone:
    """A check's default-path result (CheckResult.to_dict), as soon as it is known: kept if the worker dies later."""

    kind: ClassVar[str] = "result"
    result: dict[str, Any]
    internal_error: bool = False


@dataclass(frozen=True)
class Finished:
    """The whole report (Report.to_dict): the last event of a run that ended."""

    kind: ClassVar[str] = "report"
    report: dict[str, Any]
    internal_errors: list[bool]
    interrupted: bool


@dataclass(frozen=True)
class RunError:
    """The run could not be made: its exit code and one line; the traceback and warnings --debug shows."""

    kind: ClassVar[str] = "error"
    exit_code: int
    message: str
    detail: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Compared:
    """`fwdcheck diff`'s result (Diff.to_dict): the last event of a comparison that ended."""

    kind: ClassVar[str] = "diff"
    result: dict[str, Any]


Event = Plan | ModelLoaded | Progress | CheckDone | Finished | RunError | Compared
KINDS: dict[str, type[Event]] = {
    cls.kind: cls for cls in (Plan, ModelLoaded, Progress, CheckDone, Finished, RunError, Compared)
}


def encode(event: Event) -> dict[str, Any]:
    """The event as it travels: its kind under "event", the process that sent it under "pid", then its fields. The
    listener hears only the process it started: a process the model forked inside a forward carries on with
    fwdcheck's run in its copy of the worker, and its events (a clean model's report) are not the run's."""
    return {"event": event.kind, "pid": os.getpid(), **asdict(event)}


def sent_by(message: Any) -> int | None:
    """The process that sent an encoded event (None: it does not say)."""
    pid = message.get("pid") if isinstance(message, dict) else None
    return pid if isinstance(pid, int) else None


def decode(message: dict[str, Any]) -> Event:
    """The event a message carries; ValueError for a message that is no event of a run."""
    kind = KINDS.get(str(message.get("event"))) if isinstance(message, dict) else None
    if kind is None:
        raise ValueError(f"not an event of a run: {str(message)[:200]}")
    try:
        return kind(**{name: value for name, value in message.items() if name not in ("event", "pid")})
    except TypeError as exc:  # missing or unknown fields
        raise ValueError(f"a malformed {kind.kind} event: {exc}") from None
