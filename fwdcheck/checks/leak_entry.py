"""Where a leak enters: the first module whose output at an earlier position moves when later tokens change.

future-token shows that earlier logits move; this names the module where that starts. Two forwards of one row, as
it is and with its tokens from the cut on changed, each keeping every module's input and output; in the order the
modules complete, the first whose output at a position before the cut differs between the two is where the leak is
first seen. Its input says which side of it the leak is on: if the input had not moved, the module's own code reads
the future (its forward, at the line named); if it had, the code just before it did, in the module that called it
(a reshape, a roll, a norm over the sequence after the attention call). Leaks outside any mask are then located, not
only detected.

A tensor's sequence axis is the first after the batch whose size is the row's length; a module whose output has
none (a per-head parameter, a pooled vector) is passed over. A change counts when it exceeds the golden column of
the dtype's tolerances (fwdcheck/run/tolerances.py), relative to the tensor's own largest value: the two forwards run
the same code on the same positions, so only the changed tokens can move it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn as nn

from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.observe.frames import first_tensor, output_tensor
from fwdcheck.observe.locations import code_location
from fwdcheck.observe.records import AttentionCall
from fwdcheck.run.session import Session
from fwdcheck.run.tolerances import TOLERANCES


@dataclass
class Entry:
    module: str  # the first module whose output moved before the cut
    position: int  # the earliest earlier position at which it moved
    input_moved: bool  # its input had moved already: the leak is in the code before it
    caller: str  # the module that called it ("" for the root)
    source: str | None  # "path:line" of the code to look at


@dataclass
class Kept:
    name: str
    input: torch.Tensor | None
    output: torch.Tensor | None


def leak_entry(
    model: ModelUnderTest, session: Session, row: torch.Tensor, changed: torch.Tensor, cut: int
) -> Entry | None:
    """The module where the leak that moves row's positions < cut when tokens >= cut change (to `changed`) is first
    seen; None when no module's output shows it (it enters after the last module: in forward's own code)."""
    before = kept_outputs(model, lambda: session.logits(row[None]))
    after = kept_outputs(model, lambda: session.logits(changed[None]))
    if [k.name for k in before] != [k.name for k in after]:
        return None  # the changed tokens took another path through the modules: no pairing to compare
    T = row.shape[-1]
    modules = dict(model.module.named_modules())
    for a, b in zip(before, after, strict=True):
        position = _moved_before(a.output, b.output, T, cut)
        if position is None:
            continue
        input_moved = _moved_before(a.input, b.input, T, cut) is not None
        caller = a.name.rpartition(".")[0]
        source = _forward_line(modules.get(caller if input_moved else a.name))
        return Entry(a.name, position, input_moved, caller, source)
    return None


def describe(entry: Entry, cut: int) -> str:
    """What the finding says of where the leak enters (the line to look at is the finding's source)."""
    moved = f"its output at position {entry.position} moves when tokens >= {cut} change"
    if entry.input_moved:
        return (
            f"the leak enters before {entry.module}: {moved}, and so does its input; look at the code of "
            f"{entry.caller or 'the model'} that feeds it"
        )
    return f"the leak enters at {entry.module}: {moved}, its input does not"


def attention_reading_ahead(entry: Entry, calls: list) -> AttentionCall | None:
    """The attention call, made by the module whose code feeds the entry (or the entry itself), whose may-read set
    reaches later keys: where a leak that enters through a mask comes from. Its line is the one to fix (the call
    the mask is handed to, or the softmax over the masked scores), not the forward the module is defined at."""
    owners = {entry.caller, entry.module} if entry.input_moved else {entry.module}
    for call in calls:
        L, S = call.allowed.shape[-2:]
        if call.module in owners and call.source and L == S and bool(torch.triu(call.allowed, 1).any()):
            return call
    return None


def first_apart(a: list[Kept], b: list[Kept]) -> str | None:
    """The first module, in the order modules complete, whose output differs between two runs of the same inputs
    beyond rounding; None when none does, or the runs went through other modules."""
    if [k.name for k in a] != [k.name for k in b]:
        return None
    rtol, atol = TOLERANCES[torch.float32].golden
    for x, y in zip(a, b, strict=True):
        if x.output is None or y.output is None or x.output.shape != y.output.shape:
            continue
        if not float((x.output - y.output).abs().max()) <= atol + rtol * float(x.output.abs().max()):  # NaN too
            return x.name
    return None


def kept_outputs(model: ModelUnderTest, forward: Callable[[], object]) -> list[Kept]:
    """Every module's first input and output tensor for one forward, in the order modules complete."""
    inputs: dict[int, list[torch.Tensor | None]] = {}
    kept: list[Kept] = []

    def before(name):
        def hook(module, args):
            inputs.setdefault(id(module), []).append(_copy(first_tensor(args)))

        return hook

    def after(name):
        def hook(module, args, output):
            stack = inputs.get(id(module)) or [None]
            kept.append(Kept(name, stack.pop(), _copy(output_tensor(output))))

        return hook

    with ExitStack() as hooks:
        for name, module in model.module.named_modules():
            if name:  # the root's output is the logits future-token compared
                hooks.callback(module.register_forward_pre_hook(before(name)).remove)
                hooks.callback(module.register_forward_hook(after(name)).remove)
        forward()
    return kept


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """fwdcheck's own float copy (a buffer the model reuses would otherwise move with it); None for what cannot be
    compared: no float. A sharded DTensor is this rank's shard: every rank runs the same forward and compares its
    own, and a position that moves in a shard has moved."""
    if tensor is None or not tensor.is_floating_point():
        return None
    if type(tensor) is not torch.Tensor and _sharded(tensor):
        tensor = tensor.to_local()  # type: ignore[attr-defined]  # (a DTensor's own)
    return tensor.detach().float().clone()


def _sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _moved_before(a: torch.Tensor | None, b: torch.Tensor | None, T: int, cut: int) -> int | None:
    """The earliest position < cut at which a and b differ beyond rounding, along their sequence axis; None when
    they do not, or hold no sequence axis."""
    if a is None or b is None or a.shape != b.shape or a.dim() < 2:
        return None
    axis = next((i for i in range(1, a.dim()) if a.shape[i] == T), None)
    if axis is None:
        return None
    rtol, atol = TOLERANCES[torch.float32].golden
    scale = float(a.abs().max())
    change = (a - b).abs().movedim(axis, 0)[:cut].reshape(cut, -1).amax(-1)  # (cut,)
    moved = ~(change <= atol + rtol * scale)  # NaN counts
    return int(moved.nonzero()[0, 0]) if bool(moved.any()) else None


def _forward_line(module: nn.Module | None) -> str | None:
    """'path:line' of the module class's forward, where its code is; None for torch's own modules."""
    if module is None:
        return None
    try:
        forward = type(module).forward
        path = inspect.getsourcefile(forward)
        line = inspect.getsourcelines(forward)[1]
    except (OSError, TypeError):
        return None
    if path is None or path.startswith(str(torch.__path__[0])):
        return None
    return code_location(path, line)
