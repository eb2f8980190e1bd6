"""The built-in reference transformer: a decoder-only model you can read top to bottom.

It exists for two reasons: it is the model `fwdcheck run sample_configs/toy.yaml` checks out of the box, and it can
plant one real bug at a time (`bugs: [...]`) so every check can be shown failing on the bug it targets. Each planted
bug is written the way it shows up in real model code, at the call site where it usually happens.

Shapes use B (batch), T (sequence), C (d_model), nh (query heads), nkv (key/value heads), hs (head size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from fwdcheck.config.bugs import BUGS

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
    init_std: float | None = None  # None: PyTorch's default initialisation; a number: GPT-2's normal(0, init_std)
    window: int | None = None  # a sliding window: each query reads itself and the window - 1 keys before it
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

    @property
    def _attn_implementation(self) -> str:
        """The attention path under the name Hugging Face configs give it, so that tools switching implementations
        the Hugging Face way (ReferenceTransformer.set_attn_implementation) can read which one runs."""
        return self.attention


# ---------------------------------------------------------------------------------------------------------------------
# Rotary position embedding (RoFormer section 3), in both pairings real code uses.


def rope_angles(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Angle m * theta_i for each position m and frequency theta_i = base^(-2i/rotary_dim): (..., T, rotary_dim/2).
    Computed in float32 whatever the activations' dtype: bfloat16 holds integers exactly only up to 256."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=dtype, device=positions.device) / rotary_dim))
    return positions.to(dtype)[..., None] * inv_freq


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    base: float,
    pairing: Pairing,
    rotary_dim: int,
    angle_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by its positions (B, T) or (T,); only the first rotary_dim dims of each head turn.

    half (GPT-NeoX, Llama): dim i pairs with dim i + rotary_dim/2.  interleaved (GPT-J, RoFormer): 2i pairs with 2i+1.
    """
    angles = rope_angles(positions, rotary_dim, base, angle_dtype)  # (B, T, r/2) or (T, r/2)
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
# Packed documents: several documents in one row, each read as if it ran alone.


def positions_within_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its own document, (B, T): 0 again at every document's first token."""
    B, T = document_ids.shape
    index = torch.arange(T, device=document_ids.device).expand(B, T)  # (B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # (B, T) True where a document begins
    first = torch.where(starts, index, 0).cummax(dim=1).values  # (B, T) where the token's document begins
    return index - first


