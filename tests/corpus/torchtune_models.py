"""torchtune's component builders, `llama3(...)` and `qwen2(...)`, at tiny sizes.

torchtune's TransformerDecoder carries no config object: the sizes are declared with `dims:` (tests.corpus.DIMS).
Its Llama 3 RoPE pairs dims (2i, 2i+1), as Meta's reference code does; Qwen 2's pairs i with i + d_h/2 (rotate_half).
Each attention layer holds its SDPA call as the instance attribute `_attention_call` and its rotary module as
`pos_embeddings`: planted bugs replace those on the built layers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtune.models.llama3 import llama3 as build_llama3
from torchtune.models.qwen2 import qwen2 as build_qwen2
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import TransformerDecoder

from tests.corpus import FF, HEAD_DIM, HEADS, KV_HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH

LLAMA3_BASE = 500_000


def llama3() -> TransformerDecoder:
    torch.manual_seed(0)
    return build_llama3(
        vocab_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=WIDTH,
        max_seq_len=MAX_POSITIONS,
        intermediate_dim=FF,
        rope_base=LLAMA3_BASE,
    )


def qwen2() -> TransformerDecoder:
    torch.manual_seed(0)
    return build_qwen2(
        vocab_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=WIDTH,
        intermediate_dim=FF,
        max_seq_len=MAX_POSITIONS,
    )


# -- planted bugs, each on the Llama 3 instance ------------------------------------------------------------------------


def _sdpa_with_inverted_mask(q, k, v, mask, dropout_p, is_causal):
    """torchtune's attention call with nn.MultiheadAttention's boolean mask (True = masked out) instead of
    is_causal: SDPA reads True as 'may attend', so every query reads only the future."""
    T, S = q.size(2), k.size(2)
    masked_out = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(diagonal=1)  # (T, S) True on the future
    return F.scaled_dot_product_attention(q, k, v, attn_mask=masked_out, dropout_p=dropout_p)


class SplitRotary(nn.Module):
    """One layer's pos_embeddings rotating queries with one module and keys with another (None: left unrotated).

    torchtune calls pos_embeddings on q [b, s, n_h, h_d] and then on k [b, s, n_kv, h_d]; with grouped-query attention
    the head count tells which is which (4 query heads, 2 key heads here)."""

    def __init__(self, for_queries: nn.Module, for_keys: nn.Module | None, query_heads: int):
        super().__init__()
        self.for_queries, self.for_keys, self.query_heads = for_queries, for_keys, query_heads

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if x.size(2) == self.query_heads:
            return self.for_queries(x, input_pos=input_pos)
        return x if self.for_keys is None else self.for_keys(x, input_pos=input_pos)


def llama3_with(bug: str) -> TransformerDecoder:
    """The Llama 3 model with one planted bug:
    no-mask             is_causal switched off on every attention layer, no mask given: SDPA attends everywhere
    inverted-bool-mask  triu(ones, 1).bool() handed to SDPA (True = masked is MultiheadAttention's convention)
    rope-q-only         q rotated, k left as it was
    rope-pairing        q rotated by Llama 3's interleaved RoPE, k by Qwen 2's rotate_half at the same base
    """
    model = llama3()
    for layer in model.layers:
        attention = layer.attn
        if bug == "no-mask":
            attention.is_causal = False
        elif bug == "inverted-bool-mask":
            attention._attention_call = _sdpa_with_inverted_mask
        elif bug == "rope-q-only":
            attention.pos_embeddings = SplitRotary(attention.pos_embeddings, None, HEADS)
        elif bug == "rope-pairing":
            half = Qwen2RotaryPositionalEmbeddings(HEAD_DIM, max_seq_len=MAX_POSITIONS, base=LLAMA3_BASE)
            attention.pos_embeddings = SplitRotary(attention.pos_embeddings, half, HEADS)
        else:
            raise ValueError(f"unknown bug {bug!r}")
    return model


def shifted_logits(model: TransformerDecoder, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """torchtune takes the positions as input_pos [b, s] (packed samples use it): here every position + offset."""
    B, T = input_ids.shape
    positions = torch.arange(offset, offset + T, device=input_ids.device).expand(B, T)  # (B, T)
    return model(input_ids, input_pos=positions)
