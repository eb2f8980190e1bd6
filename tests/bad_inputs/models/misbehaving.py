"""Models that build fine and then misbehave while fwdcheck runs them (tests/test_model_failures.py).

Each has parameters, a buffer, a dropout layer and one causal SDPA attention, so that a run has state to put back
(eval/train flags, dropout p, devices, dtypes) and mask-audit has an attention call to read. Only forward misbehaves.
"""

import os
import signal
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H = 16, 8, 2


class Base(nn.Module):
    """Position-wise except for one causal attention: a clean model, until a subclass breaks its forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.drop = nn.Dropout(0.1)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.register_buffer("scale", torch.ones(()))

    def clean_logits(self, input_ids):
        x = self.drop(self.embed(input_ids))
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return self.head(x) * self.scale

    def forward(self, input_ids):
        return self.clean_logits(input_ids)


def _mix(x):
    raise ValueError(f"mix expects 3 dims, got {x.dim() + 1}")  # RAISES-HERE: the model-code line a report names


class RaisesInForward(Base):
    def forward(self, input_ids):
        return _mix(self.embed(input_ids))


class ReturnsString(Base):
    def forward(self, input_ids):
        return "logits"


class ReturnsNone(Base):
    def forward(self, input_ids):
        self.clean_logits(input_ids)  # computes, forgets to return


class LastPositionSqueezed(Base):
    """[B, V]: only the last position's logits, its axis squeezed away."""

    def forward(self, input_ids):
        return self.clean_logits(input_ids)[:, -1, :]


class LastPositionKept(Base):
    """[B, 1, V]: nanoGPT at inference (no targets)."""

    def forward(self, input_ids):
        return self.clean_logits(input_ids)[:, -1:, :]


class NaNLogits(Base):
    def forward(self, input_ids):
        return self.clean_logits(input_ids) * float("nan")


class NaNAtLastPosition(Base):
    def forward(self, input_ids):
        logits = self.clean_logits(input_ids)
        logits[:, -1, 0] = float("nan")
        return logits


class InfLogits(Base):
    def forward(self, input_ids):
        return self.clean_logits(input_ids) + float("inf")


class Hangs(Base):
    """Hangs (a sleep loop, as a deadlocked data loader or a wait on another rank would) whenever it is handed at
    least `rows` rows of the length of its first forward (the run's inputs), some of them other than those of its
    first forward; otherwise a clean model. `marker`: a file it creates when it starts hanging."""

    def __init__(self, rows: int = 1, marker: str | None = None):
        super().__init__()
        self.rows = rows
        self.marker = marker
        self.seen = None

    def forward(self, input_ids):
        if self.seen is None:
            self.seen = input_ids.clone()
        new = input_ids.shape[1] == self.seen.shape[1] and not bool(
            (input_ids[:, None, :] == self.seen[None, :, :]).all(-1).any(-1).all()
        )
        if new and input_ids.shape[0] >= self.rows:
            if self.marker:
                Path(self.marker).touch()
            while True:
                time.sleep(0.02)
        return self.clean_logits(input_ids)


class Interrupts(Base):
    """Ctrl-C arrives during the `after`-th forward: a SIGINT to the process, whose handler raises KeyboardInterrupt.
    With `own`, the forward raises KeyboardInterrupt itself, no signal behind it: the model's error, not Ctrl-C."""

    def __init__(self, after: int = 3, own: bool = False):
        super().__init__()
        self.after = after
        self.own = own
        self.calls = 0

    def forward(self, input_ids):
        self.calls += 1
        if self.calls >= self.after:
            if self.own:
                raise KeyboardInterrupt("raised by the model")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        return self.clean_logits(input_ids)


def build_clean():
    return Base()


def build_raises_in_forward():
    return RaisesInForward()


def build_returns_string():
    return ReturnsString()


def build_returns_none():
    return ReturnsNone()


def build_last_position_squeezed():
    return LastPositionSqueezed()


def build_last_position_kept():
    return LastPositionKept()


def build_nan_logits():
    return NaNLogits()


def build_nan_at_last_position():
    return NaNAtLastPosition()


def build_inf_logits():
    return InfLogits()


def build_hangs(rows: int = 1, marker: str | None = None):
    return Hangs(rows, marker)


def build_interrupts(after: int = 3, own: bool = False):
    return Interrupts(after, own)


class NaNOnNewInputs(Base):
    """Finite on the rows of its first forward (the run's baseline inputs), NaN at every position of any other row:
    in a cut, the earlier positions turn NaN when later tokens change."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def forward(self, input_ids):
        logits = self.clean_logits(input_ids)
        if self.seen is None:
            self.seen = input_ids.clone()
            return logits
        known = (
            (input_ids[:, None, :] == self.seen[None, :, :]).all(-1).any(-1)
            if input_ids.shape[1] == self.seen.shape[1]
            else torch.zeros(input_ids.shape[0], dtype=torch.bool)
        )
        return torch.where(known[:, None, None], logits, torch.full_like(logits, float("nan")))


class RaisesMidway(Base):
    """Runs cleanly `after - 1` times, then raises on every later forward (a cache that fills up, ...)."""

    def __init__(self, after: int = 4):
        super().__init__()
        self.after = after
        self.calls = 0

    def forward(self, input_ids):
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError(f"KV cache full: it holds {self.after - 1} forwards")
        return self.clean_logits(input_ids)


class ExitsInForward(Base):
    """sys.exit(0) inside forward (an error handler that 'exits cleanly')."""

    def forward(self, input_ids):
        import sys

        sys.exit(0)


def rotary_raises(x, positions):
    """A `rotary_function:` that raises (tested on its own by the rope check)."""
    raise RuntimeError(f"rotary cache holds 8 positions, asked for {positions.numel()}")


def build_nan_on_new_inputs():
    return NaNOnNewInputs()


def build_raises_midway(after: int = 4):
    return RaisesMidway(after)


def build_exits_in_forward():
    return ExitsInForward()
