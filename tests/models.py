"""Small third-party-style models for testing fwdcheck's verdicts: each one a pattern lifted from real model code.

Every factory returns an nn.Module whose forward takes input_ids [B, T] and returns logits [B, T, V]. Some are
correct (the checks must pass them), some carry one real bug (the checks must catch it). Sizes are tiny on purpose:
vocab 32, width 32, 4 heads of 8, 2 layers.

Shapes use B (batch), T (sequence), C (model width), nh (query heads), nkv (key/value heads), hs (head size).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, LAYERS, MAX_POSITIONS = 32, 32, 4, 2, 64


# =====================================================================================================================
# 1. torch.nn.TransformerEncoder used as a decoder (the PyTorch word-language-model tutorial's pattern)


@dataclass
class EncoderConfig:
    vocab_size: int = VOCAB
    d_model: int = WIDTH
    num_heads: int = HEADS
    dim_feedforward: int = 64
    d_ff: int = 64  # the same, under a name fwdcheck reads
    num_layers: int = LAYERS
    max_seq_len: int = MAX_POSITIONS
    dropout: float = 0.1


class TorchEncoderLM(nn.Module):
    """Embedding + learned positions -> nn.TransformerEncoder(batch_first) -> lm head.

    mask (how the causal mask reaches nn.MultiheadAttention, whose boolean convention is True = masked out):
      float      nn.Transformer.generate_square_subsequent_mask(T): 0 on the past, -inf on the future (correct)
      bool       torch.triu(ones, 1).bool(): True on the future (correct for MultiheadAttention)
      is_causal  the generated mask plus the is_causal=True hint (correct)
      none       no mask at all (bug for a decoder; right for an encoder)
      tril_bool  torch.tril(ones).bool(): SDPA's True = may attend, handed to MultiheadAttention (bug)
    key_padding: also pass src_key_padding_mask (all False: no padding), the input that turns on the nested-tensor
      fast path of nn.TransformerEncoder in eval mode.
    """

    def __init__(self, cfg: EncoderConfig, mask: str, enable_nested_tensor: bool, key_padding: bool):
        super().__init__()
        self.config, self.mask, self.key_padding = cfg, mask, key_padding
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.num_heads, cfg.dim_feedforward, dropout=cfg.dropout, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=enable_nested_tensor)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def causal_mask(self, T: int, device) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for nn.TransformerEncoder."""
        if self.mask == "float":
            return nn.Transformer.generate_square_subsequent_mask(T, device=device), False  # (T, T) 0 / -inf
        if self.mask == "bool":
            return torch.triu(torch.ones(T, T, device=device), diagonal=1).bool(), False  # (T, T) True = future
        if self.mask == "is_causal":
            return nn.Transformer.generate_square_subsequent_mask(T, device=device), True
        if self.mask == "none":
            return None, False
        if self.mask == "tril_bool":
            return torch.tril(torch.ones(T, T, device=device)).bool(), False  # (T, T) True = past and self
        raise ValueError(f"unknown mask {self.mask!r}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.embed(input_ids) + self.pos(positions)  # (B, T, C)
        mask, is_causal = self.causal_mask(T, input_ids.device)
        padding = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device) if self.key_padding else None
        x = self.encoder(x, mask=mask, src_key_padding_mask=padding, is_causal=is_causal)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)


