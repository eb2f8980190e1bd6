"""The records of an observation pass: plain data that checks read, filled by the dispatcher (dispatcher.py), the
kernel readers (kernels/) and the module hooks (frames.py). Nothing here computes; `Api` names the attention
functions a call can come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class Api(str, Enum):
    """Which attention function made a call. A str: a record's `api` prints, compares and goes into JSON as the
    plain name it is ("sdpa"), so reports read the same whatever holds it. A kernel read outside fwdcheck names
    its calls with a string of its own."""

    SDPA = "sdpa"  # F.scaled_dot_product_attention
    MHA = "mha"  # F.multi_head_attention_forward (nn.MultiheadAttention, nn.TransformerEncoder)
    SOFTMAX = "softmax"  # eager: a softmax over a q @ k^T product
    FLEX = "flex"  # flex_attention's kernel call
    FLASH = "flash"  # flash-attn's kernels
    XFORMERS = "xformers"  # xformers' memory_efficient_attention kernel
    KERNEL = "kernel"  # an attention kernel or function computed where fwdcheck does not see: not judged

    def __str__(self) -> str:  # "sdpa", not "Api.SDPA", in every Python
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return format(str.__str__(self), spec)


@dataclass
class AttentionCall:
    """One attention computation, reduced to what checks need: L queries over S keys."""

    index: int
    api: Api | str  # an Api member, or the name a kernel read outside fwdcheck gives its calls
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
    # Whether the keys were computed from the input ids (None: not followed, or not told by this API): a
    # cross-attention whose keys are the input's own streams (ProphetNet's n-gram attention) reads no source.
    keys_read_input: bool | None = None
    # Whether the keys were computed both from the attention module's own input and from another sequence it was
    # handed: a decoder's keys and its source's side by side in one call (T5Gemma 2's merged self- and cross-attention).
    keys_of_both: bool = False
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
    api: str = "F.dropout"  # the functional form called (F.alpha_dropout, torch.dropout, ...)


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
            (f"{d.module or 'model'} ({d.api} p={d.p:g}, training=True)", d.source)
            for d in self.dropouts
            if d.training and d.p > 0
        ]
        return spots
