"""xformers' memory_efficient_attention, read at its kernel op with its attn_bias object lowered to arguments:
custom_mask_type (causal aligned top left or bottom right), window_size, sequences packed by cu_seqlens_q /
cu_seqlens_k (seqlen_k: the keys each holds), and an additive bias tensor on top."""

from __future__ import annotations

import itertools

import torch

from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.masks import MaskRead, _read_mask, _short, _xformers_band
from fwdcheck.observe.records import Api
from fwdcheck.observe.table import KERNELS

# xformers::efficient_attention_forward_cutlass's arguments in order, as xformers registers the op.
XFORMERS_ARGS = (
    "query",
    "key",
    "value",
    "bias",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "custom_mask_type",
    "compute_log_sumexp",
)
XFORMERS_MASK_TYPES = {0: "no causal mask", 1: "causal from the top left", 2: "causal from the bottom right"}


@KERNELS.reader("xformers::efficient_attention_forward_cutlass")
def read_xformers(observer: Observer, func, args, kwargs):
    """xformers' memory_efficient_attention kernel, q (B, M, h, d), k and v (B, N, h_kv, d), its attn_bias object
    lowered to arguments: custom_mask_type (0 none, 1 causal aligned top left, 2 bottom right), window_size (each
    query's own key and the window_size - 1 before it), sequences packed along one axis by cu_seqlens_q /
    cu_seqlens_k (B = 1; seqlen_k: the keys each sequence really holds), and an additive bias tensor on top."""
    a = dict(zip(XFORMERS_ARGS, args, strict=False), **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    L, S = q.shape[1], k.shape[1]
    mask_type, window = int(a["custom_mask_type"]), a.get("window_size")
    described = f"custom_mask_type={mask_type} ({XFORMERS_MASK_TYPES.get(mask_type, '?')}), window_size={window}"
    if a.get("cu_seqlens_q") is None:
        allowed = _xformers_band(L, S, mask_type, window, q.device)
    else:
        starts_q, starts_k = a["cu_seqlens_q"].tolist(), a["cu_seqlens_k"].tolist()
        held = a["seqlen_k"].tolist() if a.get("seqlen_k") is not None else None
        allowed = torch.zeros(L, S, dtype=torch.bool, device=q.device)
        pairs = zip(itertools.pairwise(starts_q), itertools.pairwise(starts_k), strict=False)
        for b, ((q0, q1), (k0, k1)) in enumerate(pairs):
            keys = held[b] if held is not None else k1 - k0  # padded keys: only the first seqlen_k[b] are held
            allowed[q0:q1, k0 : k0 + keys] = _xformers_band(q1 - q0, keys, mask_type, window, q.device)
        described += f", cu_seqlens_q {_short(starts_q)}, cu_seqlens_k {_short(starts_k)}"
    mask = MaskRead(allowed, "declared", described)
    if a.get("bias") is not None:  # an additive bias tensor (B, h, M, N), read as SDPA's float masks are
        given = _read_mask(a["bias"], true_means_masked=False)
        mask = MaskRead(
            allowed & given.allowed,
            "declared+float",
            f"{described}; bias {given.values}",
            given.float_01,
            given.shape,
        )
    a["causal"] = mask_type != 0
    observer.record_fused(Api.XFORMERS, func, q, k, v, mask, (q.shape[0], q.shape[2]), a)
    return observer.plain(func, args, kwargs)
