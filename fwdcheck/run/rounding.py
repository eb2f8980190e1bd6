"""The model's own rounding: how far its logits lie from the same arithmetic carried out in float64.

Two forwards that compute the same logits in another order (a matrix product of another shape, a row run alone
instead of beside others, a prefix instead of the whole sequence) differ by their rounding, not by a bug. The dtype
tolerance (torch.testing's, 1.3e-6 of the largest |logit| in float32) covers that for most models, but not for one
whose hidden states run far above its logits: a tiny Mamba's residual stream reaches 200 while its logits stay near
13, and its first two tokens run alone differ from the full run by 7.5e-5, 2.3 times the tolerance, while in float64
they agree exactly. So the rounding is measured, not assumed: a twin of the model (a deep copy, cast to float64; the
model under test is not touched) runs the same tokens, and the largest difference of the logits is the rounding a
forward of the run's dtype carries. Two orders of the same arithmetic each lie within that of the exact logits, so
within twice it of each other; the threshold allows ROUNDING_FACTOR times it, twice that again for a forward of
another shape rounding more than the one measured (the prefix above: 1.1 times).

It costs a copy of the model in float64 and one forward, so it is measured only when a change goes beyond the
tolerance (Session.noise_matters), as the run-to-run noise floor is. A model the twin cannot be made of (a kernel
without float64, a module that cannot be copied, too little memory for the copy, a model run across processes, whose
copy would have to run the collectives again on every rank alike) has no rounding floor: the tolerance and the
run-to-run noise stand alone, and the run's notes say why.

The twin must compute the same thing, only more exactly. One that does not (an adapter that draws its image with
torch.randn in the default dtype gets another image in float64; an input built from the clock) measures a difference
of computations, not rounding, and would raise the threshold over a real leak. So what it measures is used only when
it is small next to the logits' scale, at most ROUNDING_BOUND of it (1024 units of the run dtype's precision, capped
at 1%: the tiny Mamba's rounding is 6e-6 of its scale); beyond that the twin is not used, and the notes say why.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch

from fwdcheck.errors import first_line
from fwdcheck.model.tested import ModelUnderTest

# How many times the measured rounding a change must exceed to count (see the module's docstring).
ROUNDING_FACTOR = 4.0
# The largest rounding, in units of the run dtype's precision (torch.finfo.eps) times the logits' scale, that the
# twin's difference can be taken for; capped at ROUNDING_CAP of the scale (see the module's docstring).
ROUNDING_BOUND = 1024
ROUNDING_CAP = 0.01


def rounding_bound(scale: float, *dtypes: torch.dtype) -> float:
    """The largest difference from the float64 twin that can be rounding, for logits of this scale computed in the
    coarsest of these dtypes."""
    eps = max(torch.finfo(d).eps for d in dtypes if d.is_floating_point)
    return min(ROUNDING_BOUND * eps, ROUNDING_CAP) * scale


def float64_twin(model: ModelUnderTest, device: torch.device) -> ModelUnderTest | str:
    """The model as a float64 copy on `device`, or why none can be made. Its capabilities stay the model's own; only
    the module (what forward and logits() run) is the twin."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:
        # A copy's forward would run the collectives again, and every rank would have to take it alike.
        return "a model run across processes is not copied"
    floating = [t for t in (*model.module.parameters(), *model.module.buffers()) if t.is_floating_point()]
    needed = 8 * sum(t.numel() for t in floating)
    free = _free_memory(device)
    if free is not None and 2 * needed > free:  # the copy and its activations beside everything already held
        return f"a float64 copy of the model needs {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on {device}"
    try:
        module = copy.deepcopy(model.module).double()
    except Exception as exc:  # anything a module's own __deepcopy__ or _apply may raise
        return f"the model cannot be copied to float64 ({type(exc).__name__}: {first_line(exc, limit=120)})"
    return dataclasses.replace(model, module=module)


def _free_memory(device: torch.device) -> int | None:
    """Bytes free on the device; None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None
