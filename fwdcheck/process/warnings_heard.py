"""The warnings a run raises, each marked with whose it is: the model's (its code, its libraries, torch about its
tensors) or fwdcheck's own. A warning of fwdcheck's own is a defect of fwdcheck, never news about the model, so it never
reaches the report as the model's.

Whose it is, by the frame Python names as its origin: a file outside fwdcheck's package is the model's. A line of
fwdcheck that only forwards the model's own call (a function mode's `__torch_function__`, an observer's reader running
the op it read) carries the marker FORWARDS, and then the stack is read outward, past torch's dispatch and other
forwarding lines, to the code that made the call: fwdcheck's own (a `float()` of a tensor in an observer's reader) or
the model's (its softmax without `dim`).
"""

from __future__ import annotations

import linecache
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

FORWARDS = "# forwards the model's call"  # the marker, at the end of a line that runs an op on the model's behalf
PACKAGE = Path(__file__).resolve().parents[1]  # fwdcheck/


class Heard(warnings.WarningMessage):
    """A warning as `catch_warnings(record=True)` records it, and `own`: raised by fwdcheck's code."""

    own: bool = False


@contextmanager
def warnings_heard() -> Iterator[list[Heard]]:
    """Every warning shown inside, recorded (as catch_warnings(record=True) records them) with whose it is."""
    heard: list[Heard] = []

    def record(message, category, filename, lineno, file=None, line=None):
        warning = Heard(message, category, filename, lineno, file, line)
        warning.own = _own(filename, lineno, sys._getframe(1))
        heard.append(warning)

    with warnings.catch_warnings():
        warnings.showwarning = record
        yield heard


def _in_package(filename: str) -> bool:
    try:
        return PACKAGE in Path(filename).resolve().parents
    except (OSError, ValueError):
        return False


def _forwards(filename: str, lineno: int) -> bool:
    return FORWARDS in linecache.getline(filename, lineno)


def _own(filename: str, lineno: int, frame: FrameType | None) -> bool:
    if not _in_package(filename):
        return False
    if not _forwards(filename, lineno):
        return True
    # named at a line that forwards the model's call: the caller is whoever handed the op to it
    torch = sys.modules.get("torch")
    torch_dir = Path(torch.__file__).resolve().parent if torch is not None and torch.__file__ else None
    while frame is not None:
        name, line = frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
        path = Path(name).resolve() if not name.startswith("<") else None
        if path is None or path.name == "warnings.py" or (torch_dir is not None and torch_dir in path.parents):
            continue  # the warnings machinery, torch's dispatch and the op itself
        if not _in_package(name):
            return False
        if not _forwards(name, line):
            return True
    return False
