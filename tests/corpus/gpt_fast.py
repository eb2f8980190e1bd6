"""gpt-fast (pytorch-labs) style: a preallocated KV cache longer than the sequence, written at `input_pos`.

`setup_caches` sizes the cache for the prompt plus the tokens to generate, rounded up to a multiple of 8 (T = 8 and 20
new tokens give 32 slots); every attention call then reads all 32 keys, [B, h, 32, d_h], for T queries, and the
boolean mask is the row slice `causal_mask[None, None, input_pos]` of a [32, 32] tril, so the slots not yet written are
masked out. RoPE is gpt-fast's real-valued form of the complex rotation (pairs 2i, 2i+1, cos/sin stacked in
freqs_cis); grouped-query attention repeats keys and values with repeat_interleave.

gpt-fast's forward needs input_pos, so the config names an adapter: `prefill` runs the whole sequence as a prompt;
`generate` prefills half and decodes the rest one token at a time through the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus import FF, HEADS, KV_HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH

NEW_TOKENS = 20  # what the cache is sized for beyond the prompt


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class ModelArgs:  # gpt-fast's field names
    block_size: int = MAX_POSITIONS
    vocab_size: int = VOCAB
    n_layer: int = LAYERS
    n_head: int = HEADS
    dim: int = WIDTH
    intermediate_size: int = FF
    n_local_heads: int = KV_HEADS
    rope_base: float = 10000
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size: int, max_seq_length: int, n_heads: int, head_dim: int, dtype, device):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype, device=device))

    def update(self, input_pos: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor):
        # input_pos: [S], k_val: [B, H, S, D]
        assert input_pos.shape[0] == k_val.shape[2]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out  # (B, H, max_seq_length, D): every slot, written or not


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))  # (n_elem/2,)
    t = torch.arange(seq_len)
    freqs = torch.outer(t, freqs)  # (seq_len, n_elem/2)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex e^(i m theta)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)  # (seq_len, n_elem/2, 2)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x (B, T, h, d_h); freqs_cis (T, d_h/2, 2). Pairs (2i, 2i+1) multiplied by e^(i m theta_i)."""
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, T, h, d_h/2, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)  # (B, T, h, d_h)


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)  # key, query, value projections for all heads
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache: KVCache | None = None
        self.n_head, self.head_dim, self.n_local_heads, self.dim = (
            config.n_head,
            config.head_dim,
            config.n_local_heads,
            config.dim,
        )

    def rotate(self, q, k, freqs_cis):
        return apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)

    def repeat_kv(self, k, v):
        """(B, n_local_heads, S, d_h) -> (B, n_head, S, d_h): each kv head serves n_head // n_local_heads queries."""
        n_rep = self.n_head // self.n_local_heads
        return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)  # (B, T, h, d_h)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)  # (B, T, h_kv, d_h)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k = self.rotate(q, k, freqs_cis)
        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))  # (B, h or h_kv, T, d_h)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # (B, h_kv, S, d_h), S = the cache length
        k, v = self.repeat_kv(k, v)  # (B, h, S, d_h)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)  # (B, h, T, d_h)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)  # (B, T, C)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(config.block_size, config.head_dim, config.rope_base)
        self.causal_mask: torch.Tensor | None = None
        self.max_batch_size = self.max_seq_length = -1

    def make_causal_mask(self, length: int, device) -> torch.Tensor:
        """(S, S) True = may attend: row p holds the keys position p reads."""
        return torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        """Caches for this batch and length (rounded up to a multiple of 8), in the model's dtype and device.
        gpt-fast keeps larger caches; these tests call with other batch sizes, so any change reallocates."""
        max_seq_length = find_multiple(max_seq_length, 8)
        weight = self.output.weight
        current = self.layers[0].attention.kv_cache
        if (
            (self.max_seq_length, self.max_batch_size) == (max_seq_length, max_batch_size)
            and current is not None
            and current.k_cache.dtype == weight.dtype
            and current.k_cache.device == weight.device
        ):
            return
        self.max_seq_length, self.max_batch_size = max_seq_length, max_batch_size
        for b in self.layers:
            b.attention.kv_cache = KVCache(
                max_batch_size,
                max_seq_length,
                self.config.n_local_heads,
                self.config.head_dim,
                weight.dtype,
                weight.device,
            )
        self.causal_mask = self.make_causal_mask(max_seq_length, weight.device)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        assert self.causal_mask is not None, "Caches must be initialized first"
        mask = self.causal_mask[None, None, input_pos]  # (1, 1, T, S): the rows of the positions being run
        freqs_cis = self.freqs_cis.to(idx.device)[input_pos]  # (T, d_h/2, 2)
        x = self.tok_embeddings(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))  # (B, T, V)


