"""The record of one run: what it found, and the exit code that means. Renderers draw it (fwdcheck/report/terminal.py,
junit.py, github.py, markdown.py); Report (fwdcheck/report/__init__.py) adds its own display on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from fwdcheck import __version__
from fwdcheck.errors import ExitCode
from fwdcheck.report.text import clean, cleaned
from fwdcheck.result import CheckResult, Status, worst

SCHEMA_VERSION = 1

Record = TypeVar("Record", bound="ReportRecord")


@dataclass
class ReportRecord:
    """What one run found: each check's result, the model's and the environment's summaries, the run's notes; and
    the exit code and verdict they mean, which every renderer states."""

    results: list[CheckResult]  # each check's, in the order they ran
    model: dict[str, Any] = field(default_factory=dict)  # what was checked: its label, source, sizes
    environment: dict[str, Any] = field(default_factory=dict)  # torch, python, device, dtype, seed, B, T
    notes: list[str] = field(default_factory=list)  # what the run has to say beside the checks (warnings included)
    config_path: str | None = None  # the config file, as given
    fail_on: str = "fail"  # fail | warn
    interrupted: bool = False  # Ctrl-C or SIGTERM: the report holds what ran
    interrupted_exit: int = ExitCode.INTERRUPTED  # 130 for SIGINT, 143 for SIGTERM

    def __post_init__(self) -> None:
        """The model's text made safe for every format, here where it enters the report (fwdcheck/report/text.py)."""
        for result in self.results:
            result.summary, result.data = clean(result.summary), cleaned(result.data)
            if result.paths is not None:  # a cell's summary and note may quote the model
                result.paths = result.paths.texts(clean)
            for finding in result.findings:
                for name in ("message", "where", "source", "module", "ignored"):
                    value = getattr(finding, name)
                    if value is not None:
                        setattr(finding, name, clean(value))
        self.model, self.environment, self.notes = cleaned(self.model), cleaned(self.environment), cleaned(self.notes)
        self.config_path = clean(self.config_path) if self.config_path is not None else None

    @property
    def status(self) -> Status:
        """The worst status of the checks that ran (skip when none did)."""
        ran = [r.status for r in self.results if r.status != Status.SKIP]
        return worst(ran, default=Status.SKIP)

    @property
    def exit_code(self) -> int:
        """0 passed (warnings allowed unless fail_on=warn); 1 failed or the model raised; 3 fwdcheck broke;
        5 nothing ran."""
        if self.interrupted:
            return self.interrupted_exit
        if any(r.internal_error for r in self.results):
            return ExitCode.INTERNAL
        status = self.status
        if status in (Status.FAIL, Status.ERROR) or (status == Status.WARN and self.fail_on == "warn"):
            return ExitCode.FAILED
        if status == Status.SKIP:
            return ExitCode.NOTHING_RAN
        return ExitCode.OK

    @property
    def verdict(self) -> str:
        """The exit code in a word, as every renderer says it."""
        return ExitCode(self.interrupted_exit if self.interrupted else self.exit_code).verdict

    @property
    def ok(self) -> bool:
        """Exit code 0: nothing failed (a warning counts only with fail_on="warn")."""
        return self.exit_code == ExitCode.OK

    @property
    def failures(self) -> list[CheckResult]:
        """The check results that failed or errored (CheckResult, not Finding): their codes are
        `{f.code for r in report.failures for f in r.findings}`."""
        return [r for r in self.results if r.status in (Status.FAIL, Status.ERROR)]

    def result(self, name: str) -> CheckResult:
        """The result of the check named `name` (StopIteration when it did not run)."""
        return next(r for r in self.results if r.name == name)

    @classmethod
    def from_dict(
        cls: type[Record],
        d: dict[str, Any],
        *,
        internal_errors: list[bool] | None = None,
        fail_on: str = "fail",
        interrupted: bool = False,
    ) -> Record:
        """The inverse of to_dict, given what the JSON report leaves out (which errors were fwdcheck's own)."""
        flags = internal_errors or [False] * len(d["checks"])
        return cls(
            results=[CheckResult.from_dict(c, flag) for c, flag in zip(d["checks"], flags, strict=False)],
            model=d.get("model", {}),
            environment=d.get("environment", {}),
            notes=d.get("notes", []),
            config_path=d.get("config"),
            fail_on=fail_on,
            interrupted=interrupted,
        )

    def to_json(self, **dump_options) -> str:
        """The JSON report, as `--json PATH` writes it (`fwdcheck schema --json-report` is its schema)."""
        import json

        return json.dumps(self.to_dict(), default=str, **dump_options)

    def to_dict(self) -> dict[str, Any]:
        """The JSON report as a dict (to_json's)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "fwdcheck_version": __version__,
            "status": self.status.value,
            "exit_code": self.exit_code,
            "config": self.config_path,
            "model": self.model,
            "environment": self.environment,
            "notes": self.notes,
            "checks": [r.to_dict() for r in self.results],
        }
