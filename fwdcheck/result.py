"""The small types every check and renderer shares: Status, Finding, CheckResult (with the code-path matrix's rows,
PathMatrix) and the Check base class."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from fwdcheck.model.tested import ModelUnderTest
    from fwdcheck.run.session import Session


class Status(str, Enum):
    """A check's or a finding's outcome: pass, warn, fail (the model is wrong), skip (does not apply, with the
    reason), error (the check could not run: the model raised, or fwdcheck did)."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """Severity order used to combine findings: skip < pass < warn < fail < error."""
        return [Status.SKIP, Status.PASS, Status.WARN, Status.FAIL, Status.ERROR].index(self)


# How a skipped result's summary starts when the model lacks what the check examines (DoesNotApply), as against a
# skip the run's environment caused (inputs too short, a kernel this machine lacks)
DOES_NOT_APPLY = "does not apply: "


def does_not_apply(result: CheckResult) -> bool:
    """Whether a result is a skip because the check does not apply to this model."""
    return result.status == Status.SKIP and result.summary.startswith(DOES_NOT_APPLY)


def worst(statuses, default: Status = Status.PASS) -> Status:
    return max(statuses, key=lambda s: s.rank, default=default)


@dataclass
class Finding:
    """One thing a check found, with where it is: `fwdcheck explain CODE` says what its code means."""

    code: str  # stable id, e.g. FWD101
    status: Status
    message: str  # what was found, in one line: the measured numbers, positions, the fix when it is known
    where: str | None = None  # module path, positions, layer/head
    source: str | None = None  # "file:line" of the model code it concerns, when fwdcheck can tell
    ignored: str | None = None  # the config's reason for ignoring this code; an ignored finding does not count
    module: str | None = None  # the module it concerns (a name of model.named_modules()); its class is the source
    # when the check names no line

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        """The inverse of to_dict (a report read back from the model's process)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known} | {"status": Status(d["status"])})

    def to_dict(self) -> dict[str, Any]:
        """The finding as the JSON report holds it."""
        return {
            "code": self.code,
            "status": self.status.value,
            "message": self.message,
            "where": self.where,
            "source": self.source,
            "ignored": self.ignored,
            "module": self.module,
        }


def grouped(findings: list[Finding], key: Callable[[Finding], Hashable]) -> list[tuple[Finding, list[Finding]]]:
    """Findings that say the same thing (the same `key`) gathered, in the order first seen: each group's first
    finding and every member. A bug in shared code repeats in every layer; a check reports it once, saying where."""
    groups: dict[Hashable, list[Finding]] = {}
    for f in findings:
        groups.setdefault(key(f), []).append(f)
    return [(members[0], members) for members in groups.values()]


def first_per_code(findings: list[Finding], more: Callable[[Finding, int], None] | None = None) -> list[Finding]:
    """Each code's first finding, in the order first seen: a bug in shared code repeats (in every layer, at every
    position), and one finding says it. `more(first, n)`, when given, is told of the n > 0 others of first's code, to
    say so on it (where, or in its message)."""
    kept = []
    for first, members in grouped(findings, key=lambda f: f.code):
        if more is not None and len(members) > 1:
            more(first, len(members) - 1)
        kept.append(first)
    return kept


@dataclass(frozen=True)
class Shared:
    """The cell whose verdict a cell of the code-path matrix took, and by which rule: "code path" (it saw exactly
    what that cell saw) or "logits" (a check whose verdict follows from logits, on the same logits)."""

    cell: str
    by: str


@dataclass(frozen=True)
class PathRow:
    """One cell of the code-path matrix as one per-path check judged it."""

    path: str  # the cell's label
    status: Status
    summary: str
    codes: tuple[str, ...]  # the codes that did not pass there, sorted
    seq_len: int  # tokens per row of the cell's inputs
    note: str | None = None  # how the cell came to run as it did, when not as planned
    shares: Shared | None = None  # the cell whose verdict it took; None: it ran its own

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PathRow:
        shares = d.get("shares")
        return cls(
            path=d["path"],
            status=Status(d["status"]),
            summary=d["summary"],
            codes=tuple(d.get("codes", [])),
            seq_len=d["seq_len"],
            note=d.get("note"),
            shares=Shared(shares["cell"], shares["by"]) if shares else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The row as the JSON report's `data.paths` holds it: `note` and `shares` only when there is one."""
        d: dict[str, Any] = {
            "path": self.path,
            "status": self.status.value,
            "summary": self.summary,
            "codes": list(self.codes),
            "seq_len": self.seq_len,
        }
        if self.note:
            d["note"] = self.note
        if self.shares:
            d["shares"] = {"cell": self.shares.cell, "by": self.shares.by}
        return d

    def ignoring(self, ignores: dict[str, str]) -> PathRow:
        """A cell that failed (or warned) only by codes the config ignores is no failure either: it passes, naming
        the codes it ignored, as a check's own findings are marked."""
        if self.status not in (Status.FAIL, Status.WARN) or not self.codes or not set(self.codes) <= set(ignores):
            return self
        return replace(self, status=Status.PASS, summary=f"{self.summary} [ignored: {', '.join(sorted(self.codes))}]")

    def texts(self, fix: Callable[[str], str]) -> PathRow:
        """Every text of the row passed through `fix` (a cell's summary and note may hold the model's text)."""
        shares = Shared(fix(self.shares.cell), fix(self.shares.by)) if self.shares else None
        note = fix(self.note) if self.note is not None else None
        codes = tuple(fix(c) for c in self.codes)
        return replace(self, path=fix(self.path), summary=fix(self.summary), codes=codes, note=note, shares=shares)


@dataclass(frozen=True)
class PathMatrix:
    """A per-path check's verdicts on the cells of the code-path matrix, filled in by the run when it merges the
    cells into the check's result. The check's own `data` and `metrics` stay as it returned them; the JSON report
    writes the rows under `data.paths` and the counts under `metrics` (to_dict), where its schema has them."""

    rows: tuple[PathRow, ...]
    failing: int  # cells that failed or raised, counted as they were merged (before the config's ignores)
    default_fails: bool  # whether the default path's own verdict was a failure (or an error)

    # The JSON report's keys under `metrics`, in the order it writes them
    METRICS: ClassVar[tuple[str, ...]] = ("code_paths", "failing_code_paths", "default_path_fails")

    def metrics(self) -> dict[str, int]:
        return dict(zip(self.METRICS, (len(self.rows), self.failing, int(self.default_fails)), strict=True))

    @classmethod
    def taken_from(cls, metrics: dict[str, Any], data: dict[str, Any]) -> PathMatrix | None:
        """The matrix a JSON report wrote into a check's `metrics` and `data` (to_dict), its keys removed from both;
        None (both left as they are) when the check did not run over the matrix."""
        if "paths" not in data or not all(key in metrics for key in cls.METRICS):
            return None
        counts = [metrics.pop(key) for key in cls.METRICS]
        return cls(tuple(PathRow.from_dict(row) for row in data.pop("paths")), counts[1], bool(counts[2]))

    def ignoring(self, ignores: dict[str, str]) -> PathMatrix:
        return replace(self, rows=tuple(row.ignoring(ignores) for row in self.rows))

    def texts(self, fix: Callable[[str], str]) -> PathMatrix:
        return replace(self, rows=tuple(row.texts(fix) for row in self.rows))


@dataclass
class CheckResult:
    """One check's result on one model: its status (the worst of its findings'), a one-line summary, the findings,
    and the numbers and data it measured."""

    name: str  # the check's name, as `fwdcheck list` shows it
    status: Status
    summary: str  # one line: what was measured and the verdict
    findings: list[Finding] = field(default_factory=list)  # each with a code; not only failures (a pass may say why)
    metrics: dict[str, Any] = field(default_factory=dict)  # the numbers measured, by name
    data: dict[str, Any] = field(default_factory=dict)  # structured payload: the ledger, the leak map, the calls
    duration_s: float = 0.0  # the check's own time
    internal_error: bool = False  # an exception of fwdcheck's own, not of the model: exit 3
    key_number: str = ""  # the measurement the verdict rests on, in a few characters (Check.key_number)
    # Its verdict on each cell of the code-path matrix, for a check that declares per_code_path (the run fills it in)
    paths: PathMatrix | None = None

    @classmethod
    def from_findings(cls, name: str, findings: list[Finding], summary: str, **kw) -> CheckResult:
        """The status is the worst finding's; no finding worse than pass means pass."""
        return cls(name=name, status=worst(f.status for f in findings), summary=summary, findings=findings, **kw)

    def apply_ignores(self, ignores: dict[str, str]) -> None:
        """Mark findings whose code the config ignores; the status then comes from the others alone. A cell of the
        code-path matrix that failed only by ignored codes passes (PathRow.ignoring)."""
        if self.paths is not None:
            self.paths = self.paths.ignoring(ignores)
        marked = [f for f in self.findings if f.code in ignores]
        if not marked:
            return
        for f in marked:
            f.ignored = ignores[f.code]
        if self.status in (Status.PASS, Status.WARN, Status.FAIL):
            self.status = worst(f.status for f in self.findings if f.ignored is None)
        self.summary += f" [ignored: {', '.join(sorted({f.code for f in marked}))}]"

    @classmethod
    def from_dict(cls, d: dict[str, Any], internal_error: bool = False) -> CheckResult:
        """The inverse of to_dict, which leaves internal_error out of the JSON report; the code-path matrix's rows
        and counts go back from `data` and `metrics` into `paths`."""
        metrics, data = dict(d.get("metrics", {})), dict(d.get("data", {}))
        return cls(
            name=d["name"],
            status=Status(d["status"]),
            summary=d["summary"],
            findings=[Finding.from_dict(f) for f in d.get("findings", [])],
            paths=PathMatrix.taken_from(metrics, data),
            metrics=metrics,
            data=data,
            duration_s=d.get("duration_s", 0.0),
            key_number=d.get("key_number", ""),
            internal_error=internal_error,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON report's check (report/schema.py): the code-path matrix's rows last in `data` (`paths`), its
        counts last in `metrics`, as the published schema has them."""
        d = asdict(self)
        d["status"] = self.status.value
        d["findings"] = [f.to_dict() for f in self.findings]
        d.pop("internal_error")
        d.pop("paths")
        if self.paths is not None:
            d["metrics"] = {**d["metrics"], **self.paths.metrics()}
            d["data"] = {**d["data"], "paths": [row.to_dict() for row in self.paths.rows]}
        return d


class Check:
    """A forward-pass check. Subclasses set the class attributes and implement run().

    run() returns a CheckResult, raises DoesNotApply(reason) when the model lacks what the check examines (no cache,
    no loss from labels), SkipCheck(reason) when it could not measure here, and lets ModelRaised propagate when the
    model itself fails; the runner turns each into a result.
    """

    name: ClassVar[str]
    description: ClassVar[str]  # one line, for `fwdcheck list`
    explain: ClassVar[str]  # what it verifies, why it matters, how to fix; for `fwdcheck explain`
    codes: ClassVar[dict[str, str]] = {}  # finding code -> what it means
    needs_values: ClassVar[bool] = True  # False: runs on the meta device, from shapes alone
    per_code_path: ClassVar[bool] = False  # True: runs again on every cell of the code-path matrix (code_paths.py)
    # True: its verdict on a cell follows from the cell's logits alone, so a cell with the logits of a cell it passed on
    # (the same tokens) takes that pass (code_paths.py)
    verdict_from_logits: ClassVar[bool] = False
    default: ClassVar[bool] = True  # runs when a config names no checks; False: only when named (or `all`)
    order: ClassVar[int] = 100  # where it runs and is reported: lower first (built-ins 10-90), ties by name
    # "module:function" of a function (CheckResult) -> rich renderable drawing the check's `data` in the terminal's
    # detail panel. It must import without torch: the report is drawn in a process that never loads it.
    detail_view: ClassVar[str | None] = None
    # "module:Class" of its options model (a fwdcheck.config.schema.CheckOptions in a module free of torch), read from
    # the config's `options:` section under the check's name; None: no options.
    options: ClassVar[str | None] = None
    # Command-line flags it contributes to `fwdcheck run`: flag -> the option it sets (typed and helped from the
    # options model; a bool option is a switch). Several checks may declare one flag: it then sets each one's.
    flags: ClassVar[dict[str, str]] = {}
    # Files it reads or writes, each behind a `fwdcheck run` flag that takes a path: flag -> what the flag does, as
    # literals (read without importing the check), each function a "module:function" in a module free of torch:
    #   {"reads": f}   f(path, label) -> document: the file read and validated before any model loads; the check
    #                  gets the document from expected_in(session)
    #   {"fits": f}    f(document, run_config, label): refuses (UsageError) a file made for another run
    #   {"writes": f}  f(result, report) -> text, or None when the result holds nothing to write; written after
    #                  the run, whole or not at all
    #   {"help": "...", "selects": True}   its help; True: the flag adds the check to the run's selection (else the
    #                  check must be in it)
    #   {"beside": ".suffix"}   a reading flag's file the pytest plugin finds beside a config (gpt.golden.json)
    # A flag takes one config; a check that needs values refuses its flags on the meta device.
    files: ClassVar[dict[str, dict[str, Any]]] = {}
    one_process: ClassVar[str | None] = None  # why a distributed run cannot run it; None: it can
    opens_distributed_runs: ClassVar[bool] = False  # True: a distributed run starts with it, named or not
    # A code of its own that, failed, ends a distributed run's checks there: the ones after it would only meet the
    # same error (the sharding check's, for a sharded model that raises where the unsharded one runs)
    ends_distributed_runs: ClassVar[str | None] = None
    # Top-level config keys of former releases that now set one of its options: key -> option (`exhaustive:`)
    former_keys: ClassVar[dict[str, str]] = {}
    # The models (or runs) it applies to, in words, for `fwdcheck list` and `run --help` ("models that decode through
    # a KV cache"); "" when every model. A model without it gets a skip reading "does not apply: <reason>".
    applies_when: ClassVar[str] = ""

    def __init_subclass__(cls, declared: DataclassInstance | None = None, **kwargs: Any) -> None:
        """`class Golden(Check, declared=SPEC)`: the class attributes above, each set from the field of that name of
        a CheckInfo written in a torch-free module of its own (fwdcheck's own checks': fwdcheck/checks/<name>_spec.py),
        which `fwdcheck list` and `explain` import instead of the check."""
        super().__init_subclass__(**kwargs)
        if declared is not None:
            for declaration in fields(declared):
                if declaration.name in vars(cls):  # one place for each value: two could drift apart
                    raise TypeError(f"{cls.__name__} sets {declaration.name} both in its class body and in `declared`")
                setattr(cls, declaration.name, getattr(declared, declaration.name))

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:  # pragma: no cover - interface
        raise NotImplementedError

    def options_in(self, session: Session) -> Any:
        """This check's options for the run: its `options:` section of the config with the flags on top, validated
        (the options model's defaults when nothing is said, or when the run's settings were made without this check
        in their selection); None for a check that declares no options model."""
        chosen = session.settings.check_options.get(self.name)
        if chosen is None and self.options is not None:
            import pkgutil

            chosen = pkgutil.resolve_name(self.options)()
        return chosen

    def expected_in(self, session: Session, flag: str | None = None) -> Any:
        """The document of the file given to this check's reading flag (Check.files; `flag` when it declares several),
        read and validated before the model loaded; None when no file was given."""
        flags = [flag] if flag is not None else [f for f, does in self.files.items() if "reads" in does]
        return next((session.settings.expected[f] for f in flags if f in session.settings.expected), None)

    def key_number(self, result: CheckResult) -> str:
        """The number the verdict rests on, in a few characters, for the summary table (e.g. "0.18 / 1.2e-05",
        "14 tensors"): for a failure the measurement that failed, for a pass the one that came closest. Called
        after run() on every result that is not a skip; "" shows nothing."""
        return ""
