"""rope's view of a multi-axis rotary embedding (M-RoPE: time, height and width): each section judged against its own
axis.

For text tokens every axis holds the same positions, and an M-RoPE then turns each rotary pair by its frequency
times the position whichever axis the pair reads: the one-axis probe sees a plain rotary embedding, and cannot see
which axis turns which pair. So the probe runs once more per axis, with position_ids [axes, 1, P] that walk that
axis over 0..P-1 and hold the others at one position. Along each axis:

  - q and k must turn alike (FWD302 when they do not: one of them reads another axis, or another section layout);
  - q_m . k_n must depend on n - m alone, the other axes held fixed (FWD303);
  - each rotary pair must turn with exactly one axis, the one the declared sections give it (mrope_section, laid out
    one after the other or interleaved as mrope_interleaved says; either layout when the model does not say): a
    section read from another axis, sections split in the wrong order, a pair turned by two axes, is FWD309, naming
    the section.

A pair is judged only where its frequency can be seen within the probe (rotation.well_measured); the slower ones are
listed as not judged. This module computes from the q and k rope's probe observed; rope runs the forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fwdcheck.checks.rotation import Rotation, pair_thetas, same_turns, toeplitz_error, well_measured
from fwdcheck.model.capabilities import RotaryAxes, SectionLayout
from fwdcheck.result import Finding, Status

SAME_RATE = 0.05  # a pair turning with one axis turns at its all-axes frequency, within this fraction


@dataclass
class AxisCall:
    """One attention call as the one-axis probe measured it (head 0): its rotations of q and k, with every axis at
    the same positions, and the rotary pairs the model declares."""

    where: str
    q: Rotation
    k: Rotation
    pairs: int  # rotary pairs, as declared (the measured ones when the declaration does not fit them)


def axis_positions(axes: RotaryAxes, axis: int, P: int, held_at: int, device: torch.device) -> torch.Tensor:
    """position_ids [axes, 1, P]: `axis` walks 0..P-1, every other axis stays at `held_at`."""
    positions = torch.full((len(axes.names), 1, P), held_at, dtype=torch.long, device=device)
    positions[axis, 0] = torch.arange(P, device=device)
    return positions


def judge_axes(
    axes: RotaryAxes,
    calls: list[AxisCall],
    seen: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
    P: int,
    held_at: int,
    tol: float,
    data: dict,
) -> list[Finding]:
    """FWD302, FWD303 and FWD309 at each call, from seen[axis][where] = (q, k) (P, d_h) of head 0 with that axis
    driven; what the first call shows goes to data["axes"]."""
    findings: list[Finding] = []
    reports = []
    for call in calls:
        if any(call.where not in along for along in seen):
            continue  # not judged in every axis's probe
        report, found = _judge_call(axes, call, [along[call.where] for along in seen], P, held_at, tol)
        findings += found
        reports.append((report, bool(found)))
    if not reports:
        data["axes"] = "not judged: no attention call could be judged in every axis's probe"
        return []
    shown = next((r for r, bad in reports if bad), reports[0][0])  # the first call with a finding, else the first
    data["axes"] = {**shown, "calls": len(reports)}
    return findings


def _judge_call(
    axes: RotaryAxes,
    call: AxisCall,
    seen: list[tuple[torch.Tensor, torch.Tensor]],
    P: int,
    held_at: int,
    tol: float,
) -> tuple[dict, list[Finding]]:
    names = axes.names
    pairing = call.q.pairing
    assert pairing is not None  # the caller hands over calls whose q and k turn as rotations
    start, rotary_dim = call.q.rotary_start, call.q.rotary_dim
    measured_pairs = rotary_dim // 2
    where = call.where
    findings: list[Finding] = []
    for axis, (q, k) in enumerate(seen):
        others = ", ".join(n for i, n in enumerate(names) if i != axis)
        along = f"along the {names[axis]} axis ({others} held at {held_at})"
        if not same_turns(q, k, pairing, rotary_dim, start, tol):
            q_pairs = _turning(pair_thetas(q, pairing, rotary_dim, start), P, tol)
            k_pairs = _turning(pair_thetas(k, pairing, rotary_dim, start), P, tol)
            findings.append(
                Finding(
                    "FWD302",
                    Status.FAIL,
                    f"{along} q and k turn differently (q turns pairs {_spans(q_pairs)}, k pairs {_spans(k_pairs)}): "
                    "one of them reads another axis or another section layout",
                    where,
                    module=where,
                )
            )
            continue
        error = toeplitz_error(q.double() @ k.double().T)
        if error > tol:
            findings.append(
                Finding(
                    "FWD303",
                    Status.FAIL,
                    f"{along} q_m . k_n varies along diagonals by {error:.3g} of its scale (tolerance {tol:g}): it "
                    "depends on more than n - m",
                    where,
                    module=where,
                )
            )
    # Which axis turns each pair, from q (k turns alike, or that is a finding above).
    thetas = [pair_thetas(q, pairing, rotary_dim, start) for q, _ in seen]  # [axis][pair]
    together = call.q.thetas  # every axis at the same positions
    judged = [p for p in range(measured_pairs) if well_measured(together[p], P, tol)]
    turns_with = {p: [a for a in range(len(names)) if well_measured(thetas[a][p], P, tol)] for p in judged}
    off_rate = {
        p: axes_[0]
        for p, axes_ in turns_with.items()
        if len(axes_) == 1 and abs(thetas[axes_[0]][p] - together[p]) > SAME_RATE * abs(together[p])
    }
    report: dict = {
        "names": list(names),
        "declared": {"sections": list(axes.sections or ()), "layout": axes.layout, "origin": axes.origin},
        "held_at": held_at,
        "pairing": pairing,
        "pairs": call.pairs,
        "sections": {
            names[a]: {
                "pairs": [p for p in judged if turns_with[p] == [a]],
                "thetas": [round(thetas[a][p], 6) for p in judged if turns_with[p] == [a]],
            }
            for a in range(len(names))
        },
        "not_judged_pairs": [p for p in range(call.pairs) if p not in judged],
    }
    layouts: list[SectionLayout] = [axes.layout] if axes.layout else ["contiguous", "interleaved"]
    expected = {layout: axes.pair_axes(call.pairs, layout) for layout in layouts}
    fitting = {layout: e for layout, e in expected.items() if e is not None}
    if not fitting:
        report["layout"] = (
            f"not compared: the declared sections {list(axes.sections or ())} do not lay out over the "
            f"{call.pairs} rotary pairs ({' or '.join(layouts)})"
        )
        return report, findings
    wrong = {layout: [p for p in judged if turns_with[p] != [e[p]] or p in off_rate] for layout, e in fitting.items()}
    layout = min(wrong, key=lambda name: len(wrong[name]))
    report["layout"] = layout
    if wrong[layout]:
        findings.append(
            Finding(
                "FWD309",
                Status.FAIL,
                _misplaced(axes, layout, fitting[layout], wrong[layout], turns_with, off_rate, len(fitting)),
                where,
                module=where,
            )
        )
    return report, findings


def _misplaced(
    axes: RotaryAxes,
    layout: SectionLayout,
    expected: list[int],
    wrong: list[int],
    turns_with: dict[int, list[int]],
    off_rate: dict[int, int],
    candidates: int,
) -> str:
    """FWD309's message: each section with pairs that turn with another axis (or several, or none alone, or at
    another rate than their frequency), then the declaration they were held against."""
    names = axes.names
    parts = []
    for axis, name in enumerate(names):
        said: dict[str, list[int]] = {}  # what the pairs do: the pairs that do it
        for p in (p for p in wrong if expected[p] == axis):
            got = turns_with[p]
            if p in off_rate:
                what = f"turn{{s}} with the {names[got[0]]} axis at another rate than {{its}} frequency"
            elif not got:
                what = "turn{s} with no axis alone"
            else:
                what = f"turn{{s}} with the {' and '.join(names[a] for a in got)} ax{'e' if len(got) > 1 else 'i'}s"
            said.setdefault(what, []).append(p)
        if said:
            declared = _spans([p for p, a in enumerate(expected) if a == axis])
            shown = [
                f"pair{'s' if len(ps) > 1 else ''} {_spans(ps)} "
                + what.format(s="" if len(ps) > 1 else "s", its="their" if len(ps) > 1 else "its")
                for what, ps in said.items()
            ]
            parts.append(f"the {name} section (pairs {declared}): {', '.join(shown)}")
    layout_said = f"laid out {layout}"
    if axes.layout is None:  # not stated: the layout held against is the closer one, or the only one that fits
        layout_said += (
            ", the closer of the two layouts (the config states neither)"
            if candidates > 1
            else ", the one layout they fit (the config states none)"
        )
    return f"{'; '.join(parts)} (declared sections {list(axes.sections or ())}, {layout_said}; {axes.origin})"


def _turning(thetas: list[float], P: int, tol: float) -> list[int]:
    return [p for p, theta in enumerate(thetas) if well_measured(theta, P, tol)]


def _spans(pairs: list[int]) -> str:
    """[0, 1, 2, 5] as '0-2, 5'; 'none' for []."""
    if not pairs:
        return "none"
    spans, first, last = [], pairs[0], pairs[0]
    for p in pairs[1:]:
        if p == last + 1:
            last = p
            continue
        spans.append(f"{first}-{last}" if last > first else f"{first}")
        first = last = p
    spans.append(f"{first}-{last}" if last > first else f"{first}")
    return ", ".join(spans)
