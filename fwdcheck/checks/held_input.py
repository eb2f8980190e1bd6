"""Holding the hidden state that enters each attention module the same at every position, so that what q and k do
with position inside it is the position encoding alone (rope's probe): the forward pre-hooks that hold it (Hold), and
where to hold it, the innermost module around each attention call that takes the residual stream (hold_points).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from fwdcheck.errors import ModelRaised
from fwdcheck.observe.frames import first_tensor
from fwdcheck.run.compare import relative_error


class Hold:
    """Forward pre-hooks that hand each named module its hidden-state input with one row at every position: the row
    its first call of the forward got at position 0. Whatever q and k then do with position inside that module is the
    position encoding alone, however position entered the residual stream before it (learned or sinusoidal tables,
    tokens mixed with their neighbours), in whichever layer, and over however many calls the forward makes (a prefill
    and then one token at a time through a KV cache).

    The shifted probe replays the rows the first probe held, so that q and k start from the same content at other
    positions; how far a module's own rows moved under the shift tells whether position entered it absolutely."""

    def __init__(self, names: set[str], positions: int):
        self.names, self.positions = names, positions
        self.rows: dict[str, tuple[torch.Tensor, ...]] = {}  # module -> the rows it is given in this forward
        self.replay: dict[str, tuple[torch.Tensor, ...]] | None = None  # rows to give instead of its own
        self.moved: dict[str, float] = {}  # module -> how far its own rows were from the replayed ones
        self.spread: dict[str, float] = {}  # module -> how much its own input changed along the positions

    def start(self, replay: dict[str, tuple[torch.Tensor, ...]] | None = None) -> None:
        """Before each forward: forget the rows of the last one; replay these instead of the modules' own."""
        self.rows, self.replay, self.moved = {}, replay, {}

    @contextmanager
    def installed(self, model: nn.Module):
        handles = [
            m.register_forward_pre_hook(self._hook(n), with_kwargs=True)
            for n, m in model.named_modules()
            if n in self.names
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str):
        def hold(module, args, kwargs):
            x = first_tensor(args) if args else first_tensor(kwargs)  # what the observation pass records as input
            if (
                x is None
                or not x.is_floating_point()
                or x.dim() != 3
                or x.shape[0] != 1
                or not 1 <= x.shape[1] <= self.positions
            ):
                return None  # not a hidden state (1, L <= P, width): leave this call alone

            # Every tensor shaped like it (q, k and v inputs given apart) is held alike; one handed over twice stays
            # one tensor (whether keys come from the queries' own input is read off that identity).
            distinct: list[torch.Tensor] = []
            for t in (*args, *kwargs.values()):
                if (
                    isinstance(t, torch.Tensor)
                    and t.shape == x.shape
                    and t.dtype == x.dtype
                    and not any(t is d for d in distinct)
                ):
                    distinct.append(t)
            if not any(x is d for d in distinct):
                return None  # the hidden state sits inside a container: nothing is held, and nothing claims it
            own = tuple(t[0, 0].detach().clone() for t in distinct)
            self.spread[name] = max(self.spread.get(name, 0.0), relative_spread(x))
            if name not in self.rows:
                given = own
                if self.replay is not None and name in self.replay:
                    given = self.replay[name]
                    # Not compare.relative_error: its inf for a NaN row would read as positions entering absolutely,
                    # which skips the logits shift.
                    self.moved[name] = max(
                        [0.0]
                        + [
                            float((a - b).abs().max()) / (float(b.abs().max()) + 1e-30)
                            for a, b in zip(own, given, strict=False)
                        ]
                    )
                self.rows[name] = given
            rows = (*self.rows[name], *own[len(self.rows[name]) :])
            made = [row[None, None].expand_as(t).contiguous() for row, t in zip(rows, distinct, strict=False)]

            def held(t):
                return next((m for d, m in zip(distinct, made, strict=True) if t is d), t)

            return tuple(held(a) for a in args), {key: held(v) for key, v in kwargs.items()}

        return hold


def relative_spread(x: torch.Tensor) -> float:
    """How far a hidden state x (B, P, width) is from being the same at every position, relative to its largest
    entry."""
    return relative_error(x, x[:, :1], relative_to=x)


def hold_points(model, session) -> dict[str, str]:
    """For the module each attention call ran in, the innermost module around it (itself included) that took the
    residual stream (B, T, width) in the session's observation pass: where the probe holds the input position-free.

    Without an observation pass (the model cannot be observed) there are none, and only calls whose block input is
    already position-free, or whose q and k turn as clean rotations, can be judged."""
    try:
        seen = session.observation()
    except ModelRaised:
        return {}
    B, T = session.inputs.shape
    width = {
        m.name: m.input_shape[2]
        for m in seen.modules
        if m.name and m.input_shape is not None and len(m.input_shape) == 3 and m.input_shape[:2] == (B, T)
    }
    where = {c.module for c in seen.attention} | {mm.module for mm in seen.matmuls if mm.kind == "scores"}
    points = {}
    for module in where:
        around = [name for name in width if module == name or module.startswith(f"{name}.")]
        if not around:
            continue
        # The residual stream, not one head's already rotated q and k handed on to an inner module as (B, T, d_h):
        # holding those would hold the rotation away. Its width is the model's, when known, else the widest.
        wide = (
            model.dims.get("d")
            if any(width[n] == model.dims.get("d") for n in around)
            else max(width[n] for n in around)
        )
        points[module] = max((n for n in around if width[n] == wide), key=len)
    return points
