"""future-token's options, detail view and the records its `data` holds (torch-free: the command line and the report
read them without the check).

The leak map: rows are query positions, columns the perturbed position (exhaustive) or cut; '.' still, '#' moved,
'N' NaN/Inf, ' ' not before k. Under it, what ran otherwise than planned.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from pydantic import Field
from rich.console import Group, RenderableType
from rich.text import Text

from fwdcheck.config import CheckOptions
from fwdcheck.report.layout import notes
from fwdcheck.result import CheckResult

MAP_WIDTH = 64  # leak maps wider than this many positions are binned


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
    legend = Text(
        f"# moved beyond {threshold:.2g}, . still, N NaN/Inf, blank: not before k. Columns: {kind}.", style="dim"
    )
    return Group(*lines, legend, *said)


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
