"""Leaving the model as found: its state (mode, device, dtype, parameters bitwise, dropout probabilities, hooks)
and the process's (global switches, default dtype and device, RNG) taken before a run and put back after it, also
when something raises; and fingerprints of the parameters, to tell a forward that writes its own weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.rnn import RNNBase

from fwdcheck.model.default_device import global_default_device, set_global_default_device


@dataclass
class ModelState:
    """Everything a run may touch on the model, taken before and put back after.

    Tensors go back by object: `.to()` swaps a parameter's `.data` and reassigns buffers, and the originals are kept.
    A forward may also write its tensors in place. Buffers are where models keep what they legitimately write (a KV
    cache, a step counter) and are small beside the weights, so their contents are copied and written back.
    Parameters are not copied (that would double the model's memory): `ParameterWatch` tells which ones a forward
    wrote. Hooks and attributes the model adds to its own modules during the run (transformers installs
    output-capturing hooks the first time `output_attentions` is asked for, and marks the model as hooked) are
    removed, attributes it rebinds are put back (an int position limit grown with its buffer), and child modules,
    parameters and buffers it hangs on the model (caches set up on demand) are taken off, so that a second run, and
    the caller, find the model as the first one did."""

    training: dict[nn.Module, bool] = field(default_factory=dict)
    # every dropout module's probability by (module, attribute): nn.Dropout and its kin (Dropout1d/2d/3d,
    # AlphaDropout, FeatureAlphaDropout) keep it as `p`; nn.RNN, LSTM and GRU as `dropout`, applied between their
    # layers inside the kernel, where no function mode sees it
    dropout_p: dict[tuple[nn.Module, str], float] = field(default_factory=dict)
    # (owner, kind, name, original data, the .grad tensor, its original data)
    tensors: list[tuple[nn.Module, str, str, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )
    buffer_contents: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (name, buffer, copy)
    parameters: dict[tuple[nn.Module, str], nn.Parameter] = field(default_factory=dict)  # the objects themselves
    hooks: list[tuple[dict, dict]] = field(default_factory=list)  # (a module's hook dict, a copy of its entries)
    # each module's attributes (its __dict__ entries) by object, as found: rebound or added ones are put back or removed
    attributes: dict[nn.Module, dict[str, Any]] = field(default_factory=dict)
    children: dict[nn.Module, dict[str, nn.Module | None]] = field(default_factory=dict)  # each module's _modules
    tensor_names: dict[nn.Module, tuple[set[str], set[str]]] = field(default_factory=dict)  # its parameters', buffers'

    @classmethod
    def take(cls, model: nn.Module) -> ModelState:
        state = cls()
        for module in model.modules():
            state.training[module] = module.training
            attribute = dropout_attribute(module)
            if attribute is not None:
                state.dropout_p[module, attribute] = getattr(module, attribute)
            for name, p in module._parameters.items():
                if p is not None:
                    grad = p.grad
                    state.tensors.append((module, "param", name, p.data, grad, grad.data if grad is not None else None))
                    state.parameters[module, name] = p
            for name, b in module._buffers.items():
                if b is not None:
                    state.tensors.append((module, "buffer", name, b, None, None))
            # _forward_hooks, _forward_pre_hooks, their with_kwargs and always_called companions, backward and
            # state-dict hooks: every dict of hooks a module keeps, whatever this torch version names them
            # (most are empty: an empty one is kept without a copy, and restore() empties it again)
            state.hooks += [
                (hooks, hooks.copy() if hooks else {})
                for key, hooks in vars(module).items()
                if "_hooks" in key and isinstance(hooks, dict)
            ]
            state.attributes[module] = dict(vars(module))
            state.children[module] = dict(module._modules)
            state.tensor_names[module] = (set(module._parameters), set(module._buffers))
        state.buffer_contents = [(name, b, b.clone()) for name, b in model.named_buffers() if readable(b)]
        return state

    def zero_dropout(self) -> None:
        """Every dropout module's probability set to 0 (restore() puts them back)."""
        for module, attribute in self.dropout_p:
            setattr(module, attribute, 0.0)

    def restore(self) -> list[str]:
        """Put everything back; the names of the buffers whose contents the run had written in place."""
        for hooks, entries in self.hooks:
            if hooks != entries:
                hooks.clear()
                hooks.update(entries)
        for module, found in self.attributes.items():
            now = vars(module)
            for added in set(now) - set(found):
                delattr(module, added)
            # Rebound during the run (a position table grown on demand: an int and a buffer updated together, the
            # buffer put back below): the object found, written where it was found, past any __setattr__ of the
            # model's. A container changed in place is not a rebinding, and stays as changed.
            for name, value in found.items():
                if name != "training" and now.get(name, _MISSING) is not value:  # (training: below)
                    now[name] = value
        # Child modules, parameters and buffers the run hung on the model (a cache's modules and masks set up on
        # demand) are taken off again, and children it replaced put back: the model's structure as found.
        for module, children in self.children.items():
            if module._modules != children:
                module._modules.clear()
                module._modules.update(children)
        for module, (parameters, buffers) in self.tensor_names.items():
            for added in set(module._parameters) - parameters:
                del module._parameters[added]
            for added in set(module._buffers) - buffers:
                del module._buffers[added]
        for module, kind, name, original, grad, grad_data in self.tensors:
            if kind == "param":
                # A move to another kind of tensor (the meta device) replaced the Parameter object: put it back.
                param = module._parameters[name] = self.parameters[module, name]
                param.data = original  # .to() swapped .data (of the grad too); the original storages are intact
                if grad is not None:
                    assert grad_data is not None  # taken with the grad
                    grad.data = grad_data
                param.grad = grad
            else:
                module._buffers[name] = original
        written = []
        for name, buffer, contents in self.buffer_contents:
            if not same_bytes(buffer, contents):
                written.append(name)
                with torch.no_grad():
                    if buffer.shape == contents.shape:
                        buffer.copy_(contents)  # into its own storage, where the model and its views find it
                    else:  # resized in place
                        buffer.set_(contents)  # type: ignore[call-overload]  # documented; the stubs list storages only
        for (module, attribute), p in self.dropout_p.items():
            setattr(module, attribute, p)
        for module, training in self.training.items():
            module.training = training
        return written


_MISSING = object()


class KeptBuffers:
    """The buffers of a model as found, put back after each forward that wrote them: state a train-mode forward
    updates as it runs (spectral norm's power-iteration vectors, BatchNorm's running statistics and
    num_batches_tracked, a step counter) would make the next identical forward a different one, which is no
    randomness of the model's. Each buffer's contents are copied once (buffers are small beside the weights); a
    buffer the forward rebound (`self.steps = self.steps + 1`) is put back by object."""

    def __init__(self, model: nn.Module):
        self.kept = [
            (f"{path}.{name}" if path else name, module, name, buffer, buffer.clone())
            for path, module in model.named_modules()
            for name, buffer in module._buffers.items()
            if buffer is not None and readable(buffer)
        ]
        self.updated: set[str] = set()  # the dotted names of the buffers a forward wrote, put back each time

    def put_back(self) -> None:
        with torch.no_grad():
            for dotted, module, name, buffer, contents in self.kept:
                if module._buffers.get(name) is not buffer:
                    module._buffers[name] = buffer
                    self.updated.add(dotted)
                if not same_bytes(buffer, contents):
                    self.updated.add(dotted)
                    if buffer.shape == contents.shape:
                        buffer.copy_(contents)
                    else:  # resized in place
                        buffer.set_(contents.clone())


def dropout_attribute(module: nn.Module) -> str | None:
    """The attribute holding a module's dropout probability, or None for a module without one."""
    if isinstance(module, _DropoutNd):
        return "p"
    if isinstance(module, RNNBase) and isinstance(module.dropout, float):
        return "dropout"
    return None


def readable(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes can be read: it has values (not on the meta device) in ordinary strided memory."""
    return tensor.device.type != "meta" and tensor.layout == torch.strided and not tensor.is_quantized


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal says NaN differs from itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes. A sharded tensor's (a DTensor, in a distributed run) are those of the whole tensor,
    gathered from every rank (which reads them at the same point): FSDP2 swaps a module's sharded parameters for the
    gathered ones around a forward, and the same values must read the same."""
    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return whole.detach().reshape(-1).view(torch.uint8)  # reshape copies only a tensor that is not contiguous


# 64-bit words per block of a fingerprint's position-weighted sum: 2 KiB, as fast to sum as the whole tensor at once.
FINGERPRINT_BLOCK = 256


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 that change when any byte of the tensor changes: the sum of its bytes read as 64-bit words, and the
    sum of its blocks of words each weighted by its position, so that values moved elsewhere show too. Integer sums
    wrap around: exact, and the same whatever order the reduction takes. One read of the tensor, at the speed of a
    plain sum; a rearrangement of words inside one 2 KiB block, which no arithmetic write makes, is what it misses."""
    data = _bytes(tensor)
    try:
        words = data.view(torch.int64)
    except RuntimeError:  # a size or an offset that is not a multiple of 8 bytes: byte by byte
        words = data.long()
    whole = len(words) // FINGERPRINT_BLOCK * FINGERPRINT_BLOCK
    sums = torch.cat([words[:whole].view(-1, FINGERPRINT_BLOCK).sum(1), words[whole:]])  # (blocks + rest,)
    positions = torch.arange(1, len(sums) + 1, device=sums.device)
    return torch.stack([sums.sum(), (sums * positions).sum()])


class ParameterWatch:
    """Which parameters a forward wrote in place. A forward in eval mode has no reason to change the model's weights,
    and every forward after such a write runs a different model than the one checked. Copies of the parameters would
    double the model's memory, so each one is held as its fingerprint; reading them all costs about what a forward
    spends reading the weights."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.prints = self._take()

    def written(self) -> list[str]:
        """The parameters whose contents changed since the watch began or was last asked."""
        now = self._take()
        changed = [name for name, now_print in now.items() if self.prints.get(name, now_print) != now_print]
        self.prints = now
        return changed

    def _take(self) -> dict[str, tuple[int, int]]:
        named = [(name, p) for name, p in self.module.named_parameters() if readable(p)]
        if not named:
            return {}
        prints = torch.stack([fingerprint(p).cpu() for _, p in named]).tolist()
        return {name: tuple(values) for (name, _), values in zip(named, prints, strict=True)}


def _switches() -> list[tuple[str, Callable[[], Any], Callable[[Any], object]]]:
    """(name, read, set) of the process-wide settings model code is known to flip: TF32 and matmul precision,
    cuDNN's, the thread count, deterministic algorithms, grad mode, the default dtype and device, the SDPA backends.
    In the order they are put back: the matmul precision and the fp32_precision settings (torch 2.9 and later) first,
    since the older TF32 flags read them."""
    backends = torch.backends

    def attribute(owner: Any, path: str, name: str):
        return f"{path}.{name}", lambda: getattr(owner, name), lambda value: setattr(owner, name, value)

    found: list[tuple[str, Callable[[], Any], Callable[[Any], object]]] = [
        ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision)
    ]
    for path, owner in [
        ("torch.backends", backends),
        ("torch.backends.cuda.matmul", backends.cuda.matmul),
        ("torch.backends.cudnn", backends.cudnn),
        ("torch.backends.mkldnn", backends.mkldnn),
    ]:
        for sub in ("", "matmul", "conv", "rnn"):
            inner = getattr(owner, sub, None) if sub else owner
            if inner is not None and hasattr(inner, "fp32_precision"):
                found.append(attribute(inner, f"{path}.{sub}" if sub else path, "fp32_precision"))
    found += [
        attribute(backends.cuda.matmul, "torch.backends.cuda.matmul", "allow_tf32"),
        *(
            attribute(backends.cudnn, "torch.backends.cudnn", name)
            for name in ("allow_tf32", "benchmark", "deterministic", "enabled")
        ),
        ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
        (
            "torch.are_deterministic_algorithms_enabled() (warn_only)",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
        ),
        ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
        ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        # the global default alone (None: none set), never an enclosing `with torch.device()` block's
        ("torch.set_default_device()", global_default_device, set_global_default_device),
    ]
    for kernel in ("flash", "mem_efficient", "math", "cudnn"):
        found.append(
            (
                f"torch.backends.cuda.{kernel}_sdp_enabled()",
                getattr(backends.cuda, f"{kernel}_sdp_enabled"),
                getattr(backends.cuda, f"enable_{kernel}_sdp"),
            )
        )
    found.append(attribute(module_globals, "torch.nn.modules.module", "_global_is_full_backward_hook"))
    return found


@dataclass
class GlobalState:
    """The process-wide settings a forward may flip, and the global module hooks it may register
    (`nn.modules.module.register_module_forward_hook` and the like); taken before a run and put back after it."""

    switches: dict[str, tuple[Any, Callable[[], Any], Callable[[Any], object]]] = field(default_factory=dict)
    hooks: list[tuple[str, dict, dict]] = field(default_factory=list)  # (name, the global dict, a copy of it)

    @classmethod
    def take(cls) -> GlobalState:
        state = cls()
        for name, read, put in _switches():
            try:
                state.switches[name] = (read(), read, put)
            except RuntimeError:  # unreadable as it stands (torch refuses TF32 flags set through both APIs): kept out
                continue
        state.hooks = [
            (f"torch.nn.modules.module.{name}", hooks, hooks.copy())
            for name, hooks in vars(module_globals).items()
            if name.startswith("_global_") and isinstance(hooks, dict)
        ]
        return state

    def restore(self) -> list[str]:
        """Put everything back; a note for each setting or global hook dict the run changed."""
        notes = []
        for name, (value, read, put) in self.switches.items():
            try:
                now = read()
            except RuntimeError:
                now = "unreadable"
            if now != value:
                put(value)
                if "fp32_precision" not in name:  # the state behind the TF32 flags and matmul precision, named instead
                    notes.append(f"the model changed {name} during the run ({value} -> {now}); put back")
        for name, hooks, entries in self.hooks:
            if hooks != entries:
                hooks.clear()
                hooks.update(entries)
                notes.append(f"the model registered global module hooks during the run ({name}); removed")
        return notes
