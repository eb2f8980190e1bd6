"""Meta's Llama reference code (llama/model.py), without its inference cache: complex-number RoPE
(`torch.polar` for e^(i m theta), `view_as_complex` to multiply pairs (2i, 2i+1)), grouped-query attention by
`repeat_kv` (expand + reshape), eager attention with an additive triu(-inf, 1) float mask.

The model keeps its sizes in `self.params`, a ModelArgs, not in a `config`: the sizes are declared with `dims:`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus import HEAD_DIM, HEADS, KV_HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH, during_forward, replaced

DIMS = {"d": WIDTH, "h": HEADS, "h_kv": KV_HEADS, "d_h": HEAD_DIM, "d_ff": 96, "V": VOCAB}


@dataclass
class ModelArgs:
    dim: int = WIDTH
    n_layers: int = LAYERS
    n_heads: int = HEADS
    n_kv_heads: int = KV_HEADS
    vocab_size: int = VOCAB
    multiple_of: int = 32  # SwiGLU hidden layer size: a multiple of this (2/3 of 4 * dim = 85 -> 96)
    norm_eps: float = 1e-5
    max_seq_len: int = MAX_POSITIONS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return output.type_as(x) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))  # (dim/2,)
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()  # (end, dim/2)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64 (end, dim/2)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)  # (1, T, 1, dim/2)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))  # (B, T, h, d_h/2) complex
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)  # (B, T, h, d_h)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep)"""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )  # (B, T, h, d_h)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_local_heads = args.n_heads
        self.n_rep = args.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)  # (B, T, h, d_h)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)  # (B, T, h_kv, d_h)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)  # (B, T, h, d_h)
        values = repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)  # (B, h, T, d_h)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)  # (B, h, T, T)
        if mask is not None:
            scores = scores + mask  # (B, h, T, T)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # (B, h, T, d_h)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)  # (B, T, h * d_h)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(dim=args.dim, hidden_dim=4 * args.dim, multiple_of=args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(params) for _ in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(params.dim // params.n_heads, params.max_seq_len * 2)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)  # (B, T, C)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]  # (T, d_h/2) complex
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1).type_as(h)  # (T, T): 0 on and below the diagonal, -inf above
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        h = self.norm(h)
        return self.output(h).float()  # (B, T, V)


def transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs())


# -- planted bug -------------------------------------------------------------------------------------------------------


def _rotate_q_only(xq, xk, freqs_cis):
    """apply_rotary_emb with the key line dropped: xk comes back as it went in."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * reshape_for_broadcast(freqs_cis, xq_)).flatten(3)
    return xq_out.type_as(xq), xk


def transformer_with(bug: str) -> Transformer:
    """Llama with one planted bug: rope-q-only (apply_rotary_emb rotates the queries only)."""
    if bug != "rope-q-only":
        raise ValueError(f"unknown bug {bug!r}")
    model = transformer()
    this_module = sys.modules[__name__]
    return during_forward(model, lambda: replaced(this_module, "apply_rotary_emb", _rotate_q_only))


def shifted_logits(model: Transformer, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """Meta's forward takes the first position as start_pos."""
    return model(input_ids, start_pos=offset)
