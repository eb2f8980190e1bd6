"""What each running module was handed, read by forward hooks on every module: a stack of frames (the module, the
positions and key sources its forward received, the integer tensors that may index a cache, the cache slots written
inside it) that the dispatcher reads when an attention call comes, and each module's input and output shapes as
ModuleCall records. Also the tensors-by-identity table the dispatcher marks provenance in."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Collection, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fwdcheck.observe.records import ModuleCall, Observation

# Inputs a module's forward may receive that say where its queries sit on the key axis. The cache's own index first:
# cache_position (Hugging Face) and input_pos (gpt-fast, litgpt, torchtune) index the cache slots; position_ids
# usually does too, but with left padding it counts real tokens only, so it comes last.
POSITION_INPUTS = ("cache_position", "input_pos", "position_ids")
# In-place writes that put keys and values into cache slots, whatever the arguments are called: gemma_pytorch's
# k_cache.index_copy_(1, kv_write_indices, xk), gpt-fast's k_cache[:, :, input_pos] = k, cache[:, :, :T] = x.
# Mistral's reference implementation: cache_k.scatter_(1, positions % window, xk), a ring buffer.
WRITES = {torch.Tensor.index_copy_, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.scatter_}
# Inputs that hand an attention module the keys' source when it is another sequence (Hugging Face, x-transformers,
# torchtune, Whisper). A module that has one of these parameters says for itself whether its keys come from elsewhere.
KEY_SOURCE_INPUTS = ("encoder_hidden_states", "key_value_states", "context", "y", "xa")


@dataclass
class _Frame:
    """A module whose forward is running, with what it was handed that attention calls inside it may need."""

    name: str
    positions: dict[str, torch.Tensor]  # POSITION_INPUTS name -> (n,) positions shared by every batch row
    cross: bool | None  # keys from another sequence (True), from its own input (False), no such parameter (None)
    writes: list[_SlotWrite] = field(default_factory=list)  # slot writes made inside this forward, its children's too
    # every integer tensor it was handed, whatever its name, shared by every batch row (not the input ids): what may
    # have indexed a cache write (kv_write_indices; positions, of which a ring buffer writes positions % window)
    integers: list[torch.Tensor] = field(default_factory=list)
    # For a module handed its hidden state and other tensors of its rank (a cross-attention's other sequence): the
    # tensors computed from its own input, and from the others, followed op by op while it runs.
    own: _Identities | None = None
    others: _Identities | None = None


@dataclass
class _SlotWrite:
    """An in-place write of n slots along one axis of a tensor (a cache): which slots, how many the axis has, the
    positions written there when known, and after it, when a slot holds another position than its index (a ring
    buffer past its wrap), the position each slot holds (-1: none yet)."""

    slots: torch.Tensor  # (n,) long on the CPU
    size: int  # slots along the written axis
    destination: torch.Tensor  # the tensor written (a view's base): the same cache written again
    axis: int
    positions: torch.Tensor | None = None  # (n,)
    held: torch.Tensor | None = None  # (size,) the position in each slot; None while slot j holds position j


def logits_in(output: Any) -> torch.Tensor | None:
    """The logits in what a forward returned, by the one rule every check reads them with: a tensor is the logits;
    an object with a `.logits` tensor (transformers' ModelOutput, a dataclass, a namedtuple) its `.logits`; a
    mapping its "logits" entry (`{"hidden_states": h, "logits": z}`); a tuple or list its first item that is not a
    scalar (a loss may lead it: transformers' `(loss, logits, ...)` without return_dict). None when none of these
    holds. Reading `.logits` runs the output's own code, which may raise."""
    if isinstance(output, torch.Tensor):
        return output
    attribute = getattr(output, "logits", None)
    if isinstance(attribute, torch.Tensor):
        return attribute
    if isinstance(output, Mapping):
        entry = output.get("logits")
        return entry if isinstance(entry, torch.Tensor) else None
    if isinstance(output, (tuple, list)):
        return next((item for item in output if isinstance(item, torch.Tensor) and item.dim() > 0), None)
    return None


def output_tensor(output: Any) -> torch.Tensor | None:
    """The tensor a module's output stands for: its logits where it carries them (logits_in), else its first
    tensor (a block's hidden state before the attention weights it also returns)."""
    try:
        found = logits_in(output)
    except Exception:  # a `.logits` property of the model's that raises: read the output's tensors instead
        found = None
    return found if found is not None else first_tensor(output)


def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for v in value if (t := first_tensor(v)) is not None), None)
    if isinstance(value, dict):
        return next((t for v in value.values() if (t := first_tensor(v)) is not None), None)
    for name in ("last_hidden_state", "logits"):  # model-output objects of Hugging Face style
        if isinstance(getattr(value, name, None), torch.Tensor):
            return getattr(value, name)
    return None


