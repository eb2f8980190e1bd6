"""flash-attn's kernels, read from the arguments that declare their mask: causal and the window, aligned to the
bottom right (_flash_band); the variable-length kernel's packed sequences (cu_seqlens_q / cu_seqlens_k); and
flash_attn_with_kvcache, which calls its CUDA extension's fwd_kvcache directly, so no torch function mode sees it:
that function is wrapped for the pass instead (a wrapper row of the table)."""

from __future__ import annotations

import itertools
import sys
from contextlib import contextmanager
from typing import Any

import torch

from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.masks import MaskRead, _flash_band, _short
from fwdcheck.observe.records import Api
from fwdcheck.observe.table import KERNELS

FLASH_ARGS = (
    "query",
    "key",
    "value",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "return_softmax",
)
FLASH_VARLEN_ARGS = ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k") + (
    FLASH_ARGS[3:]
)

# flash-attn's CUDA extension fwd_kvcache's arguments in order, as flash_attn_with_kvcache hands them over.
FWD_KVCACHE_ARGS = (
    "q",
    "k_cache",
    "v_cache",
    "k",
    "v",
    "cache_seqlens",
    "rotary_cos",
    "rotary_sin",
    "cache_batch_idx",
    "cache_leftpad",
    "block_table",
    "alibi_slopes",
    "out",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "rotary_interleaved",
    "num_splits",
)
# The names flash-attn's interface module gives its CUDA extension (flash_attn_gpu from 2.7, flash_attn_cuda before).
FLASH_EXTENSIONS = ("flash_attn_gpu", "flash_attn_cuda")


