"""The observation pass: see every attention call as the model makes it. This module enters its parts together
(`observing`): the dispatcher (dispatcher.py), the module hooks (frames.py), the wrappers of the kernel table
(table.py, filled by kernels/) and torch.compile'd code run eagerly.

A torch function mode intercepts `scaled_dot_product_attention`, `multi_head_attention_forward`, eager attention and
functional dropout; forward hooks on every submodule say which module was running, what shapes went in and out, and
which positions (`input_pos`, `cache_position`, `position_ids`) and key sources it was handed. Each attention call is
reduced on the spot to the set of keys each query may read, whatever the mask's encoding, so checks compare one thing:
that set, [L queries, S keys], with the position of every query on the key axis when it can be known.

Eager attention (kernels/products.py) is recognised by what it does, not by its size: a product shaped like
q @ k^T (a [.., L, d] @ b [.., d, S] -> [.., L, S], by matmul, bmm, baddbmm or a two-operand einsum) whose result,
scaled, masked or biased, reaches a softmax; the product that then reads the softmax's output is weights @ v. So a
KV cache longer than the prompt, a one-token decode step and an einsum are seen, and a softmax over anything else (a
router's [B, T, E] logits) is not attention. What is computed from the model's input ids is followed the same way,
op by op, so that attention over another sequence (an encoder over a fixed source) is told from attention over the
tokens under test.

Each attention call (and each dropout live in eval) also records the line of model code that made it, the first frame
beyond torch, so that a finding about the call points at that line rather than at the class around it.

A mode changes code paths (torch's TransformerEncoder fast path turns itself off under one), so behavioural checks
never run under it: they run the model untouched and use this pass only for what they cannot see from the outside.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import ExitStack, contextmanager, nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import fwdcheck.observe.kernels  # noqa: F401  (fills the kernel table)
from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.dropouts import RANDOM_FORMS, as_in_eval
from fwdcheck.observe.frames import _Frame, _Identities, module_tracking
from fwdcheck.observe.kernels.mha import _MHA_SIGNATURE
from fwdcheck.observe.kernels.sdpa import SDPA_SIGNATURE
from fwdcheck.observe.records import Observation
from fwdcheck.observe.table import KERNELS


@contextmanager
def observing(
    model: nn.Module,
    seq_len: int,
    keep_tensors: bool = False,
    zero_dropout: bool = False,
    keep_inputs_of: Collection[str] = frozenset(),
    tokens: torch.Tensor | None = None,
):
    """Everything inside runs observed; the Observation fills as it runs and is complete on exit. `tokens`: the ids
    under test, followed into the attention calls computed from them (module_tracking)."""
    record = Observation(seq_len=seq_len)
    where: list[_Frame] = []
    from_input = _Identities()
    observer = Observer(record, where, keep_tensors, zero_dropout, from_input)
    with ExitStack() as stack:
        stack.enter_context(compiled_eagerly())
        stack.enter_context(module_tracking(model, record, where, keep_inputs_of, from_input, tokens))
        for wrapper in list(KERNELS.wrappers.values()):  # calls no torch function mode sees, wrapped for the pass
            stack.enter_context(wrapper(observer))
        stack.enter_context(observer)
        yield record


def compiled_eagerly():
    """torch.compile'd code runs as plain Python inside the block (torch.compiler.set_stance("force_eager"), torch
    2.6 on): the observer then sees inside it, and nothing is compiled while it is active. flex_attention, compiled
    or not, still ends in its one kernel call, which computes its mask's math exactly. A session holds every check
    in it: model code compiled at import (torchtitan's flex_attention and create_block_mask) would otherwise compile
    for each new shape, minutes on a CPU."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else nullcontext()


def compiled_as_compiled():
    """Inside, torch.compile compiles again (the default stance), within a block of compiled_eagerly: for the
    check whose subject is what the compiled model computes."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("default") if set_stance is not None else nullcontext()


class ZeroAttentionDropout(TorchFunctionMode):
    """Forces dropout_p=0 in attention calls and makes every functional dropout the identity (F.dropout,
    alpha and feature dropout, dropout1d/2d/3d, torch.dropout and their in-place forms; rrelu its mean slope): for
    models that apply dropout in eval mode, and on the train path, so that a comparison measures the mask and not
    the dice."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            bound = SDPA_SIGNATURE.bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            return func(**bound.arguments)  # forwards the model's call
        if func is F.multi_head_attention_forward:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            return func(**bound.arguments)  # forwards the model's call
        if func in RANDOM_FORMS:
            return as_in_eval(func, args, kwargs)
        return func(*args, **kwargs)  # forwards the model's call
