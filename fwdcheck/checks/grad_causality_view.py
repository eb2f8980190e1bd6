"""grad-causality's detail view and the records its `data` holds (torch-free: the report reads them without the check).

The gradient leak map: rows are query positions (whose logits were backpropagated), columns the later positions
whose input embeddings got a gradient. '#' a nonzero gradient, '.' exactly 0.0, 'N' NaN/Inf, ' ' not later than
the query. Under it, how the check ran.
"""

from __future__ import annotations

from typing import TypedDict

from rich.console import Group, RenderableType
from rich.text import Text

from fwdcheck.report.layout import notes
from fwdcheck.result import CheckResult

MAP_WIDTH = 64  # maps wider than this many positions are binned


class GradientMap(TypedDict):
    row: int  # the row of the session's inputs the queries belong to
    length: int  # T
    # per query position q (the first ones only), the largest |gradient| at each position 0..T-1 (inf for NaN/Inf);
    # only the positions after q are judged
    gradient: list[list[float]]


def gradient_map(r: CheckResult) -> RenderableType:
    said = notes(r.data.get("notes", []))
    leak: GradientMap | None = r.data.get("gradient_map")
    if not leak:
        return Group(*said)
    T = leak["length"]
    bins = max(1, -(-T // MAP_WIDTH))  # key positions per character
    header = f"query\\key 0..{T - 1}" + (f" ({bins} positions per char)" if bins > 1 else "")
    lines = [Text(f"row {leak['row']}: {header}", style="dim")]
    for q, per_key in enumerate(leak["gradient"]):
        line = Text(f"{q:>6}  ")
        for start in range(0, T, bins):
            later = [per_key[k] for k in range(start, min(start + bins, T)) if k > q]
            line.append(_cell(later))
        lines.append(line)
    legend = Text(
        "# nonzero gradient from that later position's embedding, . exactly 0.0, N NaN/Inf, blank: not later",
        style="dim",
    )
    return Group(*lines, legend, *said)


def _cell(values: list[float]) -> Text:
    if not values:
        return Text(" ")
    if any(v != v or v == float("inf") for v in values):
        return Text("N", "bold magenta")
    return Text("#", "bold red") if max(values) > 0 else Text(".", "green")
