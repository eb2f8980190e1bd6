"""The rich terminal report: a summary table, then each check's detail panel: its findings, and its data drawn by the
view the check names (Check.detail_view: the built-ins' live beside them, fwdcheck/checks/<name>_view.py); and `fwdcheck
diff`.

It only shows what the checks put in their results; it computes nothing but layout (report/layout.py). How much it
shows is the reader's choice (Verbosity): a green run is a few lines, a red one shows the detail of what did not
pass and ends, as pytest's "short test summary info" does, with one line per finding that failed it. Tables are
laid out for the console's width: a word is never cut, and at a narrow width the least needed columns give way
first. On a terminal a passing check's summary is cut to one line (its detail is a -v away); off one (a pipe, a
file, a CI log, where nobody can widen the window) every text is whole.
"""

from __future__ import annotations

import functools
import math
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.rule import Rule
from rich.text import Text

from fwdcheck.errors import Own
from fwdcheck.report.layout import FitColumn, FitTable
from fwdcheck.report.record import ReportRecord
from fwdcheck.result import CheckResult, Finding, PathRow, Status, does_not_apply

STYLE = {
    Status.PASS: "bold green",
    Status.WARN: "bold yellow",
    Status.FAIL: "bold red",
    Status.SKIP: "dim",
    Status.ERROR: "bold magenta",
}
IGNORED = "dim"  # an ignored finding is shown, never in its status's colour: it does not count
VERDICT_STYLE = {
    "passed": "bold green",
    "failed": "bold red",
    "internal error": "bold magenta",
    "nothing ran": "dim",
    "interrupted": "bold red",
    "terminated": "bold red",
}


class Verbosity(str, Enum):
    QUIET = "quiet"  # one line: the verdict, its exit code, and what failed
    DEFAULT = "default"  # the summary table; the detail of every check that did not pass
    VERBOSE = "verbose"  # the summary table and every check's detail


def render(
    report: ReportRecord,
    console: Console,
    debug: bool = False,
    verbosity: Verbosity | str = Verbosity.DEFAULT,
    durations: bool = True,
    name: str | None = None,
    terminal: bool | None = None,
) -> None:
    """The report on `console`, laid out for its width. `durations` False leaves every time out, for text that must
    not change from run to run (documentation, comparisons). `name` (the config's file name, when a run has several)
    leads the quiet line. `terminal` says whether a person reads it in a window they can widen (the console's own
    idea when None): only there is a text cut short."""
    verbosity = Verbosity(verbosity)
    if verbosity == Verbosity.QUIET:
        console.print(one_line(report, durations, name), soft_wrap=True)  # one line, however narrow: it wraps
        return
    terminal = console.is_terminal if terminal is None else terminal
    for part in parts(report, debug, verbosity, durations, terminal):
        console.print(part)


def parts(
    report: ReportRecord,
    debug: bool = False,
    verbosity: Verbosity = Verbosity.DEFAULT,
    durations: bool = True,
    terminal: bool = True,
) -> list[RenderableType]:
    """The report's pieces, top to bottom: the run's line, its notes, the summary table, the panels, the model's
    shared exception, the short summary and the verdict."""
    raised = shared_model_error(report)
    env = report.environment
    shown: list[RenderableType] = [
        Text.assemble(
            ("fwdcheck ", "bold"),
            f"· {report.model.get('label', '?')} · ",
            f"{env.get('device')} {env.get('dtype')} · B={env.get('batch_size')} "
            f"T={env.get('seq_len')} seed={env.get('seed')}",
        )
    ]
    shown += [Text(f"note: {note}", style="dim") for note in report.notes]
    results = [r for r in report.results if raised is None or r.name not in raised.checks]
    if results:
        shown.append(summary_table(results, verbosity, durations, terminal))
    for result in results:
        if shows_detail(result, verbosity):
            shown.append(detail(result, debug, durations))
        else:  # no panel to show them in: an ignored finding still shows, marked, on a line of its own
            shown += [
                Text(f"{result.name} {f.code} {f.status.value}: {f.message} (ignored: {f.ignored})", style=IGNORED)
                for f in result.findings
                if f.ignored
            ]
    if raised is not None:
        shown.append(model_error_panel(raised, report, debug))
    lines = short_summary(report, raised)
    if lines:
        shown.append(Rule(Text("short summary", style="bold"), align="left", style="dim"))
        for line in lines:
            if terminal:  # one line a finding, cut to the window; the panels above hold the rest
                line.no_wrap, line.overflow = True, "ellipsis"
            shown.append(Group(line))  # as it is: console.print would join a bare Text to others, losing no_wrap
    word, style = verdict(report)
    shown.append(Text.assemble((word, style), f" (exit {report.exit_code})"))
    return shown


