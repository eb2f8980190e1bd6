"""Recording scaled_dot_product_attention calls: each call's arguments as the model made it, and the line of model
code that made it. Nothing of what runs changes, so a forward under the recorder is the model's own; backends replays
the calls under each SDPA kernel, attention-stats reads the scale and mask each call was given.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fwdcheck.observe.kernels.sdpa import SDPA_SIGNATURE
from fwdcheck.observe.locations import code_location


@dataclass
class SdpaCall:
    """One scaled_dot_product_attention call as the model made it: its arguments (tensors detached and kept) and
    the line of model code that made it."""

    arguments: dict
    source: str | None


class RecordSdpa(TorchFunctionMode):
    """Keeps the arguments of every scaled_dot_product_attention call, and changes nothing of what runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[SdpaCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = SDPA_SIGNATURE.bind(*args, **kwargs)
            kept = {
                name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                for name, value in bound.arguments.items()
            }
            self.calls.append(SdpaCall(kept, _model_line()))
        return func(*args, **kwargs)  # forwards the model's call


def _model_line() -> str | None:
    """'path:line' of the first frame beyond torch and fwdcheck: the model code that called SDPA."""
    skip = (str(torch.__path__[0]), str(__import__("fwdcheck").__path__[0]), __file__)
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return code_location(frame.f_code.co_filename, frame.f_lineno) if frame is not None else None
