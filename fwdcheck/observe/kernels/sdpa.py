"""F.scaled_dot_product_attention, read from its arguments: attn_mask in SDPA's convention (boolean True = may
attend, a float mask added to the scores), is_causal aligned to the top left, torch's own causal biases by their
alignment. Its dropout_p is zeroed here when the pass is asked to (ZeroAttentionDropout does the same outside it)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.masks import CausalBias, MaskRead, _read_causal_bias, _read_mask
from fwdcheck.observe.records import Api, AttentionCall
from fwdcheck.observe.table import KERNELS

# F.scaled_dot_product_attention's parameters, to bind a call's arguments by name: the reader below, the observer's
# ZeroAttentionDropout, and the checks that record SDPA calls themselves (fwdcheck/checks/sdpa_calls.py).
SDPA_SIGNATURE = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value")]
    + [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
        for n, d in (
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)


@KERNELS.reader(F.scaled_dot_product_attention)
def read_sdpa(observer: Observer, func, args, kwargs):
    bound = SDPA_SIGNATURE.bind(*args, **kwargs)
    observer.record.attention.append(_sdpa(observer, bound.arguments, observer.module()))
    if observer.zero_dropout:
        bound.arguments["dropout_p"] = 0.0
        args, kwargs = (), dict(bound.arguments)
    return observer.plain(func, args, kwargs)


def _sdpa(observer: Observer, a: dict, module: str) -> AttentionCall:
    q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
    L, S = q.shape[-2], k.shape[-2]
    is_causal = bool(a.get("is_causal", False))
    read = MaskRead(torch.ones(L, S, dtype=torch.bool, device=q.device), "is_causal" if is_causal else "none")
    if is_causal:
        read.allowed = read.allowed.tril()  # SDPA's is_causal is aligned to the top left, also when L != S
    if isinstance(mask, CausalBias):
        read = read.combined(_read_causal_bias(mask, L, S, q.device))
    elif mask is not None:
        read = read.combined(_read_mask(mask, true_means_masked=False))
    return observer.attention_call(
        Api.SDPA,
        module,
        q,
        k,
        v,
        batch_heads=tuple(q.shape[:-2]),
        mask=read,
        is_causal=is_causal,
        dropout=float(a.get("dropout_p", 0.0) or 0.0),
        cross=observer.cross(q, k),
        reads_input=observer.reads_input(q),
        keys_read_input=observer.reads_input(k),
        keys_of_both=observer.keys_of_both(k),
    )