class _Identities:
    """Tensors by identity, held weakly, each with a value: what the observer learned about them (computed from the
    input ids; scores or weights on their way through eager attention). A plain dict keyed by id() with a weak
    reference to check the entry still names the same tensor: torch's WeakIdKeyDictionary does the same in Python on
    every lookup, and the observer looks up the arguments of every op the model runs."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __setitem__(self, tensor: torch.Tensor, value: Any) -> None:
        self._entries[id(tensor)] = (weakref.ref(tensor), value)

    def get(self, tensor: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else default

    def __contains__(self, tensor: Any) -> bool:
        entry = self._entries.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def holds_any(self, values: tuple) -> bool:
        """Whether any of an op's arguments is held: the tensors _tensors(values) yields, looked up inline (this
        runs for nearly every op of an observed forward)."""
        entries = self._entries
        for value in values:
            if isinstance(value, torch.Tensor):
                entry = entries.get(id(value))
                if entry is not None and entry[0]() is value:
                    return True
            elif isinstance(value, (tuple, list)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        entry = entries.get(id(item))
                        if entry is not None and entry[0]() is item:
                            return True
        return False

    def __getitem__(self, tensor: torch.Tensor) -> Any:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            raise KeyError(tensor)
        return entry[1]


def _parameters(module: nn.Module) -> tuple[list[str], set[str]]:
    """(names of the positional parameters of the module's forward in order, without self; names of all of them)."""
    forward: Any = module.forward  # a bound method, or any callable set on the instance
    method = inspect.ismethod(forward)
    try:
        positional, accepted = _signature(forward.__func__ if method else forward)
    except TypeError:  # an unhashable callable: read it uncached
        positional, accepted = _signature.__wrapped__(forward.__func__ if method else forward)
    return (positional[1:] if method else positional), accepted


@functools.lru_cache(maxsize=4096)
def _signature(function) -> tuple[list[str], set[str]]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or an object inspect cannot read: only keyword arguments are named
        return [], set()
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional, {p.name for p in parameters}


@dataclass(frozen=True)
class _Reading:
    """What the hooks read off one module's forward signature, once per observation rather than once per call:
    where each position input and the keys' source may arrive, and the name of its first input."""

    positions: tuple[tuple[str, int | None], ...]  # (POSITION_INPUTS name, its positional index or None)
    source: tuple[str, int | None] | None  # the first KEY_SOURCE_INPUTS parameter it has, and its index
    first: str | None  # its first positional parameter


def _reading(module: nn.Module) -> _Reading:
    positional, accepted = _parameters(module)
    index = {n: i for i, n in enumerate(positional)}
    source = next((n for n in KEY_SOURCE_INPUTS if n in accepted), None)
    return _Reading(
        tuple((n, index.get(n)) for n in POSITION_INPUTS),
        (source, index.get(source)) if source is not None else None,
        positional[0] if positional else None,
    )


def _given(name: str, at: int | None, args: tuple, kwargs: dict) -> Any:
    """The argument a call handed to a parameter, by keyword or by position (a keyword wins, as it does in
    Python); None when not handed."""
    if name in kwargs:
        return kwargs[name]
    return args[at] if at is not None and at < len(args) else None


def _frame(
    name: str,
    reading: _Reading,
    args: tuple,
    kwargs: dict,
    from_input: _Identities | None = None,
    positions_of: Callable[[Any], torch.Tensor | None] | None = None,
) -> _Frame:
    """What this forward call was handed: positions, integer tensors that may index a cache, and whether the keys'
    source is another sequence. `positions_of`: _shared_positions, or a memo of it (_PositionsSeen)."""
    positions_of = positions_of or _shared_positions
    integers = [
        p
        for value in (*args, *kwargs.values())
        if isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and not (from_input is not None and value in from_input)  # token ids are no positions
        and (p := positions_of(value)) is not None
    ]
    positions = {}
    for n, at in reading.positions:
        p = positions_of(_given(n, at, args, kwargs))
        if p is not None:
            positions[n] = p
    cross = None
    if reading.source is not None:
        keys = _given(*reading.source, args, kwargs)
        own = _given(reading.first, 0, args, kwargs) if reading.first else None
        cross = isinstance(keys, torch.Tensor) and keys is not own  # torchtune passes its input again as y
    return _Frame(name, positions, cross, integers=integers)


def _slot_write(func, args, kwargs) -> _SlotWrite | None:
    """The slots an in-place write puts values into along one axis of its destination: the index of index_copy_,
    the one integer index tensor or partial slice of a __setitem__ or index_put_ (the other axes whole); None for
    any other write (a mask filled by a boolean index, several indexed axes, a Python int)."""
    destination = args[0] if args else None
    if not isinstance(destination, torch.Tensor) or destination.is_meta:
        return None
    if func in (torch.Tensor.index_copy_, torch.Tensor.scatter_):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        index = kwargs.get("index", args[2] if len(args) > 2 else None)
        if func is torch.Tensor.scatter_ and isinstance(dim, int) and isinstance(index, torch.Tensor):
            index = _along(index, dim)  # the same slot for every element of a row along the other axes
        axes: list[tuple[int, Any]] = [(dim, index)] if isinstance(dim, int) and index is not None else []
    else:
        key = args[1] if len(args) > 1 else kwargs.get("indices")
        key = tuple(key) if isinstance(key, (tuple, list)) else (key,)
        if any(k is Ellipsis or k is None for k in key):
            return None
        axes = [(d, k) for d, k in enumerate(key) if not (isinstance(k, slice) and k == slice(None))]
    if len(axes) != 1:
        return None
    dim, index = axes[0]
    if not -destination.dim() <= dim < destination.dim():
        return None
    size = destination.shape[dim]
    if isinstance(index, slice):
        if index.step not in (None, 1):
            return None
        slots = torch.arange(size, device="cpu")[index]
    elif isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
        shared = _shared_positions(index)
        if shared is None:
            return None
        slots = shared % size  # a negative index counts from the end
    else:
        return None
    if not len(slots) or len(set(slots.tolist())) != len(slots):
        return None
    base = destination._base if destination._base is not None else destination  # cache_k[:bsz] writes cache_k
    return _SlotWrite(slots, size, base, dim % destination.dim())


def _along(index: torch.Tensor, dim: int) -> torch.Tensor | None:
    """scatter_'s index as the slots along `dim` (n,), when every element at one step along it goes to one slot
    (the index repeated over batch, heads and width); None otherwise."""
    if index.is_meta or not -index.dim() <= dim < index.dim():
        return None
    rows = index.movedim(dim, -1).reshape(-1, index.shape[dim])  # (everything else, n)
    return rows[0] if bool((rows == rows[:1]).all()) else None


def _shared_positions(value: Any) -> torch.Tensor | None:
    """(n,) integer positions on the CPU when every batch row has the same ones; None otherwise (or on meta)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.is_meta
        or value.is_floating_point()
        or value.dim() > 2
        or value.dtype == torch.bool
        or not value.numel()
    ):
        return None
    rows = value.reshape(-1, value.shape[-1]) if value.dim() else value.reshape(1, 1)
    if not bool((rows == rows[:1]).all()):
        return None  # rows differ (left padding): no single answer for the union over the batch
    return rows[0].detach().to("cpu", torch.long)


class _PositionsSeen:
    """_shared_positions of each integer tensor once while it is unchanged: a model hands the same position ids and
    masks to every block and to each block's attention, so one forward asks about one tensor hundreds of times."""

    def __init__(self):
        self._seen = _Identities()  # tensor -> (its version counter when read, the positions)

    def __call__(self, value: Any) -> torch.Tensor | None:
        if not isinstance(value, torch.Tensor):
            return None
        try:
            version = value._version
        except RuntimeError:  # an inference tensor keeps no version counter: read it each time
            return _shared_positions(value)
        seen = self._seen.get(value)
        if seen is not None and seen[0] == version:
            return seen[1]
        positions = _shared_positions(value)
        self._seen[value] = (version, positions)
        return positions


def _follow_sequences(frame: _Frame, x: torch.Tensor, args: tuple, kwargs: dict) -> None:
    """A module handed a hidden state x and other sequences of its batch and rank (a cross-attention's memory):
    mark each, so that the frame follows what each is computed into (frame.own, frame.others)."""
    others = [
        t
        for t in (*args, *kwargs.values())
        if isinstance(t, torch.Tensor)
        and t is not x
        and t.is_floating_point()
        and t.dim() == x.dim()
        and t.shape[0] == x.shape[0]
    ]
    if others:  # a hidden state and another sequence: follow what each is computed into
        frame.own, frame.others = _Identities(), _Identities()
        frame.own[x] = True
        for t in others:
            frame.others[t] = True


def _module_call(name: str, module: nn.Module, x: torch.Tensor | None, keep: bool) -> ModuleCall:
    """The record of one module call as it starts: its input's shape, and a copy of the input when kept."""
    return ModuleCall(
        name,
        type(module).__name__,
        tuple(x.shape) if x is not None else None,
        None,
        x.detach().clone() if keep and x is not None else None,
    )


@contextmanager
def module_tracking(
    model: nn.Module,
    record: Observation,
    where: list[_Frame],
    keep_inputs_of: Collection[str] = frozenset(),
    from_input: _Identities | None = None,
    tokens: torch.Tensor | None = None,
):
    """Forward hooks on every submodule: keep a stack of running modules (with the positions and key sources their
    forward was handed) and record in/out shapes; the root's input ids go into from_input, where the observer
    follows what is computed from them. The input ids are `tokens` (the ids under test) where the root is handed
    that very tensor under any name (an encoder-decoder's decoder_input_ids, its input_ids a source held fixed);
    else its decoder_input_ids, else its input_ids, else its first tensor."""
    handles = []
    running: dict[str, list[ModuleCall]] = {}  # module name -> its calls whose output has not come yet
    positions_of = _PositionsSeen()

    # Both hooks read a module's arguments and output for fwdcheck (a shape, a dtype, a dim), no op of the model's:
    # the observer's mode is off for those reads. Read through the mode, they were half of the calls an observed
    # forward made to it (786 of 1,552 in one of transformers' GPT-2 small). Finding the tensor is the model's code,
    # though (a model output's `logits` may be a property that computes them), and runs with the mode on.
    def pre(name, reading):
        def hook(module, args, kwargs):
            x = first_tensor(args) if args else first_tensor(kwargs)
            with torch._C.DisableTorchFunction():
                entered(name, reading, module, x, args, kwargs)

        return hook

    def entered(name, reading, module, x, args, kwargs) -> None:
        if not name and from_input is not None:
            given = [*args, *kwargs.values()]
            # an encoder-decoder's decoder_input_ids are the tokens under test, its input_ids the source
            fallback = kwargs.get("decoder_input_ids", kwargs.get("input_ids", x))
            ids = tokens if any(a is tokens for a in given) else fallback
            if isinstance(ids, torch.Tensor):
                from_input[ids] = True
        frame = _frame(name, reading, args, kwargs, from_input, positions_of)
        if name and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 3:
            _follow_sequences(frame, x, args, kwargs)
        where.append(frame)
        call = _module_call(name, module, x, keep=name in keep_inputs_of)
        record.modules.append(call)
        running.setdefault(name, []).append(call)

    def post(name):
        def hook(module, args, kwargs, output):
            y = output_tensor(output) if running.get(name) else None
            with torch._C.DisableTorchFunction():
                completed(name, y)

        return hook

    def completed(name, y: torch.Tensor | None) -> None:
        if where and where[-1].name == name:
            done = where.pop()
            if where:  # the writes of a child (a cache module's update) are its caller's too
                where[-1].writes.extend(done.writes)
        calls = running.get(name)
        if calls:  # the innermost call of this module still waiting for its output
            call = calls.pop()
            call.output_shape = tuple(y.shape) if y is not None else ()
            call.output_dtype = str(y.dtype).removeprefix("torch.") if y is not None else ""
            call.seq = record.tick()

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(name, _reading(module)), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name), with_kwargs=True, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
