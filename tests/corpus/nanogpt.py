"""nanoGPT (Karpathy) on its non-flash path, as in model.py: a fused c_attn projection, learned absolute positions
(wpe, no rotary), and eager attention masked with a registered `tril` buffer:

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))

Like nanoGPT, forward returns the logits of the last position only unless targets are given: the config names the
adapter `every_position`, which passes targets, as users of fwdcheck do. `padded_vocab_size` pads the embedding and
the lm head lit-style (96 tokens, 128 logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MethodType

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus import HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH


@dataclass
class GPTConfig:
    block_size: int = MAX_POSITIONS
    vocab_size: int = VOCAB
    padded_vocab_size: int | None = None  # rows of wte and lm_head when the vocabulary is padded
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_embd: int = WIDTH
    dropout: float = 0.1  # nanoGPT's fine-tuning value; fwdcheck runs in eval mode
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        # causal mask to ensure that attention is only applied to the left in the input sequence
        T = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """nanoGPT's manual implementation of attention: q, k, v (B, nh, T, hs) -> (B, nh, T, hs)."""
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v  # (B, nh, T, hs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = self.attend(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        rows = config.padded_vocab_size or config.vocab_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(rows, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, rows, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (t,)
        tok_emb = self.transformer.wte(idx)  # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)  # (b, t, rows)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None
        return logits, loss


def every_position(model: GPT, input_ids: torch.Tensor, **_) -> torch.Tensor:
    """Logits [B, T, V] at every position: nanoGPT computes them all only when given targets (here the ids
    themselves; the loss is not used)."""
    logits, _ = model(input_ids, targets=input_ids)
    return logits


def gpt(padded_vocab: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(padded_vocab_size=128 if padded_vocab else None))


# -- planted bugs, each on the built attention instances ---------------------------------------------------------------


def _single_sequence_fast_path(self, q, k, v):
    """A shortcut for one sequence (generation with batch size 1) through SDPA that forgot is_causal=True; batches
    of two or more still take nanoGPT's masked path."""
    if q.size(0) == 1:
        return F.scaled_dot_product_attention(q, k, v)
    return CausalSelfAttention.attend(self, q, k, v)


def gpt_with(bug: str) -> GPT:
    """nanoGPT with one planted bug:
    no-mask      the mask buffer registered as torch.ones (the tril forgotten): masked_fill masks nothing
    block-leak   the buffer built as tril(ones, diagonal=1): position i also reads i + 1
    batch1-leak  batch size 1 takes a 'fast path' without the causal mask
    """
    model = gpt()
    for block in model.transformer.h:
        attention = block.attn
        T = attention.bias.size(-1)
        if bug == "no-mask":
            attention.bias = torch.ones(1, 1, T, T)
        elif bug == "block-leak":
            attention.bias = torch.tril(torch.ones(T, T), diagonal=1).view(1, 1, T, T)
        elif bug == "batch1-leak":
            attention.attend = MethodType(_single_sequence_fast_path, attention)
        else:
            raise ValueError(f"unknown bug {bug!r}")
    return model