@dataclass
class ModelError:
    """One exception of the model's that stopped several checks: said once, not once a check."""

    message: str  # "the model raised RuntimeError: ..."
    at: str | None  # "model.py:10 in forward"
    checks: list[str]  # the checks it stopped


def shared_model_error(report: ReportRecord) -> ModelError | None:
    """The model's exception when two or more checks errored on it alone (the same FWD002 finding, nothing else):
    every check needs a forward, so a forward that raises stops each of them the same way."""
    stopped = [
        r
        for r in report.results
        if r.status == Status.ERROR and r.findings and all(f.code == Own.MODEL_RAISED for f in r.findings)
    ]
    said = {(f.message, f.where, f.source) for r in stopped for f in r.findings}
    if len(stopped) < 2 or len(said) != 1:
        return None
    message, where, source = said.pop()
    at = where
    if source and where and " in " in where:  # the short file:line, and the function the long one names
        at = f"{source} in {where.rsplit(' in ', 1)[1]}"
    elif source:
        at = source
    return ModelError(message, at, [r.name for r in stopped])


def model_error_panel(raised: ModelError, report: ReportRecord, debug: bool) -> Panel:
    """The model's exception once, where it was raised, and what it stopped."""
    n = len(raised.checks)
    text = Text(raised.message)
    if raised.at:
        text.append(f"\nat {raised.at}", style="dim")
    text.append(f"\nevery check needs a forward: {n} check{'s' if n != 1 else ''} not run ({', '.join(raised.checks)})")
    parts: list[RenderableType] = [text]
    traceback = next((report.result(c).data.get("traceback") for c in raised.checks), None)
    if debug and traceback:
        parts.append(Text(traceback, style="dim"))
    title = Text("the model raised", STYLE[Status.ERROR])
    return Panel(Group(*parts), title=title, title_align="left", border_style=STYLE[Status.ERROR].split()[-1])


def short_summary(report: ReportRecord, raised: ModelError | None = None) -> list[Text]:
    """What failed the run, one line a finding: status, check, code, the module and the model code's file:line it
    concerns, and its message; the model's shared exception once. Nothing for a run that passed."""
    if report.exit_code in (0, 5):  # passed, or nothing ran: nothing failed
        return []
    lines = []
    if raised is not None:
        n = len(raised.checks)
        at = f" at {raised.at}" if raised.at else ""
        lines.append(
            Text.assemble(
                ("ERROR", STYLE[Status.ERROR]),
                f" {Own.MODEL_RAISED} {raised.message}{at}; every check needs a forward: {n} checks not run",
            )
        )
    for r in counted(report):
        if raised is not None and r.name in raised.checks:
            continue
        findings = [f for f in r.findings if f.status == r.status and not f.ignored]
        if not findings:  # a status without a finding (a check of a plugin's): its summary says why
            lines.append(Text.assemble((r.status.value.upper(), STYLE[r.status]), f" {r.name} - {r.summary}"))
        for f in findings:
            where = " ".join(part for part in (f.module, f.source) if part)
            lines.append(
                Text.assemble(
                    (f.status.value.upper(), STYLE[f.status]),
                    f" {r.name} {f.code}" + (f" {where}" if where else "") + f" - {f.message}",
                )
            )
    return lines


