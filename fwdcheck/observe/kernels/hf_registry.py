"""transformers' registry of attention functions (AttentionInterface, ALL_ATTENTION_FUNCTIONS), looked up by name
at every call, so a function registered under a name of one's own is reached by no torch function the observer
reads unless it makes one: each entry is wrapped for the pass (a wrapper row of the table), and one that ran and
made no call the observer reads is recorded by its name as not judged."""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import torch

from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.masks import MaskRead
from fwdcheck.observe.records import Api
from fwdcheck.observe.table import KERNELS


@KERNELS.wrapper("transformers attention functions")
@contextmanager
def _registered_attention_seen(observer: Observer):
    """transformers looks its attention functions up by name at every call (AttentionInterface: its own sdpa, flex
    and flash entries, and any function registered under a name of one's own and chosen by attn_implementation).
    While observing, each is wrapped: one that computes through a call the observer reads (SDPA, flex_attention, a
    flash-attn kernel, a softmax over q @ k^T) is judged by that call; one that ran and made none (its own kernel) is
    recorded by its name as not judged (not_seen), never passed over. Put back as found after. Only where
    transformers is already imported: fwdcheck imports it for no model that does not."""
    utils = sys.modules.get("transformers.modeling_utils")
    registry = getattr(utils, "AttentionInterface", None)
    shared = getattr(utils, "ALL_ATTENTION_FUNCTIONS", None)
    mappings = [m for m in (getattr(registry, "_global_mapping", None), getattr(shared, "_local_mapping", None)) if m]
    originals = [(mapping, name, function) for mapping in mappings for name, function in list(mapping.items())]
    for mapping, name, function in originals:
        mapping[name] = _seen_function(observer, name, function)
    try:
        yield
    finally:
        for mapping, name, function in originals:
            mapping[name] = function


def _seen_function(observer: Observer, name: str, function):
    @functools.wraps(function)
    def seen(module, query, key, value, *args, **kwargs):
        before = len(observer.record.attention)
        out = function(module, query, key, value, *args, **kwargs)  # forwards the model's call
        if len(observer.record.attention) == before and not torch.compiler.is_compiling():
            with torch._C.DisableTorchFunction():  # bookkeeping, not the model's: outside the observer
                not_seen(observer, name, query, key, value)
        return out

    return seen


def not_seen(observer: Observer, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """An attention function of transformers' registry (_registered_attention_seen) that ran and made no call the
    observer reads (its own kernel): recorded by its name as not judged, q, k, v (B, h, T, d) as it got them."""
    L, S = q.shape[-2], k.shape[-2]
    everything = torch.ones(L, S, dtype=torch.bool, device=q.device)  # what it reads is not known: nothing judged
    observer.record.attention.append(
        observer.attention_call(
            Api.KERNEL,
            observer.module(),
            q,
            k,
            v,
            batch_heads=(q.shape[0], q.shape[1]),
            mask=MaskRead(everything, "declared", f"{name}: computed where fwdcheck does not see"),
            is_causal=False,
            dropout=0.0,
            cross=observer.cross(q, k),
            reads_input=observer.reads_input(q),
            unread=f"{name}, an attention function of transformers' registry whose computation makes no call "
            "fwdcheck reads",
        )
    )
