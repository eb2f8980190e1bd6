"""The rich terminal report: a summary table, then each check's detail (ledger, leak map, mask table, RoPE numbers).

It only shows what the checks put in their results; it computes nothing but layout.
"""

from __future__ import annotations

import re
from typing import Callable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Status

STYLE = {Status.PASS: "bold green", Status.WARN: "bold yellow", Status.FAIL: "bold red", Status.SKIP: "dim",
         Status.ERROR: "bold magenta"}
MAP_WIDTH = 64  # leak maps wider than this many positions are binned
GRID_KEYS = 48  # may-read grids show at most this many key slots (two characters each), to fit a 120-column report


def render(report: Report, console: Console, debug: bool = False) -> None:
    env = report.environment
    console.print(Text.assemble(("fwdcheck ", "bold"), f"· {report.model.get('label', '?')} · ",
                                f"{env.get('device')} {env.get('dtype')} · B={env.get('batch_size')} "
                                f"T={env.get('seq_len')} seed={env.get('seed')}"))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="dim"))
    console.print(summary_table(report))
    for result in report.results:
        if result.status == Status.SKIP:
            continue
        console.print(detail(result, debug))
    verdict = {0: "[bold green]passed[/]", 1: "[bold red]failed[/]", 3: "[bold magenta]internal error[/]",
               5: "[dim]nothing ran[/]", 130: "[bold red]interrupted[/]"}[report.exit_code]
    console.print(f"{verdict} (exit {report.exit_code})")


def summary_table(report: Report) -> Table:
    table = Table(box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=False)
    table.add_column("check", style="bold")
    table.add_column("status")
    table.add_column("key number", justify="right")
    table.add_column("summary", overflow="fold")
    for r in report.results:
        table.add_row(r.name, Text(r.status.value, STYLE[r.status]), key_number(r), Text(r.summary))
    return table


def key_number(r: CheckResult) -> str:
    m = r.metrics
    if r.name == "future-token" and "threshold" in m:
        return f"{m.get('max_change_before_cut', m.get('batch_max_change', 0)):.2g} / {m['threshold']:.2g}"
    if r.name == "shape-ledger" and "tensors" in m:
        return f"{m['tensors']} tensors"
    if r.name == "mask-audit" and "attention_calls" in m:
        return f"{m['attention_calls']} calls"
    if r.name == "rope" and m.get("base"):
        return f"base {m['base']:.4g}"
    return f"{r.duration_s:.2f}s"


def detail(r: CheckResult, debug: bool) -> Panel:
    parts: list[RenderableType] = []
    if r.findings:
        findings = Table(box=None, show_header=False, pad_edge=False)
        findings.add_column(no_wrap=True)
        findings.add_column(no_wrap=True)
        findings.add_column(overflow="fold")
        for f in r.findings:
            message = Text(f.message)
            if f.where:
                message.append(f"\nat {f.where}", style="dim")
            findings.add_row(f.code, Text(f.status.value, STYLE[f.status]), message)
        parts.append(findings)
    render_data = DETAIL.get(r.name)
    if render_data is not None and r.data:
        parts.append(render_data(r))
    if r.data.get("paths"):
        parts.append(code_paths(r.data["paths"]))
    if debug and r.data.get("traceback"):
        parts.append(Text(r.data["traceback"], style="dim"))
    if not parts:
        parts.append(Text(r.summary))
    title = Text.assemble((r.name, "bold"), " ", (r.status.value, STYLE[r.status]), f"  {r.duration_s:.2f}s")
    return Panel(Group(*parts), title=title, title_align="left", border_style=STYLE[r.status].split()[-1])


# -- per-check detail -------------------------------------------------------------------------------------------------


def ledger(r: CheckResult) -> RenderableType:
    """The ledger, with rows that repeat across layers folded into one: layers.{0..11}.attn q."""
    table = Table(box=box.SIMPLE, pad_edge=False, show_edge=False)
    for column in ("tensor", "shape", "dims", "expected"):
        table.add_column(column)
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
        table.add_row(Text(name), Text(str(e["shape"])), Text(dims, "green" if e["ok"] else "bold red"), Text(expected))
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
    conventions = Table(title="conventions", box=box.SIMPLE, pad_edge=False, show_edge=False, title_justify="left")
    for column in ("API", "bool mask", "float mask", "flag"):
        conventions.add_column(column)
    for c in r.data.get("conventions", []):
        conventions.add_row(*(Text(c[key]) for key in ("api", "bool", "float", "flag")))
    calls = Table(title="what each call used", box=box.SIMPLE, pad_edge=False, show_edge=False, title_justify="left")
    # A module's name is how a row is found in the code: it stays whole while the pattern wraps, and folds rather
    # than lose its end only when nothing else can give way.
    for column in ("module", "api", "mask", "shape", "values", "flags", "L x S", "may read"):
        calls.add_column(column, overflow="fold", no_wrap=column in ("module", "L x S"))
    rows = r.data.get("calls", [])
    for c in rows:
        module = c["module"] + (" at B=1" if c.get("batch_size") == 1 else "")
        cells = (module, c["api"], c["mask"], str(c["mask_shape"] or "-"), c["values"], _flags(c), _extent(c))
        calls.add_row(*map(Text, cells), _pattern(c))
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
        parts.append(may_read_grid(shown))
    return Group(*parts)


