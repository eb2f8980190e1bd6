"""modded-nanogpt (the speedrun) style, batched: QK-norm, its half-truncated RoPE, value embeddings, token smearing,
a lm head padded to a multiple of 128.

- RoPE: pairs (i, i + d_h/2) as rotate_half, but only the first quarter of the frequencies turn (1 .. 1/1024); the
  rest are 0 and never rotate.
- Value embeddings: an extra nn.Embedding of the input ids whose width is that of the values (h_kv * d_h = 16), not
  of the model (32), mixed into v of every layer.
- Token smearing: each token's embedding plus a gated copy of its predecessor's, before the first block: no position
  enters attention with the same input as the others, even when every token is the same.
- `min_two_tokens`: the forward asserts T > 1, as training code does whose loss needs a next token.

The model has no config object: the sizes are declared with `dims:`, the vocabulary (96; the logits are 128 wide)
with `vocab_size:`.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus import HEAD_DIM, HEADS, KV_HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH

DIMS = {"d": WIDTH, "h": HEADS, "h_kv": KV_HEADS, "d_h": HEAD_DIM, "d_ff": 4 * WIDTH}


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def next_multiple_of_n(v: int, *, n: int) -> int:
    return next(x for x in range(n, int(v) + 1 + n, n) if x >= v)


class Rotary(nn.Module):
    def __init__(self, dim: int, max_seq_len: int):
        super().__init__()
        # half-truncate RoPE by @YouJiacheng (w/ base freq tuning)
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])  # (d_h/2,)
        t = torch.arange(max_seq_len, dtype=torch.float32)
        theta = torch.einsum("i,j -> ij", t, angular_freq)  # (P, d_h/2)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x_BTHD: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        assert self.cos.size(0) >= x_BTHD.size(-3)
        cos, sin = self.cos[None, : x_BTHD.size(-3), None, :], sign * self.sin[None, : x_BTHD.size(-3), None, :]
        x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)  # (B, T, h, d_h/2) each
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x_BTHD)  # (B, T, h, d_h)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.k = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.rotary = Rotary(head_dim, max_seq_len)
        self.c_proj = nn.Linear(num_heads * head_dim, dim, bias=False)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(q), self.rotary(k)

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q = self.q(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, h, d_h)
        k = self.k(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, h_kv, d_h)
        v = self.v(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = norm(q), norm(k)  # QK norm @Grad62304977
        q, k = self.rotate(q, k)
        if ve is not None:
            v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)  # @KoszarskyB & @Grad62304977
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h or h_kv, T, d_h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, h, T, d_h)
        y = y.transpose(1, 2).contiguous().view(B, T, self.num_heads * self.head_dim)  # (B, T, h * d_h)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())  # ReLU²


class Block(nn.Module):
    def __init__(self, dim: int, max_seq_len: int):
        super().__init__()
        self.attn = CausalSelfAttention(dim, HEADS, KV_HEADS, HEAD_DIM, max_seq_len)
        self.mlp = MLP(dim)

    def forward(self, x, ve):
        x = x + self.attn(norm(x), ve)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        num_layers: int,
        model_dim: int,
        max_seq_len: int,
        value_embeds: bool,
        smear: bool,
        min_two_tokens: bool,
    ):
        super().__init__()
        self.min_two_tokens = min_two_tokens
        self.embed = nn.Embedding(vocab_size, model_dim)
        # value embeddings: one table per layer, as wide as the values (h_kv * d_h), not as the model
        self.value_embeds = (
            nn.ModuleList(nn.Embedding(vocab_size, KV_HEADS * HEAD_DIM) for _ in range(num_layers))
            if value_embeds
            else None
        )
        self.smear_gate = nn.Linear(12, 1, bias=False) if smear else None
        self.blocks = nn.ModuleList(Block(model_dim, max_seq_len) for _ in range(num_layers))
        self.lm_head = nn.Linear(model_dim, next_multiple_of_n(vocab_size, n=128), bias=False)

    def smear(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C): smear each token embedding one position forward, through a gate read off the token."""
        gate = torch.sigmoid(self.smear_gate(x[:, 1:, :12]))  # (B, T-1, 1)
        return torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)  # (B, T, C)

    def forward(self, input_seq: torch.Tensor) -> torch.Tensor:
        B, T = input_seq.shape
        if self.min_two_tokens:
            assert T > 1, "a training sequence needs at least two tokens"
        ve = (
            [value_embed(input_seq) for value_embed in self.value_embeds]
            if self.value_embeds is not None
            else [None] * len(self.blocks)
        )  # (B, T, h_kv * d_h) per layer
        x = self.embed(input_seq)  # (B, T, C)
        if self.smear_gate is not None:
            x = self.smear(x)
        x = norm(x)
        for block, v in zip(self.blocks, ve, strict=True):
            x = block(x, v)
        return self.lm_head(norm(x))  # (B, T, 128): the vocabulary padded to a multiple of 128


def gpt(value_embeds: bool = False, smear: bool = False, min_two_tokens: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(
        VOCAB, LAYERS, WIDTH, MAX_POSITIONS, value_embeds=value_embeds, smear=smear, min_two_tokens=min_two_tokens
    )


# -- planted bugs, each on the built instance --------------------------------------------------------------------------


def _smear_by_roll(self, x):
    """Token smearing written with torch.roll: position 0 is smeared with the LAST token, which wraps around."""
    gate = torch.sigmoid(self.smear_gate(x[..., :12]))  # (B, T, 1)
    return x + gate * torch.roll(x, shifts=1, dims=1)  # (B, T, C)


def _rotate_k_backwards(self, q, k):
    """q rotated by +theta per position, k by -theta: q_m . k_n then depends on m + n, not n - m."""
    return self.rotary(q), self.rotary(k, sign=-1.0)


def gpt_with(bug: str, min_two_tokens: bool = False) -> GPT:
    """The smearing model with one planted bug:
      smear-roll      the smear done with torch.roll (the last token leaks into position 0)
      rope-backwards  k rotated the opposite way to q (found only if rope measures through the smearing)
    min_two_tokens: also assert T > 1, so a check that needs T = 1 cannot hide the leak behind 'the model raised'.
    """
    model = gpt(value_embeds=True, smear=True, min_two_tokens=min_two_tokens)
    if bug == "smear-roll":
        model.smear = MethodType(_smear_by_roll, model)
    elif bug == "rope-backwards":
        for block in model.blocks:
            block.attn.rotate = MethodType(_rotate_k_backwards, block.attn)
    else:
        raise ValueError(f"unknown bug {bug!r}")
    return model


def shifted_logits(model: GPT, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """The rotary tables slid by `offset` rows for one call: every position is read `offset` further on."""
    rotaries = [block.attn.rotary for block in model.blocks]
    tables = [(r.cos, r.sin) for r in rotaries]
    try:
        for r, (cos, sin) in zip(rotaries, tables, strict=True):
            r.cos, r.sin = cos[offset:], sin[offset:]
        return model(input_ids)
    finally:
        for r, (cos, sin) in zip(rotaries, tables, strict=True):
            r.cos, r.sin = cos, sin
