"""torch's own nn.TransformerDecoder and nn.Transformer used as decoders: the target is the token sequence under a
causal tgt_mask, the memory comes from a fixed source sequence (a prompt or a conditioning input encoded once).

Self-attention is [T, T] and causal; cross-attention is [T, S] and reads every memory position, as it must.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tests.corpus import FF, HEADS, LAYERS, MAX_POSITIONS, VOCAB, WIDTH

SOURCE_LENGTH = 5  # S; unlike T, so a cross-attention [T, S] cannot pass for self-attention by its shape alone


@dataclass
class Config:  # the names fwdcheck reads off a config object
    vocab_size: int = VOCAB
    d_model: int = WIDTH
    num_heads: int = HEADS
    d_ff: int = FF
    num_layers: int = LAYERS
    max_seq_len: int = MAX_POSITIONS


class Seq2SeqDecoderLM(nn.Module):
    """Token embedding + learned positions -> nn.TransformerDecoder (or a whole nn.Transformer) -> lm head.

    full: use nn.Transformer, whose encoder turns the fixed source into the memory; otherwise the embedded source
      itself is the memory of an nn.TransformerDecoder.
    mask: causal (generate_square_subsequent_mask, with the tgt_is_causal hint), or none (the bug: tgt_mask forgotten).
    source_length: S, the memory's length; equal to T, cross-attention has the shape of self-attention.
    """

    def __init__(self, cfg: Config, full: bool, mask: str, source_length: int):
        super().__init__()
        self.config, self.full, self.mask = cfg, full, mask
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        if full:
            self.transformer = nn.Transformer(
                cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.num_layers, cfg.d_ff, dropout=0.1, batch_first=True
            )
        else:
            layer = nn.TransformerDecoderLayer(cfg.d_model, cfg.num_heads, cfg.d_ff, dropout=0.1, batch_first=True)
            self.decoder = nn.TransformerDecoder(layer, cfg.num_layers)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        source = torch.randint(0, cfg.vocab_size, (1, source_length), generator=torch.Generator().manual_seed(1))
        self.register_buffer("source", source, persistent=False)  # (1, S): the same source for every sample

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        tgt = self.embed(input_ids) + self.pos(torch.arange(T, device=input_ids.device))  # (B, T, C)
        src = self.embed(self.source).expand(B, -1, -1)  # (B, S, C)
        causal = self.mask == "causal"
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(T, device=input_ids.device) if causal else None
        if self.full:
            y = self.transformer(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=causal)  # (B, T, C)
        else:
            y = self.decoder(tgt, src, tgt_mask=tgt_mask, tgt_is_causal=causal)  # (B, T, C)
        return self.lm_head(y)  # (B, T, V)


def decoder(mask: str = "causal", source_length: int = SOURCE_LENGTH) -> Seq2SeqDecoderLM:
    torch.manual_seed(0)
    return Seq2SeqDecoderLM(Config(), full=False, mask=mask, source_length=source_length)


def transformer(mask: str = "causal", source_length: int = SOURCE_LENGTH) -> Seq2SeqDecoderLM:
    torch.manual_seed(0)
    return Seq2SeqDecoderLM(Config(), full=True, mask=mask, source_length=source_length)
