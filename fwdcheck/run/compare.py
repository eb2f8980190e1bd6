"""Comparing logits: per-position changes that no NaN can pass, where the non-finite ones are, the scale tolerances
grow with, and one relative error for every "how far apart, relative to its size" question.

A masked vocabulary is no broken logit: models set the logits of entries they never emit (a vocabulary padded to a
multiple of 64, tokens banned from generation) to -inf. -inf where the other side holds -inf too is equal, the finite
entries are compared, and a position whose entries are all -inf, or that holds NaN or +inf anywhere, is broken. A
masked entry that becomes finite, or a finite one that becomes -inf, is a change as large as they come."""

from __future__ import annotations

import torch

# Elements of one [.., V] difference computed at once by position_change: a slice of the vocabulary at a time, so that
# comparing logits needs a few MB beside them instead of another copy of them.
DIFFERENCE_BLOCK = 1 << 20


def position_change(new: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row and position, the largest |change| over the vocabulary; inf where either side is not finite,
    but for entries that are -inf on both sides (a masked vocabulary), which are equal.

    NaN survives the subtraction and amax, and so does inf (inf - inf is NaN), so one pass over the difference finds
    both; NaN is then reported as inf so that no comparison can pass it. The difference is taken a slice of the
    vocabulary at a time (torch.maximum keeps NaN), so it never holds another [N, T, V] beside the logits. Masked
    entries are looked for only when that pass finds something that is not finite: logits without them, nearly all,
    are read once."""
    change = _largest_difference(new, reference, masked=False)
    if not bool(torch.isfinite(change).all()):
        change = _largest_difference(new, reference, masked=True)
    return change.nan_to_num_(nan=float("inf"))


def _largest_difference(new: torch.Tensor, reference: torch.Tensor, masked: bool) -> torch.Tensor:
    """max |new - reference| over the vocabulary, (..); with `masked`, entries -inf on both sides count as equal
    (-inf - -inf is NaN otherwise)."""
    V = new.shape[-1]
    positions = max(1, max(new[..., 0].numel(), reference[..., 0].numel()))
    step = max(1, DIFFERENCE_BLOCK // positions)
    change = None
    for start in range(0, V, step):
        a, b = new[..., start : start + step], reference[..., start : start + step]
        difference = (a - b).abs_()
        if masked:
            difference.masked_fill_(torch.isneginf(a) & torch.isneginf(b), 0.0)
        part = difference.amax(-1)  # (N, T)
        change = part if change is None else torch.maximum(change, part)
    assert change is not None  # a vocabulary of at least one
    return change


def nonfinite_positions(logits: torch.Tensor) -> list[tuple[int, int]]:
    """(row, position) pairs whose logits hold NaN or +inf, or nothing but -inf (no entry left to predict): read
    off each position's largest logit (amax keeps NaN; +inf is the largest), so no mask as large as the logits is
    made. -inf beside finite entries is a masked vocabulary, not a broken logit."""
    bad = ~torch.isfinite(logits.amax(-1))
    return [tuple(x) for x in bad.nonzero().tolist()]


def logit_scale(logits: torch.Tensor) -> float:
    """The largest |logit| among the finite ones (a masked vocabulary's -inf scales nothing), which tolerances
    scale with; without the copy that logits.abs() would make, but where entries are -inf."""
    largest, smallest = float(logits.amax()), float(logits.amin())
    if smallest == float("-inf"):
        smallest = float(torch.where(torch.isneginf(logits), 0.0, logits).amin())
    return max(abs(largest), abs(smallest))


def relative_error(a: torch.Tensor, b: torch.Tensor, relative_to: torch.Tensor | None = None) -> float:
    """max |a - b| over max |b|: how far apart two tensors are relative to the size of `b` (the reference); inf when
    either holds NaN or Inf (no comparison may pass them), but for -inf on both sides (a masked entry), equal.
    Against an all-zero `b` two equal tensors are 0 apart and any difference is infinitely large, as the checks'
    former `difference / (scale + 1e-30)` made it.

    `relative_to`, when given, is the tensor whose size counts instead of b's: a stack of vectors compared with its
    first, relative to the whole stack."""
    difference = float((a - b).abs().masked_fill_(torch.isneginf(a) & torch.isneginf(b), 0.0).max())
    if difference != difference or difference == float("inf"):
        return float("inf")
    reference = b if relative_to is None else relative_to
    scale = float(reference.abs().masked_fill_(torch.isneginf(reference), 0.0).max())
    if scale == 0:
        return 0.0 if difference == 0 else float("inf")
    return difference / scale