def restrict_to_documents(
    mask: torch.Tensor | None, is_causal: bool, same_document: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """The causal mask narrowed to the keys of each query's own document, (B, 1, T, T) in the mask's encoding.
    same_document: (B, T, T), True where query and key belong to one document."""
    T = same_document.shape[-1]
    if mask is None:  # is_causal cannot say "documents", so the causal mask is spelled out
        mask = torch.ones(T, T, dtype=torch.bool, device=same_document.device)
        mask = mask.tril() if is_causal else mask
    if mask.dtype == torch.bool:
        return mask & same_document[:, None], False  # True = may attend
    return mask.masked_fill(~same_document[:, None], float("-inf")), False  # 0 = keep, -inf = drop


# ---------------------------------------------------------------------------------------------------------------------
# The model


class KVCache:
    """What incremental decoding keeps: per layer, the keys (already rotated) and values of every token seen so far,
    each (B, nkv, S, hs), grown along S by update(). The shape of Hugging Face's DynamicCache, without the library."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached in this layer so far."""
        return self.keys[layer_idx].shape[2] if layer_idx < len(self.keys) else 0

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' k, v (B, nkv, T, hs) to the layer's; return all of them, (B, nkv, S, hs)."""
        if layer_idx == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ReferenceConfig, layer_idx: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx  # which of the cache's layers holds this layer's keys and values
        assert cfg.n_kv_heads is not None  # filled in by ReferenceConfig.__post_init__
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout  # attention-probability dropout, handed to SDPA as dropout_p
        self.bugs = set(cfg.bugs)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        offset_given: bool,
        cache: KVCache | None = None,
        same_document: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, C = x.size()
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        if "batch-mix" in self.bugs:
            # (B, T, nh, hs) -> (nh, B, T, hs) -> read back as (B, nh, T, hs): batch and head axes interleave
            q = self.q_proj(x).view(B, T, nh, hs).permute(2, 0, 1, 3).reshape(B, nh, T, hs)
        else:
            q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if "scale-applied-twice" in self.bugs:
            q = q * hs**-0.5  # OPT's q_proj(x) * self.scaling, before an attention that scales again

        if self.cfg.positional == "rope":
            rope_positions = position_ids
            if "kv-cache-rope-restart" in self.bugs and cache is not None:
                rope_positions = torch.arange(T, device=x.device)  # freqs[:T], not freqs[start_pos:start_pos + T]
            q, k = self.rotate(q, k, rope_positions, offset_given)

        past_len = 0  # tokens already cached: the new queries sit at positions past_len .. past_len + T - 1
        if cache is not None:
            past_len = cache.get_seq_length(self.layer_idx)
            k, v = cache.update(k, v, self.layer_idx)  # (B, nkv, past_len + T, hs) each

        mask, is_causal = self.causal_mask(T, x.device, q.dtype, past_len)
        if same_document is not None and "packing-no-document-mask" not in self.bugs:
            mask, is_causal = restrict_to_documents(mask, is_causal, same_document)  # (B, 1, T, T)
        dropout_p = self.dropout if (self.training or "sdpa-dropout-in-eval" in self.bugs) else 0.0
        if self.cfg.attention == "sdpa":
            scale = 1.0 if "sdpa-scale-dropped" in self.bugs else None  # None: SDPA's own 1/sqrt(hs)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=nkv != nh, scale=scale
            )  # (B, nh, T, hs)
        else:
            y = self.eager_attention(q, k, v, mask, is_causal, dropout_p)
        if "heads-swapped" in self.bugs and nh > 1:
            y = y[:, [1, 0, *range(2, nh)]]  # (B, nh, T, hs): head 0's output where o_proj reads head 1's
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.o_proj(y)

    def rotate(self, q, k, position_ids, offset_given):
        cfg = self.cfg
        rope = dict(base=cfg.rope.base, rotary_dim=cfg.rotary_dim, angle_dtype=self.angle_dtype(q))
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

    def angle_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the rotary angles are computed in: float32, or the planted mistake, the activations' own."""
        return x.dtype if "rope-angles-in-model-dtype" in self.bugs else torch.float32

    def causal_mask(self, T: int, device, dtype, past_len: int = 0) -> tuple[torch.Tensor | None, bool]:
        """The causal mask of T new queries over past_len cached keys and their own, in the configured encoding, or
        the planted mistake. Returns (attn_mask, is_causal)."""
        window = self.cfg.window
        if past_len and T == 1 and window is None:
            return None, False  # one new token reads every cached key and itself: nothing to mask
        S = past_len + T
        # (T, S) aligned bottom-right: query i, at position past_len + i, reads keys 0 .. past_len + i
        may_attend = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=past_len)
        if window is not None:  # and only the `window` keys up to its own: key j when j > past_len + i - window
            band = window + 1 if "sliding-window-one-wider" in self.bugs else window
            may_attend &= ~torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=past_len - band)
        if "kv-cache-mask-top-left" in self.bugs:
            may_attend = torch.ones(T, S, dtype=torch.bool, device=device).tril()  # query i reads keys 0 .. i
        if "no-causal-mask" in self.bugs:
            return None, False
        if "inverted-bool-mask" in self.bugs:
            return ~may_attend, False  # True = masked out: right for nn.MultiheadAttention, inverted for SDPA
        if "float-mask-01" in self.bugs:
            return may_attend.float().to(dtype), False  # 1 on allowed keys, 0 elsewhere: added, it masks nothing
        if self.cfg.mask == "is_causal" and window is None and (past_len == 0 or "kv-cache-mask-top-left" in self.bugs):
            return None, True  # torch aligns is_causal top-left: right only while queries and keys start together
        if self.cfg.mask == "float":
            zeros = torch.zeros(T, S, dtype=dtype, device=device)
            return zeros.masked_fill(~may_attend, float("-inf")), False  # 0 = keep, -inf = drop
        return may_attend, False

    def eager_attention(self, q, k, v, mask, is_causal, dropout_p):
        """Attention written out: softmax over the keys of (q k^T / sqrt(hs) + mask), then weights @ v."""
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=1)  # (B, nh, S, hs): S keys, T without a cache
        v = v.repeat_interleave(group, dim=1)  # (B, nh, S, hs)
        # 1/sqrt(hs) keeps scores of unit-variance q, k at unit variance; the planted mistake divides by hs itself
        scale = q.size(-1) if "eager-scale-1-over-d" in self.bugs else math.sqrt(q.size(-1))
        scores = (q @ k.transpose(-2, -1)) / scale  # (B, nh, T, S): query rows, key columns
        T, S = q.size(-2), k.size(-2)
        if is_causal:  # as torch's is_causal: aligned top-left
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
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
    def __init__(self, cfg: ReferenceConfig, layer_idx: int = 0):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, position_ids, offset_given, cache=None, same_document=None):
        if self.pre_norm:  # x + f(norm(x))
            x = x + self.resid_dropout(
                self.attn(self.ln_1(x), position_ids, offset_given, cache, same_document=same_document)
            )
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(
            x + self.resid_dropout(self.attn(x, position_ids, offset_given, cache, same_document=same_document))
        )  # norm(x + f(x))
        return self.ln_2(x + self.mlp(x))


