"""The built-in reference transformer: a decoder-only model you can read top to bottom.

It exists for two reasons: it is the model `fwdcheck run sample_configs/toy.yaml` checks out of the box, and it can
plant one real bug at a time (`bugs: [...]`) so every check can be shown failing on the bug it targets. Each planted
bug is written the way it shows up in real model code, at the call site where it usually happens.

Shapes use B (batch), T (sequence), C (d_model), nh (query heads), nkv (key/value heads), hs (head size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from fwdcheck.bugs import BUGS

Positional = Literal["rope", "learned", "none"]
Pairing = Literal["half", "interleaved"]



@dataclass
class RopeConfig:
    base: float = 10000.0
    pairing: Pairing = "half"
    rotary_dim: int | None = None  # None: the whole head; less rotates only the first rotary_dim dims


@dataclass
class ReferenceConfig:
    vocab_size: int = 16
    d_model: int = 8
    n_heads: int = 2
    n_kv_heads: int | None = None  # None: same as n_heads; fewer: grouped-query attention
    n_layers: int = 2
    d_ff: int = 32
    max_seq_len: int = 64
    positional: Positional = "rope"
    rope: RopeConfig = field(default_factory=RopeConfig)
    norm: Literal["pre", "post"] = "pre"
    attention: Literal["sdpa", "eager"] = "sdpa"
    mask: Literal["bool", "float", "is_causal"] = "bool"  # how the causal mask is encoded (all three are correct)
    dropout: float = 0.0
    bias: bool = False
    bugs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.rope, dict):
            self.rope = RopeConfig(**self.rope)
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        unknown = [b for b in self.bugs if b not in BUGS]
        assert not unknown, f"unknown bugs {unknown}; known: {sorted(BUGS)}"
        assert self.d_model % self.n_heads == 0, f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}"
        assert self.n_heads % self.n_kv_heads == 0, (
            f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
        )
        assert self.positional != "rope" or (self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim), (
            f"rope.rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim or self.head_dim


# ---------------------------------------------------------------------------------------------------------------------
# Rotary position embedding (RoFormer section 3), in both pairings real code uses.


def rope_angles(positions: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Angle m * theta_i for each position m and frequency theta_i = base^(-2i/rotary_dim): (..., T, rotary_dim/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    return positions.to(torch.float32)[..., None] * inv_freq


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float, pairing: Pairing, rotary_dim: int) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by its positions (B, T) or (T,); only the first rotary_dim dims of each head turn.

    half (GPT-NeoX, Llama): dim i pairs with dim i + rotary_dim/2.  interleaved (GPT-J, RoFormer): 2i pairs with 2i+1.
    """
    angles = rope_angles(positions, rotary_dim, base)  # (B, T, r/2) or (T, r/2)
    if angles.dim() == 3:
        angles = angles[:, None]  # (B, 1, T, r/2): the same rotation for every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if pairing == "half":
        x1, x2 = rot.chunk(2, dim=-1)  # (B, nh, T, r/2) each
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]  # (B, nh, T, r/2) each
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# The model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout  # attention-probability dropout, handed to SDPA as dropout_p
        self.bugs = set(cfg.bugs)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, offset_given: bool) -> torch.Tensor:
        B, T, C = x.size()
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        if "batch-mix" in self.bugs:
            # (B, T, nh, hs) -> (nh, B, T, hs) -> read back as (B, nh, T, hs): batch and head axes interleave
            q = self.q_proj(x).view(B, T, nh, hs).permute(2, 0, 1, 3).reshape(B, nh, T, hs)
        else:
            q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)

        if self.cfg.positional == "rope":
            q, k = self.rotate(q, k, position_ids, offset_given)

        mask, is_causal = self.causal_mask(T, x.device, q.dtype)
        dropout_p = self.dropout if (self.training or "sdpa-dropout-in-eval" in self.bugs) else 0.0
        if self.cfg.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=nkv != nh
            )  # (B, nh, T, hs)
        else:
            y = self.eager_attention(q, k, v, mask, is_causal, dropout_p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.o_proj(y)

    def rotate(self, q, k, position_ids, offset_given):
        cfg = self.cfg
        rope = dict(base=cfg.rope.base, rotary_dim=cfg.rotary_dim)
        k_positions = position_ids
        if "rope-absolute-offset" in self.bugs and offset_given:
            T = position_ids.shape[-1]
            k_positions = torch.arange(T, device=position_ids.device)  # the offset never reaches the keys
        q_pairing = k_pairing = cfg.rope.pairing
        if "rope-pairing-mismatch" in self.bugs:
            q_pairing, k_pairing = "half", "interleaved"
        q = apply_rope(q, position_ids, pairing=q_pairing, **rope)
        if "rope-k-unrotated" not in self.bugs:
            k = apply_rope(k, k_positions, pairing=k_pairing, **rope)
        return q, k

    def causal_mask(self, T: int, device, dtype) -> tuple[torch.Tensor | None, bool]:
        """The causal mask in the configured encoding, or the planted mistake. Returns (attn_mask, is_causal)."""
        may_attend = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T) True on and below the diagonal
        if "no-causal-mask" in self.bugs:
            return None, False
        if "inverted-bool-mask" in self.bugs:
            return ~may_attend, False  # True = masked out: right for nn.MultiheadAttention, inverted for SDPA
        if "float-mask-01" in self.bugs:
            return may_attend.float().to(dtype), False  # 1 on allowed keys, 0 elsewhere: added, it masks nothing
        if self.cfg.mask == "is_causal":
            return None, True
        if self.cfg.mask == "float":
            zeros = torch.zeros(T, T, dtype=dtype, device=device)
            return zeros.masked_fill(~may_attend, float("-inf")), False  # 0 = keep, -inf = drop
        return may_attend, False

    def eager_attention(self, q, k, v, mask, is_causal, dropout_p):
        """Attention written out: softmax over the keys of (q k^T / sqrt(hs) + mask), then weights @ v."""
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, T, T): query rows, key columns
        T = q.size(-2)
        if is_causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))  # True = may attend
        elif mask is not None:
            scores = scores + mask
        weights = F.softmax(scores, dim=-1)  # normalised over the keys each query reads
        training = self.training or "sdpa-dropout-in-eval" in self.bugs
        weights = F.dropout(weights, p=dropout_p, training=training)
        return weights @ v  # (B, nh, T, hs)


class MLP(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.down(F.gelu(self.up(x))))  # (B, T, d_ff) inside, (B, T, C) out


class Block(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, position_ids, offset_given):
        if self.pre_norm:  # x + f(norm(x))
            x = x + self.resid_dropout(self.attn(self.ln_1(x), position_ids, offset_given))
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.resid_dropout(self.attn(x, position_ids, offset_given)))  # norm(x + f(x))
        return self.ln_2(x + self.mlp(x))


class ReferenceTransformer(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positional == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        # PyTorch's default initialisation: attention scores of order one, so a wrong rotation or a leaked key
        # moves the logits by far more than rounding noise even in an untrained model.
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.size()
        assert T <= self.config.max_seq_len, f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}"
        offset_given = position_ids is not None
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)  # (B, T)
        x = self.wte(input_ids)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)  # (B, T, C)
        x = self.drop(x)
        for block in self.layers:
            x = block(x, position_ids, offset_given)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def build(**fields) -> ReferenceTransformer:
    """Factory: `fwdcheck.reference:build` with the config's fields as keyword arguments."""
    return ReferenceTransformer(ReferenceConfig(**fields))
