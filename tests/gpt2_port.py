"""A port of GPT-2 written by hand in nanoGPT's style (model.py, its SDPA path) under names of its own, for
`fwdcheck diff` against transformers' GPT2LMHeadModel (tests/test_diff.py).

What a port changes and a diff must see through: every name (tok_emb for transformer.wte, blocks.N for
transformer.h.N, qkv for c_attn, ...; the rename rules are RENAME), nn.Linear [out, in] where GPT-2's Conv1D holds
[in, out] (square ones too), an activation module called `gelu` where GPT-2 calls it `act`, and no attention-dropout
module (SDPA takes dropout_p). What it may get wrong, one planted change at a time (`bug=`):

    no-scale       attention scores q @ k^T not divided by sqrt(hs): the eager path written out without its scale
    heads-swapped  the first two heads' outputs swapped before the output projection
    post-norm      norm(x + f(x)) instead of x + f(norm(x)) in every block

Shapes use B (batch), T (sequence), C (width), nh (heads), hs (head size).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# A's (GPT2LMHeadModel) parameter and module names -> this port's, in order.
RENAME = [
    r"^transformer\.wte -> tok_emb",
    r"^transformer\.wpe -> pos_emb",
    r"^transformer\.h\.(\d+) -> blocks.\1",
    r"\.ln_1 -> .norm1",
    r"\.ln_2 -> .norm2",
    r"\.attn\.c_attn -> .attn.qkv",
    r"\.attn\.c_proj -> .attn.proj",
    r"\.mlp\.c_fc -> .mlp.fc",
    r"\.mlp\.c_proj -> .mlp.proj",
    r"^transformer\.ln_f -> norm",
    r"^lm_head -> head",
]
BUGS = ("no-scale", "heads-swapped", "post-norm")


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, bug: str | None):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.heads, self.bug = heads, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        nh, hs = self.heads, C // self.heads
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if self.bug == "no-scale":
            att = q @ k.transpose(-2, -1)  # (B, nh, T, T): the 1/sqrt(hs) forgotten
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1) @ v  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        if self.bug == "heads-swapped":
            y = y[:, [1, 0, *range(2, nh)]]  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): the heads side by side again
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()  # exact (erf); GPT-2 itself uses the tanh approximation ("gelu_new")
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gelu(self.fc(x)))  # (B, T, 4C) inside


class Block(nn.Module):
    def __init__(self, width: int, heads: int, bug: str | None):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, bug)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLP(width)
        self.post_norm = bug == "post-norm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_norm:
            x = self.norm1(x + self.attn(x))
            return self.norm2(x + self.mlp(x))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, width: int, layers: int, heads: int, max_positions: int, bug: str | None):
        super().__init__()
        assert bug in (None, *BUGS), f"unknown bug {bug!r}; known: {BUGS}"
        self.max_positions = max_positions
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(max_positions, width)
        self.blocks = nn.ModuleList(Block(width, heads, bug) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied, as GPT-2's

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        assert T <= self.max_positions, f"sequence of {T} tokens, at most {self.max_positions}"
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, V)


def gpt(
    vocab_size: int = 96,
    width: int = 32,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 128,
    bug: str | None = None,
) -> GPT:
    return GPT(vocab_size, width, layers, heads, max_positions, bug)
