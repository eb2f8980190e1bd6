"""A stand-in for flash-attn on machines without CUDA (the real package needs it to install): its public functions
with their real signatures, calling custom ops registered under flash-attn's own names and argument lists
(flash_attn::_flash_attn_forward, flash_attn::_flash_attn_varlen_forward, as flash-attn >= 2.7 registers them), each
implemented by a reference computation on any device. Tensors are laid out as flash-attn lays them out: q
(B, L, h, d), k and v (B, S, h_kv, d); packed: (total, h, d) with cu_seqlens.

Only what fwdcheck reads is reproduced: the mask the arguments declare, aligned to the bottom right as flash-attn
>= 2.1 aligns it. Not a kernel: no speed, no dropout, no backward of its own.
"""

from __future__ import annotations

import math

import torch

__version__ = "2.7.4.standin"


def _reference(q, k, v, softmax_scale, causal, left, right, offset=0):
    """Attention of one sequence as flash-attn computes it: q (L, h, d), k and v (S, h_kv, d) -> (L, h, d).
    `offset`: the slot of the first key (a cache read from its left pad on); the queries are the last L slots."""
    L, h, d = q.shape
    S, h_kv = k.shape[0], k.shape[1]
    k, v = k.repeat_interleave(h // h_kv, dim=1), v.repeat_interleave(h // h_kv, dim=1)  # (S, h, d)
    scores = torch.einsum("lhd,shd->hls", q.float(), k.float()) * softmax_scale  # (h, L, S)
    own = torch.arange(L)[:, None] + (offset + S - L)  # bottom-right alignment: query i sits at slot i + S - L
    slots = torch.arange(S)[None, :] + offset
    allowed = torch.ones(L, S, dtype=torch.bool)
    if causal:
        allowed &= slots <= own
    if right >= 0:
        allowed &= slots <= own + right
    if left >= 0:
        allowed &= slots >= own - left
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)  # empty rows give 0
    return torch.einsum("hls,shd->lhd", weights, v.float()).to(q.dtype)


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = torch.stack(
        [
            _reference(q[b], k[b], v[b], softmax_scale, causal, window_size_left, window_size_right)
            for b in range(len(q))
        ]
    )
    empty = torch.empty(0)
    return out, empty, empty.clone(), empty.clone()


@torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        out[q0:q1] = _reference(
            q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, causal, window_size_left, window_size_right
        )
    empty = torch.empty(0)
    return out, empty, empty.clone(), empty.clone()


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    softmax_scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    out, *_ = torch.ops.flash_attn._flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes, False
    )
    return out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    softmax_scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    out, *_ = torch.ops.flash_attn._flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size[0],
        window_size[1],
        softcap,
        alibi_slopes,
        False,
        block_table,
    )
    return out


from flash_attn.flash_attn_interface import flash_attn_with_kvcache as flash_attn_with_kvcache  # noqa: E402
