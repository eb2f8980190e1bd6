"""Models that fail in ways an `except Exception` or a plain `.float()` does not expect (tests/test_cli.py).

Each is misbehaving.Base (parameters, a buffer, dropout, one causal attention) with only its output or its exception
changed: logits of the right shape that cannot be compared (an empty vocabulary axis, on the meta device, sparse,
complex), an output whose `.logits` property raises, an exception whose message cannot be shown, BaseExceptions that
are no Ctrl-C (asyncio's CancelledError, GeneratorExit, a model's own), and a model whose eval() raises.
"""

import asyncio
import sys

import torch
from misbehaving import Base, V


class ZeroVocabulary(Base):
    def forward(self, input_ids):
        return self.clean_logits(input_ids)[..., :0]  # (B, T, 0)


class MetaLogits(Base):
    def forward(self, input_ids):
        return torch.empty(*input_ids.shape, V, device="meta")  # the shape, no values


class SparseLogits(Base):
    def forward(self, input_ids):
        return self.clean_logits(input_ids).to_sparse()


class ComplexLogits(Base):
    def forward(self, input_ids):
        return self.clean_logits(input_ids).to(torch.complex64)


class Output:
    """A model output whose logits are computed on access, and fail there."""

    @property
    def logits(self):
        raise RuntimeError("logits were not computed: call generate() first")


class LogitsPropertyRaises(Base):
    def forward(self, input_ids):
        self.clean_logits(input_ids)
        return Output()


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("__str__ of Unprintable")


class RaisesUnprintable(Base):
    def forward(self, input_ids):
        raise Unprintable()


class Cancelled(Base):
    def forward(self, input_ids):
        raise asyncio.CancelledError("forward was cancelled")


class GeneratorExits(Base):
    def forward(self, input_ids):
        raise GeneratorExit()


class Abort(BaseException):
    """A model's own BaseException, as some training loops define to stop a step."""


class RaisesOwnBaseException(Base):
    def forward(self, input_ids):
        raise Abort("abort the step")


class RaisesExceptionGroup(Base):
    def forward(self, input_ids):
        # A builtin from Python 3.11, which the test suite needs (it imports tomllib).
        raise BaseExceptionGroup("two workers failed", [GeneratorExit(), ValueError("shard 1 is empty")])  # noqa: F821


class EvalRaises(Base):
    """Refuses evaluation mode, as a module that only supports training might (eval() is train(False))."""

    def train(self, mode: bool = True):
        if not mode:
            raise RuntimeError("this model cannot be put in eval mode")
        return super().train(mode)


def build(kind: str):
    if kind == "RaisesExceptionGroup" and sys.version_info < (3, 11):  # pragma: no cover - no groups before 3.11
        raise RuntimeError("exception groups need Python 3.11")
    return globals()[kind]()
