"""The observation pass: see every attention call as the model makes it.

A torch function mode intercepts `scaled_dot_product_attention`, `multi_head_attention_forward`, eager attention and
functional dropout; forward hooks on every submodule say which module was running, what shapes went in and out, and
which positions (`input_pos`, `cache_position`, `position_ids`) and key sources it was handed. Each attention call is
reduced on the spot to the set of keys each query may read, whatever the mask's encoding, so checks compare one thing:
that set, [L queries, S keys], with the position of every query on the key axis when it can be known.

Eager attention is recognised by what it does, not by its size: a product shaped like q @ k^T (a [.., L, d] @
b [.., d, S] -> [.., L, S], by matmul, bmm, baddbmm or a two-operand einsum) whose result, scaled, masked or biased,
reaches a softmax; the product that then reads the softmax's output is weights @ v. So a KV cache longer than the
prompt, a one-token decode step and an einsum are seen, and a softmax over anything else (a router's [B, T, E]
logits) is not attention. What is computed from the model's input ids is followed the same way, op by op, so that
attention over another sequence (an encoder over a fixed source) is told from attention over the tokens under test.

Each attention call (and each dropout live in eval) also records the line of model code that made it, the first frame
beyond torch, so that a finding about the call points at that line rather than at the class around it.

A mode changes code paths (torch's TransformerEncoder fast path turns itself off under one), so behavioural checks
never run under it: they run the model untouched and use this pass only for what they cannot see from the outside.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
import weakref
from collections.abc import Callable, Collection
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# A float mask entry at or below this adds so much negative score that the key gets no weight: it is masked.
# (exp(-100) underflows to 0 in float32 next to any real score.) Entries of -inf are masked of course.
MASKED_BELOW = -100.0
# A score tensor entry this far below its row's maximum gets no weight after the softmax.
SCORE_GAP = 80.0

SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
BADDBMM = {torch.baddbmm, torch.Tensor.baddbmm}  # bias + a @ b: BLOOM's ALiBi scores, GPT-2's upcast path
PRODUCTS = MATMUL | BADDBMM | {torch.einsum}

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

_SDPA_SIGNATURE = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value")]
    + [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
        for n, d in (
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)

try:  # torch's causal masks for SDPA, aligned top left or bottom right (torch 2.3 on)
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:
    CausalBias = CausalVariant = None  # type: ignore[assignment,misc]

# flex_attention, eager or compiled, ends in one higher-order operator call that a torch function mode sees with the
# kernel's own arguments: (query, key, value, score_mod, block_mask.as_tuple(), scale, kernel_options, buffers...).
# Reading it there, rather than tracing the kernel's inside, leaves its compilation alone. None where torch has none.
try:
    from torch._higher_order_ops.flex_attention import flex_attention as FLEX_ATTENTION
    from torch.nn.attention.flex_attention import create_mask as _flex_create_mask
    from torch.nn.attention.flex_attention import noop_mask as _flex_noop_mask
except ImportError:  # torch before 2.5
    FLEX_ATTENTION = None  # type: ignore[assignment]

# Walking out from an attention call, frames of torch (its wrappers, nn.MultiheadAttention, nn.TransformerEncoder) and
# of this observer are passed over: the first frame beyond them is the line of model code that made the call. A frame
# of fwdcheck's own there (the session running the forward) means no model code made it: the model is torch's own.
# fwdcheck's reference transformer is model code like any other.
_TORCH = str(Path(torch.__file__).parent) + os.sep
_FWDCHECK = str(Path(__file__).parents[1]) + os.sep
_REFERENCE_MODEL = str(Path(__file__).parents[1] / "model" / "reference.py")


@dataclass
class AttentionCall:
    """One attention computation, reduced to what checks need: L queries over S keys."""

    index: int
    api: str  # sdpa | mha | softmax
    module: str  # the innermost module that was running
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...] | None
    value_shape: tuple[int, ...] | None
    weights_shape: tuple[int, ...]  # [B, h, L, S] (implied for SDPA and MHA, observed for softmax)
    mask_kind: str  # none | bool | float | is_causal | scores (eager: read off the softmax input)
    mask_shape: tuple[int, ...] | None
    mask_values: str  # a short description of the mask's values
    is_causal: bool
    dropout_p: float
    allowed: torch.Tensor  # (L, S) bool: True where at least one batch row and head may read the key (meta: no values)
    empty_rows: int  # (batch, head, query) rows in which every key is masked
    float_01: bool = False  # a float mask made only of 0 and 1: added to the scores it masks nothing
    softmax_dim: int | None = None  # eager: the dim the softmax normalised, counted from the end (-1 = keys)
    row_sum_error: float | None = None  # eager: max |sum over the key axis - 1| of the weights (None on meta)
    nonfinite_rows: int = 0  # eager: weight rows containing NaN or Inf
    query: torch.Tensor | None = None  # kept only when asked (rope probe); eager: in the scores' MatmulCall
    key: torch.Tensor | None = None
    seq: int = 0  # when it happened, on the observation's clock
    dtype: str = ""  # of the query
    # Where each query sits on the key axis: key slot j may be read by a causal query i only if j <= query_positions[i].
    # (L,) long on the CPU, or None when it cannot be known. Key slot j holds position j in every cache layout this
    # reads (a preallocated cache indexed by position, or a growing one), so these are the queries' absolute positions
    # whenever a cache is involved; a square call is the sequence against itself, 0..L-1.
    query_positions: torch.Tensor | None = None
    # How query_positions was learned: square | cache_position | input_pos | position_ids (handed to a running
    # module's forward) | bottom-right (S is the number of tokens this module has attended with so far: a growing
    # cache, queries last) | "" (unknown, or cross-attention).
    positions_from: str = ""
    # The position each key slot holds when it is not its index (a ring buffer past its wrap): (S,) long, -1 for a
    # slot not written yet; None when slot j holds position j.
    key_positions: torch.Tensor | None = None
    cross: bool = False  # the keys come from another sequence (encoder memory, context): causality does not apply
    written: int = 0  # query tokens this module has attended with in this pass so far, this call's included
    matmul: int | None = None  # eager: index in Observation.matmuls of the q @ k^T product that made the scores
    # Whether the queries were computed from the forward's input ids (followed op by op from the root module's first
    # input). False for an encoder over a fixed source; None when the input was not followed (no root call seen).
    reads_input: bool | None = None
    # "path:line" of the model code that made the call (eager: the softmax), None when no model code did (a bare
    # nn.TransformerEncoder): what a finding about this call points at.
    source: str | None = None
    # flex_attention: the (query, key) lengths its BlockMask was built for, when they are not the call's own
    mask_lengths: tuple[int, int] | None = None
    # Why the mask could not be read, when it could not (a mask_mod that raised when fwdcheck evaluated it): the call
    # is then not judged, rather than judged on a guess.
    unread: str | None = None

    @property
    def query_len(self) -> int:
        return self.weights_shape[-2]

    @property
    def key_len(self) -> int:
        return self.weights_shape[-1]

    @property
    def self_attention(self) -> bool:
        """The sequence against itself: square and keys from the queries' own sequence."""
        return self.query_len == self.key_len and not self.cross


