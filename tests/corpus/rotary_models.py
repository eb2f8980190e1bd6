"""rotary-embedding-torch (lucidrains' `RotaryEmbedding`) inside a small GPT written here, the way its README shows:
queries and keys as (B, h, T, d_h), each through `rotate_queries_or_keys`, then SDPA with is_causal=True.

The library pairs dims (2i, 2i+1) and rotates the whole head (dim = d_h) at base 10000. Its default seq_dim is -2, the
axis T of (B, h, T, d_h): handing it (B, T, h, d_h) turns the heads instead of the positions, a bug below.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType

import torch
import torch.nn as nn
import torch.nn.functional as F
from rotary_embedding_torch import RotaryEmbedding

from tests.corpus import FF, HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH


@dataclass
class Config:  # nanoGPT's field names
    vocab_size: int = VOCAB
    n_embd: int = WIDTH
    n_head: int = HEADS
    n_layer: int = LAYERS
    n_inner: int = FF
    block_size: int = MAX_POSITIONS


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.rotary = RotaryEmbedding(dim=self.head_dim)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, h, T, d_h), rotated to positions offset .. offset + T - 1."""
        rotate = self.rotary.rotate_queries_or_keys
        return rotate(q, offset=offset), rotate(k, offset=offset)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, h, T, d_h)
        q, k = self.rotate(q, k, offset)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, d_h)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, cfg.n_inner), nn.GELU(), nn.Linear(cfg.n_inner, cfg.n_embd))

    def forward(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), offset)
        return x + self.mlp(self.ln_2(x))


class RotaryGPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """offset: the position of the first token (the library's own argument, used when decoding with a cache)."""
        x = self.wte(input_ids)  # (B, T, C)
        for block in self.h:
            x = block(x, offset)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def gpt() -> RotaryGPT:
    torch.manual_seed(0)
    return RotaryGPT(Config())


# -- planted bugs, each replacing `rotate` on the built attention instances --------------------------------------------


def _rotate_q_only(self, q, k, offset):
    return self.rotary.rotate_queries_or_keys(q, offset=offset), k


def _rotate_k_other_pairing(self, q, k, offset):
    """q through the library (pairs 2i, 2i+1); k through a hand-written rotate_half (pairs i, i + d_h/2) at the
    library's own frequencies."""
    T = k.shape[-2]
    freqs = self.rotary(torch.arange(offset, offset + T, device=k.device, dtype=torch.float32))  # (T, d_h): f0 f0 f1 f1
    freqs = torch.cat((freqs[:, 0::2], freqs[:, 0::2]), dim=-1)  # (T, d_h): f0 f1 .. f0 f1 ..
    k1, k2 = k.chunk(2, dim=-1)
    k_rotated = k * freqs.cos() + torch.cat((-k2, k1), dim=-1) * freqs.sin()
    return self.rotary.rotate_queries_or_keys(q, offset=offset), k_rotated.type(k.dtype)


def _rotate_heads(self, q, k, offset):
    """Rotation applied before the heads were moved forward: q, k as (B, T, h, d_h), so the library's seq_dim -2 is the
    heads axis, and each head is turned by its index while positions are not turned at all."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, T, h, d_h), the layout before transpose(1, 2)
    q, k = self.rotary.rotate_queries_or_keys(q, offset=offset), self.rotary.rotate_queries_or_keys(k, offset=offset)
    return q.transpose(1, 2), k.transpose(1, 2)  # (B, h, T, d_h)


def gpt_with(bug: str) -> RotaryGPT:
    """The model with one planted bug: rope-q-only, rope-pairing (k rotate_half), rope-heads-axis (wrong seq_dim)."""
    rotate = {"rope-q-only": _rotate_q_only, "rope-pairing": _rotate_k_other_pairing, "rope-heads-axis": _rotate_heads}[
        bug
    ]
    model = gpt()
    for block in model.h:
        block.attn.rotate = MethodType(rotate, block.attn)
    return model


def shifted_logits(model: RotaryGPT, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    return model(input_ids, offset=offset)
