"""The rich terminal report: a summary table, then each check's detail (ledger, leak map, mask table, RoPE numbers).

It only shows what the checks put in their results; it computes nothing but layout. How much it shows is the
reader's choice (Verbosity): a green run is a few lines, a red one shows the detail of what did not pass. Tables are
laid out for the console's width: a word is never cut, and at a narrow width the least needed columns give way first.
"""

from __future__ import annotations

import functools
import math
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from rich import box
from rich.console import Console, ConsoleOptions, Group, JustifyMethod, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Column, Table
from rich.text import Text

from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Finding, Status

STYLE = {Status.PASS: "bold green", Status.WARN: "bold yellow", Status.FAIL: "bold red", Status.SKIP: "dim",
         Status.ERROR: "bold magenta"}
IGNORED = "dim"  # an ignored finding is shown, never in its status's colour: it does not count
VERDICT_STYLE = {"passed": "bold green", "failed": "bold red", "internal error": "bold magenta",
                 "nothing ran": "dim", "interrupted": "bold red", "terminated": "bold red"}
MAP_WIDTH = 64  # leak maps wider than this many positions are binned
GRID_KEYS = 48  # may-read grids show at most this many key slots (two characters each), fewer on a narrow console


class Verbosity(str, Enum):
    QUIET = "quiet"  # one line: the verdict, its exit code, and what failed
    DEFAULT = "default"  # the summary table; the detail of every check that did not pass
    VERBOSE = "verbose"  # the summary table and every check's detail


def render(report: Report, console: Console, debug: bool = False, verbosity: Verbosity | str = Verbosity.DEFAULT,
           durations: bool = True) -> None:
    """The report on `console`, laid out for its width. `durations` False leaves every time out, for text that must
    not change from run to run (documentation, comparisons)."""
    verbosity = Verbosity(verbosity)
    if verbosity == Verbosity.QUIET:
        console.print(one_line(report, durations), soft_wrap=True)  # one line, however narrow: the terminal wraps it
        return
    env = report.environment
    console.print(Text.assemble(("fwdcheck ", "bold"), f"· {report.model.get('label', '?')} · ",
                                f"{env.get('device')} {env.get('dtype')} · B={env.get('batch_size')} "
                                f"T={env.get('seq_len')} seed={env.get('seed')}"))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="dim"))
    console.print(summary_table(report, verbosity, durations))
    for result in report.results:
        if shows_detail(result, verbosity):
            console.print(detail(result, debug, durations))
        else:  # no panel to show them in: an ignored finding still shows, marked, on a line of its own
            for f in result.findings:
                if f.ignored:
                    console.print(Text(f"{result.name} {f.code} {f.status.value}: {f.message} (ignored: {f.ignored})",
                                       style=IGNORED))
    word, style = verdict(report)
    console.print(Text.assemble((word, style), f" (exit {report.exit_code})"))


def verdict(report: Report) -> tuple[str, str]:
    """The word for the exit code, and its style."""
    return report.verdict, VERDICT_STYLE[report.verdict]


def shows_detail(result: CheckResult, verbosity: Verbosity) -> bool:
    """Verbose shows every check that ran; the default only those a reader has to look at."""
    if verbosity == Verbosity.VERBOSE:
        return result.status != Status.SKIP
    return result.status in (Status.WARN, Status.FAIL, Status.ERROR)


def one_line(report: Report, durations: bool) -> Text:
    """'fwdcheck: failed (exit 1): future-token FWD101 FWD105, mask-audit FWD202 · 2.1 s': what decided the exit
    code, then what else a reader should know (warnings that did not count, skipped and ignored checks)."""
    word, style = verdict(report)
    counted = [r for r in report.results if r.status in (Status.FAIL, Status.ERROR)
               or (r.status == Status.WARN and report.fail_on == "warn")]
    ran = [r.name for r in report.results if r.status != Status.SKIP]
    if counted:
        what = ", ".join(" ".join([r.name, *(_counted_codes(r) or [r.status.value])]) for r in counted)
    else:
        what = f"{len(ran)} check{'s' if len(ran) != 1 else ''}" + (f" ({', '.join(ran)})" if ran else "")
    line = Text.assemble("fwdcheck: ", (word, style), f" (exit {report.exit_code}) — {what}")
    warned = [" ".join([r.name, *_counted_codes(r)]) for r in report.results
              if r.status == Status.WARN and r not in counted]
    skipped = [r.name for r in report.results if r.status == Status.SKIP]
    ignored = list(dict.fromkeys(f"{r.name} {f.code}" for r in report.results for f in r.findings if f.ignored))
    for label, names in (("warn", warned), ("skipped", skipped), ("ignored", ignored)):
        if names:
            line.append(f"; {label}: {', '.join(names)}")
    if durations:
        line.append(f" · {sum(r.duration_s for r in report.results):.1f} s")
    return line