@dataclass
class MatmulCall:
    module: str
    kind: str  # scores (q @ k^T, before the softmax) | values (weights @ v, after it)
    a_shape: tuple[int, ...]  # in matmul layout: scores q [.., L, d_h]; values weights [.., L, S]
    b_shape: tuple[int, ...]  # scores k^T [.., d_h, S]; values v [.., S, d_h]
    out_shape: tuple[int, ...]
    a: torch.Tensor | None = None  # kept only when asked, in the layout of a_shape
    b: torch.Tensor | None = None
    seq: int = 0
    op: str = "matmul"  # matmul | einsum | baddbmm; an einsum's operands are recorded permuted to matmul layout
    call: int | None = None  # index in Observation.attention of the attention call this product belongs to


@dataclass
class DropoutCall:
    module: str
    p: float
    training: bool
    source: str | None = None  # "path:line" of the model code that made a live call (training=True, p > 0)


@dataclass
class ModuleCall:
    name: str  # dotted path, "" for the root
    cls: str
    input_shape: tuple[int, ...] | None
    output_shape: tuple[int, ...] | None
    input_value: torch.Tensor | None = None  # kept only for the modules named in keep_inputs_of
    seq: int = 0  # when its output was produced
    output_dtype: str = ""


@dataclass
class Observation:
    seq_len: int  # of the ids the pass ran on; attention is recognised by structure, whatever its L and S
    attention: list[AttentionCall] = field(default_factory=list)
    matmuls: list[MatmulCall] = field(default_factory=list)
    dropouts: list[DropoutCall] = field(default_factory=list)
    modules: list[ModuleCall] = field(default_factory=list)
    clock: int = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    @property
    def active_dropout(self) -> list[tuple[str, str | None]]:
        """Where dropout was still live although the model was in eval mode: (module and call, "file:line")."""
        spots = [
            (f"{c.module or 'model'} ({c.api}, dropout_p={c.dropout_p:g})", c.source)
            for c in self.attention
            if c.dropout_p
        ]
        spots += [
            (f"{d.module or 'model'} (F.dropout p={d.p:g}, training=True)", d.source)
            for d in self.dropouts
            if d.training and d.p > 0
        ]
        return spots


PROJECTED = "projected"  # a stream mark: made by an op with a parameter since the module was entered


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


@dataclass
class _Product:
    """A product shaped like q @ k^T, waiting to learn whether a softmax reads it; a and b in matmul layout."""

    call: MatmulCall
    a: torch.Tensor | None  # dropped once recorded
    b: torch.Tensor | None
    reads_input: bool | None  # q was computed from the input ids
    recorded: bool = False
    cross: bool = False  # k was computed from another sequence than q (_Observer._cross)


@dataclass
class _Origin:
    """What a tensor was computed from: scores (a q @ k^T product, possibly scaled, masked or biased since) or the
    weights of attention call `call` (a softmax output, possibly cast or dropped out since)."""

    kind: str  # scores | weights
    product: _Product | None = None
    call: int | None = None


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