def _pattern(call: dict) -> Text:
    """Red only for a judged call that lets a query read past its own position. A call that was not compared with
    causal (cross-attention, an encoder over another sequence, query positions unknown) is no failure: dim, named by
    the start of its reason ('not judged: cross-attention'); the whole reason is said under the table."""
    pattern = call["pattern"]
    if call.get("judged", True):
        return Text(pattern, "green" if pattern.startswith("causal") else "bold red")
    why = pattern.split(" (")[0].removeprefix("not judged: ") if pattern.startswith("not judged") else \
        pattern.split(":")[0]
    return Text(f"not judged:\n{why}", "dim")  # two short lines fit a narrow column where one long one breaks words


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
    failing = [c for c in judged if not c["pattern"].startswith("causal")]
    return next(iter(failing or judged or small), None)


def may_read_grid(call: dict) -> RenderableType:
    """Rows: queries; columns: key slots; a key after the query's own position is the future. That position is
    query_positions[i] when the call has them (a KV cache, a decode step: query 0 of a decode step may sit at
    position 37), else i. A call that was not judged has no future to colour: its set is drawn plain."""
    may_read = call["may_read"]
    judged = call.get("judged", True)
    positions = call.get("query_positions")
    if not positions or len(positions) != len(may_read):
        positions = list(range(len(may_read)))  # the square case: query i sits at position i
    keys = len(may_read[0]) if may_read else 0
    # A long cache would wrap the grid into noise: a window of slots is drawn, ending a little after the last query's
    # own position, so that the boundary between past and future is in it.
    width = min(keys, GRID_KEYS)
    end = min(keys, max(width, max(positions, default=0) + 1 + GRID_KEYS // 4))
    start = end - width
    where = f" at {_positions(positions)} ({call['positions_from']})" if call.get("positions_from") not in (
        None, "", "square") and call.get("query_positions") else ""
    slots = f"{keys} key slots" + (f", {start}..{end - 1} shown" if width < keys else "")
    caption = Text(f"may-read set of {call['module']}{' at B=1' if call.get('batch_size') == 1 else ''} "
                   f"(rows: queries{where}; columns: {slots})" + ("" if judged else ": not judged, drawn plain"),
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
    table = Table(box=box.SIMPLE, pad_edge=False, show_edge=False)
    for column in ("view", "rotates", "pairing", "rotary dim", "base", "first frequencies (rad/position)"):
        table.add_column(column)
    probe = r.data.get("probe")
    rows = []
    if isinstance(probe, dict):
        rows += [("probe q", probe["q"]), ("probe k", probe["k"])]
    if r.data.get("component"):
        rows.append(("rotary function", r.data["component"]))
    for view, rot in rows:
        thetas = ", ".join(f"{t:.4g}" for t in rot.get("thetas", [])[:4])
        table.add_row(view, str(rot["rotates"]), str(rot.get("pairing")), str(rot.get("rotary_dim")),
                      f"{rot['base']:.5g}" if rot.get("base") else "-", thetas)
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


def _notes(notes) -> list[Text]:
    """One dim line per note, with nothing to show for the empty ones."""
    return [Text(note, style="dim") for note in notes or [] if note]


def code_paths(rows: list[dict]) -> RenderableType:
    """Every cell of the code-path matrix that did not pass; one line when all did."""
    bad = [row for row in rows if row["status"] != "pass"]
    if not bad:
        return Text(f"all {len(rows)} code paths pass", style="green")
    table = Table(title=f"code paths: {len(bad)} of {len(rows)} not passing", box=box.SIMPLE, pad_edge=False,
                  show_edge=False, title_justify="left")
    for column in ("path", "status", "codes", "summary"):
        table.add_column(column, overflow="fold")
    for row in bad:
        table.add_row(Text(row["path"]), Text(row["status"], STYLE[Status(row["status"])]),
                      Text(", ".join(row.get("codes", []))), Text(row["summary"]))
    return table


DETAIL: dict[str, Callable[[CheckResult], RenderableType]] = {
    "shape-ledger": ledger,
    "future-token": leak_map,
    "mask-audit": mask_table,
    "rope": rope_numbers,
}