def torch_encoder(mask: str = "float", enable_nested_tensor: bool = True, key_padding: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return TorchEncoderLM(EncoderConfig(), mask, enable_nested_tensor, key_padding)


class MHABlock(nn.Module):
    """Pre-LN block around nn.MultiheadAttention called directly (minGPT-like code that borrows torch's attention)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.num_heads, dropout=cfg.dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x, mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]  # (B, T, C)
        return x + self.mlp(self.ln_2(x))


class MHADecoderLM(nn.Module):
    """Decoder built on nn.MultiheadAttention directly. mask: bool (triu(ones, 1): True = masked, correct) or
    tril_bool (SDPA's True = may attend handed to MultiheadAttention: bug)."""

    def __init__(self, cfg: EncoderConfig, mask: str):
        super().__init__()
        self.config, self.mask = cfg, mask
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(MHABlock(cfg) for _ in range(cfg.num_layers))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(torch.arange(T, device=input_ids.device))  # (B, T, C)
        ones = torch.ones(T, T, dtype=torch.bool, device=input_ids.device)
        mask = torch.triu(ones, diagonal=1) if self.mask == "bool" else torch.tril(ones)  # (T, T)
        for block in self.blocks:
            x = block(x, mask)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)


def torch_mha(mask: str = "bool") -> nn.Module:
    torch.manual_seed(0)
    return MHADecoderLM(EncoderConfig(), mask)


# =====================================================================================================================
# 2-4, 6, 7, 9, 10. nanoGPT skeleton (fused c_attn, learned wpe, pre-LN blocks) with swappable attention


@dataclass
class GPTConfig:  # nanoGPT's field names
    vocab_size: int = VOCAB
    n_embd: int = WIDTH
    n_head: int = HEADS
    n_layer: int = LAYERS
    block_size: int = MAX_POSITIONS
    n_inner: int = 4 * WIDTH  # the MLP width (GPT-2's name for it)
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """nanoGPT: fused qkv projection, heads split with view + transpose, flash attention with is_causal=True."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, nh, T, hs)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        return q, k, v

    def attend(self, q, k, v) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        y = self.attend(*self.heads(x))  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.c_proj(y)


class MissingTransposeAttention(CausalSelfAttention):
    """Bug: heads split with view(B, T, nh, hs) but never transposed, so SDPA gets (B, T, nh, hs) and attends over
    the heads of one position (its axis -2) instead of over positions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs): transpose(1, 2) forgotten
        k = k.view(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs)
        v = v.view(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, T, nh, hs)
        y = y.contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MHAMaskToSDPAAttention(CausalSelfAttention):
    """Bug, the mirror image of tril_bool above: nn.MultiheadAttention's mask (triu(ones, 1), True = masked out)
    handed to SDPA, where True means 'may attend'."""

    def attend(self, q, k, v) -> torch.Tensor:
        T = q.size(-2)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)  # (T, T) True = future
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class SoftmaxOverQueriesAttention(CausalSelfAttention):
    """Bug: eager attention (nanoGPT's non-flash branch) with a correct causal masked_fill but softmax(dim=-2):
    every key column is normalised over the queries that read it, so later queries change earlier weights."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        T = cfg.block_size
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T), persistent=False)

    def attend(self, q, k, v) -> torch.Tensor:
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-2)  # bug: should be dim=-1
        return att @ v  # (B, nh, T, hs)


class SlidingWindowAttention(CausalSelfAttention):
    """Mistral-style local attention: each query reads itself and the window - 1 keys before it (bool, SDPA's
    True = may attend)."""

    window = 3

    def attend(self, q, k, v) -> torch.Tensor:
        T = q.size(-2)
        i = torch.arange(T, device=q.device)[:, None]  # (T, 1) query positions
        j = torch.arange(T, device=q.device)[None, :]  # (1, T) key positions
        may_attend = (j <= i) & (i - j < self.window)  # (T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=may_attend)


class ScaledAttention(CausalSelfAttention):
    """nanoGPT's attention, flash or eager (its non-flash branch), scaled as written (`scaling`: "once"), with q
    multiplied by 1/sqrt(hs) too before a kernel that scales again ("twice", OPT's shipped bug), or with no scale
    anywhere ("none": the eager branch's `* (1.0 / math.sqrt(k.size(-1)))` dropped, SDPA handed scale=1.0)."""

    def __init__(self, cfg: GPTConfig, scaling: str = "once", eager: bool = False):
        super().__init__(cfg)
        self.scaling, self.eager = scaling, eager
        T = cfg.block_size
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T), persistent=False)

    def attend(self, q, k, v) -> torch.Tensor:
        T, hs = q.size(-2), q.size(-1)
        if self.scaling == "twice":
            q = q * (1.0 / math.sqrt(hs))
        if not self.eager:
            scale = 1.0 if self.scaling == "none" else None  # None: SDPA's own 1/sqrt(hs)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        att = q @ k.transpose(-2, -1)  # (B, nh, T, T)
        if self.scaling != "none":
            att = att * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(-8/n), 2^(-16/n), ... (n a power of two)."""
    start = 2 ** (-8 / n_heads)
    return torch.tensor([start ** (h + 1) for h in range(n_heads)])


class AlibiAttention(CausalSelfAttention):
    """ALiBi (BLOOM, MPT): no position embedding; a float bias -slope_h * (i - j) on the past, -inf on the future,
    added to the scores through SDPA's attn_mask."""

    def attend(self, q, k, v) -> torch.Tensor:
        T = q.size(-2)
        i = torch.arange(T, device=q.device)[:, None]  # (T, 1)
        j = torch.arange(T, device=q.device)[None, :]  # (1, T)
        distance = (i - j).to(q.dtype)  # (T, T), >= 0 on the past
        slopes = alibi_slopes(self.n_head).to(q.device, q.dtype)[:, None, None]  # (nh, 1, 1)
        bias = -slopes * distance  # (nh, T, T)
        bias = bias.masked_fill(j > i, float("-inf"))  # the future gets no weight
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])  # mask (1, nh, T, T)


