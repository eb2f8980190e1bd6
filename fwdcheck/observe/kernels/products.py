"""Eager attention, recognised by what it does, not by its size: a product shaped like q @ k^T (a [.., L, d] @
b [.., d, S] -> [.., L, S], by matmul, bmm, baddbmm or a two-operand einsum) whose result, scaled, masked or biased,
reaches a softmax; the product that then reads the softmax's output is weights @ v. So a KV cache longer than the
prompt, a one-token decode step and an einsum are seen, and a softmax over anything else (a router's [B, T, E]
logits) is not attention. The mask is read off the scores the softmax normalised. Between the product and the
softmax, and from the softmax to weights @ v, the dispatcher passes each tensor's origin on (Observer.origins)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.records import Api, AttentionCall, MatmulCall
from fwdcheck.observe.table import KERNELS

# A score tensor entry this far below its row's maximum gets no weight after the softmax.
SCORE_GAP = 80.0

SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
BADDBMM = {torch.baddbmm, torch.Tensor.baddbmm}  # bias + a @ b: BLOOM's ALiBi scores, GPT-2's upcast path
PRODUCTS = MATMUL | BADDBMM | {torch.einsum}


@dataclass
class _Product:
    """A product shaped like q @ k^T, waiting to learn whether a softmax reads it; a and b in matmul layout."""

    call: MatmulCall
    a: torch.Tensor | None  # dropped once recorded
    b: torch.Tensor | None
    reads_input: bool | None  # q was computed from the input ids
    recorded: bool = False
    cross: bool = False  # k was computed from another sequence than q (Observer.cross)
    keys_read_input: bool | None = None  # k was computed from the input ids
    keys_of_both: bool = (
        False  # k was computed from the module's own input and another sequence (Observer.keys_of_both)
    )


@dataclass
class _Origin:
    """What a tensor was computed from: scores (a q @ k^T product, possibly scaled, masked or biased since) or the
    weights of attention call `call` (a softmax output, possibly cast or dropped out since)."""

    kind: str  # scores | weights
    product: _Product | None = None
    call: int | None = None


@KERNELS.reader(*PRODUCTS)
def read_product(observer: Observer, func, args, kwargs):
    out = func(*args, **kwargs)  # forwards the model's call
    _product(observer, func, args, kwargs, out, observer.module())
    observer.marked(args, kwargs, out)
    return out


@KERNELS.reader(*SOFTMAX)
def read_softmax(observer: Observer, func, args, kwargs):
    out = func(*args, **kwargs)  # forwards the model's call
    observer.marked(args, kwargs, out)
    x = args[0] if args else kwargs["input"]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    origin = observer.origins.get(x)
    if dim is not None and origin is not None and origin.kind == "scores":
        call = _softmax(observer, x, out, dim, observer.module(), origin.product)
        observer.record.attention.append(call)
        observer.origins[out] = _Origin("weights", call=call.index)
    return out


def _product(observer: Observer, func, args, kwargs, out, module: str) -> None:
    operands = _operands(func, args, kwargs)
    if operands is None:
        return
    a, b, equation = operands
    weights = next(
        (i for i, x in enumerate((a, b)) if x in observer.origins and observer.origins[x].kind == "weights"), None
    )
    op = "einsum" if equation else "baddbmm" if func in BADDBMM else "matmul"
    if weights is not None:  # weights @ v
        call = observer.origins[(a, b)[weights]].call
        w, v = (a, b) if weights == 0 else (b, a)
        if equation:
            w, v = _values_layout(equation, a, b, weights) or (w, v)
        keep = observer.keep_tensors
        observer.record.matmuls.append(
            MatmulCall(
                module,
                "values",
                tuple(w.shape),
                tuple(v.shape),
                tuple(out.shape),
                w.detach().clone() if keep else None,
                v.detach().clone() if keep else None,
                observer.record.tick(),
                op,
                call,
            )
        )
        return
    if a.dim() < 3 or b.dim() < 3:
        return  # a projection by a weight matrix, not a product of two per-head tensors
    q, k_t, reads_input = a, b, observer.reads_input(a)
    given_q, given_k = a, b  # the model's own tensors, which what the observer follows knows (not a re-laid copy)
    if equation:
        layout = _scores_layout(equation, a, b)
        if layout is None:
            return
        q, k_t, q_index = layout
        given_q, given_k = (a, b)[q_index], (a, b)[1 - q_index]
        reads_input = observer.reads_input(given_q)
    # Only a softmax reading the result (or something made from it) makes this q @ k^T; until then, a candidate.
    call = MatmulCall(
        module, "scores", tuple(q.shape), tuple(k_t.shape), tuple(out.shape), seq=observer.record.tick(), op=op
    )
    observer.origins[out] = _Origin(
        "scores",
        product=_Product(
            call,
            q,
            k_t,
            reads_input,
            cross=observer.cross(given_q, given_k),
            keys_read_input=observer.reads_input(given_k),
            keys_of_both=observer.keys_of_both(given_k),
        ),
    )


# -- a softmax over scores: the attention call, its mask read off the scores ----------------------------------


def _softmax(
    observer: Observer, scores: torch.Tensor, weights: torch.Tensor, dim: int, module: str, product: _Product
) -> AttentionCall:
    L, S = scores.shape[-2], scores.shape[-1]
    if product.recorded:
        matmul = next(i for i, m in enumerate(observer.record.matmuls) if m is product.call)
    else:  # the q @ k^T product it came from is now known to be one: record it, under its own time
        product.recorded = True
        if observer.keep_tensors:
            assert product.a is not None and product.b is not None  # held until the product is recorded
            product.call.a, product.call.b = product.a.detach().clone(), product.b.detach().clone()
        observer.record.matmuls.append(product.call)
        matmul = len(observer.record.matmuls) - 1
        product.a = product.b = None  # no longer needed: let q and k go with the scores' other users
    index = len(observer.record.attention)
    product.call.call = index
    if scores.is_meta:  # shapes only: no mask can be read, no sum checked, nothing of size L x S allocated
        allowed, empty, error, nonfinite = torch.ones(L, S, dtype=torch.bool, device="meta"), 0, None, 0
    else:
        finite = torch.isfinite(scores)
        row_max = scores.masked_fill(~finite, float("-inf")).amax(-1, keepdim=True)
        may = finite & (scores - row_max > -SCORE_GAP)  # keys that get any weight after normalising over them
        allowed = may.reshape(-1, L, S).any(0)
        empty = int((~finite | (scores <= -1e4)).all(-1).sum())
        sums = weights.detach().float().sum(-1)  # over the key axis; detached: the train cell records gradients
        ok_rows = torch.isfinite(sums)
        error = float((sums[ok_rows] - 1).abs().max()) if ok_rows.any() else float("nan")
        nonfinite = int((~torch.isfinite(weights)).any(-1).sum())
    positions, source, written, cross, held = observer.where_queries(Api.SOFTMAX, module, L, S, product.cross)
    return AttentionCall(
        index=index,
        api=Api.SOFTMAX,
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
        seq=observer.record.tick(),
        dtype=str(weights.dtype).removeprefix("torch."),
        query_positions=positions,
        positions_from=source,
        key_positions=held,
        cross=cross,
        written=written,
        matmul=matmul,
        reads_input=product.reads_input,
        keys_read_input=product.keys_read_input,
        keys_of_both=product.keys_of_both,
        source=observer.model_line(),
    )


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
