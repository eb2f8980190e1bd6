"""The observation pass: see every attention call as the model makes it.

A torch function mode intercepts `scaled_dot_product_attention`, `multi_head_attention_forward`, softmax over a
[.., T, T] score tensor (eager attention), the matmuls around it and functional dropout; forward hooks on every
submodule say which module was running and what shapes went in and out. Each attention call is reduced on the spot to
the set of keys each query may read, whatever the mask's encoding, so checks compare one thing: that set.

A mode changes code paths (torch's TransformerEncoder fast path turns itself off under one), so behavioural checks
never run under it: they run the model untouched and use this pass only for what they cannot see from the outside.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
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

_SDPA_SIGNATURE = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value")]
    + [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
        for n, d in (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
                     ("enable_gqa", False))
    ]
)
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@dataclass
class AttentionCall:
    """One attention computation, reduced to what checks need."""

    index: int
    api: str  # sdpa | mha | softmax
    module: str  # the innermost module that was running
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...] | None
    value_shape: tuple[int, ...] | None
    weights_shape: tuple[int, ...]  # [B, h, T, S] (implied for SDPA and MHA, observed for softmax)
    mask_kind: str  # none | bool | float | is_causal | scores (eager: read off the softmax input)
    mask_shape: tuple[int, ...] | None
    mask_values: str  # a short description of the mask's values
    is_causal: bool
    dropout_p: float
    allowed: torch.Tensor  # (T, S) bool: True where at least one batch row and head may read the key
    empty_rows: int  # (batch, head, query) rows in which every key is masked
    float_01: bool = False  # a float mask made only of 0 and 1: added to the scores it masks nothing
    softmax_dim: int | None = None  # eager: the dim the softmax normalised, counted from the end (-1 = keys)
    row_sum_error: float | None = None  # eager: max |sum over the key axis - 1| of the weights
    nonfinite_rows: int = 0  # eager: weight rows containing NaN or Inf
    query: torch.Tensor | None = None  # kept only when asked (rope probe)
    key: torch.Tensor | None = None
    seq: int = 0  # when it happened, on the observation's clock
    dtype: str = ""  # of the query

    @property
    def self_attention(self) -> bool:
        return self.allowed.shape[0] == self.allowed.shape[1]


@dataclass
class MatmulCall:
    module: str
    kind: str  # scores (q @ k^T, before the softmax) | values (weights @ v, after it)
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    seq: int = 0


@dataclass
class DropoutCall:
    module: str
    p: float
    training: bool


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
    seq_len: int
    attention: list[AttentionCall] = field(default_factory=list)
    matmuls: list[MatmulCall] = field(default_factory=list)
    dropouts: list[DropoutCall] = field(default_factory=list)
    modules: list[ModuleCall] = field(default_factory=list)
    clock: int = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    @property
    def active_dropout(self) -> list[str]:
        """Where dropout was still live although the model was in eval mode."""
        spots = [f"{c.module or 'model'} ({c.api}, dropout_p={c.dropout_p:g})" for c in self.attention if c.dropout_p]
        spots += [f"{d.module or 'model'} (F.dropout p={d.p:g}, training=True)" for d in self.dropouts
                  if d.training and d.p > 0]
        return spots


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


class _Observer(TorchFunctionMode):
    def __init__(self, record: Observation, where: list[str], keep_tensors: bool, zero_dropout: bool):
        super().__init__()
        self.record, self.where, self.keep_tensors, self.zero_dropout = record, where, keep_tensors, zero_dropout
        self.softmax_pending: set[str] = set()  # modules whose last attention step was a softmax

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        module = self.where[-1] if self.where else ""
        if func is F.scaled_dot_product_attention:
            bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
            self.record.attention.append(self._sdpa(bound.arguments, module))
            if self.zero_dropout:
                bound.arguments["dropout_p"] = 0.0
                args, kwargs = (), dict(bound.arguments)
        elif func is F.multi_head_attention_forward:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            self.record.attention.append(self._mha(bound.arguments, module))
        elif func is F.dropout:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            self.record.dropouts.append(DropoutCall(module, float(p), bool(training)))
            if self.zero_dropout and training:
                return args[0] if args else kwargs["input"]
        elif func in MATMUL:
            out = func(*args, **kwargs)
            a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
            T = self.record.seq_len
            # Order decides, not shape (with T = d_h both products are [.., T, T]): after a softmax comes weights @ v.
            kind = "values" if module in self.softmax_pending and _is_scores(a, T) else \
                "scores" if _is_scores(out, T) else None
            if kind:
                self.softmax_pending.discard(module)
                keep = self.keep_tensors
                self.record.matmuls.append(MatmulCall(module, kind, tuple(a.shape), tuple(b.shape), tuple(out.shape),
                                                      a.detach().clone() if keep else None,
                                                      b.detach().clone() if keep else None, self.record.tick()))
            return out
        elif func in SOFTMAX:
            out = func(*args, **kwargs)
            x = args[0] if args else kwargs["input"]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim is not None and _is_scores(x, self.record.seq_len):
                self.record.attention.append(self._softmax(x, out, dim, module))
                self.softmax_pending.add(module)
            return out
        return func(*args, **kwargs)

    # -- one reducer per API ----------------------------------------------------------------------------------------

    def _sdpa(self, a: dict, module: str) -> AttentionCall:
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        L, S = q.shape[-2], k.shape[-2]
        is_causal = bool(a.get("is_causal", False))
        allowed = torch.ones(L, S, dtype=torch.bool, device=_values_device(q))
        if is_causal:
            allowed = allowed.tril()  # SDPA's is_causal is aligned to the top left
        kind, values, float_01 = ("is_causal" if is_causal else "none"), "-", False
        if mask is not None:
            kind, values, float_01, may = _read_mask(mask, true_means_masked=False)
            allowed = allowed & may
        batch_heads = tuple(q.shape[:-2])
        return self._call("sdpa", module, q, k, v, batch_heads, L, S, allowed, kind, mask, values, float_01,
                          is_causal, float(a.get("dropout_p", 0.0) or 0.0))

    def _mha(self, a: dict, module: str) -> AttentionCall:
        q, k, v = a["query"], a["key"], a["value"]
        batched = q.dim() == 3
        L, S = q.shape[0], k.shape[0]  # the functional form is sequence-first: (L, N, E)
        N, h = (q.shape[1] if batched else 1), int(a["num_heads"])
        mask, padding = a.get("attn_mask"), a.get("key_padding_mask")
        is_causal, need_weights = bool(a.get("is_causal", False)), bool(a.get("need_weights", True))
        allowed = torch.ones(N, h, L, S, dtype=torch.bool, device=_values_device(q))
        kind, values, float_01 = "none", "-", False
        # is_causal is only a hint here; it replaces the mask exactly when torch takes the SDPA path without one.
        if is_causal and padding is None and not need_weights:
            kind, allowed = "is_causal", allowed.tril()
        elif mask is not None:
            kind, values, float_01, may = _read_mask(mask, true_means_masked=True)
            allowed = allowed & (may.view(N, h, L, S) if may.dim() == 3 else may)  # (N*h, L, S) or (L, S)
        if padding is not None:
            _, pad_values, pad_01, pad_may = _read_mask(padding, true_means_masked=True)
            allowed = allowed & pad_may.view(N, 1, 1, S)
            kind, values, float_01 = kind + "+key_padding", f"{values}; padding {pad_values}", float_01 or pad_01
        dropout = float(a.get("dropout_p", 0.0) or 0.0) if a.get("training", True) else 0.0
        return self._call("mha", module, q, k, v, (N, h), L, S, allowed, kind, mask, values, float_01,
                          is_causal, dropout)

    def _softmax(self, scores: torch.Tensor, weights: torch.Tensor, dim: int, module: str) -> AttentionCall:
        L, S = scores.shape[-2], scores.shape[-1]
        if scores.is_meta:  # shapes only: no mask can be read, no sum checked
            scores, weights = torch.zeros(1, L, S), torch.full((1, L, S), 1.0 / S)
        finite = torch.isfinite(scores)
        row_max = scores.masked_fill(~finite, float("-inf")).amax(-1, keepdim=True)
        may = finite & (scores - row_max > -SCORE_GAP)  # keys that get any weight after normalising over them
        empty = int((~finite | (scores <= -1e4)).all(-1).sum())
        sums = weights.float().sum(-1)  # over the key axis
        ok_rows = torch.isfinite(sums)
        error = float((sums[ok_rows] - 1).abs().max()) if ok_rows.any() else float("nan")
        call = AttentionCall(
            index=len(self.record.attention), api="softmax", module=module, query_shape=tuple(scores.shape),
            key_shape=None, value_shape=None, weights_shape=tuple(weights.shape), mask_kind="scores",
            mask_shape=None, mask_values="read off the scores (-inf or far below the row maximum)",
            is_causal=False, dropout_p=0.0, allowed=may.reshape(-1, L, S).any(0), empty_rows=empty,
            softmax_dim=dim - scores.dim() if dim >= 0 else dim, row_sum_error=error,
            nonfinite_rows=int((~torch.isfinite(weights)).any(-1).sum()), seq=self.record.tick(),
            dtype=str(weights.dtype).removeprefix("torch."),
        )
        return call

    def _call(self, api, module, q, k, v, batch_heads, L, S, allowed, kind, mask, values, float_01, is_causal,
              dropout) -> AttentionCall:
        full = allowed.expand(*batch_heads, L, S) if allowed.dim() == 2 else allowed
        empty = int((~full.reshape(-1, L, S).any(-1)).sum()) if allowed.dim() > 2 else \
            int((~allowed.any(-1)).sum()) * math.prod(batch_heads)
        keep = self.keep_tensors
        return AttentionCall(
            index=len(self.record.attention), api=api, module=module, query_shape=tuple(q.shape),
            key_shape=tuple(k.shape), value_shape=tuple(v.shape), weights_shape=(*batch_heads, L, S),
            mask_kind=kind, mask_shape=tuple(mask.shape) if mask is not None else None, mask_values=values,
            is_causal=is_causal, dropout_p=dropout, allowed=allowed.reshape(-1, L, S).any(0), empty_rows=empty,
            float_01=float_01, query=q.detach().clone() if keep else None, key=k.detach().clone() if keep else None,
            seq=self.record.tick(), dtype=str(q.dtype).removeprefix("torch."),
        )


def _is_scores(t: Any, seq_len: int) -> bool:
    """A [.., T, T] tensor of the pass's sequence length: attention scores or weights."""
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-1] == t.shape[-2] == seq_len