def counted(report: ReportRecord) -> list[CheckResult]:
    """The checks whose status decided a failing exit code."""
    return [
        r
        for r in report.results
        if r.status in (Status.FAIL, Status.ERROR) or (r.status == Status.WARN and report.fail_on == "warn")
    ]


def verdict(report: ReportRecord) -> tuple[str, str]:
    """The word for the exit code, and its style."""
    return report.verdict, VERDICT_STYLE[report.verdict]


def shows_detail(result: CheckResult, verbosity: Verbosity) -> bool:
    """Verbose shows every check that ran; the default only those a reader has to look at."""
    if verbosity == Verbosity.VERBOSE:
        return result.status != Status.SKIP
    return result.status in (Status.WARN, Status.FAIL, Status.ERROR)


def one_line(report: ReportRecord, durations: bool, name: str | None = None) -> Text:
    """'fwdcheck: failed (exit 1): future-token FWD101 FWD105, mask-audit FWD202 · checks 2.1 s': what decided the exit
    code, then what else a reader should know (warnings that did not count, skipped and ignored checks). The model's
    exception, when it stopped every check it names, is said in full, once. `name` leads the line ('fwdcheck
    gpt.yaml: ...') when a run has several configs."""
    word, style = verdict(report)
    failing = counted(report)
    raised = shared_model_error(report)
    ran = [r.name for r in report.results if r.status != Status.SKIP]
    parts = []
    if raised is not None:
        n = len(raised.checks)
        at = f" at {raised.at}" if raised.at else ""
        parts.append(f"{raised.message}{at}; {n} checks not run")
    parts += [
        " ".join([r.name, *(_counted_codes(r) or [r.status.value])])
        for r in failing
        if raised is None or r.name not in raised.checks
    ]
    if parts:
        what = ", ".join(parts)
    else:
        what = f"{len(ran)} check{'s' if len(ran) != 1 else ''}" + (f" ({', '.join(ran)})" if ran else "")
    line = Text.assemble(
        f"fwdcheck{' ' + name if name else ''}: ", (word, style), f" (exit {report.exit_code}) — {what}"
    )
    warned = [
        " ".join([r.name, *_counted_codes(r)]) for r in report.results if r.status == Status.WARN and r not in failing
    ]
    absent = [r.name for r in report.results if does_not_apply(r)]
    skipped = [r.name for r in report.results if r.status == Status.SKIP and not does_not_apply(r)]
    ignored = list(dict.fromkeys(f"{r.name} {f.code}" for r in report.results for f in r.findings if f.ignored))
    for label, names in (("warn", warned), ("skipped", skipped), ("did not apply", absent), ("ignored", ignored)):
        if names:
            line.append(f"; {label}: {', '.join(names)}")
    if durations:
        # the checks' own time: the interpreter's start and the model's import and build are not in it
        line.append(f" · checks {sum(r.duration_s for r in report.results):.1f} s")
    return line


def _counted_codes(r: CheckResult) -> list[str]:
    """The codes behind a check's status: its findings of that status that are not ignored, each once."""
    return list(dict.fromkeys(f.code for f in r.findings if f.status == r.status and not f.ignored))


