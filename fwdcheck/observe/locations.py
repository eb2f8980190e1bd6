"""Where in the model's code an observed call was made: the first frame beyond torch and fwdcheck's observer, as
'path:line'. Path-sensitive: every module of this package (fwdcheck/observe/, kernels/ included) is the observer's."""

from __future__ import annotations

import os
from pathlib import Path
from types import FrameType

import torch

# Walking out from an attention call, frames of torch (its wrappers, nn.MultiheadAttention, nn.TransformerEncoder) and
# of this observer are passed over: the first frame beyond them is the line of model code that made the call. A frame
# of fwdcheck's own there (the session running the forward) means no model code made it: the model is torch's own.
# fwdcheck's reference transformer is model code like any other.
_TORCH = str(Path(torch.__file__).parent) + os.sep
_FWDCHECK = str(Path(__file__).parents[1]) + os.sep
_REFERENCE_MODEL = str(Path(__file__).parents[1] / "model" / "reference.py")
_OBSERVER = str(Path(__file__).parent) + os.sep  # fwdcheck/observe/: the dispatcher, masks, kernels/


def code_location(filename: str, line: int) -> str:
    """'path:line', the path relative to the working directory when under it (as CI annotations want), else as
    given."""
    try:
        path = str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        path = filename
    return f"{path}:{line}"


def model_line(frame: FrameType | None, lines: dict[tuple[str, int], str]) -> str | None:
    """'path:line' of the model code making the call being observed, walking out from `frame`: the first frame
    beyond torch and this observer, None when that is fwdcheck running the forward. Each call site is formatted once
    per observation (`lines`: the observation's own memo, (file, line) -> its code_location)."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename.startswith(_OBSERVER)
    ):
        frame = frame.f_back
    if frame is None:
        return None
    filename = frame.f_code.co_filename
    if filename.startswith(_FWDCHECK) and filename != _REFERENCE_MODEL:
        return None
    site = (filename, frame.f_lineno)
    if site not in lines:
        lines[site] = code_location(*site)
    return lines[site]