def _values_device(t: torch.Tensor) -> torch.device:
    """Where derived masks live: beside the tensors, except for meta tensors, which hold no values to derive from."""
    return torch.device("cpu") if t.is_meta else t.device


def _read_mask(mask: torch.Tensor, true_means_masked: bool) -> tuple[str, str, bool, torch.Tensor]:
    """(kind, values description, is a 0/1 float mask, may-attend bool tensor of the mask's shape)."""
    if mask.is_meta:
        kind = "bool" if mask.dtype == torch.bool else "float"
        return kind, "(meta: no values)", False, torch.ones(mask.shape, dtype=torch.bool)
    if mask.dtype == torch.bool:
        may = ~mask if true_means_masked else mask
        share = float(mask.float().mean())
        return "bool", f"True on {share:.0%}", False, may
    m = mask.detach().float()
    finite = m[torch.isfinite(m)]
    has_neg_inf = bool(torch.isneginf(m).any())
    distinct = torch.unique(finite)
    if distinct.numel() <= 4:
        shown = ", ".join(f"{x:g}" for x in distinct.tolist()) + (", -inf" if has_neg_inf else "")
        values = "{" + shown + "}"
    else:
        values = f"[{float(finite.min()):.3g}, {float(finite.max()):.3g}]" + (" and -inf" if has_neg_inf else "")
    float_01 = (not has_neg_inf and distinct.numel() == 2 and distinct.tolist() == [0.0, 1.0])
    may = torch.isfinite(m) & (m > MASKED_BELOW)  # float masks are added to the scores: -inf / very negative = drop
    return "float", values, float_01, may


