"""litgpt (Lightning AI's `litgpt.model.GPT`): Pythia-, Llama-, Mistral- and Gemma-style configurations at tiny sizes.

litgpt pads its vocabulary: Config(vocab_size=96, padding_multiple=64) has padded_vocab_size 128, so the embedding has
128 rows and the logits are [B, T, 128]. That is litgpt working as designed (the 32 extra logits belong to no token),
not a bug.

With `input_pos`, litgpt runs through its preallocated KV cache, sized as litgpt's generate sizes it (prompt plus the
tokens to generate): keys [B, h, T + 20, d_h] for T queries, masked by rows of a bool tril sliced by input_pos. The
adapters `kv_cache_prefill` and `generate` below call it that way.

Its attention is the method `CausalSelfAttention.scaled_dot_product_attention`: a planted mask bug replaces it on the
built instances. RoPE goes through the module-level `litgpt.model.apply_rope`, which a planted rotary bug swaps only
while the model's own forward runs.
"""

from __future__ import annotations

import math
from types import MethodType

import litgpt.model as lit
import torch
import torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import GPT

from tests.corpus import FF, HEADS, KV_HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH, alternating, during_forward, replaced


def _build(name: str, **fields) -> GPT:
    config = Config(
        name=name,
        block_size=MAX_POSITIONS,
        vocab_size=VOCAB,
        padding_multiple=64,
        n_layer=LAYERS,
        n_head=HEADS,
        **fields,
    )
    torch.manual_seed(0)
    return GPT(config)


def pythia() -> GPT:
    """GPT-NeoX / Pythia: parallel residual, LayerNorm, biases, rotary on a quarter of each head (4 of 16 dims).

    litgpt's Config defaults are exactly this family; the width is 64 so that a quarter of a head is 2 pairs."""
    return _build("tiny-pythia", n_embd=2 * WIDTH, rotary_percentage=0.25)


def llama() -> GPT:
    """Llama 2/3: RMSNorm, SwiGLU, no biases, grouped-query attention (4 query heads share 2 kv heads), base 5e5."""
    return _build(
        "tiny-llama",
        n_embd=WIDTH,
        n_query_groups=KV_HEADS,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=FF,
        rope_base=500000,
    )


def mistral() -> GPT:
    """Mistral: the Llama layout with a sliding window of 4 in every layer (litgpt builds it as a float mask)."""
    return _build(
        "tiny-mistral",
        n_embd=WIDTH,
        n_query_groups=KV_HEADS,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=FF,
        sliding_window_size=4,
    )


def gemma() -> GPT:
    """Gemma: multi-query (1 kv head), heads of 16 whose concatenation (64) is wider than the model (32), embeddings
    scaled by sqrt(d), GeGLU, RMSNorm with the unit offset (litgpt turns it on for names containing 'Gemma')."""
    return _build(
        "tiny-Gemma",
        n_embd=WIDTH,
        n_query_groups=1,
        head_size=16,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="GemmaMLP",
        gelu_approximate="tanh",
        intermediate_size=FF,
        scale_embeddings=True,
    )


# -- through the KV cache, as litgpt.generate runs it ------------------------------------------------------------------


NEW_TOKENS = 20  # what the cache is sized for beyond the prompt


def _set_up_cache(model: GPT, batch_size: int, prompt: int) -> None:
    """What litgpt's generate does first: max_seq_length = prompt + new tokens, then a KV cache for the batch."""
    if model.max_seq_length != prompt + NEW_TOKENS:
        model.clear_kv_cache()  # a new length needs a new cache (and litgpt warns while the old one is shorter)
        model.max_seq_length = prompt + NEW_TOKENS  # litgpt rebuilds cos/sin for this length
    weight = model.lm_head.weight
    model.set_kv_cache(batch_size=batch_size, device=weight.device, dtype=weight.dtype)


