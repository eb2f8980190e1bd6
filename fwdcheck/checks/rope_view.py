"""rope's detail view and the record its `data` holds (torch-free: the report is drawn without the check).

What each view of the rotation measured (the probe's q and k, the rotary function alone), what the model declares,
and what could not be judged.
"""

from __future__ import annotations

from typing import Any, TypedDict

from rich import box
from rich.console import Group, RenderableType
from rich.text import Text

from fwdcheck.report.layout import FitColumn, FitTable, notes
from fwdcheck.result import CheckResult


class Rotation(TypedDict, total=False):
    """What one view measured of the rotation."""

    rotates: bool
    pairing: str | None
    rotary_dim: int | None
    base: float | None
    thetas: list[float]  # the first frequencies, radians per position


class Probe(Rotation, total=False):
    q: Rotation
    k: Rotation
    toeplitz_error: float  # q_m . k_n off its diagonals, relative to its scale


class Component(Rotation, total=False):
    identity_error: float
    norm_error: float
    position0_error: float


class AxisSection(TypedDict):
    pairs: list[int]  # the rotary pairs that turn with this axis alone
    thetas: list[float]  # their frequencies along it, radians per position


class Axes(TypedDict, total=False):
    """A multi-axis rotary embedding judged per axis (rope_axes): the sections each axis turns."""

    names: list[str]
    declared: dict[str, Any]  # sections, layout (None: not stated), origin
    held_at: int  # where the other axes were held while one walked
    pairing: str
    pairs: int
    sections: dict[str, AxisSection]
    not_judged_pairs: list[int]  # too slow to turn visibly within the probe
    layout: str  # the layout held against, or why none was
    calls: int


class RopeData(TypedDict, total=False):
    probe: Probe | str  # str: why it did not run
    probe_calls: list[dict[str, Any]]
    probe_shift: dict[str, Any] | str
    component: Component
    component_note: str
    component_scale: float
    declared: dict[str, Any]
    declared_from: str | None  # where the declaration came from (ModelUnderTest.origins["rope"])
    absolute_positions: str
    logits_shift: str
    axes: Axes | str  # str: why the axes were not judged


def rope_numbers(r: CheckResult) -> RenderableType:
    """The rotation each view measured (the probe's q and k, the rotary function alone), what the model declares,
    the relative errors each view found, and what was not judged."""
    probe = r.data.get("probe")
    rows = []
    if isinstance(probe, dict):
        rows += [("probe q", probe["q"]), ("probe k", probe["k"])]
    if r.data.get("component"):
        rows.append(("rotary function", r.data["component"]))
    lines: list[RenderableType] = [_rotations(rows)] if rows else []  # headers over nothing say less than the notes
    return Group(*lines, *_errors(r, probe), *notes(_ropenotes(r.data)))


def _rotations(rows: list[tuple[str, Rotation]]) -> FitTable:
    """A row per view: whether it rotates, the pairing, rotary dim and base, and the first frequencies."""
    cells = []
    for view, rot in rows:
        thetas = ", ".join(f"{t:.4g}" for t in rot.get("thetas", [])[:4])
        cells.append(
            [
                *map(
                    Text,
                    (
                        view,
                        str(rot["rotates"]),
                        str(rot.get("pairing")),
                        str(rot.get("rotary_dim")),
                        f"{rot['base']:.5g}" if rot.get("base") else "-",
                        thetas,
                    ),
                )
            ]
        )
    columns = [
        FitColumn("view"),
        FitColumn("rotates"),
        FitColumn("pairing"),
        FitColumn("rotary dim"),
        FitColumn("base", whole=True),
        FitColumn("first frequencies (rad/position)"),
    ]
    return FitTable(columns, cells, box=box.SIMPLE, pad_edge=False, show_edge=False)


def _errors(r: CheckResult, probe: Any) -> list[Text]:
    """What the model declares, and the relative errors each view measured: off the diagonals of q_m . k_n, the
    rotary function's identity, norms and R(0), the logits with every position shifted."""
    lines = []
    declared = r.data.get("declared")
    if declared:
        base = f"{declared['base']:g}" if declared.get("base") else "not compared"
        lines.append(
            Text(
                f"declared: pairing {declared.get('pairing') or 'not stated'}, base {base}, rotary dim "
                f"{declared.get('rotary_dim') or 'head size'}",
                style="dim",
            )
        )
    if r.data.get("declared_from"):
        lines.append(Text(f"declaration: {r.data['declared_from']}", style="dim"))
    if isinstance(probe, dict):
        lines.append(Text(f"q_m . k_n off its diagonals: {probe['toeplitz_error']:.2g} of its scale", style="dim"))
    if r.data.get("component_note"):
        lines.append(Text(r.data["component_note"], style="dim"))
    if r.data.get("component"):
        c = r.data["component"]
        lines.append(
            Text(
                f"rotary function: identity {c['identity_error']:.2g}, norms {c['norm_error']:.2g}, "
                f"R(0) {c['position0_error']:.2g} (relative errors)",
                style="dim",
            )
        )
    m = r.metrics
    if "logits_shift_change" in m:
        lines.append(
            Text(
                f"logits with every position shifted: change {m['logits_shift_change']:.2g} vs threshold "
                f"{m['logits_shift_threshold']:.2g}",
                style="dim",
            )
        )
    return lines


def _ropenotes(data: dict) -> list[str]:
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
        notes.append(
            f"probe: {len(cached)} call(s) read a KV cache; only the key slots holding the probe's positions were read"
        )
    shift = data.get("probe_shift")
    if isinstance(shift, dict):
        notes.append(
            f"probe with every position shifted by {shift['offset']}: q . k changed by "
            f"{shift['score_change']:.2g} of its scale over {shift['calls']} call(s)"
        )
    elif shift:
        notes.append(f"probe shift: {shift}")
    if data.get("absolute_positions"):
        notes.append(f"positions also enter absolutely: {data['absolute_positions']}")
    if isinstance(data.get("logits_shift"), str):
        notes.append(f"logits shift: {data['logits_shift']}")
    axes = data.get("axes")
    if isinstance(axes, dict):
        turned = "; ".join(
            f"{name} pairs {', '.join(map(str, v['pairs'])) or 'none judged'}"
            + (f" ({', '.join(f'{t:.3g}' for t in v['thetas'][:3])} rad/position)" if v["thetas"] else "")
            for name, v in axes["sections"].items()
        )
        slow = axes.get("not_judged_pairs") or []
        notes.append(
            f"multi-axis sections, each axis walked with the others held at {axes['held_at']} over "
            f"{axes['calls']} call(s), layout {axes['layout']}: {turned}"
            + (f"; pairs {', '.join(map(str, slow))} too slow to judge" if slow else "")
        )
        declared = axes["declared"]
        notes.append(f"declared sections {declared['sections']}: {declared['origin']}")
    elif axes:
        notes.append(f"multi-axis sections: {axes}")
    if data.get("component_scale"):
        notes.append(f"rotary function scales by {data['component_scale']:.4g} (an attention factor, divided out)")
    return notes
