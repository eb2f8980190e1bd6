"""What a stack of rotated vectors reveals about the rotation: X[m] = R(m) x for positions m = 0..P-1 tells which dims
turn, paired how (half: i with i + r/2; interleaved: 2i with 2i+1), at which frequency each pair turns and the base
they imply; and scores q_m . k_n tell how far they are from depending on n - m alone. rope reads the rotations of q
and k at the model's attention calls and of its rotary function alone; rope-precision reads which dims the rotary
function turns, paired how, before it measures the angles of long positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fwdcheck.run.compare import relative_error


@dataclass
class Rotation:
    """What a stack of vectors X[m] = R(m) x reveals about R."""

    rotates: bool
    pairing: str | None = None  # half | interleaved | None when no pairing keeps pair norms constant
    rotary_dim: int = 0
    thetas: list[float] = field(default_factory=list)  # radians per position, per pair
    base: float | None = None
    decay: float | None = None  # theta_p = exp(-decay * p); base = exp(decay * rotary_dim / 2)
    norm_error: float = 0.0  # largest relative drift of a pair's norm across positions, under the best pairing
    rotary_start: int = 0  # the first rotated dim: 0, or where a head's rotated slice follows an unrotated one (MLA)


def pair_indices(pairing: str, rotary_dim: int, start: int = 0) -> tuple[list[int], list[int]]:
    half = rotary_dim // 2
    if pairing == "half":
        return list(range(start, start + half)), list(range(start + half, start + rotary_dim))
    return list(range(start, start + rotary_dim, 2)), list(range(start + 1, start + rotary_dim, 2))


def analyze(X: torch.Tensor, tol: float, prefer: str | None = None, noise: float | None = None) -> Rotation:
    """X: (P, D), the same vector rotated to positions 0..P-1. Which dims turn, paired how, how fast.

    The rotated dims are one slice of the head: its start (usually 0; after the unrotated part in multi-head latent
    attention, whose heads concatenate [no rope | rope]) and its width are measured, not assumed.

    tol judges whether pair norms stay constant; noise (default tol) is the relative change below which a dim counts
    as still: set it near the dtype's rounding so that slow pairs, which turn by little within the probe, still count.
    """
    X = X.double()
    P, D = X.shape
    scale = float(X.abs().max()) or 1.0
    moving = (X - X[0]).abs().amax(0) > (tol if noise is None else noise) * scale  # (D,)
    if not bool(moving.any()):
        return Rotation(rotates=False)
    first, last = (int(i) for i in moving.nonzero().flatten()[[0, -1]])
    # The slice starts at 0 or at the first moving dim (or one before it: an interleaved pair whose first dim holds
    # nothing); every (pairing, start, rotary dim) that holds every moving dim is a candidate, and a rotation keeps
    # each pair's norm constant.
    candidates = []
    for pairing in ("half", "interleaved"):
        for start in sorted({0, first, max(first - 1, 0)}):
            for rotary_dim in range(2, D - start + 1, 2):
                if start + rotary_dim <= last:
                    continue
                i, j = pair_indices(pairing, rotary_dim, start)
                radius = torch.hypot(X[:, i], X[:, j])  # (P, r/2)
                drift = relative_error(radius, radius[0], relative_to=radius)
                candidates.append((drift, pairing, rotary_dim, start))
    valid = [c for c in candidates if c[0] <= tol]
    if not valid:
        drift, _, rotary_dim, start = min(candidates)
        return Rotation(rotates=True, pairing=None, rotary_dim=rotary_dim, norm_error=drift, rotary_start=start)
    # The smallest rotary dim that works (pairs that never turn are not rotary), the declared pairing on a tie.
    drift, pairing, rotary_dim, start = min(valid, key=lambda c: (c[2], c[1] != prefer, c[3] != 0, c[0]))
    thetas = pair_thetas(X, pairing, rotary_dim, start)
    # theta_p = base^(-2p/r) = exp(-decay p): the decay comes from the pairs that turned enough to measure, the base
    # from the decay and the rotary dim.
    decays = sorted(-math.log(abs(t)) / p for p, t in enumerate(thetas) if p > 0 and well_measured(t, P, tol))
    decay = decays[len(decays) // 2] if decays else None
    base = math.exp(decay * rotary_dim / 2) if decay else None
    return Rotation(True, pairing, rotary_dim, thetas, base, decay=decay, norm_error=drift, rotary_start=start)


def pair_thetas(X: torch.Tensor, pairing: str, rotary_dim: int, start: int = 0) -> list[float]:
    """X: (P, D), one vector at positions 0..P-1 (or along one axis of them). The angle each pair turns by per
    position: its turns unwrapped step by step and fitted by least squares through the origin."""
    X = X.double()
    P = X.shape[0]
    i, j = pair_indices(pairing, rotary_dim, start)
    angle = torch.atan2(X[:, j], X[:, i])  # (P, r/2)
    step = torch.remainder(angle[1:] - angle[:-1] + math.pi, 2 * math.pi) - math.pi  # per-position turn, unwrapped
    turned = step.cumsum(0)  # (P-1, r/2): total angle at positions 1..P-1
    m = torch.arange(1, P, dtype=X.dtype)[:, None]
    return ((m * turned).sum(0) / (m * m).sum()).tolist()


def same_turns(
    q_seen: torch.Tensor, k_seen: torch.Tensor, pairing: str, rotary_dim: int, start: int, tol: float
) -> bool:
    """Whether q and k (P, D) turn by the same angle, pair by pair, at every position, under one pairing.

    Compared as measured, not as fitted frequencies: a slow pair of small magnitude may stay below the rounding on
    one side and count as still there, and angles that are not linear in the position (FWD303's business) fit no
    frequency at all. A pair's angle is only as precise as its radius allows, so each difference is weighted by the
    smaller of the two radii, relative to its vector's scale: rounding then weighs about the same in every pair."""
    i, j = pair_indices(pairing, rotary_dim, start)
    weights = []
    angles = []
    for X in (q_seen.double(), k_seen.double()):
        # A tensor of weights, not one number: no compare.relative_error.
        weights.append(torch.hypot(X[:, i], X[:, j]).mean(0) / (X.abs().max() + 1e-30))  # (r/2,)
        angles.append(torch.atan2(X[:, j], X[:, i]) - torch.atan2(X[:1, j], X[:1, i]))  # (P, r/2): turned since 0
    difference = torch.remainder(angles[0] - angles[1] + math.pi, 2 * math.pi) - math.pi  # (P, r/2)
    return float((difference.abs() * torch.minimum(*weights)).max()) <= 10 * tol


def well_measured(theta: float, positions: int, tol: float) -> bool:
    """A pair's frequency is trusted when its total turn over the probe is far above the rounding noise."""
    return abs(theta) * (positions - 1) > 20 * tol


def toeplitz_error(scores: torch.Tensor) -> float:
    """How far scores[m, n] is from depending on n - m alone, relative to the largest |score|."""
    P = scores.shape[0]
    worst = 0.0
    for offset in range(-P + 1, P):
        diagonal = torch.diagonal(scores, offset)
        worst = max(worst, float(diagonal.max() - diagonal.min()))
    # The spread along each diagonal, not a difference of two tensors: no compare.relative_error.
    return worst / (float(scores.abs().max()) + 1e-30)