def kv_cache_prefill(model: GPT, input_ids: torch.Tensor, **_) -> torch.Tensor:
    """The whole sequence as the prompt, at input_pos 0 .. T-1, through the KV cache. Logits [B, T, 128]."""
    B, T = input_ids.shape
    _set_up_cache(model, B, T)
    return model(input_ids, input_pos=torch.arange(T, device=input_ids.device))


def generate(model: GPT, input_ids: torch.Tensor, **_) -> torch.Tensor:
    """Generate-style: prefill the first half, then one token at a time at input_pos [t] (the given tokens,
    teacher-forced), as litgpt.generate.base.generate_fn steps. Returns every position's logits, [B, T, 128]."""
    B, T = input_ids.shape
    _set_up_cache(model, B, T)
    prompt = max(1, T // 2)
    steps = [model(input_ids[:, :prompt], input_pos=torch.arange(prompt, device=input_ids.device))]
    for t in range(prompt, T):
        steps.append(model(input_ids[:, t : t + 1], input_pos=torch.tensor([t], device=input_ids.device)))
    return torch.cat(steps, dim=1)  # (B, T, 128)


# -- planted bugs, each on the Llama-style instance --------------------------------------------------------------------


def _scale(attention) -> float:
    config = attention.config
    return 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)


def _attention_without_mask(self, q, k, v, mask=None):
    """litgpt's scaled_dot_product_attention with the causal mask lost: no mask, and is_causal left False."""
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, scale=_scale(self), is_causal=False)
    return y.transpose(1, 2)  # (B, T, nh, hs), as litgpt's own method returns it


def _attention_with_inverted_mask(self, q, k, v, mask=None):
    """nn.MultiheadAttention's boolean convention (True = masked out) handed to SDPA, where True means 'may attend'."""
    T, S = q.size(2), k.size(2)
    masked_out = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(diagonal=1)  # (T, S) True on the future
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=masked_out, scale=_scale(self))
    return y.transpose(1, 2)


def _unrotated(x, cos, sin):
    return x


def _rope_every_two(x, cos, sin):
    """GPT-J's pairing (dims 2i and 2i+1 turn together) at the frequencies of litgpt's cos/sin, which are laid out
    for rotate_half: [f0 .. f(r/2-1), f0 .. f(r/2-1)]."""
    half = x.size(-1) // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1).unsqueeze(1)  # (B, 1, T, r): f0 f0 f1 f1 ..., over heads
    sin = sin[..., :half].repeat_interleave(2, dim=-1).unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, h, T, r/2) each
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)  # (B, h, T, r): -x1, x0, -x3, x2, ...
    return (x * cos + rotated * sin).to(x.dtype)


def llama_with(bug: str) -> GPT:
    """The Llama-style model with one planted bug:
    no-mask             SDPA gets neither a mask nor is_causal
    inverted-bool-mask  triu(ones, 1).bool() (True = masked, MultiheadAttention's convention) handed to SDPA
    rope-q-only         apply_rope rotates q; k goes through unrotated
    rope-pairing        q rotated with litgpt's rotate_half, k with GPT-J's rotate_every_two at the same frequencies
    """
    model = llama()
    if bug in ("no-mask", "inverted-bool-mask"):
        method = _attention_without_mask if bug == "no-mask" else _attention_with_inverted_mask
        for block in model.transformer.h:
            block.attn.scaled_dot_product_attention = MethodType(method, block.attn)
    elif bug in ("rope-q-only", "rope-pairing"):
        keys = _unrotated if bug == "rope-q-only" else _rope_every_two
        # litgpt calls apply_rope for q, then for k, in every layer
        during_forward(model, lambda: replaced(lit, "apply_rope", alternating(lit.apply_rope, keys)))
    else:
        raise ValueError(f"unknown bug {bug!r}")
    return model


def shifted_logits(model: GPT, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """Logits with every position moved by `offset`: litgpt reads cos/sin[:T] from the model's rope cache, so the
    cache is slid by `offset` rows for one call."""
    with replaced(model, "cos", model.cos[offset:]), replaced(model, "sin", model.sin[offset:]):
        return model(input_ids)
