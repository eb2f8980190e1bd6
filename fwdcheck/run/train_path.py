"""The path that trains: train() mode, every dropout forced to zero, gradients enabled.

A training job runs the model in train() mode with autograd recording, and model code may branch on either: `if
self.training:` (a mask skipped, another kernel, a cache bypassed), `torch.is_grad_enabled()` (a fused kernel only
without gradients), or a kernel's `dropout_p=self.attention_dropout if self.training else 0.0`. The checks judge
that path as they judge eval's once its randomness is off: dropout modules at p=0 (the session sets them, nn.RNN,
LSTM and GRU's `dropout` too), every functional form of dropout called as in eval and every attention call's
dropout_p 0.0 (ZeroAttentionDropout, fwdcheck/observe/dropouts.py). What a train-mode forward writes as it runs
(running statistics, spectral norm's vectors, counters) the session puts back after each forward (KeptBuffers), so
that two identical forwards differ only by randomness the model draws itself.

Some models cannot record gradients on every path (torch's flex_attention has no backward on the CPU in torch 2.13):
they run the train path without gradients, and the caller says so. What changes the modes is model code (an
overridden train()): what it raises is the model's error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.nn as nn

from fwdcheck.errors import ModelRaised, first_line
from fwdcheck.model.tested import model_code
from fwdcheck.observe.observer import ZeroAttentionDropout

Result = TypeVar("Result")


def gradients_or_not(forward: Callable[[], Result]) -> tuple[Result, str | None]:
    """forward() with gradients recorded, and None; when it raises with them but runs without them (a kernel with
    no backward on this device: flex_attention on the CPU), its result without them and why they were refused (the
    first line of what the model raised). That is the environment's limit, not a bug of the model's: the train path
    runs on without gradients, and a check that needs them skips saying so. When forward() raises without
    gradients too, that is the model's own error, and it propagates."""
    try:
        with torch.enable_grad():
            return forward(), None
    except ModelRaised as exc:
        with torch.no_grad():
            result = forward()
        return result, first_line(exc)


@contextmanager
def train_path(module: nn.Module, gradients: bool = True) -> Iterator[None]:
    """Inside, `module` is in train() mode, functional and attention dropout are zeroed and gradients are recorded
    (unless `gradients` is False). Dropout modules are not touched here: the session holds them at p=0. The mode is
    put back as it was on exit (every module's own flag: a model may keep submodules in eval on purpose)."""
    modes = {m: m.training for m in module.modules()}
    with model_code("the model cannot be put in train mode:"):
        module.train()
    try:
        with torch.enable_grad() if gradients else torch.no_grad(), ZeroAttentionDropout():
            yield
    finally:
        for m, training in modes.items():
            m.training = training


@contextmanager
def eval_path(module: nn.Module) -> Iterator[None]:
    """Inside, `module` is in eval() mode without gradients, dropout zeroed as on the train path; the modes are put
    back as they were on exit."""
    modes = {m: m.training for m in module.modules()}
    with model_code("the model cannot be put in eval mode:"):
        module.eval()
    try:
        with torch.no_grad(), ZeroAttentionDropout():
            yield
    finally:
        for m, training in modes.items():
            m.training = training