def summary_table(
    results: list[CheckResult],
    verbosity: Verbosity = Verbosity.DEFAULT,
    durations: bool = True,
    terminal: bool = True,
) -> RenderableType:
    """One row per check. In the default view on a terminal a passing check's summary is one line, cut to the width:
    its detail is a -v away, while a check that did not pass is the one to read in full. Off a terminal every
    summary is whole."""
    columns = [
        FitColumn("check", style="bold", whole=True),
        FitColumn("status", whole=True),
        FitColumn("key number", justify="right", whole=True),
    ]
    columns += [FitColumn("time", justify="right", whole=True)] if durations else []
    columns += [FitColumn("summary")]
    rows = []
    for r in results:
        brief = terminal and verbosity == Verbosity.DEFAULT and r.status == Status.PASS
        summary = Text(r.summary, no_wrap=brief, overflow="ellipsis" if brief else "fold")
        time = [Text("" if r.status == Status.SKIP else f"{r.duration_s:.2f}s")] if durations else []
        rows.append([Text(r.name), Text(r.status.value, STYLE[r.status]), Text(key_number(r)), *time, summary])
    return FitTable(columns, rows, box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=False)


def key_number(r: CheckResult) -> str:
    """The number the verdict rests on, as the check measured it (Check.key_number); for a verdict that came from
    the code-path matrix alone, how much of it failed; nothing for a skipped check, which measured nothing."""
    if r.status == Status.SKIP:
        return ""
    if r.paths is not None and r.paths.failing and not r.paths.default_fails:
        return f"{r.paths.failing} of {len(r.paths.rows)} paths"
    return r.key_number


def detail(r: CheckResult, debug: bool, durations: bool = True) -> Panel:
    parts: list[RenderableType] = []
    if r.findings:
        parts.append(findings_table(r.findings))
    render_data = detail_view(r.name)
    # A result merged over the code-path matrix goes to its view even when the check's own data is empty, as it
    # did while the rows were in its data.
    if render_data is not None and (r.data or r.paths is not None):
        parts.append(render_data(r))
    if r.paths is not None and r.paths.rows:
        parts.append(code_paths(r.paths.rows))
    if debug and r.data.get("traceback"):
        parts.append(Text(r.data["traceback"], style="dim"))
    if not parts:
        parts.append(Text(r.summary))
    title = Text.assemble((r.name, "bold"), " ", (r.status.value, STYLE[r.status]))
    if durations:
        title.append(f"  {r.duration_s:.2f}s")
    return Panel(Group(*parts), title=title, title_align="left", border_style=STYLE[r.status].split()[-1])


def findings_table(findings: list[Finding]) -> RenderableType:
    """Code, status and message of each finding, with where it is; an ignored one dim, with the config's reason."""
    rows = []
    for f in findings:
        message = Text(f.message, style=IGNORED if f.ignored else "")
        if f.where or f.source:  # the model code's file:line, to open in an editor
            at = " · ".join(part for part in (f.where, f.source) if part)
            message.append(f"\nat {at}", style="dim")
        if f.ignored:
            message.append(f"\nignored: {f.ignored}", style=IGNORED)
        status = Text(f.status.value, IGNORED if f.ignored else STYLE[f.status])
        rows.append([Text(f.code, IGNORED if f.ignored else ""), status, message])
    columns = [FitColumn("", whole=True), FitColumn("", whole=True), FitColumn("")]  # code, status, message
    return FitTable(columns, rows, box=None, show_header=False, pad_edge=False)


def render_diff(diff: dict, console: Console, plot: bool = False) -> None:
    """`fwdcheck diff`'s report (fwdcheck.run.diff.Diff.to_dict()): the largest difference of every pair of modules in
    A's order of execution, the first that parts marked; with `plot`, the difference by depth; then what was not
    paired, the notes and the verdict."""
    pairs = diff["pairs"]
    console.print(Text.assemble(("fwdcheck diff ", "bold"), f"· A {diff['a']} · B {diff['b']} · {diff['dtype']}"))
    console.print(_pairs_table(pairs, diff["first_parting"]))
    if not all(p["by_name"] for p in pairs):
        console.print(
            Text(
                "* paired by order: no name in common, the same shape, between the same two pairs paired by name",
                style="dim",
            )
        )
    if plot and pairs:
        console.print(difference_plot(pairs, max(console.width - 8, 10)))
    for line in (*_diff_notes(diff), *_diff_verdict(diff)):
        console.print(line)