def prefill(model: Transformer, input_ids: torch.Tensor, **_) -> torch.Tensor:
    """The whole sequence as one prompt at positions 0 .. T-1, the cache sized for T + NEW_TOKENS."""
    B, T = input_ids.shape
    model.setup_caches(max_batch_size=B, max_seq_length=T + NEW_TOKENS)
    return model(input_ids, torch.arange(T, device=input_ids.device))  # (B, T, V)


def generate(model: Transformer, input_ids: torch.Tensor, **_) -> torch.Tensor:
    """Generate-style: prefill the first half, then decode one token at a time (the given tokens, teacher-forced)
    through the cache. Returns every position's logits, [B, T, V]."""
    B, T = input_ids.shape
    model.setup_caches(max_batch_size=B, max_seq_length=T + NEW_TOKENS)
    prompt = max(1, T // 2)
    steps = [model(input_ids[:, :prompt], torch.arange(prompt, device=input_ids.device))]  # (B, prompt, V)
    for t in range(prompt, T):
        steps.append(model(input_ids[:, t : t + 1], torch.tensor([t], device=input_ids.device)))  # (B, 1, V)
    return torch.cat(steps, dim=1)  # (B, T, V)


def transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs())


# -- planted bugs, each on the built instance --------------------------------------------------------------------------


def _mask_of_the_other_convention(self, length, device):
    """triu(ones, 1).bool(): True on the future, right for nn.MultiheadAttention, inverted for SDPA."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)


def _repeat_over_batch(self, k, v):
    """The grouped-query repeat on the batch axis: (B, h_kv, S, d_h) tiled to (n_rep*B, ...) and viewed as
    (B, n_rep*h_kv, S, d_h), so sample 0's extra heads hold sample 1's keys and values."""
    n_rep = self.n_head // self.n_local_heads
    B, _, S, D = k.shape
    return k.repeat(n_rep, 1, 1, 1).view(B, -1, S, D), v.repeat(n_rep, 1, 1, 1).view(B, -1, S, D)


def _rotate_k_half(self, q, k, freqs_cis):
    """q rotated with gpt-fast's pairs (2i, 2i+1), k with rotate_half's (i, i + d_h/2) at the same frequencies."""
    cos, sin = freqs_cis[..., 0], freqs_cis[..., 1]  # (T, d_h/2) each
    cos = torch.cat((cos, cos), dim=-1)[None, :, None]  # (1, T, 1, d_h)
    sin = torch.cat((sin, sin), dim=-1)[None, :, None]
    k1, k2 = k.float().chunk(2, dim=-1)
    k_rotated = k.float() * cos + torch.cat((-k2, k1), dim=-1) * sin
    return apply_rotary_emb(q, freqs_cis), k_rotated.type_as(k)


def transformer_with(bug: str) -> Transformer:
    """gpt-fast with one planted bug:
    inverted-bool-mask  the [S, S] causal mask built with triu(ones, 1) and sliced by input_pos as usual
    gqa-batch-mix       the grouped-query repeat tiles the batch instead of the heads
    rope-pairing        k rotated with rotate_half's pairing, q with gpt-fast's
    """
    model = transformer()
    if bug == "inverted-bool-mask":
        model.make_causal_mask = MethodType(_mask_of_the_other_convention, model)
    elif bug in ("gqa-batch-mix", "rope-pairing"):
        name, method = ("repeat_kv", _repeat_over_batch) if bug == "gqa-batch-mix" else ("rotate", _rotate_k_half)
        for block in model.layers:
            setattr(block.attention, name, MethodType(method, block.attention))
    else:
        raise ValueError(f"unknown bug {bug!r}")
    return model


def shifted_logits(model: Transformer, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """Prefill logits with the rotary table slid by `offset`: the cache and the mask keep their slots, so only
    the rotation sees other positions (a real input_pos offset would also read empty cache slots)."""
    full = model.freqs_cis
    model.freqs_cis = full[offset:]
    try:
        return prefill(model, input_ids)
    finally:
        model.freqs_cis = full
