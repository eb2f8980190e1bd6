"""golden's detail view and the record its `data` holds (torch-free: the report is drawn without the check)."""

from __future__ import annotations

from typing import Any, TypedDict

from rich import box
from rich.console import Group, RenderableType
from rich.text import Text

from fwdcheck.report.layout import FitColumn, FitTable
from fwdcheck.result import CheckResult


class Moved(TypedDict):
    name: str
    by: float
    tolerance: float
    what: str  # the largest change, in words


class Comparison(TypedDict, total=False):
    moved: list[Moved]
    moved_outputs: int
    parameters_moved: list[Moved]
    moved_parameters: int
    tolerance: dict[str, float]


class GoldenData(TypedDict, total=False):
    golden: dict[str, Any]  # the fingerprints (fwdcheck.checks.golden_file's document)
    comparison: Comparison  # with a golden file to compare with


def golden(r: CheckResult) -> RenderableType:
    """The outputs that moved from the golden file, in the order they came (the first is where to look), and the
    parameters that moved; a line saying what was recorded when nothing was compared."""
    comparison = r.data.get("comparison")
    if comparison is None:
        document = r.data.get("golden", {})
        return Text(
            f"{len(document.get('outputs', []))} module outputs and {len(document.get('parameters', []))} "
            "parameters and buffers fingerprinted; --save-golden FILE writes them",
            style="dim",
        )
    parts: list[RenderableType] = []
    for key, total, title in (
        ("moved", "moved_outputs", "module outputs"),
        ("parameters_moved", "moved_parameters", "parameters"),
    ):
        rows = [
            [Text(m["name"]), Text(f"{m['by']:.3g}", "bold red"), Text(f"{m['tolerance']:.2g}"), Text(m["what"])]
            for m in comparison.get(key, [])
        ]
        if rows:
            columns = [
                FitColumn("name", whole=True),
                FitColumn("moved by", justify="right", whole=True),
                FitColumn("tolerance", justify="right", whole=True),
                FitColumn("largest change", give_way=1),
            ]
            more = comparison[total] - len(rows)
            parts.append(
                FitTable(
                    columns,
                    rows,
                    title=f"{title} that moved ({comparison[total]}), in order"
                    + (f"; {more} more not shown" if more > 0 else ""),
                    box=box.SIMPLE,
                    pad_edge=False,
                    show_edge=False,
                )
            )
    tolerance = comparison.get("tolerance", {})
    parts.append(
        Text(
            f"tolerance: atol {tolerance.get('atol', 0):g} + rtol {tolerance.get('rtol', 0):g} x each "
            "tensor's abs-max in the golden file",
            style="dim",
        )
    )
    return Group(*parts)
