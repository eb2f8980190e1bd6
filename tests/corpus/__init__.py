"""A corpus of transformer code nobody here wrote, at tiny sizes, for tests/test_corpus.py.

Each module builds models one way people really build them: litgpt, torchtune, x-transformers, rotary-embedding-torch
inside a small model, torch's own nn.Transformer / nn.TransformerDecoder, and models written here in the textbook shapes
that circulate (nanoGPT's eager attention, gpt-fast's preallocated KV cache, Meta's complex-number RoPE,
modded-nanogpt's value embeddings and token smearing). Every factory returns a module with seeded random weights; no
model hub is reached.

Planted bugs change ONE built instance (its method, its buffer, or a library function swapped only while that
instance's forward runs), never a library globally: a bug must not leak into the next test.

Each module also offers `shifted_logits(model, input_ids, offset)`: the logits with every position moved by `offset`,
through whatever door that code has for positions. The tests use it to establish, with plain torch, whether a rotary
model's attention really depends on relative positions only.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager

import torch.nn as nn

# The sizes every model shares: width 32, 2 layers, 4 query heads of 8 (2 key/value heads where a model groups them),
# feed-forward 64, a vocabulary of 96 (litgpt, modded-nanogpt and one nanoGPT variant return 128 logits), room for 128
# positions.
VOCAB, WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FF, MAX_POSITIONS = 96, 32, 2, 4, 2, 8, 64, 128
# The same sizes as a config's `dims:` names them, for code that carries no config object (torchtune's decoders).
DIMS = {"d": WIDTH, "h": HEADS, "h_kv": KV_HEADS, "d_h": HEAD_DIM, "d_ff": FF, "V": VOCAB}


@contextmanager
def replaced(owner, name: str, value):
    """owner.name is value inside the block, and what it was after it, however the block ends."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def during_forward(module: nn.Module, context: Callable[[], AbstractContextManager]) -> nn.Module:
    """Run this one instance's forward inside a fresh `context()` (e.g. a library function swapped for a buggy copy).

    The swap exists only while this module's forward runs, so other instances and other tests never see it. The
    wrapper keeps forward's signature (functools.wraps), so whoever inspects it still sees its parameters.
    """
    forward = module.forward

    @functools.wraps(forward)
    def patched(*args, **kwargs):
        with context():
            return forward(*args, **kwargs)

    module.forward = patched
    return module


def alternating(first: Callable, second: Callable) -> Callable:
    """A function that behaves as `first` on calls 0, 2, 4, ... and as `second` on calls 1, 3, 5, ...

    Libraries that rotate q and then k with one function call it in that order in every layer: this is how a bug
    reaches k only (or q only) without touching the library's source.
    """
    calls = itertools.count()

    def call(*args, **kwargs):
        return (first if next(calls) % 2 == 0 else second)(*args, **kwargs)

    return call
