"""flex_attention, read at its one kernel call: its BlockMask's mask_mod evaluated at every (batch, head, query, key)
index the call covers, its score_mod on a probe of zero scores, the lengths the BlockMask was built for."""

from __future__ import annotations

from typing import Any

import torch

from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.masks import MaskRead
from fwdcheck.observe.records import Api, AttentionCall
from fwdcheck.observe.table import KERNELS

# flex_attention, eager or compiled, ends in one higher-order operator call that a torch function mode sees with the
# kernel's own arguments: (query, key, value, score_mod, block_mask.as_tuple(), scale, kernel_options, buffers...).
# Reading it there, rather than tracing the kernel's inside, leaves its compilation alone. None where torch has none.
try:
    from torch._higher_order_ops.flex_attention import flex_attention as FLEX_ATTENTION
    from torch.nn.attention.flex_attention import create_mask as _flex_create_mask
    from torch.nn.attention.flex_attention import noop_mask as _flex_noop_mask
except ImportError:  # torch before 2.5
    FLEX_ATTENTION = None  # type: ignore[assignment]


@KERNELS.reader(FLEX_ATTENTION)  # none where torch has none
def read_flex(observer: Observer, func, args, kwargs):
    observer.record.attention.append(_flex(observer, args, kwargs, observer.module()))
    return observer.plain(func, args, kwargs)


def _flex(observer: Observer, args: tuple, kwargs: dict, module: str) -> AttentionCall:
    names = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options", "score_buffers")
    a = dict(zip(names, args, strict=False), **kwargs)
    a.setdefault("mask_mod_other_buffers", args[8] if len(args) > 8 else ())
    q, k, v = a["query"], a["key"], a["value"]  # (B, Hq, L, E), (B, Hkv, S, E): GQA repeats the key heads
    read, lengths, unread = _read_flex(
        q,
        k,
        a.get("score_mod"),
        tuple(a["block_mask"]),
        tuple(a.get("score_mod_other_buffers", a.get("score_buffers", ())) or ()),
        tuple(a["mask_mod_other_buffers"] or ()),
    )
    return observer.attention_call(
        Api.FLEX,
        module,
        q,
        k,
        v,
        batch_heads=tuple(q.shape[:-2]),
        mask=read,
        is_causal=False,
        dropout=0.0,
        cross=observer.cross(q, k),
        reads_input=observer.reads_input(q),
        mask_lengths=lengths if lengths != (q.shape[-2], k.shape[-2]) else None,
        unread=unread,
    )


def _read_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    score_mod: Any,
    block_mask: tuple,
    score_buffers: tuple,
    mask_buffers: tuple,
) -> tuple[MaskRead, tuple[int, int] | None, str | None]:
    """What a flex_attention call lets each query read, exactly: its BlockMask's mask_mod evaluated at every (batch,
    head, query, key) index the call covers (not the block-level view, which rounds to blocks), and its score_mod
    applied to a probe of zero scores, where a score it turns into -inf is masked as surely. Also the (query, key)
    lengths the BlockMask was built for, and why the mask could not be read when it could not.

    block_mask is BlockMask.as_tuple(): its seq_lengths first, its mask_mod last (as flex_attention hands it on)."""
    B, H, L, S = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    mask_mod = block_mask[-1]
    lengths = (block_mask[0], block_mask[1]) if all(isinstance(n, int) for n in block_mask[:2]) else None
    if getattr(mask_mod, "fn", mask_mod) is _flex_noop_mask:
        lengths = None  # no BlockMask handed over: flex_attention's own stand-in, which fits any length
    allowed = torch.ones(1, 1, L, S, dtype=torch.bool, device=q.device)
    if q.is_meta:
        return MaskRead(allowed, "block_mask", "(meta: no values)"), lengths, None
    kinds, values = [], []
    try:
        if getattr(mask_mod, "fn", mask_mod) is not _flex_noop_mask:
            may = _flex_create_mask(
                lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx, *mask_buffers), B, H, L, S, device=q.device
            )
            allowed = allowed & may
            kinds.append("block_mask")
            values.append(f"mask_mod {_callable_name(mask_mod)} True on {float(may.float().mean()):.0%}")
        if score_mod is not None and _callable_name(score_mod) != "_identity":
            kept = _flex_create_mask(
                lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_idx, kv_idx, *score_buffers),
                B,
                H,
                L,
                S,
                device=q.device,
            )
            allowed = allowed & kept
            kinds.append("score_mod")
            values.append(f"score_mod {_callable_name(score_mod)} -inf on {float((~kept).float().mean()):.0%}")
    except Exception as exc:  # the model's own function, evaluated by fwdcheck over the grid: say so, judge nothing
        reason = (
            f"its mask_mod or score_mod raised when evaluated over the call's indices ({type(exc).__name__}: {exc})"
        )
        return MaskRead(allowed, "block_mask", "(not read)"), lengths, reason.splitlines()[0]
    return MaskRead(allowed, "+".join(kinds) or "none", "; ".join(values) or "-"), lengths, None


def _callable_name(function: Any) -> str:
    """How a mask_mod or score_mod is named in a report: its function's name, through torch's wrappers."""
    inner = getattr(function, "fn", function)
    return getattr(inner, "__name__", type(inner).__name__)