@KERNELS.reader("flash_attn::_flash_attn_forward")
def read_flash(observer: Observer, func, args, kwargs):
    """flash-attn's kernel: q (B, L, h, d), k and v (B, S, h_kv, d), its mask declared by causal and the window,
    both aligned to the bottom right (the queries are the last L of the S keys)."""
    a = dict(zip(FLASH_ARGS, args, strict=False), **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    L, S = q.shape[1], k.shape[1]
    allowed, described = _flash_band(L, S, bool(a["causal"]), a, q.device)
    observer.record_fused(
        Api.FLASH, func, q, k, v, MaskRead(allowed, "declared", described), (q.shape[0], q.shape[2]), a
    )
    return observer.plain(func, args, kwargs)


@KERNELS.reader("flash_attn::_flash_attn_varlen_forward")
def read_flash_varlen(observer: Observer, func, args, kwargs):
    """flash-attn's variable-length kernel: sequences packed along one axis, q (total_q, h, d) and k
    (total_k, h_kv, d); sequence b holds queries cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys
    cu_seqlens_k[b]:cu_seqlens_k[b+1], and reads no other sequence's keys; within it, causal and the window
    are aligned to the bottom right."""
    a = dict(zip(FLASH_VARLEN_ARGS, args, strict=False), **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    starts_q, starts_k = a["cu_seqlens_q"].tolist(), a["cu_seqlens_k"].tolist()
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    described = ""
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(starts_q), itertools.pairwise(starts_k), strict=False):
        allowed[q0:q1, k0:k1], described = _flash_band(q1 - q0, k1 - k0, bool(a["causal"]), a, q.device)
    described += f", cu_seqlens_q {_short(starts_q)}, cu_seqlens_k {_short(starts_k)}"
    q4, k4, v4 = q[None], k[None], v[None]  # one packed row: (1, total, h, d)
    observer.record_fused(
        Api.FLASH, func, q4, k4, v4, MaskRead(allowed, "declared", described), (q.shape[1],), a, (q, k)
    )
    return observer.plain(func, args, kwargs)


@KERNELS.wrapper("flash_attn fwd_kvcache")
@contextmanager
def _kvcache_seen(observer: Observer):
    """flash_attn_with_kvcache looks its extension's fwd_kvcache up at call time: while observing, that attribute
    is a wrapper that records the call (on_fwd_kvcache), and it is put back after. Only where flash-attn's
    interface module is already imported: fwdcheck imports no attention library itself."""
    interface = sys.modules.get("flash_attn.flash_attn_interface")
    found = [getattr(interface, name, None) for name in FLASH_EXTENSIONS] if interface is not None else []
    extensions: list[Any] = [e for e in found if e is not None and hasattr(e, "fwd_kvcache")]
    patched = []
    for extension in {id(e): e for e in extensions}.values():
        kernel = extension.fwd_kvcache

        def seen(*args, kernel=kernel, **kwargs):
            return on_fwd_kvcache(observer, kernel, args, kwargs)

        seen.__name__ = "fwd_kvcache"
        extension.fwd_kvcache = seen
        patched.append((extension, kernel))
    try:
        yield
    finally:
        for extension, kernel in patched:
            extension.fwd_kvcache = kernel


def on_fwd_kvcache(observer: Observer, kernel, args, kwargs):
    """flash-attn's flash_attn_with_kvcache, which calls its CUDA extension's fwd_kvcache directly (no torch op
    to see): q (B, L, h, d) over a cache k_cache, v_cache (B_cache, S, h_kv, d), into which the kernel first
    writes k and v (B, L_new, h_kv, d) when given, at slots cache_seqlens[b] on. Row b reads the cache row
    cache_batch_idx[b], its slots from cache_leftpad[b] up to seqlen_k = cache_seqlens[b] (+ L_new): its
    queries are the last L of those keys (bottom-right), so query i reads the slots up to cache_seqlens[b] + i
    when the kernel wrote them, and causal and the window are as _flash_band says. Recorded one call per row, as
    each row reads a cache of its own; a paged cache (block_table) is not judged."""
    if torch.compiler.is_compiling():
        return kernel(*args, **kwargs)
    # An extension's kernel: nothing inside it is torch's to see; nor is this bookkeeping, which runs outside a
    # torch function (the observer's own handlers run with the mode set aside).
    with torch._C.DisableTorchFunction():
        return _kvcache_call(observer, kernel, args, kwargs)


def _kvcache_call(observer: Observer, kernel, args, kwargs):
    a = dict(zip(FWD_KVCACHE_ARGS, args, strict=False), **kwargs)
    out = kernel(*args, **kwargs)  # the cache holds the new keys from here on, as the kernel reads it
    q, k_cache, v_cache, new = a["q"], a["k_cache"], a["v_cache"], a.get("k")
    B, L, S = q.shape[0], q.shape[1], k_cache.shape[1]
    a["causal"], a["dropout_p"] = bool(a["causal"]), 0.0
    if a.get("block_table") is not None:
        observer.record_fused(
            Api.FLASH,
            kernel,
            q,
            k_cache[:B],
            v_cache[:B],
            MaskRead(torch.ones(L, S, dtype=torch.bool, device=q.device), "declared", "paged cache"),
            (B, q.shape[2]),
            a,
            unread="flash_attn_with_kvcache over a paged cache (block_table), whose slots fwdcheck does not map",
        )
        return out
    lengths = _per_row(a.get("cache_seqlens"), B, S)
    rows = _per_row(a.get("cache_batch_idx"), B, None) or list(range(B))
    starts = _per_row(a.get("cache_leftpad"), B, 0)
    added = new.shape[1] if new is not None else 0
    for b in range(B):
        seqlen_k = lengths[b] + added if a.get("cache_seqlens") is not None else S
        allowed = torch.zeros(L, S, dtype=torch.bool, device=q.device)
        allowed[:, :seqlen_k], described = _flash_band(L, seqlen_k, a["causal"], a, q.device)
        allowed[:, : starts[b]] = False
        described += f", cache_seqlens {lengths[b]}" + (f", cache_leftpad {starts[b]}" if starts[b] else "")
        placed = None
        if new is not None and added == L:  # the kernel wrote the row's new keys, its queries' own: they sit there
            placed = (torch.arange(L) + lengths[b], "the kernel's cache write")
        row = rows[b]
        observer.record_fused(
            Api.FLASH,
            kernel,
            q[b : b + 1],
            k_cache[row : row + 1],
            v_cache[row : row + 1],
            MaskRead(allowed, "declared", described),
            (1, q.shape[2]),
            a,
            placed=placed,
        )
    return out


def _per_row(value: Any, B: int, default: int | None) -> list[int]:
    """A per-row integer argument (a tensor of B, an int, or None) as B ints; [] when None and no default."""
    if value is None:
        return [] if default is None else [default] * B
    if isinstance(value, int):
        return [value] * B
    return [int(v) for v in value.reshape(-1)[:B].tolist()]