def _pairs_table(pairs: list[dict], first: dict | None) -> FitTable:
    """A row per pair of modules: its number (* when paired by order), the names in A and B, the shape, the largest
    difference against its tolerance, the first that parts marked."""
    rows = []
    for number, p in enumerate(pairs, 1):
        style = "bold red" if p["parts"] else "green"
        shape = str(p["shape"]) if p["shape"] == p["shape_b"] else f"{p['shape']} vs {p['shape_b']}"
        mark = "◀ first" if first is not None and p["a"] == first["a"] else ""
        rows.append(
            [
                Text(f"{number}" + ("" if p["by_name"] else "*")),
                Text(p["a"]),
                Text("" if p["b"] == p["a"] else p["b"]),
                Text(shape),
                Text(_number(p["max_diff"]), style),
                Text(f"{p['tolerance']:.2g}"),
                Text(mark, "bold red"),
            ]
        )
    columns = [
        FitColumn("#", justify="right", whole=True),
        FitColumn("module (A)", whole=True),
        FitColumn("in B", whole=True, give_way=2),
        FitColumn("shape", whole=True, give_way=1),
        FitColumn("max diff", justify="right", whole=True),  # max |a - b|
        FitColumn("tol", justify="right", whole=True),
        FitColumn("", whole=True),
    ]  # the line under: what tol is
    return FitTable(columns, rows, box=box.SIMPLE, pad_edge=False, show_edge=False)


def _diff_notes(diff: dict) -> list[Text]:
    """What was not paired, the notes, and the first pair that differs at all when it is not the first that parts."""
    lines = []
    for side in ("a", "b"):
        unpaired = diff[f"unpaired_{side}"]
        if unpaired:
            shown = ", ".join(unpaired[:6]) + (f" and {len(unpaired) - 6} more" if len(unpaired) > 6 else "")
            lines.append(Text(f"not paired in {side.upper()}: {shown}", style="dim"))
    for note in diff["notes"]:
        lines.append(Text(f"note: {note}", style="dim"))
    first, earliest = diff["first_parting"], diff["first_difference"]
    if earliest is not None and (first is None or earliest["a"] != first["a"]):
        ratio = (
            ""
            if earliest["max_diff"] is None
            else f", {earliest['max_diff'] / earliest['tolerance']:.2g} of its tolerance"
        )
        lines.append(
            Text(
                f"the first pair that differs at all: A {earliest['a']} (max |a - b| "
                f"{_number(earliest['max_diff'])}{ratio})",
                style="yellow" if first else "dim",
            )
        )
    return lines


def _diff_verdict(diff: dict) -> list[Text]:
    """What the columns mean, then the verdict: equal within tolerance, or where the two models part."""
    tolerance, first = diff["tolerance"], diff["first_parting"]
    legend = Text(
        f"max diff: the largest |a - b| over an output's elements; tol: atol {tolerance['atol']:g} + "
        f"rtol {tolerance['rtol']:g} x A's largest |value| of it",
        style="dim",
    )
    if first is None:
        return [
            legend,
            Text.assemble(
                ("equal", "bold green"),
                f" within tolerance over {len(diff['pairs'])} pairs of modules (exit {diff['exit_code']})",
            ),
        ]
    b = "" if first["b"] == first["a"] else f" / B {first['b']}"
    if first.get("nonfinite"):  # NaN (or Inf in the logits): nothing to compare, not equal
        holds = "hold" if " and " in first["nonfinite"] else "holds"
        by = f"{first['nonfinite']} {holds} NaN or Inf there, which no comparison vouches for"
        if first["a"] == "(logits)":  # -inf beside finite entries is a masked vocabulary, compared
            by = (
                f"{first['nonfinite']} {holds} NaN or Inf there (NaN, +inf, or a position with every entry -inf), "
                "which no comparison vouches for"
            )
        return [
            legend,
            Text.assemble(("they part", "bold red"), f" at A {first['a']}{b}: {by} (exit {diff['exit_code']})"),
        ]
    by = _number(first["max_diff"])
    return [
        legend,
        Text.assemble(
            ("they part", "bold red"),
            f" at A {first['a']}{b}: max |a - b| {by} (tolerance {first['tolerance']:.2g}) (exit {diff['exit_code']})",
        ),
    ]