class HFMaskAttention(CausalSelfAttention):
    """Hugging Face style: a 4-D additive mask [B, 1, T, T] built from the padding mask and a causal mask that uses
    torch.finfo(dtype).min instead of -inf; eager=True adds it to the scores by hand (the 'eager' attn
    implementation), eager=False hands it to SDPA (the 'sdpa' one)."""

    def __init__(self, cfg: GPTConfig, eager: bool = False):
        super().__init__(cfg)
        self.eager = eager

    @staticmethod
    def hf_mask(attention_mask: torch.Tensor, dtype) -> torch.Tensor:
        """attention_mask (B, T) of 1 = token, 0 = padding -> additive (B, 1, T, T), 0 keep, finfo.min drop."""
        B, T = attention_mask.shape
        min_value = torch.finfo(dtype).min
        causal = torch.full((T, T), min_value, dtype=dtype, device=attention_mask.device).triu(1)  # (T, T)
        mask = causal[None, None].expand(B, 1, T, T).clone()  # (B, 1, T, T)
        padding = attention_mask[:, None, None, :] == 0  # (B, 1, 1, T) True on padded keys
        return mask.masked_fill(padding, min_value)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=x.device)  # (B, T): no padding
        mask = self.hf_mask(attention_mask, x.dtype)  # (B, 1, T, T)
        q, k, v = self.heads(x)  # (B, nh, T, hs)
        if self.eager:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, T)
            scores = scores + mask
            weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            y = weights @ v  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.n_inner)
        self.c_proj = nn.Linear(cfg.n_inner, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: nn.Module):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = attention
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class BatchMeanBlock(Block):
    """Bug: a BatchNorm-like centring statistic taken over the batch axis inside the block: sample 0's activations
    now depend on sample 1's tokens."""

    def forward(self, x):
        x = x + x.mean(dim=0, keepdim=True)  # (1, T, C) broadcast over the batch: the batch leaks
        return super().forward(x)


class GPT(nn.Module):
    def __init__(
        self,
        cfg: GPTConfig,
        attention: type[nn.Module],
        learned_positions: bool = True,
        block: type[Block] = Block,
        **attention_kwargs,
    ):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if learned_positions else None
        self.h = nn.ModuleList(block(cfg, attention(cfg, **attention_kwargs)) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.size()
        x = self.wte(input_ids)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=input_ids.device))  # (B, T, C) + (T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V): every position, not just the last


def nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), CausalSelfAttention)


def nanogpt_missing_transpose() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), MissingTransposeAttention)


def nanogpt_mha_mask_to_sdpa() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), MHAMaskToSDPAAttention)


def eager_softmax_over_queries() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), SoftmaxOverQueriesAttention)


def sliding_window() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), SlidingWindowAttention)


def nanogpt_scaled(scaling: str = "once", eager: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), ScaledAttention, scaling=scaling, eager=eager)


def alibi() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), AlibiAttention, learned_positions=False)


def hf_finfo_mask(eager: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), HFMaskAttention, eager=eager)


def batch_mean_leak() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(), CausalSelfAttention, block=BatchMeanBlock)


# =====================================================================================================================
# 5. Llama written by hand: RMSNorm, RoPE from a cos/sin cache, GQA via repeat_interleave, SwiGLU, position_ids


@dataclass
class LlamaConfig:  # Hugging Face's field names
    vocab_size: int = VOCAB
    hidden_size: int = WIDTH
    num_attention_heads: int = HEADS
    num_key_value_heads: int = 2
    intermediate_size: int = 64
    num_hidden_layers: int = LAYERS
    max_position_embeddings: int = MAX_POSITIONS
    rope_theta: float = 500000.0
    rope_pairing: str = "half"  # half: Llama's rotate_half; interleaved: GPT-J's rotate_every_two

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin cache for every position up to max_position_embeddings, indexed by position_ids."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.pairing = cfg.rope_pairing
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))  # (hs/2,)
        t = torch.arange(cfg.max_position_embeddings).float()  # (P,)
        freqs = torch.outer(t, inv_freq)  # (P, hs/2)
        # (P, hs): "half" pairs dim i with i + hs/2, else dims 2i and 2i+1; a pair shares a frequency
        emb = torch.cat((freqs, freqs), dim=-1) if self.pairing == "half" else freqs.repeat_interleave(2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cached[position_ids][:, None]  # (B, 1, T, hs): broadcast over heads
        sin = self.sin_cached[position_ids][:, None]
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]  # (..., hs/2) each
    return torch.stack((-x2, x1), dim=-1).flatten(-2)  # (..., hs): (-x1, x0, -x3, x2, ...)


