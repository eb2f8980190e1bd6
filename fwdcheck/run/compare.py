"""Comparing logits: per-position changes that no NaN can pass, where the non-finite ones are, the scale tolerances
grow with, and one relative error for every "how far apart, relative to its size" question."""

from __future__ import annotations

import torch

# Elements of one [.., V] difference computed at once by position_change: a slice of the vocabulary at a time, so that
# comparing logits needs a few MB beside them instead of another copy of them.
DIFFERENCE_BLOCK = 1 << 20


def position_change(new: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row and position, the largest |change| over the vocabulary; inf where either side is not finite.

    NaN survives the subtraction and amax, and so does inf (inf - inf is NaN), so one pass over the difference finds
    both; NaN is then reported as inf so that no comparison can pass it. The difference is taken a slice of the
    vocabulary at a time (torch.maximum keeps NaN), so it never holds another [N, T, V] beside the logits."""
    V = new.shape[-1]
    positions = max(1, max(new[..., 0].numel(), reference[..., 0].numel()))
    step = max(1, DIFFERENCE_BLOCK // positions)
    change = None
    for start in range(0, V, step):
        part = (new[..., start : start + step] - reference[..., start : start + step]).abs_().amax(-1)  # (N, T)
        change = part if change is None else torch.maximum(change, part)
    assert change is not None  # a vocabulary of at least one
    return change.nan_to_num_(nan=float("inf"))


def nonfinite_positions(logits: torch.Tensor) -> list[tuple[int, int]]:
    """(row, position) pairs whose logits hold NaN or Inf. Read off each position's largest and smallest logit
    (amax keeps NaN; +inf is the largest, -inf the smallest), so no mask as large as the logits is made."""
    bad = ~(torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1)))
    return [tuple(x) for x in bad.nonzero().tolist()]


def logit_scale(logits: torch.Tensor) -> float:
    """The largest |logit|, which tolerances scale with; without the copy that logits.abs() would make."""
    return max(abs(float(logits.amax())), abs(float(logits.amin())))


def relative_error(a: torch.Tensor, b: torch.Tensor, relative_to: torch.Tensor | None = None) -> float:
    """max |a - b| over max |b|: how far apart two tensors are relative to the size of `b` (the reference); inf when
    either holds NaN or Inf (no comparison may pass them). Against an all-zero `b` two equal tensors are 0 apart and
    any difference is infinitely large, as the checks' former `difference / (scale + 1e-30)` made it.

    `relative_to`, when given, is the tensor whose size counts instead of b's: a stack of vectors compared with its
    first, relative to the whole stack."""
    difference = float((a - b).abs().max())
    if difference != difference or difference == float("inf"):
        return float("inf")
    scale = float((b if relative_to is None else relative_to).abs().max())
    if scale == 0:
        return 0.0 if difference == 0 else float("inf")
    return difference / scale
