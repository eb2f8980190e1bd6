"""x-transformers (lucidrains): `TransformerWrapper(Decoder(...))` with rotary, with ALiBi, with token shifting and
through its KV cache, and an `Encoder` (bidirectional, declared `causal: false`).

Its rotary embedding covers half of each head by default (4 of 8 dims) and pairs dims (2i, 2i+1). Its default
attention is eager (einsum scores, masked_fill with -finfo.max, softmax); `attn_flash=True` calls SDPA instead. Keys and
values of grouped-query attention are repeated with einops as 'b kvh n d -> b (r kvh) n d'. x-transformers has no
config object: the sizes are declared with `dims:` (DIMS below).
"""

from __future__ import annotations

import einops
import torch
import x_transformers.attend as xattend
import x_transformers.x_transformers as xt
from x_transformers import Decoder, Encoder, TransformerWrapper

from tests.corpus import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    MAX_POSITIONS,
    VOCAB,
    WIDTH,
    alternating,
    during_forward,
    replaced,
)

DIMS = {"d": WIDTH, "h": HEADS, "h_kv": KV_HEADS, "d_h": HEAD_DIM, "d_ff": 2 * WIDTH, "V": VOCAB}
ROTARY_DIM = HEAD_DIM // 2  # x-transformers' default rotary_emb_dim: half of each head


def _wrapper(layers: type, use_abs_pos_emb: bool = True, **attention) -> TransformerWrapper:
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=MAX_POSITIONS,
        use_abs_pos_emb=use_abs_pos_emb,
        attn_layers=layers(
            dim=WIDTH, depth=LAYERS, heads=HEADS, attn_dim_head=HEAD_DIM, ff_mult=2, verbose=False, **attention
        ),
    )


def rotary(flash: bool = False, shift_tokens: int = 0) -> TransformerWrapper:
    """Decoder with rotary embeddings and grouped-query attention (2 kv heads). shift_tokens=1 mixes half of each
    token's features with its predecessor's before every attention and feed-forward (RWKV-style token shift)."""
    return _wrapper(Decoder, rotary_pos_emb=True, attn_kv_heads=KV_HEADS, attn_flash=flash, shift_tokens=shift_tokens)


def alibi() -> TransformerWrapper:
    """Decoder with ALiBi only (no absolute positions): SDPA gets the bias as a float mask whose future is
    -finfo.max / 2."""
    return _wrapper(Decoder, use_abs_pos_emb=False, alibi_pos_bias=True, alibi_num_heads=HEADS, attn_flash=True)


def encoder() -> TransformerWrapper:
    """A bidirectional encoder with learned absolute positions: every token reads every other, by design."""
    return _wrapper(Encoder)


def cached_logits(model: TransformerWrapper, input_ids: torch.Tensor, **_) -> torch.Tensor:
    """Generate-style forward: prefill the first half of the sequence, then feed the rest one token at a time through
    x-transformers' KV cache (`return_intermediates=True` hands the cache back; `cache=` takes it). Returns the
    logits of every position, [B, T, V], as one full forward would."""
    T = input_ids.shape[1]
    prompt = max(1, T // 2)
    logits, cache = model(input_ids[:, :prompt], return_intermediates=True)  # (B, prompt, V)
    steps = [logits]
    for t in range(prompt, T):
        # the whole sequence so far goes in; with a cache, x-transformers runs only the tokens the cache lacks
        step, cache = model(input_ids[:, : t + 1], cache=cache, return_intermediates=True)  # (B, 1, V)
        steps.append(step)
    return torch.cat(steps, dim=1)  # (B, T, V)


# -- planted bugs, each on the eager rotary decoder --------------------------------------------------------------------


def _attention_modules(model: TransformerWrapper):
    return [m for m in model.modules() if isinstance(m, xt.Attention)]


def _keys_unrotated(t, freqs, scale=1):
    return t


def _keys_rotate_half(t, freqs, scale=1):
    """x-transformers' apply_rotary_pos_emb with the other pairing: dims i and i + r/2 turn together (GPT-NeoX's
    rotate_half) at the same frequencies. freqs is laid out for pairs (2i, 2i+1): f0 f0 f1 f1 ..."""
    rot_dim, T = freqs.shape[-1], t.shape[-2]
    freqs = freqs[:, -T:, 0::2]  # (1, T, r/2): one frequency per pair
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None]  # (1, 1, T, r): f0 f1 .. f0 f1 .., over heads
    t, rest = t[..., :rot_dim], t[..., rot_dim:]
    x1, x2 = t.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((t * freqs.cos() + rotated * freqs.sin(), rest), dim=-1).type(rest.dtype)


def _repeat_over_batch(tensor, pattern, **sizes):
    """The grouped-query repeat done on the wrong axis: the batch is tiled r times and folded into the heads, so each
    sample's extra head groups hold other samples' keys and values. Every other einops.repeat call is left alone."""
    if pattern != "b kvh n d -> b (r kvh) n d":
        return einops.repeat(tensor, pattern, **sizes)
    B, _, n, d = tensor.shape
    return tensor.repeat(sizes["r"], 1, 1, 1).reshape(B, -1, n, d)  # (r*B, kvh, n, d) -> (B, r*kvh, n, d)


def _roll(t, amount, mask=None):
    """x-transformers' token shift written with torch.roll: the last token wraps around into position 0."""
    return torch.roll(t, shifts=amount, dims=-2)


def rotary_with(bug: str) -> TransformerWrapper:
    """The eager rotary decoder with one planted bug:
    no-mask          every attention layer's causal flag off (as if Encoder layers were used)
    block-leak       the causal mask of every layer lets position i read i + 1
    rope-q-only      apply_rotary_pos_emb rotates q; k goes through unrotated
    rope-pairing     q rotated with x-transformers' interleaved pairs, k with rotate_half at the same frequencies
    gqa-batch-mix    the grouped-query repeat tiles the batch instead of the heads
    shift-roll       (with shift_tokens=1) the token shift done by torch.roll: position 0 reads the last token
    """
    model = rotary(shift_tokens=1 if bug == "shift-roll" else 0)
    if bug == "no-mask":
        for attention in _attention_modules(model):
            attention.causal = attention.attend.causal = False
    elif bug == "block-leak":
        for attention in _attention_modules(model):
            # x-transformers' create_causal_mask is True where masked; triu(j - i + 1) is causal, + 2 lets i read i + 1
            attention.attend.create_causal_mask = lambda i, j, device: torch.ones(
                (i, j), device=device, dtype=torch.bool
            ).triu(j - i + 2)
    elif bug in ("rope-q-only", "rope-pairing"):
        keys = _keys_unrotated if bug == "rope-q-only" else _keys_rotate_half
        # every Attention calls apply_rotary_pos_emb for q, then for k
        during_forward(model, lambda: replaced(xt, "apply_rotary_pos_emb", alternating(xt.apply_rotary_pos_emb, keys)))
    elif bug == "gqa-batch-mix":
        during_forward(model, lambda: replaced(xattend, "repeat", _repeat_over_batch))
    elif bug == "shift-roll":
        during_forward(model, lambda: replaced(xt, "shift", _roll))
    else:
        raise ValueError(f"unknown bug {bug!r}")
    return model


def shifted_logits(model: TransformerWrapper, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """x-transformers lets the caller hand the rotary frequencies to the layers (`rotary_pos_emb=`): here those of
    positions offset .. offset + T - 1."""
    T = input_ids.shape[1]
    positions = torch.arange(offset, offset + T, device=input_ids.device)
    return model(input_ids, rotary_pos_emb=model.attn_layers.rotary_pos_emb(positions))