def apply_rotary_pos_emb(q, k, cos, sin, pairing: str):
    rotate = rotate_half if pairing == "half" else rotate_every_two
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.nh, self.nkv, self.hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hs, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hs, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hs, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hs, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, self.cfg.rope_pairing)
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)  # (B, nh, T, hs): each kv head serves a group
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, d_ff) inside


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)  # (B, T)
        cos, sin = self.rotary_emb(position_ids)  # (B, 1, T, hs) each
        x = self.embed_tokens(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, C)
        return self.lm_head(self.norm(x))  # (B, T, V)


def llama(
    pairing: str = "half", rope_theta: float = 500000.0, num_attention_heads: int = HEADS, num_key_value_heads: int = 2
) -> nn.Module:
    torch.manual_seed(0)
    return Llama(
        LlamaConfig(
            rope_theta=rope_theta,
            rope_pairing=pairing,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
        )
    )


# =====================================================================================================================
# 8. A bidirectional BERT-style encoder written by hand (eager attention, no mask, post-LN)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.nh, self.hs = cfg.n_head, cfg.n_embd // cfg.n_head
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.key = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.value = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dense = nn.Linear(cfg.n_embd, cfg.n_embd)

    def split(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.nh, self.hs).permute(0, 2, 1, 3)  # (B, nh, T, hs)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.hs)  # (B, nh, T, T)
        probs = nn.functional.softmax(scores, dim=-1)
        y = torch.matmul(probs, v)  # (B, nh, T, hs)
        y = y.permute(0, 2, 1, 3).contiguous().view(B, T, C)  # (B, T, C)
        return self.dense(y)


class BertLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention = BertSelfAttention(cfg)
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.intermediate = nn.Linear(cfg.n_embd, cfg.n_inner)
        self.output = nn.Linear(cfg.n_inner, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)

    def forward(self, x):
        x = self.ln_1(x + self.attention(x))  # post-LN
        return self.ln_2(x + self.output(F.gelu(self.intermediate(x))))


class BertMLM(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.position_embeddings = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layer))
        self.decoder = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings(torch.arange(T, device=input_ids.device))
        for layer in self.layer:
            x = layer(x)  # (B, T, C)
        return self.decoder(x)  # (B, T, V)


def bert() -> nn.Module:
    torch.manual_seed(0)
    return BertMLM(GPTConfig())


# =====================================================================================================================
# Bugs that live on one code path only: each model is correct on the default call and wrong on one other path.


class PathBugAttention(nn.Module):
    """Causal self-attention whose mask handling depends on how it is called, with one planted path bug."""

    def __init__(self, d: int, n_heads: int, bug: str):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, attention_mask=None, output_attentions=False):
        B, T, C = x.shape
        if "refuses-weights" in self.bug.split(",") and output_attentions:  # not a bug: a path it does not have
            raise NotImplementedError("this attention computes no weights to return; call it without them")
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T) True = may attend
        if attention_mask is None:
            mask = causal
        else:
            padding = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): keys that are real tokens
            mask = padding if self.bug == "mask-drops-causal" else causal & padding
            if "mask-ignored" in self.bug.split(","):
                mask = causal
        if self.bug == "batch1-no-mask" and B == 1:
            mask = None  # a "single sequence" shortcut that forgot the causal mask
        if self.bug == "eager-rescaled" and output_attentions:
            q = q * 1.5  # not a bug: an eager path computing other logits, causal all the same
        if output_attentions:  # the eager fallback used when the weights are asked for
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, h, T, T)
            if mask is not None and self.bug != "eager-no-mask":
                # the dtype's minimum, not -inf, as Hugging Face does: a pad query with no key left stays finite
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            y = torch.softmax(scores, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class PathBugModel(nn.Module):
    def __init__(self, bug: str, vocab: int = 32, d: int = 16, n_heads: int = 2, n_layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(64, d)
        self.layers = nn.ModuleList(PathBugAttention(d, n_heads, bug) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, output_attentions=False):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, d)
        for layer in self.layers:
            x = x + layer(x, attention_mask, output_attentions)
        return self.head(x)  # (B, T, V)


def path_bug(bug: str = "none") -> nn.Module:
    torch.manual_seed(0)
    return PathBugModel(bug)


class AttentionLM(nn.Module):
    """The smallest LM around attention layers of a test's own (width 16, a vocabulary of 32): embed, each layer added
    to the stream, head. `layers` makes them after the embedding, so a model seeded before it draws its weights in
    the same order whichever test builds it."""

    def __init__(self, layers: Callable[[], Iterable[nn.Module]]):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(layers())
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.embed(input_ids)  # (B, T, C)
        for attention in self.layers:
            x = x + attention(x)
        return self.head(x)
