"""Factories that cannot build a model: each is named by one config in tests/bad_inputs/."""

import sys

import torch.nn as nn


class Tiny(nn.Module):
    def __init__(self, n_layers: int = 1):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n_layers))
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(n_layers: int = 1):
    """A good factory: the kwargs case gives it a key it does not accept."""
    return Tiny(n_layers)


def build_raises():
    raise RuntimeError("no weights at /nowhere")


def build_not_module():
    return {"not": "a module"}


def build_multiline_error():
    """Errors from torch's C++ core carry their stack in the message; the error line keeps the first line."""
    raise RuntimeError(
        "CUDA out of memory. Tried to allocate 2.00 GiB\nException raised from malloc at alloc.cpp:84\n"
        "frame #0: c10::Error::Error(...)\nframe #1: ..."
    )


def build_exits():
    """sys.exit(0) where a model was expected: must not end fwdcheck with exit 0 (a CI gate passing)."""
    sys.exit(0)


NOT_CALLABLE = 42


class Unprintable(Exception):
    """An exception whose message cannot be shown: its __str__ raises."""

    def __str__(self):
        raise ValueError("__str__ of Unprintable")


def build_unprintable():
    raise Unprintable()


def build_cancelled():
    """asyncio's CancelledError is a BaseException: `except Exception` does not catch it (as a factory that waits on
    an event loop would raise it)."""
    import asyncio

    raise asyncio.CancelledError("the loading task was cancelled")
