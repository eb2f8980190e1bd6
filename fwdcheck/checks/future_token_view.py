"""future-token's options, detail view and the records its `data` holds (torch-free: the command line and the report
read them without the check).

The leak map: rows are query positions, columns the perturbed position (exhaustive) or cut; '.' still, '#' moved,
'N' NaN/Inf, ' ' not before k. It is drawn only where something moved: runs of still rows are one line, and its
height is capped. Under it, what ran otherwise than planned.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from pydantic import Field
from rich.console import Group, RenderableType
from rich.text import Text

from fwdcheck.config.schema import CheckOptions
from fwdcheck.report.layout import notes
from fwdcheck.result import CheckResult

MAP_WIDTH = 64  # leak maps wider than this many positions are binned
MAP_ROWS = 24  # lines of a leak map drawn at most; the JSON report holds it whole


class Options(CheckOptions):
    """`options: {future-token: {...}}`"""

    exhaustive: bool = Field(
        False,
        description="perturb every position, one token at a time, and draw the full "
        "leak map (T - 1 rows instead of 2 to 4)",
    )


class LeakColumn(TypedDict):
    k: int  # the cut (tokens >= k changed) or the one token changed
    sample: int  # the row of the session's inputs the perturbed row was drawn from
    change: list[float]  # per query position before k, the largest |change| of its logits


class LeakMap(TypedDict):
    kind: Literal["cut", "token"]
    threshold: float
    columns: list[LeakColumn]


class SingleRow(TypedDict):
    """The batch-size-1 pass: one row of `length` tokens, tokens >= cut replaced."""

    length: int
    cut: int
    against: Literal["prefix", "baseline"]
    change: list[float]


class FutureTokenData(TypedDict, total=False):
    leak_map: LeakMap
    single_row: SingleRow | str  # str: why it did not run
    note: str
    notes: list[str]
    reference: str
    noise_floor: str


def leak_map(r: CheckResult) -> RenderableType:
    """Rows: query positions; columns: the perturbed position (exhaustive) or cut. '.' still, '#' moved, ' ' n/a."""
    # What did not run, or ran otherwise than planned (a pass the model refused, rows run one at a time), is said
    # under the map: a finding stands only on what ran.
    said = notes([r.data.get("note"), *r.data.get("notes", []), _single_row(r)])
    leak = r.data.get("leak_map")
    if not leak:
        return Group(*said)
    columns = leak["columns"]
    threshold = leak["threshold"]
    last = max((c["k"] for c in columns), default=0)  # queries run 0..last-1, perturbed positions 1..last
    bins = max(1, -(-(last + 1) // MAP_WIDTH))  # positions per character
    if leak["kind"] == "cut":
        header, kind = "query\\k " + "".join(f"{c['k']} " for c in columns), "tokens >= k changed"
    else:
        header, kind = (
            f"query\\k 0..{last}" + (f" ({bins} positions per char)" if bins > 1 else ""),
            "token k alone changed",
        )
    rows: list[tuple[int, Text]] = []  # (first query of the row, its cells)
    for qbin in range(-(-last // bins)):
        queries = slice(qbin * bins, (qbin + 1) * bins)
        cells = Text()
        if leak["kind"] == "cut":
            for c in columns:
                cells.append(_cell(c["change"][queries], threshold))
                cells.append(" " * len(str(c["k"])))  # the column is as wide as its label "k "
        else:
            for kbin in range(-(-(last + 1) // bins)):
                group = [c for c in columns if kbin * bins <= c["k"] < (kbin + 1) * bins]
                cells.append(_cell([v for c in group for v in c["change"][queries]], threshold))
        rows.append((qbin * bins, cells))
    if not any(_moved(cells) for _, cells in rows):  # a map of dots says what one line says
        return Group(Text(f"leak map: every earlier position still ({len(rows)} query rows)", style="dim"), *said)
    legend = Text(
        f"# moved beyond {threshold:.2g}, . still, N NaN/Inf, blank: not before k. Columns: {kind}.", style="dim"
    )
    return Group(Text(header, style="dim"), *_drawn(rows, bins), legend, *said)


def _drawn(rows: list[tuple[int, Text]], bins: int) -> list[Text]:
    """The map's lines: a row with something moved as it is, a run of rows where nothing moved as one line, and
    at most MAP_ROWS lines, the last saying what was left out."""
    lines: list[Text] = []
    i = 0
    while i < len(rows):
        start, cells = rows[i]
        still = i
        while still < len(rows) and not _moved(rows[still][1]):
            still += 1
        if still - i >= 2:  # a run of still rows: one line
            end = rows[still - 1][0] + bins - 1
            lines.append(Text(f"{start:>6}  ", style="dim").append(f"… to {end}: still", style="dim green"))
            i = still
            continue
        lines.append(Text(f"{start:>6}  ").append_text(cells))
        i += 1
    if len(lines) > MAP_ROWS:
        left = lines[MAP_ROWS - 1 :]
        moved = sum(1 for line in left if "#" in line.plain or "N" in line.plain)
        lines = lines[: MAP_ROWS - 1]
        lines.append(Text(f"        … {len(left)} more lines, {moved} with a leak (the JSON report holds the map)"))
    return lines


def _moved(cells: Text) -> bool:
    return "#" in cells.plain or "N" in cells.plain


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
    return (
        f"single row (batch size 1, T={single['length']}): tokens >= {single['cut']} replaced, earlier logits "
        f"moved by up to {worst:.2g}{threshold} against {against}"
    )


def _cell(values: list[float], threshold: float) -> Text:
    if not values:
        return Text(" ")
    worst = max(values)
    if worst != worst or worst == float("inf"):
        return Text("N", "bold magenta")
    return Text("#", "bold red") if worst > threshold else Text(".", "green")