class ReferenceTransformer(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positional == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        # PyTorch's default initialisation: attention scores of order one, so a wrong rotation or a leaked key
        # moves the logits by far more than rounding noise even in an untrained model.
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.init_std is not None:
            self.init_normal(cfg.init_std)

    def init_normal(self, std: float) -> None:
        """GPT-2's initialisation: every weight of a linear layer or an embedding drawn from normal(0, std), biases
        zero; layer norms keep their ones and zeros."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    _supports_sdpa = True  # as Hugging Face models declare it: both attention paths can be switched to

    def set_attn_implementation(self, implementation: str) -> None:
        """Switch every layer's attention path ("sdpa" or "eager"), as Hugging Face's method of this name does."""
        assert implementation in ("sdpa", "eager"), f"unknown attention implementation {implementation!r}"
        self.config.attention = cast(Literal["sdpa", "eager"], implementation)  # the layers read it at every forward

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rotation the attention layers apply to q and k, on its own: x (B, nh, T, hs) turned by positions (T,)
        or (B, T), in the layers' precision (planted bugs included)."""
        cfg = self.config
        return apply_rope(
            x,
            positions,
            base=cfg.rope.base,
            pairing=cfg.rope.pairing,
            rotary_dim=cfg.rotary_dim,
            angle_dtype=cast(Block, self.layers[0]).attn.angle_dtype(x),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        labels: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ):
        """Logits (B, T, V); with use_cache, (logits, cache): the cache holds every token run so far, and handed
        back as past_key_values the next call's input_ids continue the sequence after them. With labels (B, T),
        (logits, loss) as Hugging Face's causal LMs compute it (next_token_loss). With document_ids (B, T), one id
        per document packed into the row: each token reads only its own document, at positions restarting at 0."""
        B, T = input_ids.size()
        if use_cache and past_key_values is None:
            past_key_values = KVCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0  # tokens already cached
        length = past_len + T
        assert length <= self.config.max_seq_len, (
            f"sequence length {length} exceeds max_seq_len {self.config.max_seq_len}"
        )
        offset_given = position_ids is not None
        if position_ids is None:
            start = past_len  # the new tokens follow the cached ones
            if "kv-cache-position-off-by-one" in self.config.bugs and past_len:
                start = past_len + 1  # the count of tokens seen, 1-based, taken as the next position
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)  # (B, T)
            if document_ids is not None and "packing-positions-not-reset" not in self.config.bugs:
                position_ids = positions_within_documents(document_ids)  # (B, T)
        same_document = None
        if document_ids is not None:
            same_document = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T) query, key
        x = self.wte(input_ids)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)  # (B, T, C)
        x = self.drop(x)
        for block in self.layers:
            x = block(x, position_ids, offset_given, past_key_values, same_document=same_document)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if labels is not None:
            return logits, self.next_token_loss(logits, labels)
        return (logits, past_key_values) if use_cache else logits

    def next_token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of each position's logits against the next label, as Hugging Face's causal LMs compute
        it: labels line up with input_ids, position t predicts labels[t + 1], and labels of -100 are skipped."""
        B, T, V = logits.shape
        shift_logits = logits[:, :-1]  # (B, T-1, V): the last position has no next token in the row
        shift_labels = labels[:, 1:]  # (B, T-1)
        if "label-no-shift" in self.config.bugs:
            shift_logits, shift_labels = logits, labels  # each position scored against its own input token
        if "label-double-shift" in self.config.bugs:
            # labels already moved one step on the flattened batch, as for one long token stream, then shifted again
            flat = labels.flatten()  # (B*T,)
            shift_labels = torch.cat([flat[1:], flat.new_full((1,), -100)]).view(B, T)[:, 1:]  # (B, T-1)
        return F.cross_entropy(shift_logits.reshape(-1, V), shift_labels.reshape(-1), ignore_index=-100)


def build(**fields) -> ReferenceTransformer:
    """Factory: `fwdcheck.model.reference:build` with the config's fields as keyword arguments."""
    return ReferenceTransformer(ReferenceConfig(**fields))
