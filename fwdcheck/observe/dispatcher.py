"""The dispatcher: the torch function mode of the observation pass. It sees every op the model runs and does three
things with it. An op the kernel table (table.py) has a reader for goes to that reader, which records the attention
call; the dispatcher looks the op up there and names no kernel itself. An op it reads for itself is a functional
dropout (recorded, zeroed when asked) or an in-place write into cache slots (which slots, which positions: where a
later query sits on the key axis). Every other op only passes on what its inputs were: computed from the input ids,
from a module's own input or from another sequence it was handed, scores or weights on their way through eager
attention (origins, read by kernels/products.py).

The readers record through this class's services: `plain` runs an op with what its inputs were passed on,
`attention_call` turns q, k, v and a MaskRead into an AttentionCall (the queries' positions, cross, the model line
filled in), `record_fused` does it for a kernel in the (B, T, h, d) layout. A custom op named for attention that no
reader knows is recorded as not judged, never passed over in silence.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from fwdcheck.observe.dropouts import RANDOM_FORMS, as_in_eval, live
from fwdcheck.observe.frames import POSITION_INPUTS, WRITES, _Frame, _Identities, _slot_write, _SlotWrite
from fwdcheck.observe.locations import model_line
from fwdcheck.observe.masks import MaskRead, _empty_rows
from fwdcheck.observe.records import Api, AttentionCall, DropoutCall, Observation
from fwdcheck.observe.table import KERNELS, Reader

PROJECTED = "projected"  # a stream mark: made by an op with a parameter since the module was entered


class Observer(TorchFunctionMode):
    """The mode itself: what it learned about the tensors of the forward, and the services readers record through."""

    def __init__(
        self, record: Observation, where: list[_Frame], keep_tensors: bool, zero_dropout: bool, from_input: _Identities
    ):
        super().__init__()
        self.record, self.where, self.keep_tensors, self.zero_dropout = record, where, keep_tensors, zero_dropout
        self.origins = _Identities()  # tensor -> what it was computed from on its way from q @ k^T to weights @ v
        self.from_input = from_input  # tensor -> True, for tensors computed from the forward's input ids
        self.written: dict[tuple[str, str], int] = {}  # (module, api) -> query tokens attended with so far
        self.lines: dict[tuple[str, int], str] = {}  # (file, line) of a call site -> its code_location
        # per cache (a view's base) -> axis -> the position each slot holds (-1: none), None once unknown
        self.held = _Identities()
        # The few functions the observer reads (the kernel table's, by function or by custom op name, and its own);
        # every other op only passes on what it learned about its inputs. Read from the table as the pass begins.
        self.readers: dict[Any, Reader] = {
            **KERNELS.readers,
            **dict.fromkeys(RANDOM_FORMS, Observer._on_dropout),
            **dict.fromkeys(WRITES, Observer._on_write),
        }
        self.caller: Any = None  # the frame that made the call a reader is reading: where model_line starts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Runs for every op of the forward: an op the observer does not read costs one dict lookup, and passing on
        # what its inputs were (computed from the ids; scores or weights) one identity lookup per tensor argument.
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # torch.compile traces the function modes it runs under: it compiles the op itself, not this observer
            # (whose bookkeeping it cannot trace, and a fullgraph compile such as flex_attention's would fail on it).
            return func(*args, **kwargs)  # forwards the model's call
        reader = self.readers.get(func)
        if reader is None and (op := _custom_op(func)):
            # Custom ops of attention libraries, by name (whichever is installed registers its own): their masks are
            # declared by their arguments. One named for attention that no reader knows is recorded as not judged.
            reader = self.readers.get(op) or (Observer._on_kernel if _named_for_attention(op) else None)
        if reader is not None:
            caller, self.caller = self.caller, sys._getframe(1)
            try:
                return reader(self, func, args, kwargs)  # forwards the model's call
            finally:
                self.caller = caller
        out = func(*args, **kwargs)  # forwards the model's call
        if self.from_input or self.origins:
            self._pass_on(args, kwargs, out)
        if self.streams:
            self._follow_streams(args, kwargs, out)
        return out

    @property
    def streams(self) -> list[_Frame]:
        """The running modules whose own input and other sequences are being followed."""
        return [f for f in self.where if f.own is not None]

    def _follow_streams(self, args, kwargs, out) -> None:
        """Results computed from a tracked module's own input, or from the other sequences it was handed, are
        marked as such (both, when computed from both); PROJECTED once an op with a parameter (a projection's
        weight) made them, after the module was entered."""
        values = (*args, *kwargs.values())
        projects = any(isinstance(v, nn.Parameter) for v in values)
        for frame in self.streams:
            for marks in (frame.own, frame.others):
                if marks is None or not marks.holds_any(values):
                    continue
                found = [marks.get(t) for v in values for t in _tensors(v)]
                mark = PROJECTED if projects or PROJECTED in found else True
                for t in _tensors(out):
                    marks[t] = mark

    def module(self) -> str:
        """The innermost module running."""
        return self.where[-1].name if self.where else ""

    # -- what the dispatcher reads for itself: unknown kernels, functional dropout, writes into cache slots ----------

    def _on_kernel(self, func, args, kwargs):
        """A custom op named for attention that no reader knows: its mask cannot be read from its arguments, so
        the call is recorded as not judged, by its name, never passed over in silence."""
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 3]
        name = _custom_op(func)
        if len(tensors) >= 3:
            q, k, v = tensors[:3]
            self.record.attention.append(
                AttentionCall(
                    index=len(self.record.attention),
                    api=Api.KERNEL,
                    module=self.module(),
                    query_shape=tuple(q.shape),
                    key_shape=tuple(k.shape),
                    value_shape=tuple(v.shape),
                    weights_shape=(0, 0),
                    mask_kind="declared",
                    mask_shape=None,
                    mask_values=name,
                    is_causal=False,
                    dropout_p=0.0,
                    allowed=torch.ones(0, 0, dtype=torch.bool),
                    empty_rows=0,
                    seq=self.record.tick(),
                    dtype=str(q.dtype).removeprefix("torch."),
                    cross=self.cross(q, k),
                    reads_input=self.reads_input(q),
                    source=self.model_line(),
                    unread=f"{name}, a kernel fwdcheck does not know (its mask is in its arguments)",
                )
            )
        return self.plain(func, args, kwargs)

    def _on_dropout(self, func, args, kwargs):
        """A functional dropout (any form: fwdcheck/observe/dropouts.py): recorded, and when it draws at random,
        with the line that made it; made as in eval when the pass zeroes dropout."""
        drawn = live(func, args, kwargs)
        form = RANDOM_FORMS[func]
        p = drawn[1] if drawn is not None else 0.0
        self.record.dropouts.append(
            DropoutCall(self.module(), p, drawn is not None, self.model_line() if drawn else None, form.name)
        )
        if self.zero_dropout and drawn is not None:
            return as_in_eval(func, args, kwargs)
        return self.plain(func, args, kwargs)

    def _on_write(self, func, args, kwargs):
        out = self.plain(func, args, kwargs)
        write = _slot_write(func, args, kwargs)
        if write is not None and self.where:
            self._place(write)
            self.where[-1].writes.append(write)
        return out

    def _place(self, write: _SlotWrite) -> None:
        """Which positions the write put in its slots, and which position every slot of the axis holds after it.
        An integer tensor handed to a running module that the slots are (kv_write_indices), or are modulo the axis
        (a ring buffer's positions % window), names them; without one, slot j holds position j as long as no slot
        is written twice (a second write to a slot is a ring buffer that nothing here explains)."""
        tables = self.held.get(write.destination)
        if tables is None:
            tables = {}
            self.held[write.destination] = tables
        held = tables.get(write.axis, torch.full((write.size,), -1, dtype=torch.long, device="cpu"))
        positions = self._indexing(write)
        if positions is None and held is not None and not bool((held[write.slots] >= 0).any()):
            positions = write.slots
        if positions is None or held is None:
            tables[write.axis] = None
            return
        held = held.clone()
        held[write.slots] = positions
        tables[write.axis] = held
        write.positions = positions
        filled = held >= 0
        if not torch.equal(held[filled], torch.arange(write.size, device="cpu")[filled]):
            write.held = held

    def _indexing(self, write: _SlotWrite) -> torch.Tensor | None:
        """The positions written, from the integer tensors handed to the running modules (innermost first): the
        one run of n consecutive values of one of them that the slots are, modulo the axis; None when none is, or
        several runs are (a loop writing one position at a time out of all of them)."""
        n, size = len(write.slots), write.size
        for frame in reversed(self.where):
            found = {
                tuple(run.tolist())
                for values in frame.integers
                if len(values) >= n
                for run in values.unfold(0, n, 1)
                if torch.equal(run % size, write.slots)
            }
            if len(found) == 1:
                return torch.tensor(found.pop(), dtype=torch.long, device="cpu")
            if found:
                return None
        return None

    def plain(self, func, args, kwargs):
        """The op run as it would have run, and what its inputs were passed on to its result: what a reader returns
        once it has recorded the call."""
        out = func(*args, **kwargs)  # forwards the model's call
        if self.from_input or self.origins:
            self._pass_on(args, kwargs, out)
        if self.streams:
            self._follow_streams(args, kwargs, out)
        return out

    def _pass_on(self, args, kwargs, out) -> None:
        self._mark_input(args, kwargs, out)
        if self.origins:
            self._follow(args, kwargs, out)

    def marked(self, args, kwargs, out) -> None:
        """What a reader that follows the op's result itself (a q @ k^T product, a softmax) passes on: computed from
        the input ids, from a module's own input or from its other sequences."""
        self._mark_input(args, kwargs, out)
        if self.streams:
            self._follow_streams(args, kwargs, out)

    def _mark_input(self, args, kwargs, out) -> None:
        """Results computed from the input ids are marked as such too, so that attention over another sequence (an
        encoder over a fixed source) can be told from attention over the tokens under test."""
        marks = self.from_input
        if marks and (marks.holds_any(args) or (kwargs and marks.holds_any(tuple(kwargs.values())))):
            for t in _tensors(out):
                marks[t] = True

    def model_line(self) -> str | None:
        """'path:line' of the model code making the call being observed: the first frame beyond torch and this
        observer, walking out from the frame that made the call a reader is reading (a reader registered from
        outside fwdcheck/observe/ is passed over too), or from here for a call made outside the mode (a wrapper's);
        None when that is fwdcheck running the forward. Each call site is formatted once per observation."""
        return model_line(self.caller or sys._getframe(1), self.lines)

    # -- following scores from q @ k^T to the softmax, and weights from the softmax to weights @ v -------------------

    def _follow(self, args, kwargs, out) -> None:
        """An op that keeps the [.., L, S] shape of scores or weights it read (a scale, a mask, a bias, a cast, a
        dropout) passes their origin on to its result."""
        if not self.origins or not isinstance(out, torch.Tensor) or out.dim() < 2 or out in self.origins:
            return
        for x in itertools.chain(args, kwargs.values()):
            if isinstance(x, torch.Tensor) and x in self.origins and x.shape[-2:] == out.shape[-2:]:
                self.origins[out] = self.origins[x]
                return

    # -- the records readers make ---------------------------------------------------------------------------------

    def record_fused(
        self,
        api: Api | str,
        func,
        q,
        k,
        v,
        mask: MaskRead,
        batch_heads,
        a: dict,
        identity=None,
        unread: str | None = None,
        placed: tuple[torch.Tensor, str] | None = None,
    ) -> None:
        """One fused kernel's call (flash-attn, xformers) recorded with q, k, v in SDPA's layout (B, h, T, d), given in
        theirs, (B, T, h, d); `identity`: the tensors as handed over, whose provenance (computed from the input ids,
        from another sequence) the observer knows."""
        given_q, given_k = identity or (q, k)
        name = _custom_op(func) or getattr(func, "__name__", "kernel")
        mask.values = f"{str(name).split('::')[-1]}: {mask.values}"
        self.record.attention.append(
            self.attention_call(
                api,
                self.module(),
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                batch_heads=batch_heads,
                mask=mask,
                is_causal=bool(a["causal"]),
                dropout=float(a.get("dropout_p") or 0.0),
                cross=self.cross(given_q, given_k),
                reads_input=self.reads_input(given_q),
                unread=unread,
                placed=placed,
            )
        )

    def attention_call(
        self,
        api: Api | str,
        module: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        batch_heads: tuple[int, ...],
        mask: MaskRead,
        is_causal: bool,
        dropout: float,
        cross: bool,
        reads_input: bool | None,
        keys_read_input: bool | None = None,
        keys_of_both: bool = False,
        mask_lengths: tuple[int, int] | None = None,
        unread: str | None = None,
        placed: tuple[torch.Tensor, str] | None = None,
    ) -> AttentionCall:
        """The record of one SDPA or nn.MultiheadAttention call: q, k, v as the API got them, the (batch, head)
        sizes of its weights, what its mask arguments let each query read, its is_causal and dropout_p, whether
        its keys come from another sequence and whether its queries were computed from the input ids. `placed`:
        the queries' positions on the key axis and how they are known, where the kernel itself wrote their keys."""
        L, S = mask.allowed.shape[-2:]
        positions, source, written, cross, held = self.where_queries(api, module, L, S, cross)
        if placed is not None and not cross:
            (positions, source), held = placed, None
        keep = self.keep_tensors
        return AttentionCall(
            index=len(self.record.attention),
            api=api,
            module=module,
            query_shape=tuple(q.shape),
            key_shape=tuple(k.shape),
            value_shape=tuple(v.shape),
            weights_shape=(*batch_heads, L, S),
            mask_kind=mask.kind,
            mask_shape=mask.shape,
            mask_values=mask.values,
            is_causal=is_causal,
            dropout_p=dropout,
            allowed=mask.allowed.reshape(-1, L, S).any(0),
            empty_rows=_empty_rows(mask.allowed, batch_heads, L),
            float_01=mask.float_01,
            query=q.detach().clone() if keep else None,
            key=k.detach().clone() if keep else None,
            seq=self.record.tick(),
            dtype=str(q.dtype).removeprefix("torch."),
            query_positions=positions,
            positions_from=source,
            key_positions=held,
            cross=cross,
            written=written,
            reads_input=reads_input,
            keys_read_input=keys_read_input,
            keys_of_both=keys_of_both,
            source=self.model_line(),
            mask_lengths=mask_lengths,
            unread=unread,
        )

    # -- where the queries sit on the key axis --------------------------------------------------------------------

    def reads_input(self, q: torch.Tensor) -> bool | None:
        """Whether q was computed from the input ids; None while no input has been followed."""
        return q in self.from_input if self.from_input else None

    def keys_of_both(self, k: torch.Tensor) -> bool:
        """Whether k was computed from both the innermost followed module's own input and another sequence it was
        handed (its keys and the source's concatenated: a merged self- and cross-attention)."""
        for frame in reversed(self.where):
            if frame.own is not None and frame.others is not None:
                return k in frame.own and k in frame.others
        return False

    def cross(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether the running attention took its keys from another sequence. What k was computed from says so:
        within the innermost module handed its hidden state and other tensors of its rank, q projected from its own
        input and k projected from the others only (a module handed q, k and v as they are, an attention kernel,
        projects nothing and says nothing). Otherwise the innermost module that has a key-source parameter (context,
        encoder_hidden_states, ...) says so; without one, self-attention."""
        for frame in reversed(self.where):
            if frame.own is None or frame.others is None:
                continue
            if frame.own.get(q) == PROJECTED and frame.others.get(k) == PROJECTED and k not in frame.own:
                return True
            if frame.own.get(q) == PROJECTED and frame.own.get(k) == PROJECTED:
                return False
        return next((f.cross for f in reversed(self.where) if f.cross is not None), False)

    def where_queries(
        self, api: Api | str, module: str, L: int, S: int, cross: bool
    ) -> tuple[torch.Tensor | None, str, int, bool, torch.Tensor | None]:
        """(query positions on the key axis, how they were learned, tokens written so far, cross, the position each
        key slot holds when it is not its index)."""
        written = self.written[(module, api)] = self.written.get((module, api), 0) + L
        if cross:
            return None, "", written, True, None
        # Whatever they are called: the positions this module (or one around it) just wrote into L of S key slots;
        # first where the slots are not the positions (a ring buffer past its wrap): nothing else can say so.
        write = self._latest_write(L, S)
        if write is not None and write.held is not None:
            return write.positions, "written slots", written, False, write.held
        if L == S:
            return torch.arange(L, device="cpu"), "square", written, False, None
        # A cache: the slot indices handed to the attention module or to one around it, when they fit this call.
        given = self._given_positions(L, S)
        if given and given[1] != "position_ids":
            return (*given, written, False, None)
        if write is not None:
            return write.positions, "written slots", written, False, None
        # A growing cache holds one key per token written; when S is exactly that, the queries are the last L. This
        # goes before position_ids, which count real tokens only when there is left padding, not cache slots.
        if S == written:
            return torch.arange(S - L, S, device="cpu"), "bottom-right", written, False, None
        if given:
            return (*given, written, False, None)
        return None, "", written, False, None

    def _latest_write(self, L: int, S: int) -> _SlotWrite | None:
        """The latest cache write of L slots along an axis of S made inside a running module (innermost first), when
        it knows the positions it wrote: the queries' positions, and what each of the S slots holds. A latest write
        of unknown positions (a ring buffer nothing explains) says nothing, and no earlier write speaks for it."""
        for frame in reversed(self.where):
            for write in reversed(frame.writes):
                if write.size == S and len(write.slots) == L:
                    return write if write.positions is not None else None
        return None

    def _given_positions(self, L: int, S: int) -> tuple[torch.Tensor, str] | None:
        """The first positions of L queries within the S key slots handed to a running module, innermost first, in
        the order of POSITION_INPUTS."""
        for name in POSITION_INPUTS:
            for frame in reversed(self.where):
                p = frame.positions.get(name)
                if p is not None and len(p) == L and int(p.min()) >= 0 and int(p.max()) < S:
                    return p, name
        return None


def _tensors(value: Any):
    """The tensors of an op's arguments or result: the value itself, or those in a tuple or list (and in the tuples
    and lists in it: torch.cat's sequence among the arguments)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from (t for t in item if isinstance(t, torch.Tensor))


def _custom_op(func: Any) -> str | None:
    """The qualified name of a custom op (not one of torch's own), called as an overload or as its packet
    (torch.ops.flash_attn._flash_attn_forward): flash_attn::_flash_attn_forward. None for any other function."""
    if isinstance(func, torch._ops.OpOverload):
        name = func.name()
    elif isinstance(func, torch._ops.OpOverloadPacket):
        name = func._qualified_op_name
    else:
        return None
    return None if name.partition("::")[0] in ("aten", "prims", "prim", "quantized") else name


def _named_for_attention(name: str) -> bool:
    """A custom op named for attention: flash_attn::_flash_attn_forward, a library's fused_attention."""
    op = name.partition("::")[2].lower()
    return "attn" in op or "attention" in op