class _Observer(TorchFunctionMode):
    def __init__(
        self, record: Observation, where: list[_Frame], keep_tensors: bool, zero_dropout: bool, from_input: _Identities
    ):
        super().__init__()
        self.record, self.where, self.keep_tensors, self.zero_dropout = record, where, keep_tensors, zero_dropout
        self.origins = _Identities()  # tensor -> _Origin, for tensors on the way from q @ k^T to weights @ v
        self.from_input = from_input  # tensor -> True, for tensors computed from the forward's input ids
        self.written: dict[tuple[str, str], int] = {}  # (module, api) -> query tokens attended with so far
        self.lines: dict[tuple[str, int], str] = {}  # (file, line) of a call site -> its code_location
        # per cache (a view's base) -> axis -> the position each slot holds (-1: none), None once unknown
        self.held = _Identities()
        # The few functions the observer reads; every other op only passes on what it learned about its inputs.
        self.readers: dict[Any, Any] = {
            F.scaled_dot_product_attention: self._on_sdpa,
            F.multi_head_attention_forward: self._on_mha,
            F.dropout: self._on_dropout,
            **dict.fromkeys(WRITES, self._on_write),
            **dict.fromkeys(PRODUCTS, self._on_product),
            **dict.fromkeys(SOFTMAX, self._on_softmax),
        }
        if FLEX_ATTENTION is not None:
            self.readers[FLEX_ATTENTION] = self._on_flex
        # Custom ops of attention libraries, by name (whichever is installed registers its own): their masks are
        # declared by their arguments.
        self.kernels = {
            "flash_attn::_flash_attn_forward": self._on_flash,
            "flash_attn::_flash_attn_varlen_forward": self._on_flash_varlen,
            "xformers::efficient_attention_forward_cutlass": self._on_xformers,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Runs for every op of the forward: an op the observer does not read costs one dict lookup, and passing on
        # what its inputs were (computed from the ids; scores or weights) one identity lookup per tensor argument.
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # torch.compile traces the function modes it runs under: it compiles the op itself, not this observer
            # (whose bookkeeping it cannot trace, and a fullgraph compile such as flex_attention's would fail on it).
            return func(*args, **kwargs)
        reader = self.readers.get(func)
        if reader is None and (op := _attention_kernel(func)):
            reader = self.kernels.get(op, self._on_kernel)
        if reader is not None:
            return reader(func, args, kwargs)
        out = func(*args, **kwargs)
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

    def _module(self) -> str:
        """The innermost module running."""
        return self.where[-1].name if self.where else ""

    def _on_sdpa(self, func, args, kwargs):
        bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
        self.record.attention.append(self._sdpa(bound.arguments, self._module()))
        if self.zero_dropout:
            bound.arguments["dropout_p"] = 0.0
            args, kwargs = (), dict(bound.arguments)
        return self._plain(func, args, kwargs)

    def _on_flex(self, func, args, kwargs):
        self.record.attention.append(self._flex(args, kwargs, self._module()))
        return self._plain(func, args, kwargs)

    def _on_flash(self, func, args, kwargs):
        """flash-attn's kernel: q (B, L, h, d), k and v (B, S, h_kv, d), its mask declared by causal and the window,
        both aligned to the bottom right (the queries are the last L of the S keys)."""
        a = dict(zip(FLASH_ARGS, args, strict=False), **kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        L, S = q.shape[1], k.shape[1]
        allowed, described = _flash_band(L, S, bool(a["causal"]), a, q.device)
        self._record_fused(
            "flash", func, q, k, v, MaskRead(allowed, "declared", described), (q.shape[0], q.shape[2]), a
        )
        return self._plain(func, args, kwargs)

    def _on_flash_varlen(self, func, args, kwargs):
        """flash-attn's variable-length kernel: sequences packed along one axis, q (total_q, h, d) and k
        (total_k, h_kv, d); sequence b holds queries cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys
        cu_seqlens_k[b]:cu_seqlens_k[b+1], and reads no other sequence's keys; within it, causal and the window
        are aligned to the bottom right."""
        a = dict(zip(FLASH_VARLEN_ARGS, args, strict=False), **kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        starts_q, starts_k = a["cu_seqlens_q"].tolist(), a["cu_seqlens_k"].tolist()
        allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
        described = ""
        for (q0, q1), (k0, k1) in zip(itertools.pairwise(starts_q), itertools.pairwise(starts_k), strict=False):
            allowed[q0:q1, k0:k1], described = _flash_band(q1 - q0, k1 - k0, bool(a["causal"]), a, q.device)
        described += f", cu_seqlens_q {_short(starts_q)}, cu_seqlens_k {_short(starts_k)}"
        q4, k4, v4 = q[None], k[None], v[None]  # one packed row: (1, total, h, d)
        self._record_fused(
            "flash", func, q4, k4, v4, MaskRead(allowed, "declared", described), (q.shape[1],), a, (q, k)
        )
        return self._plain(func, args, kwargs)

    def _on_xformers(self, func, args, kwargs):
        """xformers' memory_efficient_attention kernel, q (B, M, h, d), k and v (B, N, h_kv, d), its attn_bias object
        lowered to arguments: custom_mask_type (0 none, 1 causal aligned top left, 2 bottom right), window_size (each
        query's own key and the window_size - 1 before it), sequences packed along one axis by cu_seqlens_q /
        cu_seqlens_k (B = 1; seqlen_k: the keys each sequence really holds), and an additive bias tensor on top."""
        a = dict(zip(XFORMERS_ARGS, args, strict=False), **kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        L, S = q.shape[1], k.shape[1]
        mask_type, window = int(a["custom_mask_type"]), a.get("window_size")
        described = f"custom_mask_type={mask_type} ({XFORMERS_MASK_TYPES.get(mask_type, '?')}), window_size={window}"
        if a.get("cu_seqlens_q") is None:
            allowed = _xformers_band(L, S, mask_type, window, q.device)
        else:
            starts_q, starts_k = a["cu_seqlens_q"].tolist(), a["cu_seqlens_k"].tolist()
            held = a["seqlen_k"].tolist() if a.get("seqlen_k") is not None else None
            allowed = torch.zeros(L, S, dtype=torch.bool, device=q.device)
            pairs = zip(itertools.pairwise(starts_q), itertools.pairwise(starts_k), strict=False)
            for b, ((q0, q1), (k0, k1)) in enumerate(pairs):
                keys = held[b] if held is not None else k1 - k0  # padded keys: only the first seqlen_k[b] are held
                allowed[q0:q1, k0 : k0 + keys] = _xformers_band(q1 - q0, keys, mask_type, window, q.device)
            described += f", cu_seqlens_q {_short(starts_q)}, cu_seqlens_k {_short(starts_k)}"
        mask = MaskRead(allowed, "declared", described)
        if a.get("bias") is not None:  # an additive bias tensor (B, h, M, N), read as SDPA's float masks are
            given = _read_mask(a["bias"], true_means_masked=False)
            mask = MaskRead(
                allowed & given.allowed,
                "declared+float",
                f"{described}; bias {given.values}",
                given.float_01,
                given.shape,
            )
        a["causal"] = mask_type != 0
        self._record_fused("xformers", func, q, k, v, mask, (q.shape[0], q.shape[2]), a)
        return self._plain(func, args, kwargs)

    def on_fwd_kvcache(self, kernel, args, kwargs):
        """flash-attn's flash_attn_with_kvcache, which calls its CUDA extension's fwd_kvcache directly (no torch op
        to see): q (B, L, h, d) over a cache k_cache, v_cache (B_cache, S, h_kv, d), into which the kernel first
        writes k and v (B, L_new, h_kv, d) when given, at slots cache_seqlens[b] on. Row b reads the cache row
        cache_batch_idx[b], its slots from cache_leftpad[b] up to seqlen_k = cache_seqlens[b] (+ L_new): its
        queries are the last L of those keys (bottom-right), so query i reads the slots up to cache_seqlens[b] + i
        when the kernel wrote them, and causal and the window are as _flash_band says. Recorded one call per row, as
        each row reads a cache of its own; a paged cache (block_table) is not judged."""
        if torch.compiler.is_compiling():
            return kernel(*args, **kwargs)
        # An extension's kernel: nothing inside it is torch's to see; nor is this bookkeeping, which runs outside a
        # torch function (the observer's own handlers run with the mode set aside).
        with torch._C.DisableTorchFunction():
            return self._kvcache_call(kernel, args, kwargs)

    def _kvcache_call(self, kernel, args, kwargs):
        a = dict(zip(FWD_KVCACHE_ARGS, args, strict=False), **kwargs)
        out = kernel(*args, **kwargs)  # the cache holds the new keys from here on, as the kernel reads it
        q, k_cache, v_cache, new = a["q"], a["k_cache"], a["v_cache"], a.get("k")
        B, L, S = q.shape[0], q.shape[1], k_cache.shape[1]
        a["causal"], a["dropout_p"] = bool(a["causal"]), 0.0
        if a.get("block_table") is not None:
            self._record_fused(
                "flash",
                kernel,
                q,
                k_cache[:B],
                v_cache[:B],
                MaskRead(torch.ones(L, S, dtype=torch.bool, device=q.device), "declared", "paged cache"),
                (B, q.shape[2]),
                a,
                unread="flash_attn_with_kvcache over a paged cache (block_table), whose slots fwdcheck does not map",
            )
            return out
        lengths = _per_row(a.get("cache_seqlens"), B, S)
        rows = _per_row(a.get("cache_batch_idx"), B, None) or list(range(B))
        starts = _per_row(a.get("cache_leftpad"), B, 0)
        added = new.shape[1] if new is not None else 0
        for b in range(B):
            seqlen_k = lengths[b] + added if a.get("cache_seqlens") is not None else S
            allowed = torch.zeros(L, S, dtype=torch.bool, device=q.device)
            allowed[:, :seqlen_k], described = _flash_band(L, seqlen_k, a["causal"], a, q.device)
            allowed[:, : starts[b]] = False
            described += f", cache_seqlens {lengths[b]}" + (f", cache_leftpad {starts[b]}" if starts[b] else "")
            placed = None
            if new is not None and added == L:  # the kernel wrote the row's new keys, its queries' own: they sit there
                placed = (torch.arange(L) + lengths[b], "the kernel's cache write")
            row = rows[b]
            self._record_fused(
                "flash",
                kernel,
                q[b : b + 1],
                k_cache[row : row + 1],
                v_cache[row : row + 1],
                MaskRead(allowed, "declared", described),
                (1, q.shape[2]),
                a,
                placed=placed,
            )
        return out

    def not_seen(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """An attention function of transformers' registry (_registered_attention_seen) that ran and made no call the
        observer reads (its own kernel): recorded by its name as not judged, q, k, v (B, h, T, d) as it got them."""
        L, S = q.shape[-2], k.shape[-2]
        everything = torch.ones(L, S, dtype=torch.bool, device=q.device)  # what it reads is not known: nothing judged
        self.record.attention.append(
            self._call(
                "kernel",
                self._module(),
                q,
                k,
                v,
                batch_heads=(q.shape[0], q.shape[1]),
                mask=MaskRead(everything, "declared", f"{name}: computed where fwdcheck does not see"),
                is_causal=False,
                dropout=0.0,
                cross=self._cross(q, k),
                reads_input=self._reads_input(q),
                unread=f"{name}, an attention function of transformers' registry whose computation makes no call "
                "fwdcheck reads",
            )
        )

    def _record_fused(
        self,
        api: str,
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
        name = _attention_kernel(func) or getattr(func, "__name__", "kernel")
        mask.values = f"{str(name).split('::')[-1]}: {mask.values}"
        self.record.attention.append(
            self._call(
                api,
                self._module(),
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                batch_heads=batch_heads,
                mask=mask,
                is_causal=bool(a["causal"]),
                dropout=float(a.get("dropout_p") or 0.0),
                cross=self._cross(given_q, given_k),
                reads_input=self._reads_input(given_q),
                unread=unread,
                placed=placed,
            )
        )

    def _on_kernel(self, func, args, kwargs):
        """A custom op named for attention that no reader knows: its mask cannot be read from its arguments, so
        the call is recorded as not judged, by its name, never passed over in silence."""
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 3]
        name = _attention_kernel(func)
        if len(tensors) >= 3:
            q, k, v = tensors[:3]
            self.record.attention.append(
                AttentionCall(
                    index=len(self.record.attention),
                    api="kernel",
                    module=self._module(),
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
                    cross=self._cross(q, k),
                    reads_input=self._reads_input(q),
                    source=self._model_line(),
                    unread=f"{name}, a kernel fwdcheck does not know (its mask is in its arguments)",
                )
            )
        return self._plain(func, args, kwargs)

    def _on_mha(self, func, args, kwargs):
        bound = _MHA_SIGNATURE.bind(*args, **kwargs)
        self.record.attention.append(self._mha(bound.arguments, self._module()))
        return self._plain(func, args, kwargs)

    def _on_dropout(self, func, args, kwargs):
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        live = bool(training) and float(p) > 0
        self.record.dropouts.append(
            DropoutCall(self._module(), float(p), bool(training), self._model_line() if live else None)
        )
        if self.zero_dropout and training:
            return args[0] if args else kwargs["input"]
        return self._plain(func, args, kwargs)

    def _on_write(self, func, args, kwargs):
        out = self._plain(func, args, kwargs)
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

    def _on_product(self, func, args, kwargs):
        out = func(*args, **kwargs)
        self._product(func, args, kwargs, out, self._module())
        self._mark_input(args, kwargs, out)
        if self.streams:
            self._follow_streams(args, kwargs, out)
        return out

    def _on_softmax(self, func, args, kwargs):
        out = func(*args, **kwargs)
        self._mark_input(args, kwargs, out)
        if self.streams:
            self._follow_streams(args, kwargs, out)
        x = args[0] if args else kwargs["input"]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        origin = self.origins.get(x)
        if dim is not None and origin is not None and origin.kind == "scores":
            call = self._softmax(x, out, dim, self._module(), origin.product)
            self.record.attention.append(call)
            self.origins[out] = _Origin("weights", call=call.index)
        return out

    def _plain(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if self.from_input or self.origins:
            self._pass_on(args, kwargs, out)
        if self.streams:
            self._follow_streams(args, kwargs, out)
        return out

    def _pass_on(self, args, kwargs, out) -> None:
        self._mark_input(args, kwargs, out)
        if self.origins:
            self._follow(args, kwargs, out)

    def _mark_input(self, args, kwargs, out) -> None:
        """Results computed from the input ids are marked as such too, so that attention over another sequence (an
        encoder over a fixed source) can be told from attention over the tokens under test."""
        marks = self.from_input
        if marks and (marks.holds_any(args) or (kwargs and marks.holds_any(tuple(kwargs.values())))):
            for t in _tensors(out):
                marks[t] = True

    def _model_line(self) -> str | None:
        """'path:line' of the model code making the call being observed: the first frame beyond torch and this
        observer, None when that is fwdcheck running the forward. Each call site is formatted once per observation."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and (
            frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__
        ):
            frame = frame.f_back
        if frame is None:
            return None
        filename = frame.f_code.co_filename
        if filename.startswith(_FWDCHECK) and filename != _REFERENCE_MODEL:
            return None
        site = (filename, frame.f_lineno)
        if site not in self.lines:
            self.lines[site] = code_location(*site)
        return self.lines[site]

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

    def _product(self, func, args, kwargs, out, module: str) -> None:
        operands = _operands(func, args, kwargs)
        if operands is None:
            return
        a, b, equation = operands
        weights = next(
            (i for i, x in enumerate((a, b)) if x in self.origins and self.origins[x].kind == "weights"), None
        )
        op = "einsum" if equation else "baddbmm" if func in BADDBMM else "matmul"
        if weights is not None:  # weights @ v
            call = self.origins[(a, b)[weights]].call
            w, v = (a, b) if weights == 0 else (b, a)
            if equation:
                w, v = _values_layout(equation, a, b, weights) or (w, v)
            keep = self.keep_tensors
            self.record.matmuls.append(
                MatmulCall(
                    module,
                    "values",
                    tuple(w.shape),
                    tuple(v.shape),
                    tuple(out.shape),
                    w.detach().clone() if keep else None,
                    v.detach().clone() if keep else None,
                    self.record.tick(),
                    op,
                    call,
                )
            )
            return
        if a.dim() < 3 or b.dim() < 3:
            return  # a projection by a weight matrix, not a product of two per-head tensors
        q, k_t, reads_input = a, b, self._reads_input(a)
        if equation:
            layout = _scores_layout(equation, a, b)
            if layout is None:
                return
            q, k_t, q_index = layout
            reads_input = self._reads_input((a, b)[q_index])
        # Only a softmax reading the result (or something made from it) makes this q @ k^T; until then, a candidate.
        call = MatmulCall(
            module, "scores", tuple(q.shape), tuple(k_t.shape), tuple(out.shape), seq=self.record.tick(), op=op
        )
        self.origins[out] = _Origin("scores", product=_Product(call, q, k_t, reads_input, cross=self._cross(q, k_t)))

    # -- one reducer per API ----------------------------------------------------------------------------------------

    def _sdpa(self, a: dict, module: str) -> AttentionCall:
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        L, S = q.shape[-2], k.shape[-2]
        is_causal = bool(a.get("is_causal", False))
        read = MaskRead(torch.ones(L, S, dtype=torch.bool, device=q.device), "is_causal" if is_causal else "none")
        if is_causal:
            read.allowed = read.allowed.tril()  # SDPA's is_causal is aligned to the top left, also when L != S
        if isinstance(mask, CausalBias):
            read = read.combined(_read_causal_bias(mask, L, S, q.device))
        elif mask is not None:
            read = read.combined(_read_mask(mask, true_means_masked=False))
        return self._call(
            "sdpa",
            module,
            q,
            k,
            v,
            batch_heads=tuple(q.shape[:-2]),
            mask=read,
            is_causal=is_causal,
            dropout=float(a.get("dropout_p", 0.0) or 0.0),
            cross=self._cross(q, k),
            reads_input=self._reads_input(q),
        )

    def _flex(self, args: tuple, kwargs: dict, module: str) -> AttentionCall:
        names = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options", "score_buffers")
        a = dict(zip(names, args, strict=False), **kwargs)
        a.setdefault("mask_mod_other_buffers", args[8] if len(args) > 8 else ())
        q, k, v = a["query"], a["key"], a["value"]  # (B, Hq, L, E), (B, Hkv, S, E): GQA repeats the key heads
        read, lengths, unread = _read_flex(
            q,
            k,
            a.get("score_mod"),
            tuple(a["block_mask"]),
            tuple(a.get("score_mod_other_buffers", a.get("score_buffers", ())) or ()),
            tuple(a["mask_mod_other_buffers"] or ()),
        )
        return self._call(
            "flex",
            module,
            q,
            k,
            v,
            batch_heads=tuple(q.shape[:-2]),
            mask=read,
            is_causal=False,
            dropout=0.0,
            cross=self._cross(q, k),
            reads_input=self._reads_input(q),
            mask_lengths=lengths if lengths != (q.shape[-2], k.shape[-2]) else None,
            unread=unread,
        )

    def _mha(self, a: dict, module: str) -> AttentionCall:
        q, k, v = a["query"], a["key"], a["value"]
        batched = q.dim() == 3
        L, S = q.shape[0], k.shape[0]  # the functional form is sequence-first: (L, N, E)
        N, h = (q.shape[1] if batched else 1), int(a["num_heads"])
        mask, padding = a.get("attn_mask"), a.get("key_padding_mask")
        is_causal, need_weights = bool(a.get("is_causal", False)), bool(a.get("need_weights", True))
        read = MaskRead(torch.ones(L, S, dtype=torch.bool, device=q.device))
        # is_causal is only a hint here; it replaces the mask exactly when torch takes the SDPA path without one.
        if is_causal and padding is None and not need_weights:
            read = MaskRead(read.allowed.tril(), "is_causal", shape=tuple(mask.shape) if mask is not None else None)
        elif mask is not None:
            given = _read_mask(mask, true_means_masked=True)
            if given.allowed.dim() == 3:  # (N*h, L, S)
                given.allowed = given.allowed.view(N, h, L, S)
            read = read.combined(given)
        if padding is not None:
            pads = _read_mask(padding, true_means_masked=True)
            pads.allowed = pads.allowed.view(N, 1, 1, S)
            read = read.combined(pads, joined=True)
        dropout = float(a.get("dropout_p", 0.0) or 0.0) if a.get("training", True) else 0.0
        # nn.MultiheadAttention hands its own inputs on: self-attention passes one tensor as query, key and value
        # (it keeps that identity through its batch_first transpose), cross-attention passes the memory as key.
        return self._call(
            "mha",
            module,
            q,
            k,
            v,
            batch_heads=(N, h),
            mask=read,
            is_causal=is_causal,
            dropout=dropout,
            cross=k is not q,
            reads_input=self._reads_input(q),
        )

    def _softmax(
        self, scores: torch.Tensor, weights: torch.Tensor, dim: int, module: str, product: _Product
    ) -> AttentionCall:
        L, S = scores.shape[-2], scores.shape[-1]
        if product.recorded:
            matmul = next(i for i, m in enumerate(self.record.matmuls) if m is product.call)
        else:  # the q @ k^T product it came from is now known to be one: record it, under its own time
            product.recorded = True
            if self.keep_tensors:
                assert product.a is not None and product.b is not None  # held until the product is recorded
                product.call.a, product.call.b = product.a.detach().clone(), product.b.detach().clone()
            self.record.matmuls.append(product.call)
            matmul = len(self.record.matmuls) - 1
            product.a = product.b = None  # no longer needed: let q and k go with the scores' other users
        index = len(self.record.attention)
        product.call.call = index
        if scores.is_meta:  # shapes only: no mask can be read, no sum checked, nothing of size L x S allocated
            allowed, empty, error, nonfinite = torch.ones(L, S, dtype=torch.bool, device="meta"), 0, None, 0
        else:
            finite = torch.isfinite(scores)
            row_max = scores.masked_fill(~finite, float("-inf")).amax(-1, keepdim=True)
            may = finite & (scores - row_max > -SCORE_GAP)  # keys that get any weight after normalising over them
            allowed = may.reshape(-1, L, S).any(0)
            empty = int((~finite | (scores <= -1e4)).all(-1).sum())
            sums = weights.float().sum(-1)  # over the key axis
            ok_rows = torch.isfinite(sums)
            error = float((sums[ok_rows] - 1).abs().max()) if ok_rows.any() else float("nan")
            nonfinite = int((~torch.isfinite(weights)).any(-1).sum())
        positions, source, written, cross, held = self._where_queries("softmax", module, L, S, product.cross)
        return AttentionCall(
            index=index,
            api="softmax",
            module=module,
            query_shape=tuple(scores.shape),
            key_shape=None,
            value_shape=None,
            weights_shape=tuple(weights.shape),
            mask_kind="scores",
            mask_shape=None,
            mask_values="read off the scores (-inf or far below the row maximum)",
            is_causal=False,
            dropout_p=0.0,
            allowed=allowed,
            empty_rows=empty,
            softmax_dim=dim - scores.dim() if dim >= 0 else dim,
            row_sum_error=error,
            nonfinite_rows=nonfinite,
            seq=self.record.tick(),
            dtype=str(weights.dtype).removeprefix("torch."),
            query_positions=positions,
            positions_from=source,
            key_positions=held,
            cross=cross,
            written=written,
            matmul=matmul,
            reads_input=product.reads_input,
            source=self._model_line(),
        )

    def _call(
        self,
        api: str,
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
        mask_lengths: tuple[int, int] | None = None,
        unread: str | None = None,
        placed: tuple[torch.Tensor, str] | None = None,
    ) -> AttentionCall:
        """The record of one SDPA or nn.MultiheadAttention call: q, k, v as the API got them, the (batch, head)
        sizes of its weights, what its mask arguments let each query read, its is_causal and dropout_p, whether
        its keys come from another sequence and whether its queries were computed from the input ids. `placed`:
        the queries' positions on the key axis and how they are known, where the kernel itself wrote their keys."""
        L, S = mask.allowed.shape[-2:]
        positions, source, written, cross, held = self._where_queries(api, module, L, S, cross)
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
            source=self._model_line(),
            mask_lengths=mask_lengths,
            unread=unread,
        )

    # -- where the queries sit on the key axis --------------------------------------------------------------------

    def _reads_input(self, q: torch.Tensor) -> bool | None:
        """Whether q was computed from the input ids; None while no input has been followed."""
        return q in self.from_input if self.from_input else None

    def _cross(self, q: torch.Tensor, k: torch.Tensor) -> bool:
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

    def _where_queries(
        self, api: str, module: str, L: int, S: int, cross: bool
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


def code_location(filename: str, line: int) -> str:
    """'path:line', the path relative to the working directory when under it (as CI annotations want), else as
    given."""
    try:
        path = str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        path = filename
    return f"{path}:{line}"


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


def _empty_rows(allowed: torch.Tensor, batch_heads: tuple[int, ...], L: int) -> int:
    """(batch, head, query) rows with no key left, counted as the attention sees them: masks broadcast over batch
    rows and heads. None can be counted on the meta device."""
    if allowed.is_meta:
        return 0
    empty = ~allowed.any(-1)  # (.., L)
    try:
        return int(empty.expand(*batch_heads, L).sum())
    except RuntimeError:  # a mask of more dimensions than the query's: count it as it is
        return int(empty.sum())


def _operands(func, args, kwargs) -> tuple[torch.Tensor, torch.Tensor, str | None] | None:
    """The two multiplied tensors of a product, and the einsum equation if it is one; None for other forms."""
    if func is torch.einsum:
        equation, rest = args[0], args[1:]
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = tuple(rest[0])
        if not isinstance(equation, str) or len(rest) != 2:
            return None
        a, b = rest
        return (a, b, equation) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else None
    values = list(args) + [kwargs[n] for n in ("input", "other", "mat2", "batch1", "batch2") if n in kwargs]
    a, b = values[1:3] if func in BADDBMM else values[:2]
    return (a, b, None) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else None


def _einsum_labels(equation: str, a: torch.Tensor, b: torch.Tensor) -> tuple[str, str, str] | None:
    """One label per dimension of a, b and the output (ellipsis dimensions as digits, aligned from the right as
    einsum broadcasts them); None for a form read no further (repeated labels, wrong arity)."""
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return None

    def expand(term: str, ndim: int) -> str | None:
        if "..." not in term:
            return term if len(term) == ndim else None
        head, tail = term.split("...")
        n = ndim - len(head) - len(tail)
        return head + "".join(str(i) for i in reversed(range(n))) + tail if 0 <= n <= 10 else None

    la, lb = expand(terms[0], a.dim()), expand(terms[1], b.dim())
    if la is None or lb is None or len(set(la)) < len(la) or len(set(lb)) < len(lb):
        return None
    if not arrow:  # implicit output: broadcast dimensions, then the labels that appear once, sorted
        once = sorted(c for c in set(la + lb) if (la + lb).count(c) == 1 and not c.isdigit())
        output = "".join(sorted({c for c in la + lb if c.isdigit()}, reverse=True)) + "".join(once)
    else:
        n = max(a.dim() - len(terms[0].replace("...", "")), b.dim() - len(terms[1].replace("...", "")), 0)
        output = output.replace("...", "".join(str(i) for i in reversed(range(n))))
    return la, lb, output


def _scores_layout(equation: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """q [.., L, d] and k^T [.., d, S] as views, and which operand is q, when this einsum multiplies like q @ k^T: its
    output ends with one axis of each operand, and exactly one axis (the head dimension) is summed over. None
    otherwise."""
    labels = _einsum_labels(equation, a, b)
    if labels is None or len(labels[2]) < 3:
        return None
    la, lb, out = labels
    first, second = out[-2], out[-1]
    if first in la and first not in lb and second in lb and second not in la:
        q, lq, k, lk = a, la, b, lb
    elif first in lb and first not in la and second in la and second not in lb:
        q, lq, k, lk = b, lb, a, la
    else:
        return None
    summed = (set(la) & set(lb)) - set(out)
    if len(summed) != 1 or not set(la + lb) <= set(out) | summed:
        return None
    d = summed.pop()
    q_order = [c for c in out[:-2] if c in lq] + [first, d]
    k_order = [c for c in out[:-2] if c in lk] + [d, second]
    if len(q_order) != len(lq) or len(k_order) != len(lk):
        return None
    return q.permute(*[lq.index(c) for c in q_order]), k.permute(*[lk.index(c) for c in k_order]), int(q is b)


def _values_layout(
    equation: str, a: torch.Tensor, b: torch.Tensor, weights: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weights [.., L, S] and v [.., S, d] as views of an einsum that reads the weights; None if not of that form."""
    labels = _einsum_labels(equation, a, b)
    if labels is None:
        return None
    la, lb, out = labels
    w, lw, v, lv = (a, la, b, lb) if weights == 0 else (b, lb, a, la)
    summed = (set(lw) & set(lv)) - set(out)
    own_w, own_v = [c for c in lw if c not in lv], [c for c in lv if c not in lw]
    if len(summed) != 1 or len(own_w) != 1 or len(own_v) != 1:
        return None
    s, query, d = summed.pop(), own_w[0], own_v[0]
    w_order = [c for c in out if c in lw and c != query] + [query, s]
    v_order = [c for c in out if c in lv and c != d] + [s, d]
    if len(w_order) != len(lw) or len(v_order) != len(lv):
        return None
    return w.permute(*[lw.index(c) for c in w_order]), v.permute(*[lv.index(c) for c in v_order])


@dataclass
class MaskRead:
    """What an attention call's mask arguments let each query read, in its API's own convention."""

    allowed: torch.Tensor  # bool, broadcasting to (..., L, S): True where a query may read a key (meta: no values)
    kind: str = "none"  # none | is_causal | bool | float, with `+key_padding` for nn.MultiheadAttention's padding mask
    values: str = "-"  # a short description of the mask's values
    float_01: bool = False  # a float mask of only 0 and 1: added to the scores it masks nothing
    shape: tuple[int, ...] | None = None  # of the attn_mask handed over

    def combined(self, other: MaskRead, joined: bool = False) -> MaskRead:
        """Both restrictions at once: `other` replaces this one's description (a mask on top of nothing or of
        is_causal), or with `joined` is added to it (a key padding mask beside an attn_mask)."""
        if not joined:
            return replace(other, allowed=self.allowed & other.allowed)
        return MaskRead(
            self.allowed & other.allowed,
            f"{self.kind}+key_padding",
            f"{self.values}; padding {other.values}",
            self.float_01 or other.float_01,
            self.shape,
        )


def _read_mask(mask: torch.Tensor, true_means_masked: bool) -> MaskRead:
    """A mask tensor read in its API's convention: boolean True means masked out (nn.MultiheadAttention) or may
    attend (SDPA); a float mask is added to the scores, so -inf or very negative drops a key."""
    shape = tuple(mask.shape)
    if mask.is_meta:  # no values: may-attend everywhere, itself on the meta device (nothing allocated)
        kind = "bool" if mask.dtype == torch.bool else "float"
        return MaskRead(torch.ones(mask.shape, dtype=torch.bool, device="meta"), kind, "(meta: no values)", shape=shape)
    if mask.dtype == torch.bool:
        share = float(mask.float().mean())
        return MaskRead(~mask if true_means_masked else mask, "bool", f"True on {share:.0%}", shape=shape)
    m = mask.detach().float()
    finite = m[torch.isfinite(m)]
    has_neg_inf = bool(torch.isneginf(m).any())
    distinct = torch.unique(finite)
    if distinct.numel() <= 4:
        shown = ", ".join(f"{x:g}" for x in distinct.tolist()) + (", -inf" if has_neg_inf else "")
        values = "{" + shown + "}"
    else:
        values = f"[{float(finite.min()):.3g}, {float(finite.max()):.3g}]" + (" and -inf" if has_neg_inf else "")
    float_01 = not has_neg_inf and distinct.numel() == 2 and distinct.tolist() == [0.0, 1.0]
    may = torch.isfinite(m) & (m > MASKED_BELOW)  # float masks are added to the scores: -inf / very negative = drop
    return MaskRead(may, "float", values, float_01, shape)


FLASH_ARGS = (
    "query",
    "key",
    "value",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "return_softmax",
)
FLASH_VARLEN_ARGS = ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k") + (
    FLASH_ARGS[3:]
)


def _flash_band(L: int, S: int, causal: bool, a: dict, device: torch.device) -> tuple[torch.Tensor, str]:
    """The (L, S) keys flash-attn lets each query read, and how its arguments said so. Query i sits at key slot
    i + S - L (bottom-right alignment); causal reads no slot after it; window_size (left, right) reads the slots from
    `left` before it to `right` after it, -1 meaning no bound."""
    left, right = int(a.get("window_size_left", -1)), int(a.get("window_size_right", -1))
    own = torch.arange(L, device=device)[:, None] + (S - L)  # (L, 1): each query's own key slot
    slots = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if causal:
        allowed &= slots <= own
    if right >= 0:
        allowed &= slots <= own + right
    if left >= 0:
        allowed &= slots >= own - left
    return allowed, f"causal={causal}, window_size=({left}, {right})"


# flash-attn's CUDA extension fwd_kvcache's arguments in order, as flash_attn_with_kvcache hands them over.
FWD_KVCACHE_ARGS = (
    "q",
    "k_cache",
    "v_cache",
    "k",
    "v",
    "cache_seqlens",
    "rotary_cos",
    "rotary_sin",
    "cache_batch_idx",
    "cache_leftpad",
    "block_table",
    "alibi_slopes",
    "out",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "rotary_interleaved",
    "num_splits",
)
# The names flash-attn's interface module gives its CUDA extension (flash_attn_gpu from 2.7, flash_attn_cuda before).
FLASH_EXTENSIONS = ("flash_attn_gpu", "flash_attn_cuda")


def _per_row(value: Any, B: int, default: int | None) -> list[int]:
    """A per-row integer argument (a tensor of B, an int, or None) as B ints; [] when None and no default."""
    if value is None:
        return [] if default is None else [default] * B
    if isinstance(value, int):
        return [value] * B
    return [int(v) for v in value.reshape(-1)[:B].tolist()]


@contextmanager
def _kvcache_seen(observer: _Observer):
    """flash_attn_with_kvcache looks its extension's fwd_kvcache up at call time: while observing, that attribute
    is a wrapper that records the call (on_fwd_kvcache), and it is put back after. Only where flash-attn's
    interface module is already imported: fwdcheck imports no attention library itself."""
    interface = sys.modules.get("flash_attn.flash_attn_interface")
    found = [getattr(interface, name, None) for name in FLASH_EXTENSIONS] if interface is not None else []
    extensions: list[Any] = [e for e in found if e is not None and hasattr(e, "fwd_kvcache")]
    patched = []
    for extension in {id(e): e for e in extensions}.values():
        kernel = extension.fwd_kvcache

        def seen(*args, kernel=kernel, **kwargs):
            return observer.on_fwd_kvcache(kernel, args, kwargs)

        seen.__name__ = "fwd_kvcache"
        extension.fwd_kvcache = seen
        patched.append((extension, kernel))
    try:
        yield
    finally:
        for extension, kernel in patched:
            extension.fwd_kvcache = kernel


@contextmanager
def _registered_attention_seen(observer: _Observer):
    """transformers looks its attention functions up by name at every call (AttentionInterface: its own sdpa, flex
    and flash entries, and any function registered under a name of one's own and chosen by attn_implementation).
    While observing, each is wrapped: one that computes through a call the observer reads (SDPA, flex_attention, a
    flash-attn kernel, a softmax over q @ k^T) is judged by that call; one that ran and made none (its own kernel) is
    recorded by its name as not judged (not_seen), never passed over. Put back as found after. Only where
    transformers is already imported: fwdcheck imports it for no model that does not."""
    utils = sys.modules.get("transformers.modeling_utils")
    registry = getattr(utils, "AttentionInterface", None)
    shared = getattr(utils, "ALL_ATTENTION_FUNCTIONS", None)
    mappings = [m for m in (getattr(registry, "_global_mapping", None), getattr(shared, "_local_mapping", None)) if m]
    originals = [(mapping, name, function) for mapping in mappings for name, function in list(mapping.items())]
    for mapping, name, function in originals:
        mapping[name] = _seen_function(observer, name, function)
    try:
        yield
    finally:
        for mapping, name, function in originals:
            mapping[name] = function


def _seen_function(observer: _Observer, name: str, function):
    @functools.wraps(function)
    def seen(module, query, key, value, *args, **kwargs):
        before = len(observer.record.attention)
        out = function(module, query, key, value, *args, **kwargs)
        if len(observer.record.attention) == before and not torch.compiler.is_compiling():
            with torch._C.DisableTorchFunction():  # bookkeeping, not the model's: outside the observer
                observer.not_seen(name, query, key, value)
        return out

    return seen


# xformers::efficient_attention_forward_cutlass's arguments in order, as xformers registers the op.
XFORMERS_ARGS = (
    "query",
    "key",
    "value",
    "bias",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "custom_mask_type",
    "compute_log_sumexp",
)
XFORMERS_MASK_TYPES = {0: "no causal mask", 1: "causal from the top left", 2: "causal from the bottom right"}


def _xformers_band(L: int, S: int, mask_type: int, window: int | None, device: torch.device) -> torch.Tensor:
    """The (L, S) keys xformers' kernel lets each query read: with custom_mask_type 1 query i sits at key slot i
    (top left, as LowerTriangularMask), with 2 at i + S - L (bottom right, as LowerTriangularFromBottomRightMask);
    causal reads no slot after it, and a window of w reads its own slot and the w - 1 before it."""
    own = torch.arange(L, device=device)[:, None] + (S - L if mask_type == 2 else 0)  # (L, 1): each query's slot
    slots = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if mask_type != 0:
        allowed &= slots <= own
    if window is not None and window > 0:
        allowed &= slots > own - window
    return allowed


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 6 else f"[{', '.join(map(str, values[:5]))}, ...]"


def _attention_kernel(func: Any) -> str | None:
    """The qualified name of a custom op (not one of torch's own) named for attention, called as an overload or as
    its packet (torch.ops.flash_attn._flash_attn_forward): flash_attn::_flash_attn_forward, a library's
    fused_attention. None for any other function."""
    if isinstance(func, torch._ops.OpOverload):
        name = func.name()
    elif isinstance(func, torch._ops.OpOverloadPacket):
        name = func._qualified_op_name
    else:
        return None
    namespace, _, op = name.partition("::")
    if namespace in ("aten", "prims", "prim", "quantized") or not ("attn" in op.lower() or "attention" in op.lower()):
        return None
    return name


def _read_causal_bias(bias: Any, L: int, S: int, device: torch.device) -> MaskRead:
    """torch's own causal masks for SDPA (torch.nn.attention.bias): causal_upper_left aligns the diagonal to the
    top left (query i reads keys 0..i, as is_causal does), causal_lower_right to the bottom right (the last query
    reads every key: the queries are the last L of S, as over a cache)."""
    lower_right = bias.variant == CausalVariant.LOWER_RIGHT
    offset = S - L if lower_right else 0
    allowed = torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=offset)
    name = "causal_lower_right" if lower_right else "causal_upper_left"
    return MaskRead(allowed, name, f"{name}({bias.seq_len_q}, {bias.seq_len_kv})", shape=(L, S))


def _read_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    score_mod: Any,
    block_mask: tuple,
    score_buffers: tuple,
    mask_buffers: tuple,
) -> tuple[MaskRead, tuple[int, int] | None, str | None]:
    """What a flex_attention call lets each query read, exactly: its BlockMask's mask_mod evaluated at every (batch,
    head, query, key) index the call covers (not the block-level view, which rounds to blocks), and its score_mod
    applied to a probe of zero scores, where a score it turns into -inf is masked as surely. Also the (query, key)
    lengths the BlockMask was built for, and why the mask could not be read when it could not.

    block_mask is BlockMask.as_tuple(): its seq_lengths first, its mask_mod last (as flex_attention hands it on)."""
    B, H, L, S = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    mask_mod = block_mask[-1]
    lengths = (block_mask[0], block_mask[1]) if all(isinstance(n, int) for n in block_mask[:2]) else None
    if getattr(mask_mod, "fn", mask_mod) is _flex_noop_mask:
        lengths = None  # no BlockMask handed over: flex_attention's own stand-in, which fits any length
    allowed = torch.ones(1, 1, L, S, dtype=torch.bool, device=q.device)
    if q.is_meta:
        return MaskRead(allowed, "block_mask", "(meta: no values)"), lengths, None
    kinds, values = [], []
    try:
        if getattr(mask_mod, "fn", mask_mod) is not _flex_noop_mask:
            may = _flex_create_mask(
                lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx, *mask_buffers), B, H, L, S, device=q.device
            )
            allowed = allowed & may
            kinds.append("block_mask")
            values.append(f"mask_mod {_callable_name(mask_mod)} True on {float(may.float().mean()):.0%}")
        if score_mod is not None and _callable_name(score_mod) != "_identity":
            kept = _flex_create_mask(
                lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_idx, kv_idx, *score_buffers),
                B,
                H,
                L,
                S,
                device=q.device,
            )
            allowed = allowed & kept
            kinds.append("score_mod")
            values.append(f"score_mod {_callable_name(score_mod)} -inf on {float((~kept).float().mean()):.0%}")
    except Exception as exc:  # the model's own function, evaluated by fwdcheck over the grid: say so, judge nothing
        reason = (
            f"its mask_mod or score_mod raised when evaluated over the call's indices ({type(exc).__name__}: {exc})"
        )
        return MaskRead(allowed, "block_mask", "(not read)"), lengths, reason.splitlines()[0]
    return MaskRead(allowed, "+".join(kinds) or "none", "; ".join(values) or "-"), lengths, None


def _callable_name(function: Any) -> str:
    """How a mask_mod or score_mod is named in a report: its function's name, through torch's wrappers."""
    inner = getattr(function, "fn", function)
    return getattr(inner, "__name__", type(inner).__name__)


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


@contextmanager
def module_tracking(
    model: nn.Module,
    record: Observation,
    where: list[_Frame],
    keep_inputs_of: Collection[str] = frozenset(),
    from_input: _Identities | None = None,
):
    """Forward hooks on every submodule: keep a stack of running modules (with the positions and key sources their
    forward was handed) and record in/out shapes; the root's input ids go into from_input, where the observer
    follows what is computed from them."""
    handles = []
    running: dict[str, list[ModuleCall]] = {}  # module name -> its calls whose output has not come yet
    positions_of = _PositionsSeen()

    def pre(name, reading):
        def hook(module, args, kwargs):
            x = first_tensor(args) if args else first_tensor(kwargs)
            if not name and from_input is not None:
                ids = kwargs.get("input_ids", x)
                if isinstance(ids, torch.Tensor):
                    from_input[ids] = True
            # fwdcheck's own reading of the arguments: no op of the model's, so the observer's mode is off for it
            with torch._C.DisableTorchFunction():
                frame = _frame(name, reading, args, kwargs, from_input, positions_of)
            if name and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 3:
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
            where.append(frame)
            call = ModuleCall(
                name,
                type(module).__name__,
                tuple(x.shape) if x is not None else None,
                None,
                x.detach().clone() if name in keep_inputs_of and x is not None else None,
            )
            record.modules.append(call)
            running.setdefault(name, []).append(call)

        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            if where and where[-1].name == name:
                done = where.pop()
                if where:  # the writes of a child (a cache module's update) are its caller's too
                    where[-1].writes.extend(done.writes)
            calls = running.get(name)
            if calls:  # the innermost call of this module still waiting for its output
                call = calls.pop()
                y = first_tensor(output)
                call.output_shape = tuple(y.shape) if y is not None else ()
                call.output_dtype = str(y.dtype).removeprefix("torch.") if y is not None else ""
                call.seq = record.tick()

        return hook

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(name, _reading(module)), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name), with_kwargs=True, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def observing(
    model: nn.Module,
    seq_len: int,
    keep_tensors: bool = False,
    zero_dropout: bool = False,
    keep_inputs_of: Collection[str] = frozenset(),
):
    """Everything inside runs observed; the Observation fills as it runs and is complete on exit."""
    record = Observation(seq_len=seq_len)
    where: list[_Frame] = []
    from_input = _Identities()
    observer = _Observer(record, where, keep_tensors, zero_dropout, from_input)
    with (
        compiled_eagerly(),
        module_tracking(model, record, where, keep_inputs_of, from_input),
        _kvcache_seen(observer),
        _registered_attention_seen(observer),
        observer,
    ):
        yield record


def compiled_eagerly():
    """torch.compile'd code runs as plain Python inside the block (torch.compiler.set_stance("force_eager"), torch
    2.6 on): the observer then sees inside it, and nothing is compiled while it is active. flex_attention, compiled
    or not, still ends in its one kernel call, which computes its mask's math exactly."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else nullcontext()


class ZeroAttentionDropout(TorchFunctionMode):
    """Forces dropout_p=0 in attention calls and makes functional dropout the identity: for models that apply
    dropout in eval mode, so that a comparison measures the mask and not the dice."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            return func(**bound.arguments)
        if func is F.multi_head_attention_forward:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            return func(**bound.arguments)
        if func is F.dropout:
            return args[0] if args else kwargs["input"]
        return func(*args, **kwargs)
