"""Mask decoding: what an attention call's mask arguments let each query read, as a (.., L, S) boolean set, whatever
their encoding (a boolean mask in either convention, an additive float mask, torch's causal biases, the causal flag
and windows a fused kernel declares). What several kernel readers share lives here; a reader of one family's own
arguments lives in its kernels/ module."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

# A float mask entry at or below this adds so much negative score that the key gets no weight: it is masked.
# (exp(-100) underflows to 0 in float32 next to any real score.) Entries of -inf are masked of course.
MASKED_BELOW = -100.0

try:  # torch's causal masks for SDPA, aligned top left or bottom right (torch 2.3 on)
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:
    CausalBias = CausalVariant = None  # type: ignore[assignment,misc]


@dataclass
class MaskRead:
    """What an attention call's mask arguments let each query read, in its API's own convention."""

    allowed: torch.Tensor  # bool, broadcasting to (..., L, S): True where a query may read a key (meta: no values)
    kind: str = "none"  # none | is_causal | bool | float, with `+key_padding` for nn.MultiheadAttention's padding mask
    values: str = "-"  # a short description of the mask's values
    float_01: bool = False  # a float mask of only 0 and 1: added to the scores it masks nothing
    shape: tuple[int, ...] | None = None  # of the attn_mask handed over

    def combined(self, other: MaskRead, joined: bool = False) -> MaskRead:
        """Both restrictions at once: `other` replaces this one's description (a mask on top of nothing or of
        is_causal), or with `joined` is added to it (a key padding mask beside an attn_mask)."""
        if not joined:
            return replace(other, allowed=self.allowed & other.allowed)
        return MaskRead(
            self.allowed & other.allowed,
            f"{self.kind}+key_padding",
            f"{self.values}; padding {other.values}",
            self.float_01 or other.float_01,
            self.shape,
        )


def _read_mask(mask: torch.Tensor, true_means_masked: bool) -> MaskRead:
    """A mask tensor read in its API's convention: boolean True means masked out (nn.MultiheadAttention) or may
    attend (SDPA); a float mask is added to the scores, so -inf or very negative drops a key."""
    shape = tuple(mask.shape)
    if mask.is_meta:  # no values: may-attend everywhere, itself on the meta device (nothing allocated)
        kind = "bool" if mask.dtype == torch.bool else "float"
        return MaskRead(torch.ones(mask.shape, dtype=torch.bool, device="meta"), kind, "(meta: no values)", shape=shape)
    if mask.dtype == torch.bool:
        share = float(mask.float().mean())
        return MaskRead(~mask if true_means_masked else mask, "bool", f"True on {share:.0%}", shape=shape)
    m = mask.detach().float()
    finite = m[torch.isfinite(m)]
    has_neg_inf = bool(torch.isneginf(m).any())
    distinct = torch.unique(finite)
    if distinct.numel() <= 4:
        shown = ", ".join(f"{x:g}" for x in distinct.tolist()) + (", -inf" if has_neg_inf else "")
        values = "{" + shown + "}"
    else:
        values = f"[{float(finite.min()):.3g}, {float(finite.max()):.3g}]" + (" and -inf" if has_neg_inf else "")
    float_01 = not has_neg_inf and distinct.numel() == 2 and distinct.tolist() == [0.0, 1.0]
    may = torch.isfinite(m) & (m > MASKED_BELOW)  # float masks are added to the scores: -inf / very negative = drop
    return MaskRead(may, "float", values, float_01, shape)


def _empty_rows(allowed: torch.Tensor, batch_heads: tuple[int, ...], L: int) -> int:
    """(batch, head, query) rows with no key left, counted as the attention sees them: masks broadcast over batch
    rows and heads. None can be counted on the meta device."""
    if allowed.is_meta:
        return 0
    empty = ~allowed.any(-1)  # (.., L)
    try:
        return int(empty.expand(*batch_heads, L).sum())
    except RuntimeError:  # a mask of more dimensions than the query's: count it as it is
        return int(empty.sum())


def _read_causal_bias(bias: Any, L: int, S: int, device: torch.device) -> MaskRead:
    """torch's own causal masks for SDPA (torch.nn.attention.bias): causal_upper_left aligns the diagonal to the
    top left (query i reads keys 0..i, as is_causal does), causal_lower_right to the bottom right (the last query
    reads every key: the queries are the last L of S, as over a cache)."""
    lower_right = bias.variant == CausalVariant.LOWER_RIGHT
    offset = S - L if lower_right else 0
    allowed = torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=offset)
    name = "causal_lower_right" if lower_right else "causal_upper_left"
    return MaskRead(allowed, name, f"{name}({bias.seq_len_q}, {bias.seq_len_kv})", shape=(L, S))


def _flash_band(L: int, S: int, causal: bool, a: dict, device: torch.device) -> tuple[torch.Tensor, str]:
    """The (L, S) keys flash-attn lets each query read, and how its arguments said so. Query i sits at key slot
    i + S - L (bottom-right alignment); causal reads no slot after it; window_size (left, right) reads the slots from
    `left` before it to `right` after it, -1 meaning no bound."""
    left, right = int(a.get("window_size_left", -1)), int(a.get("window_size_right", -1))
    own = torch.arange(L, device=device)[:, None] + (S - L)  # (L, 1): each query's own key slot
    slots = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if causal:
        allowed &= slots <= own
    if right >= 0:
        allowed &= slots <= own + right
    if left >= 0:
        allowed &= slots >= own - left
    return allowed, f"causal={causal}, window_size=({left}, {right})"


def _xformers_band(L: int, S: int, mask_type: int, window: int | None, device: torch.device) -> torch.Tensor:
    """The (L, S) keys xformers' kernel lets each query read: with custom_mask_type 1 query i sits at key slot i
    (top left, as LowerTriangularMask), with 2 at i + S - L (bottom right, as LowerTriangularFromBottomRightMask);
    causal reads no slot after it, and a window of w reads its own slot and the w - 1 before it."""
    own = torch.arange(L, device=device)[:, None] + (S - L if mask_type == 2 else 0)  # (L, 1): each query's slot
    slots = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if mask_type != 0:
        allowed &= slots <= own
    if window is not None and window > 0:
        allowed &= slots > own - window
    return allowed


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 6 else f"[{', '.join(map(str, values[:5]))}, ...]"
