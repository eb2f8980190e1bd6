"""A stand-in for xformers.ops.fmha on machines without CUDA: memory_efficient_attention with its real signature,
lowering the bias object to the arguments of xformers' CUTLASS forward op as xformers does
(xformers::efficient_attention_forward_cutlass: custom_mask_type 0 none, 1 causal from the top left, 2 from the bottom
right; window_size; cu_seqlens for block-diagonal biases), that op implemented by a reference computation on any
device. Tensors as xformers lays them out: q (B, M, H, K), k and v (B, N, H, K); block-diagonal: B = 1, the sequences
packed along M and N.

Only what fwdcheck reads is reproduced: no speed, no dropout, no backward of its own, one kernel.
"""

from __future__ import annotations

import math

import torch

from xformers.ops.fmha.attn_bias import (
    AttentionBias,
    BlockDiagonalCausalFromBottomRightMask,
    BlockDiagonalCausalMask,
    BlockDiagonalMask,
    LowerTriangularFromBottomRightLocalAttentionMask,
    LowerTriangularFromBottomRightMask,
    LowerTriangularMask,
)

NO_CUSTOM_MASK, CAUSAL_FROM_TOP_LEFT, CAUSAL_FROM_BOTTOM_RIGHT = 0, 1, 2


def _reference(q, k, v, bias, scale, mask_type, window):
    """One sequence: q (M, H, K), k and v (N, H, K), bias broadcasting to (H, M, N) or None -> (M, H, K)."""
    M, N = q.shape[0], k.shape[0]
    scores = torch.einsum("mhk,nhk->hmn", q.float(), k.float()) * scale  # (H, M, N)
    if bias is not None:
        scores = scores + bias.float()
    own = torch.arange(M)[:, None] + (N - M if mask_type == CAUSAL_FROM_BOTTOM_RIGHT else 0)  # (M, 1)
    slots = torch.arange(N)[None, :]  # (1, N)
    allowed = torch.ones(M, N, dtype=torch.bool)
    if mask_type != NO_CUSTOM_MASK:
        allowed &= slots <= own
    if window is not None and window > 0:
        allowed &= slots > own - window
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)  # (H, M, N)
    return torch.einsum("hmn,nhk->mhk", weights, v.float()).to(q.dtype)


# The op's schema as xformers registers it (csrc/attention/attention.cpp); defined here, since custom_op cannot
# declare keyword-only tensors.
torch.library.define(
    "xformers::efficient_attention_forward_cutlass",
    "(Tensor query, Tensor key, Tensor value, Tensor? bias, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "int? max_seqlen_q, int? max_seqlen_k, float dropout_p, int custom_mask_type, bool compute_log_sumexp=False, *, "
    "float? scale=None, Tensor? seqlen_k=None, int? window_size=None) -> (Tensor output, Tensor logsumexp, "
    "Tensor philox_seed, Tensor philox_offset, SymInt max_seqlen_batch_q, SymInt max_seqlen_batch_k)",
)


@torch.library.impl("xformers::efficient_attention_forward_cutlass", "CompositeExplicitAutograd")
def efficient_attention_forward_cutlass(
    query,
    key,
    value,
    bias,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    custom_mask_type,
    compute_log_sumexp=False,
    *,
    scale=None,
    seqlen_k=None,
    window_size=None,
):
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    out = torch.empty_like(query)
    if cu_seqlens_q is None:
        B, M, H, N = query.shape[0], query.shape[1], query.shape[2], key.shape[1]
        bias = bias.expand(B, H, M, N) if bias is not None else None  # a bias broadcasts to (B, H, M, N)
        for b in range(B):
            row_bias = bias[b] if bias is not None else None
            out[b] = _reference(query[b], key[b], value[b], row_bias, scale, custom_mask_type, window_size)
    else:
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(starts_q) - 1):
            q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
            if seqlen_k is not None:
                k1 = k0 + int(seqlen_k[b])
            out[0, q0:q1] = _reference(
                query[0, q0:q1], key[0, k0:k1], value[0, k0:k1], None, scale, custom_mask_type, window_size
            )
    empty = torch.empty(0)
    return out, empty, empty.clone(), empty.clone(), query.shape[1], key.shape[1]


def _custom_mask_type(attn_bias) -> int:
    if isinstance(attn_bias, (LowerTriangularFromBottomRightMask, BlockDiagonalCausalFromBottomRightMask)):
        return CAUSAL_FROM_BOTTOM_RIGHT
    if isinstance(attn_bias, (LowerTriangularMask, BlockDiagonalCausalMask)):
        return CAUSAL_FROM_TOP_LEFT
    return NO_CUSTOM_MASK


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None):
    """q (B, M, H, K), k and v (B, N, H, K) -> (B, M, H, K). attn_bias: None, an additive tensor broadcasting to
    (B, H, M, N), or one of the bias objects of xformers.ops.fmha.attn_bias."""
    blocks = attn_bias if isinstance(attn_bias, BlockDiagonalMask) else None
    out, *_ = torch.ops.xformers.efficient_attention_forward_cutlass(
        query,
        key,
        value,
        attn_bias if isinstance(attn_bias, torch.Tensor) else None,
        blocks.q_seqinfo.seqstart if blocks else None,
        blocks.k_seqinfo.seqstart if blocks else None,
        blocks.q_seqinfo.max_seqlen if blocks else None,
        blocks.k_seqinfo.max_seqlen if blocks else None,
        p,
        _custom_mask_type(attn_bias),
        False,
        scale=scale,
        seqlen_k=None,
        window_size=getattr(attn_bias, "_window_size", None),
    )
    return out if output_dtype is None else out.to(output_dtype)


__all__ = [
    "AttentionBias",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularMask",
    "memory_efficient_attention",
]
