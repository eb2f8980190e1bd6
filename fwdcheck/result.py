"""The small types every check and renderer shares: Status, Finding, CheckResult and the Check base class."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from fwdcheck.model import ModelUnderTest
    from fwdcheck.session import Session


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """Severity order used to combine findings: skip < pass < warn < fail < error."""
        return [Status.SKIP, Status.PASS, Status.WARN, Status.FAIL, Status.ERROR].index(self)


def worst(statuses, default: Status = Status.PASS) -> Status:
    return max(statuses, key=lambda s: s.rank, default=default)


@dataclass
class Finding:
    code: str  # stable id, e.g. FWD101
    status: Status
    message: str
    where: str | None = None  # module path, positions, layer/head

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "status": self.status.value, "message": self.message, "where": self.where}


@dataclass
class CheckResult:
    name: str
    status: Status
    summary: str
    findings: list[Finding] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    internal_error: bool = False  # an exception of fwdcheck's own, not of the model: exit 3

    @classmethod
    def from_findings(cls, name: str, findings: list[Finding], summary: str, **kw) -> CheckResult:
        """The status is the worst finding's; no finding worse than pass means pass."""
        return cls(name=name, status=worst(f.status for f in findings), summary=summary, findings=findings, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        d["findings"] = [f.to_dict() for f in self.findings]
        d.pop("internal_error")
        return d


class Check:
    """A forward-pass check. Subclasses set the class attributes and implement run().

    run() returns a CheckResult, raises SkipCheck(reason) when the check does not apply, and lets ModelRaised
    propagate when the model itself fails; the runner turns both into results.
    """

    name: ClassVar[str]
    description: ClassVar[str]  # one line, for `fwdcheck list`
    explain: ClassVar[str]  # what it verifies, why it matters, how to fix; for `fwdcheck explain`
    codes: ClassVar[dict[str, str]] = {}  # finding code -> what it means
    needs_values: ClassVar[bool] = True  # False: runs on the meta device, from shapes alone

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:  # pragma: no cover - interface
        raise NotImplementedError
