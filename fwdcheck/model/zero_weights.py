"""Weights that hide paths: a weight identically zero at initialisation computes nothing through its module.

Zero-initialised output projections (modded-nanogpt's c_proj, ReZero and muP set-ups, adaLN-zero's modulation) make
attention or an MLP contribute nothing at initialisation: a leak that is not in a mask (attention's output rolled one
step in time, a transpose that mixes positions) then moves no logit, and appears only after the first optimiser step.
For the run, each such weight gets small random values, N(0, 1 / fan_in) as a default nn.Linear's scale, from the
run's seed, and is zeroed again after: what flows through it shows, and the model is left as found.

Only weights a source built are woken: a checkpoint's or a pretrained directory's are left as loaded (a zero there is
the model's own number). Only matrices (two or more axes) that require a gradient: a zero bias or a zero-initialised
norm offset hides no path, and a frozen zero tensor is a constant of the model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fwdcheck.model.tested import ModelUnderTest

SHOWN = 4  # weights named in the note


def hiding(model: ModelUnderTest) -> list[tuple[str, torch.nn.Parameter]]:
    """The weights identically zero that a source built (not loaded), as (name, parameter)."""
    if model.weights_loaded:
        return []
    found = []
    for name, p in model.module.named_parameters():
        if p.is_meta or not p.requires_grad or not p.is_floating_point() or p.dim() < 2 or p.numel() < 2:
            continue
        if type(p.detach()) is not torch.Tensor:  # a sharded DTensor: its other shards live on other ranks
            continue
        if _all_zero(p.detach()):
            found.append((name, p))
    return found


def _all_zero(weight: torch.Tensor) -> bool:
    """Whether every element is zero. A weight of any other initialisation has a nonzero element among its first
    few, so those are read first: the whole tensor is read only for the weights that are zero there (a full read of
    every weight costs what a forward spends reading them)."""
    flat = weight.reshape(-1)
    return not bool(flat[:64].any()) and not bool(flat.any())


@contextmanager
def woken(model: ModelUnderTest, seed: int, notes: list[str]) -> Iterator[None]:
    """Each weight identically zero at initialisation holds small random values inside; zero again after."""
    zero = hiding(model)
    if not zero:
        yield
        return
    found = [p.detach().clone() for _, p in zero]  # their very bytes (-0.0 is zero too) to put back
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in zero:
            fan_in = p[0].numel()  # (out, in, ...): what one output reads
            values = torch.randn(p.shape, generator=generator, dtype=torch.float32) * fan_in**-0.5
            p.copy_(values.to(device=p.device, dtype=p.dtype))
    names = ", ".join(name for name, _ in zero[:SHOWN]) + (
        f" and {len(zero) - SHOWN} more" if len(zero) > SHOWN else ""
    )
    notes.append(
        f"{len(zero)} weight(s) identically zero at initialisation ({names}) held small random values "
        "(N(0, 1/fan_in)) during the checks, so that a path through them shows; zero again after the run"
    )
    try:
        yield
    finally:
        with torch.no_grad():
            for (_, p), before in zip(zero, found, strict=True):
                p.copy_(before)