@contextmanager
def module_tracking(model: nn.Module, record: Observation, where: list[str], keep_inputs_of: set[str] = frozenset()):
    """Forward hooks on every submodule: keep a stack of running module names and record in/out shapes."""
    handles = []

    def pre(name):
        def hook(module, args, kwargs):
            where.append(name)
            x = first_tensor(args) if args else first_tensor(kwargs)
            record.modules.append(ModuleCall(name, type(module).__name__, tuple(x.shape) if x is not None else None,
                                             None, x.detach().clone() if name in keep_inputs_of and x is not None
                                             else None))
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            if where and where[-1] == name:
                where.pop()
            y = first_tensor(output)
            for call in reversed(record.modules):
                if call.name == name and call.output_shape is None:
                    call.output_shape = tuple(y.shape) if y is not None else ()
                    call.output_dtype = str(y.dtype).removeprefix("torch.") if y is not None else ""
                    call.seq = record.tick()
                    break
        return hook

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name), with_kwargs=True, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def observing(model: nn.Module, seq_len: int, keep_tensors: bool = False, zero_dropout: bool = False,
              keep_inputs_of: set[str] = frozenset()):
    """Everything inside runs observed; the Observation fills as it runs and is complete on exit."""
    record = Observation(seq_len=seq_len)
    where: list[str] = []
    with module_tracking(model, record, where, keep_inputs_of), _Observer(record, where, keep_tensors, zero_dropout):
        yield record


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
