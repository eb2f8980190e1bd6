"""nn.MultiheadAttention's computation, read where every path of it goes through: F.multi_head_attention_forward
(nn.TransformerEncoder's and TransformerDecoder's layers too, whose fast path steps aside under a function mode).
Sequence-first, its boolean masks True = masked out, key_padding_mask beside attn_mask, is_causal only a hint."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.masks import MaskRead, _read_mask
from fwdcheck.observe.records import Api, AttentionCall
from fwdcheck.observe.table import KERNELS

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@KERNELS.reader(F.multi_head_attention_forward)
def read_mha(observer: Observer, func, args, kwargs):
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    observer.record.attention.append(_mha(observer, bound.arguments, observer.module()))
    return observer.plain(func, args, kwargs)


def _mha(observer: Observer, a: dict, module: str) -> AttentionCall:
    q, k, v = a["query"], a["key"], a["value"]
    batched = q.dim() == 3
    L, S = q.shape[0], k.shape[0]  # the functional form is sequence-first: (L, N, E)
    N, h = (q.shape[1] if batched else 1), int(a["num_heads"])
    mask, padding = a.get("attn_mask"), a.get("key_padding_mask")
    is_causal, need_weights = bool(a.get("is_causal", False)), bool(a.get("need_weights", True))
    read = MaskRead(torch.ones(L, S, dtype=torch.bool, device=q.device))
    # is_causal is only a hint here; it replaces the mask exactly when torch takes the SDPA path without one.
    if is_causal and padding is None and not need_weights:
        read = MaskRead(read.allowed.tril(), "is_causal", shape=tuple(mask.shape) if mask is not None else None)
    elif mask is not None:
        given = _read_mask(mask, true_means_masked=True)
        if given.allowed.dim() == 3:  # (N*h, L, S)
            given.allowed = given.allowed.view(N, h, L, S)
        read = read.combined(given)
    if padding is not None:
        pads = _read_mask(padding, true_means_masked=True)
        pads.allowed = pads.allowed.view(N, 1, 1, S)
        read = read.combined(pads, joined=True)
    dropout = float(a.get("dropout_p", 0.0) or 0.0) if a.get("training", True) else 0.0
    # nn.MultiheadAttention hands its own inputs on: self-attention passes one tensor as query, key and value
    # (it keeps that identity through its batch_first transpose), cross-attention passes the memory as key.
    return observer.attention_call(
        Api.MHA,
        module,
        q,
        k,
        v,
        batch_heads=(N, h),
        mask=read,
        is_causal=is_causal,
        dropout=dropout,
        cross=k is not q,
        reads_input=observer.reads_input(q),
        keys_read_input=observer.reads_input(k),
    )