def _number(value: float | None) -> str:
    return "inf" if value is None else f"{value:.2g}"


PLOT_ROWS = 6  # decades of difference / tolerance a plot shows at most


def difference_plot(pairs: list[dict], width: int) -> Text:
    """Each pair's max |a - b| over its tolerance, by depth (A's order of execution, left to right), as bars on a
    log scale, one row a decade: a bar reaching the `tol x1` row parts. Wider than `width` pairs share columns (the
    largest shown). Under the bars, a caret at the first pair that parts."""
    ratios = [
        math.inf
        if p["max_diff"] is None
        else p["max_diff"] / p["tolerance"]
        if p["tolerance"]
        else (0.0 if p["max_diff"] == 0 else math.inf)
        for p in pairs
    ]
    step = math.ceil(len(ratios) / width)
    columns = [max(ratios[i : i + step]) for i in range(0, len(ratios), step)]
    finite = [r for r in columns if 0 < r < math.inf]
    # rows from the decade of the largest finite ratio (one more for an infinite one) down to that of the smallest
    top = max(0, math.floor(math.log10(max(finite)))) if finite else 0
    top = top + 1 if any(r == math.inf for r in columns) else top
    bottom = min(-1, math.floor(math.log10(min(finite)))) if finite else -1
    bottom = max(bottom, top - PLOT_ROWS + 1)
    text = Text()
    for decade in range(top, bottom - 1, -1):
        label = "tol x1 " if decade == 0 else f"1e{decade:+d} ".rjust(7)
        text.append(label, style="dim")
        for r in columns:
            text.append("█" if r >= 10.0**decade else "·" if decade == 0 else " ", "red" if decade >= 0 else "green")
        text.append("\n")
    first = next((i for i, p in enumerate(pairs) if p["parts"]), None)
    if first is not None:
        text.append(" " * (7 + first // step) + f"^ #{first + 1} {pairs[first]['a']}, the first to part\n", "bold red")
    spread = "one pair a column" if step == 1 else f"{step} pairs a column, the largest shown"
    text.append(" " * 7 + f"max |a - b| / tolerance of each pair, in A's order ({spread})", style="dim")
    return text


def code_paths(rows: Sequence[PathRow]) -> RenderableType:
    """Every cell of the code-path matrix that did not pass; one line when all did."""
    bad = [row for row in rows if row.status != Status.PASS]
    if not bad:
        return Text(f"all {len(rows)} code paths pass" if len(rows) != 1 else f"{rows[0].path}: pass", style="green")
    cells = [
        [Text(row.path), Text(row.status.value, STYLE[row.status]), Text(", ".join(row.codes)), Text(row.summary)]
        for row in bad
    ]
    columns = [FitColumn("path"), FitColumn("status", whole=True), FitColumn("codes"), FitColumn("summary")]
    return FitTable(
        columns,
        cells,
        title=f"code paths: {len(bad)} of {len(rows)} not passing",
        box=box.SIMPLE,
        pad_edge=False,
        show_edge=False,
    )


@functools.cache
def detail_view(check: str) -> Callable[[CheckResult], RenderableType] | None:
    """The function a check names (Check.detail_view) to draw its data in its panel; None when it names none, or
    is not installed here (a report read from a file), or its view does not import: the findings still show."""
    from fwdcheck.config.registry import view_of

    reference = view_of(check)
    if reference is None:
        return None
    try:
        return pkgutil.resolve_name(reference)
    except Exception:  # a plugin's view that does not import: no detail, not a broken report
        return None