def _counted_codes(r: CheckResult) -> list[str]:
    """The codes behind a check's status: its findings of that status that are not ignored, each once."""
    return list(dict.fromkeys(f.code for f in r.findings if f.status == r.status and not f.ignored))


def summary_table(report: Report, verbosity: Verbosity = Verbosity.DEFAULT, durations: bool = True) -> RenderableType:
    """One row per check. In the default view a passing check's summary is one line, cut to the width: its detail is
    a -v away, while a check that did not pass is the one to read in full."""
    columns = [FitColumn("check", style="bold", whole=True), FitColumn("status", whole=True),
               FitColumn("key number", justify="right", whole=True)]
    columns += [FitColumn("time", justify="right", whole=True)] if durations else []
    columns += [FitColumn("summary")]
    rows = []
    for r in report.results:
        brief = verbosity == Verbosity.DEFAULT and r.status == Status.PASS
        summary = Text(r.summary, no_wrap=brief, overflow="ellipsis" if brief else "fold")
        time = [Text("" if r.status == Status.SKIP else f"{r.duration_s:.2f}s")] if durations else []
        rows.append([Text(r.name), Text(r.status.value, STYLE[r.status]), Text(key_number(r)), *time, summary])
    return FitTable(columns, rows, box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=False)


def key_number(r: CheckResult) -> str:
    """The number the verdict rests on, as the check measured it (Check.key_number); for a verdict that came from
    the code-path matrix, how much of it failed; nothing for a skipped check, which measured nothing."""
    if r.status == Status.SKIP:
        return ""
    if r.metrics.get("failing_code_paths"):
        return f"{r.metrics['failing_code_paths']} of {r.metrics['code_paths']} paths"
    return r.key_number


def detail(r: CheckResult, debug: bool, durations: bool = True) -> Panel:
    parts: list[RenderableType] = []
    if r.findings:
        parts.append(findings_table(r.findings))
    render_data = detail_view(r.name)
    if render_data is not None and r.data:
        parts.append(render_data(r))
    if r.data.get("paths"):
        parts.append(code_paths(r.data["paths"]))
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


# -- layout for the console's width -----------------------------------------------------------------------------------


@dataclass
class FitColumn:
    header: str
    justify: JustifyMethod = "left"
    style: str = ""
    whole: bool = False  # never wrapped (a shape, a number, a name); other columns wrap between words
    give_way: int | None = None  # at a width too narrow for every column, these are left out, lowest first


