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
    return Group(table, caption)


def _range(indices: list[str]) -> str:
    if len(indices) == 1:
        return indices[0]
    return f"{{{indices[0]}..{indices[-1]}}}"


def leak_map(r: CheckResult) -> RenderableType:
    """Rows: query positions; columns: the perturbed position (exhaustive) or cut. '.' still, '#' moved, ' ' n/a."""
    leak = r.data.get("leak_map")
    if not leak:
        return Text(r.data.get("note", ""), style="dim")
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
    return Group(*lines, legend)


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
    for column in ("module", "api", "mask", "shape", "values", "is_causal", "dropout_p", "keys each query may read"):
        calls.add_column(column)
    for c in r.data.get("calls", []):
        ok = c["pattern"].startswith("causal") or c["pattern"].startswith("cross")
        cells = (c["module"], c["api"], c["mask"], str(c["mask_shape"] or "-"), c["values"], str(c["is_causal"]),
                 f"{c['dropout_p']:g}")
        calls.add_row(*map(Text, cells), Text(c["pattern"], "green" if ok else "bold red"))
    parts: list[RenderableType] = [conventions, calls]
    first = next((c for c in r.data.get("calls", []) if c.get("may_read") and len(c["may_read"]) <= 16), None)
    if first is not None:
        grid = Text(f"may-read set of {first['module']} (rows: queries, columns: keys)\n", style="dim")
        for i, row in enumerate(first["may_read"]):
            for j, v in enumerate(row):
                grid.append("■ " if v else "· ", "red" if v and j > i else ("green" if v else "dim"))
            grid.append("\n")
        parts.append(grid)
    return Group(*parts)


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
    lines: list[RenderableType] = [table]
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
    return Group(*lines)


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