class FitTable:
    """A table laid out for the width it is rendered at. Every column gets at least its longest word (its longest
    cell, for a `whole` column), so no word is cut; the width left over goes to the columns with more to show. When
    even the words do not fit, the columns that may give way are left out, least needed first, and a line under the
    table says which; only when nothing is left to leave out does the widest column fold."""

    def __init__(self, columns: list[FitColumn], rows: list[list[Text]], title: str | None = None, **options):
        self.columns, self.rows, self.title, self.options = columns, rows, title, options

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        kept = list(range(len(self.columns)))
        while sum(map(self._least, kept)) > self._room(console, options, kept):
            giving_way = [i for i in kept if self.columns[i].give_way is not None]
            if not giving_way:
                break
            kept.remove(min(giving_way, key=lambda i: self.columns[i].give_way or 0))  # None: not in giving_way
        widths = self._widths(kept, self._room(console, options, kept))
        # A whole column narrowed below its longest cell (the last resort) folds like the others rather than crop.
        table = Table(*(Column(self.columns[i].header, justify=self.columns[i].justify, style=self.columns[i].style,
                               no_wrap=self.columns[i].whole and width >= self._least(i), overflow="fold",
                               width=width)
                        for i, width in zip(kept, widths, strict=True)),
                      title=self.title, title_justify="left", **self.options)
        for row in self.rows:
            table.add_row(*(row[i] for i in kept))
        yield table
        left_out = [column.header for i, column in enumerate(self.columns) if i not in kept]
        if left_out:
            yield Text(f"{', '.join(left_out)}: left out to fit the width", style="dim")

    def _room(self, console: Console, options: ConsoleOptions, kept: list[int]) -> int:
        """The width the kept columns' contents share: the rest goes to padding and rules."""
        probe = Table(*(Column(width=1) for _ in kept), **self.options)
        return options.max_width - (Measurement.get(console, options, probe).maximum - len(kept))

    def _widths(self, kept: list[int], room: int) -> list[int]:
        least = [self._least(i) for i in kept]
        most = [max(self._least(i), _longest_line(Text(self.columns[i].header)),
                    *(_longest_line(row[i]) for row in self.rows)) for i in kept]
        if sum(most) <= room:
            return most
        widths = list(least)
        if sum(least) > room:  # even the words do not fit: the widest column folds, a column at a time
            while sum(widths) > room and max(widths) > 1:
                widths[widths.index(max(widths))] -= 1
            return widths
        # The spare width shared evenly, the columns that want least first: a short column gets all it wants and
        # stays on one line, the long ones share what is left.
        spare = room - sum(least)
        wanting = sorted(range(len(kept)), key=lambda n: most[n] - least[n])
        for k, n in enumerate(wanting):
            given = min(most[n] - least[n], spare // (len(wanting) - k))
            widths[n] += given
            spare -= given
        return widths

    def _least(self, i: int) -> int:
        """The narrowest a column can be without cutting a word or folding its header (a header of two words
        read one above the other names nothing). A cell that may be cut short (no_wrap with an ellipsis) asks for
        nothing."""
        column = self.columns[i]
        cells = [row[i] for row in self.rows]
        return max([_longest_line(Text(column.header)),
                    *((_longest_line(c) if column.whole else _longest_word(c)) for c in cells
                      if not (c.no_wrap and c.overflow == "ellipsis"))])


def _longest_word(text: Text) -> int:
    return max((Text(word).cell_len for word in text.plain.split()), default=0)


def _longest_line(text: Text) -> int:
    return max((Text(line).cell_len for line in text.plain.splitlines()), default=0)


# -- per-check detail -------------------------------------------------------------------------------------------------


def ledger(r: CheckResult) -> RenderableType:
    """The ledger, with rows that repeat across layers folded into one: layers.{0..11}.attn q. At a narrow width the
    expected dims give way: a mismatch is red in the dims column and named by its finding."""
    rows = []
    folded: dict[tuple, list[str]] = {}
    order = []
    for e in r.data.get("entries", []):
        match = re.search(r"\.(\d+)(\.| |$)", e["name"])
        key_name = e["name"][:match.start(1)] + "{}" + e["name"][match.end(1):] if match else e["name"]
        key = (key_name, tuple(e["shape"]), tuple(e["dims"]), e["ok"])
        if key not in folded:
            order.append((key, e))
        folded.setdefault(key, []).append(match.group(1) if match else "")
    for key, e in order:
        layers = folded[key]
        name = key[0].format(_range(layers)) if "{}" in key[0] else key[0]
        dims = f"[{','.join(e['dims'])}]"
        expected = f"[{','.join(e['expected'])}]" if e.get("expected") else ""
        if e.get("implied"):
            name += " (implied)"
        rows.append([Text(name), Text(str(e["shape"])), Text(dims, "green" if e["ok"] else "bold red"), Text(expected)])
    columns = [FitColumn("tensor"), FitColumn("shape", whole=True), FitColumn("dims", whole=True),
               FitColumn("expected", whole=True, give_way=1)]
    table = FitTable(columns, rows, box=box.SIMPLE, pad_edge=False, show_edge=False)
    dims = ", ".join(f"{k}={v}" for k, v in r.data.get("dims", {}).items())
    probe = r.data.get("probe", {})
    caption = Text(f"dims: {dims}. Axes named by a second pass at B={probe.get('batch_size')}, "
                   f"T={probe.get('seq_len')}. Softmax: {'; '.join(r.data.get('softmax', []))}.", style="dim")
    return Group(table, caption, *_notes(r.data.get("notes")))


def _range(indices: list[str]) -> str:
    if len(indices) == 1:
        return indices[0]
    return f"{{{indices[0]}..{indices[-1]}}}"


def leak_map(r: CheckResult) -> RenderableType:
    """Rows: query positions; columns: the perturbed position (exhaustive) or cut. '.' still, '#' moved, ' ' n/a."""
    # What did not run, or ran otherwise than planned (a pass the model refused, rows run one at a time), is said
    # under the map: a finding stands only on what ran.
    notes = _notes([r.data.get("note"), *r.data.get("notes", []), _single_row(r)])
    leak = r.data.get("leak_map")
    if not leak:
        return Group(*notes)
    columns = leak["columns"]
    threshold = leak["threshold"]
    last = max((c["k"] for c in columns), default=0)  # queries run 0..last-1, perturbed positions 1..last
    bins = max(1, -(-(last + 1) // MAP_WIDTH))  # positions per character
    if leak["kind"] == "cut":
        header, kind = "query\\k " + "".join(f"{c['k']} " for c in columns), "tokens >= k changed"
    else:
        header, kind = f"query\\k 0..{last}" + (f" ({bins} positions per char)" if bins > 1 else ""), \
            "token k alone changed"
    lines = [Text(header, style="dim")]
    for qbin in range(-(-last // bins)):
        queries = slice(qbin * bins, (qbin + 1) * bins)
        line = Text(f"{qbin * bins:>6}  ")
        if leak["kind"] == "cut":
            for c in columns:
                line.append(_cell(c["change"][queries], threshold))
                line.append(" " * len(str(c["k"])))  # the column is as wide as its label "k "
        else:
            for kbin in range(-(-(last + 1) // bins)):
                group = [c for c in columns if kbin * bins <= c["k"] < (kbin + 1) * bins]
                line.append(_cell([v for c in group for v in c["change"][queries]], threshold))
        lines.append(line)
    legend = Text(f"# moved beyond {threshold:.2g}, . still, N NaN/Inf, blank: not before k. Columns: {kind}.",
                  style="dim")
    return Group(*lines, legend, *notes)


def _single_row(r: CheckResult) -> str | None:
    """The batch-size-1 pass in one line: what ran and what moved, or why it did not run."""
    single = r.data.get("single_row")
    if isinstance(single, str):
        return f"single row: {single}"
    if not isinstance(single, dict):
        return None
    worst = r.metrics.get("single_row_max_change", max(single.get("change") or [0.0]))
    against = "the prefix run alone" if single.get("against") == "prefix" else "the batched run"
    threshold = f" (threshold {r.metrics['threshold']:.2g})" if "threshold" in r.metrics else ""
    return (f"single row (batch size 1, T={single['length']}): tokens >= {single['cut']} replaced, earlier logits "
            f"moved by up to {worst:.2g}{threshold} against {against}")


def _cell(values: list[float], threshold: float) -> Text:
    if not values:
        return Text(" ")
    worst = max(values)
    if worst != worst or worst == float("inf"):
        return Text("N", "bold magenta")
    return Text("#", "bold red") if worst > threshold else Text(".", "green")


def mask_table(r: CheckResult) -> RenderableType:
    conventions = FitTable([FitColumn("API", whole=True), FitColumn("bool mask"), FitColumn("float mask"),
                            FitColumn("flag")],
                           [[Text(c[key]) for key in ("api", "bool", "float", "flag")]
                            for c in r.data.get("conventions", [])],
                           title="conventions", box=box.SIMPLE, pad_edge=False, show_edge=False)
    # What a reader needs of each call: which call (the module's name is how it is found in the code), the mask in
    # its convention, the flags beside it (is_causal, a live dropout_p) and the verdict. At a narrow width the mask's
    # shape and values, the extent and then the API give way, in that order, before any of those is cut.
    columns = [FitColumn("module"), FitColumn("api", give_way=4), FitColumn("mask"),
               FitColumn("shape", whole=True, give_way=1), FitColumn("values", give_way=2), FitColumn("flags"),
               FitColumn("L x S", whole=True, give_way=3), FitColumn("may read")]
    rows = r.data.get("calls", [])
    cells = []
    for c in rows:
        module = c["module"] + (" at B=1" if c.get("batch_size") == 1 else "")
        cells.append([*map(Text, (module, c["api"], c["mask"], str(c["mask_shape"] or "-"), c["values"], _flags(c),
                                  _extent(c))), _pattern(c)])
    calls = FitTable(columns, cells, title="what each call used", box=box.SIMPLE, pad_edge=False, show_edge=False)
    parts: list[RenderableType] = [conventions, calls]
    # The reasons a call was not judged are sentences: said once each under the table, not squeezed into a column.
    reasons: dict[str, int] = {}
    for c in rows:
        if not c.get("judged", True):
            reasons[c["pattern"]] = reasons.get(c["pattern"], 0) + 1
    parts += _notes(reason + (f" ({n} calls)" if n > 1 else "") for reason, n in reasons.items())
    sources = sorted({c["positions_from"] for c in rows if c.get("positions_from") not in (None, "", "square")})
    if sources:
        parts += _notes([f"query positions (L x S at ...) from: {', '.join(sources)}"])
    if isinstance(r.data.get("batch1"), str) and r.data["batch1"] != "observed":
        parts += _notes([r.data["batch1"]])
    shown = _grid_call(rows)
    if shown is not None:
        parts.append(FittedGrid(shown))
    return Group(*parts)


def _pattern(call: dict) -> Text:
    """Red only for a judged call that lets a query read past its own position. A call that was not compared with
    causal (cross-attention, an encoder over another sequence, query positions unknown) is no failure: dim, named by
    the start of its reason ('not judged: cross-attention'); the whole reason is said under the table."""
    if call.get("judged", True):
        return Text(call["pattern"], "bold red" if call.get("reads_future") else "green")
    # two short lines fit a narrow column where one long one breaks words
    return Text(f"not judged:\n{call.get('not_judged') or 'see below'}", "dim")


def _flags(call: dict) -> str:
    """is_causal beside a mask (the mask column already says it when it is the only one) and a live dropout_p: the
    arguments besides the mask that decide what a call reads."""
    flags = ["is_causal"] if call.get("is_causal") and call.get("mask") != "is_causal" else []
    flags += [f"dropout_p={call['dropout_p']:g}"] if call.get("dropout_p") else []
    return ", ".join(flags) or "-"


def _extent(call: dict) -> str:
    """'4 x 32 at 0..3': L queries over S key slots, and where the queries sit when that is not simply
    0..L-1 over L keys."""
    if "queries" not in call:
        return "-"
    extent = f"{call['queries']} x {call['keys']}"
    positions, source = call.get("query_positions"), call.get("positions_from")
    if positions and source and source != "square":
        extent += f" at {_positions(positions)}"  # where they came from is said once, under the table
    return extent


def _positions(positions: list[int]) -> str:
    """Consecutive positions as a range (0..3), a few others listed (0, 2, 5, ...)."""
    if len(positions) > 1 and positions == list(range(positions[0], positions[-1] + 1)):
        return f"{positions[0]}..{positions[-1]}"
    shown = ", ".join(map(str, positions[:4]))
    return shown + (", ..." if len(positions) > 4 else "")


def _grid_call(rows: list[dict]) -> dict | None:
    """The call whose may-read set is drawn: the first judged one that is not causal (what a reader needs to see),
    else the first judged one, else the first at all; only sets of at most 16 queries fit."""
    small = [c for c in rows if c.get("may_read") and len(c["may_read"]) <= 16]
    judged = [c for c in small if c.get("judged", True)]
    failing = [c for c in judged if c.get("reads_future")]
    return next(iter(failing or judged or small), None)


class FittedGrid:
    """A call's may-read grid with as many key slots as the width holds, two characters each."""

    def __init__(self, call: dict):
        self.call = call

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield may_read_grid(self.call, keys=min(GRID_KEYS, options.max_width // 2))


def may_read_grid(call: dict, keys: int = GRID_KEYS) -> RenderableType:
    """Rows: queries; columns: key slots; a key after the query's own position is the future. That position is
    query_positions[i] when the call has them (a KV cache, a decode step: query 0 of a decode step may sit at
    position 37), else i. A call that was not judged has no future to colour: its set is drawn plain. At most
    `keys` key slots are drawn."""
    may_read = call["may_read"]
    judged = call.get("judged", True)
    positions = call.get("query_positions")
    if not positions or len(positions) != len(may_read):
        positions = list(range(len(may_read)))  # the square case: query i sits at position i
    slots = len(may_read[0]) if may_read else 0
    # A long cache would wrap the grid into noise: a window of slots is drawn, ending a little after the last query's
    # own position, so that the boundary between past and future is in it.
    width = min(slots, keys)
    end = min(slots, max(width, max(positions, default=0) + 1 + keys // 4))
    start = end - width
    where = f" at {_positions(positions)} ({call['positions_from']})" if call.get("positions_from") not in (
        None, "", "square") and call.get("query_positions") else ""
    shown = f"{slots} key slots" + (f", {start}..{end - 1} shown" if width < slots else "")
    caption = Text(f"may-read set of {call['module']}{' at B=1' if call.get('batch_size') == 1 else ''} "
                   f"(rows: queries{where}; columns: {shown})" + ("" if judged else ": not judged, drawn plain"),
                   style="dim")
    lines = []
    for i, row in enumerate(may_read):
        line = Text()
        for j, v in enumerate(row[start:end], start):
            if not v:
                line.append("· ", "dim")
            elif not judged:
                line.append("■ ")
            else:
                line.append("■ ", "red" if j > positions[i] else "green")
        lines.append(line)
    return Group(caption, *lines)


def rope_numbers(r: CheckResult) -> RenderableType:
    probe = r.data.get("probe")
    rows = []
    if isinstance(probe, dict):
        rows += [("probe q", probe["q"]), ("probe k", probe["k"])]
    if r.data.get("component"):
        rows.append(("rotary function", r.data["component"]))
    cells = []
    for view, rot in rows:
        thetas = ", ".join(f"{t:.4g}" for t in rot.get("thetas", [])[:4])
        cells.append([*map(Text, (view, str(rot["rotates"]), str(rot.get("pairing")), str(rot.get("rotary_dim")),
                                  f"{rot['base']:.5g}" if rot.get("base") else "-", thetas))])
    columns = [FitColumn("view"), FitColumn("rotates"), FitColumn("pairing"), FitColumn("rotary dim"),
               FitColumn("base", whole=True), FitColumn("first frequencies (rad/position)")]
    table = FitTable(columns, cells, box=box.SIMPLE, pad_edge=False, show_edge=False)
    declared = r.data.get("declared")
    lines: list[RenderableType] = [table] if rows else []  # headers over nothing say less than the notes below
    if declared:
        base = f"{declared['base']:g}" if declared.get("base") else "rescaled"
        lines.append(Text(f"declared: pairing {declared.get('pairing')}, base {base}, rotary dim "
                          f"{declared.get('rotary_dim') or 'head size'}", style="dim"))
    if isinstance(probe, dict):
        lines.append(Text(f"q_m . k_n off its diagonals: {probe['toeplitz_error']:.2g} of its scale", style="dim"))
    if r.data.get("component_note"):
        lines.append(Text(r.data["component_note"], style="dim"))
    if r.data.get("component"):
        c = r.data["component"]
        lines.append(Text(f"rotary function: identity {c['identity_error']:.2g}, norms {c['norm_error']:.2g}, "
                          f"R(0) {c['position0_error']:.2g} (relative errors)", style="dim"))
    m = r.metrics
    if "logits_shift_change" in m:
        lines.append(Text(f"logits with every position shifted: change {m['logits_shift_change']:.2g} vs threshold "
                          f"{m['logits_shift_threshold']:.2g}", style="dim"))
    return Group(*lines, *_notes(_rope_notes(r.data)))


def _rope_notes(data: dict) -> list[str]:
    """What the probe could not judge and which views were skipped, with why: a pass stands on the views that ran."""
    notes = []
    probe, calls = data.get("probe"), data.get("probe_calls") or []
    if isinstance(probe, str):
        notes.append(f"probe: {probe}")
    else:
        unjudged = [c for c in calls if not c.get("judged")]
        if unjudged:
            why = "; ".join(sorted({c["note"] for c in unjudged if c.get("note")}))
            notes.append(f"probe: {len(unjudged)} of {len(calls)} attention calls not judged ({why})")
    cached = [c for c in calls if c.get("judged") and c.get("cached")]
    if cached:
        notes.append(f"probe: {len(cached)} call(s) read a KV cache; only the key slots holding the probe's positions "
                     "were read")
    shift = data.get("probe_shift")
    if isinstance(shift, dict):
        notes.append(f"probe with every position shifted by {shift['offset']}: q . k changed by "
                     f"{shift['score_change']:.2g} of its scale over {shift['calls']} call(s)")
    elif shift:
        notes.append(f"probe shift: {shift}")
    if data.get("absolute_positions"):
        notes.append(f"positions also enter absolutely: {data['absolute_positions']}")
    if isinstance(data.get("logits_shift"), str):
        notes.append(f"logits shift: {data['logits_shift']}")
    if data.get("component_scale"):
        notes.append(f"rotary function scales by {data['component_scale']:.4g} (an attention factor, divided out)")
    return notes


def golden(r: CheckResult) -> RenderableType:
    """The outputs that moved from the golden file, in the order they came (the first is where to look), and the
    parameters that moved; a line saying what was recorded when nothing was compared."""
    comparison = r.data.get("comparison")
    if comparison is None:
        document = r.data.get("golden", {})
        return Text(f"{len(document.get('outputs', []))} module outputs and {len(document.get('parameters', []))} "
                    "parameters and buffers fingerprinted; --save-golden FILE writes them", style="dim")
    parts: list[RenderableType] = []
    for key, total, title in (("moved", "moved_outputs", "module outputs"),
                              ("parameters_moved", "moved_parameters", "parameters")):
        rows = [[Text(m["name"]), Text(f"{m['by']:.3g}", "bold red"), Text(f"{m['tolerance']:.2g}"), Text(m["what"])]
                for m in comparison.get(key, [])]
        if rows:
            columns = [FitColumn("name", whole=True), FitColumn("moved by", justify="right", whole=True),
                       FitColumn("tolerance", justify="right", whole=True), FitColumn("largest change", give_way=1)]
            more = comparison[total] - len(rows)
            parts.append(FitTable(columns, rows, title=f"{title} that moved ({comparison[total]}), in order"
                                  + (f"; {more} more not shown" if more > 0 else ""),
                                  box=box.SIMPLE, pad_edge=False, show_edge=False))
    tolerance = comparison.get("tolerance", {})
    parts.append(Text(f"tolerance: atol {tolerance.get('atol', 0):g} + rtol {tolerance.get('rtol', 0):g} x each "
                      "tensor's abs-max in the golden file", style="dim"))
    return Group(*parts)


def render_diff(diff: dict, console: Console, plot: bool = False) -> None:
    """`fwdcheck diff`'s report (fwdcheck.diff.Diff.to_dict()): the largest difference of every pair of modules in
    A's order of execution, the first that parts marked; with `plot`, the difference by depth; then what was not
    paired, the notes and the verdict."""
    pairs = diff["pairs"]
    first = diff["first_parting"]
    console.print(Text.assemble(("fwdcheck diff ", "bold"), f"· A {diff['a']} · B {diff['b']} · {diff['dtype']}"))
    rows = []
    for number, p in enumerate(pairs, 1):
        style = "bold red" if p["parts"] else "green"
        shape = str(p["shape"]) if p["shape"] == p["shape_b"] else f"{p['shape']} vs {p['shape_b']}"
        mark = "◀ first" if first is not None and p["a"] == first["a"] else ""
        rows.append([Text(f"{number}" + ("" if p["by_name"] else "*")), Text(p["a"]),
                     Text("" if p["b"] == p["a"] else p["b"]), Text(shape), Text(_number(p["max_diff"]), style),
                     Text(f"{p['tolerance']:.2g}"), Text(mark, "bold red")])
    columns = [FitColumn("#", justify="right", whole=True), FitColumn("module (A)", whole=True),
               FitColumn("in B", whole=True, give_way=2), FitColumn("shape", whole=True, give_way=1),
               FitColumn("max diff", justify="right", whole=True),  # max |a - b|
               FitColumn("tol", justify="right", whole=True), FitColumn("", whole=True)]  # the line under: what tol is
    console.print(FitTable(columns, rows, box=box.SIMPLE, pad_edge=False, show_edge=False))
    if not all(p["by_name"] for p in pairs):
        console.print(Text("* paired by order: no name in common, the same shape, between the same two pairs paired "
                           "by name", style="dim"))
    if plot and pairs:
        console.print(difference_plot(pairs, max(console.width - 8, 10)))
    for side in ("a", "b"):
        unpaired = diff[f"unpaired_{side}"]
        if unpaired:
            shown = ", ".join(unpaired[:6]) + (f" and {len(unpaired) - 6} more" if len(unpaired) > 6 else "")
            console.print(Text(f"not paired in {side.upper()}: {shown}", style="dim"))
    for note in diff["notes"]:
        console.print(Text(f"note: {note}", style="dim"))
    earliest = diff["first_difference"]
    if earliest is not None and (first is None or earliest["a"] != first["a"]):
        ratio = "" if earliest["max_diff"] is None else \
            f", {earliest['max_diff'] / earliest['tolerance']:.2g} of its tolerance"
        console.print(Text(f"the first pair that differs at all: A {earliest['a']} (max |a - b| "
                           f"{_number(earliest['max_diff'])}{ratio})", style="yellow" if first else "dim"))
    tolerance = diff["tolerance"]
    console.print(Text(f"max diff: the largest |a - b| over an output's elements; tol: atol {tolerance['atol']:g} + "
                       f"rtol {tolerance['rtol']:g} x A's largest |value| of it", style="dim"))
    if first is None:
        console.print(Text.assemble(("equal", "bold green"), f" within tolerance over {len(pairs)} pairs of modules "
                                    f"(exit {diff['exit_code']})"))
    else:
        by = _number(first["max_diff"])
        b = "" if first["b"] == first["a"] else f" / B {first['b']}"
        console.print(Text.assemble(("they part", "bold red"), f" at A {first['a']}{b}: max |a - b| {by} "
                                    f"(tolerance {first['tolerance']:.2g}) (exit {diff['exit_code']})"))


def _number(value: float | None) -> str:
    return "inf" if value is None else f"{value:.2g}"


PLOT_ROWS = 6  # decades of difference / tolerance a plot shows at most


def difference_plot(pairs: list[dict], width: int) -> Text:
    """Each pair's max |a - b| over its tolerance, by depth (A's order of execution, left to right), as bars on a
    log scale, one row a decade: a bar reaching the `tol x1` row parts. Wider than `width` pairs share columns (the
    largest shown). Under the bars, a caret at the first pair that parts."""
    ratios = [math.inf if p["max_diff"] is None else p["max_diff"] / p["tolerance"] if p["tolerance"] else
              (0.0 if p["max_diff"] == 0 else math.inf) for p in pairs]
    step = math.ceil(len(ratios) / width)
    columns = [max(ratios[i:i + step]) for i in range(0, len(ratios), step)]
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
            text.append("█" if r >= 10.0 ** decade else "·" if decade == 0 else " ", "red" if decade >= 0 else "green")
        text.append("\n")
    first = next((i for i, p in enumerate(pairs) if p["parts"]), None)
    if first is not None:
        text.append(" " * (7 + first // step) + f"^ #{first + 1} {pairs[first]['a']}, the first to part\n", "bold red")
    spread = "one pair a column" if step == 1 else f"{step} pairs a column, the largest shown"
    text.append(" " * 7 + f"max |a - b| / tolerance of each pair, in A's order ({spread})", style="dim")
    return text


def _notes(notes) -> list[Text]:
    """One dim line per note, with nothing to show for the empty ones."""
    return [Text(note, style="dim") for note in notes or [] if note]


def code_paths(rows: list[dict]) -> RenderableType:
    """Every cell of the code-path matrix that did not pass; one line when all did."""
    bad = [row for row in rows if row["status"] != "pass"]
    if not bad:
        return Text(f"all {len(rows)} code paths pass", style="green")
    cells = [[Text(row["path"]), Text(row["status"], STYLE[Status(row["status"])]),
              Text(", ".join(row.get("codes", []))), Text(row["summary"])] for row in bad]
    columns = [FitColumn("path"), FitColumn("status", whole=True), FitColumn("codes"), FitColumn("summary")]
    return FitTable(columns, cells, title=f"code paths: {len(bad)} of {len(rows)} not passing", box=box.SIMPLE,
                    pad_edge=False, show_edge=False)


@functools.cache
def detail_view(check: str) -> Callable[[CheckResult], RenderableType] | None:
    """The function a check names (Check.detail_view) to draw its data in its panel; None when it names none, or
    is not installed here (a report read from a file), or its view does not import: the findings still show."""
    from fwdcheck.registry import view_of

    reference = view_of(check)
    if reference is None:
        return None
    try:
        return pkgutil.resolve_name(reference)
    except Exception:  # a plugin's view that does not import: no detail, not a broken report
        return None
