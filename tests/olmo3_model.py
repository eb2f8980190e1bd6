"""OLMo-core 3.0's OLMo 3 (ai2-olmo-core, the training framework's own model code), built tiny on CPU: its 1M
configuration at 4 layers, vocabulary 64, with sliding windows of 4 keys on layers 0 and 2 and full causal attention
on 1 and 3 (OLMo 3's pattern [W, W, W, full], shortened to fit a short sequence). `window` builds another width than
the one a config declares: the band a declaration must be held to. PyTorch's SDPA backend is the one that runs on CPU.

`forward` is the config's `forward:` adapter: OLMo-core takes document boundaries as `doc_lens` (the lengths of the
documents packed in each row, flattened) and `max_doc_lens`, not as document ids."""

from __future__ import annotations

import torch

WINDOW = 4  # keys a sliding layer's query reads, itself included (OLMo-core's window_size; SDPA band (3, 0))


def build(n_layers: int = 4, vocab_size: int = 64, window: int = WINDOW):
    from olmo_core.nn.attention import SlidingWindowAttentionConfig
    from olmo_core.nn.transformer import TransformerConfig

    config = TransformerConfig.olmo3_1M(
        vocab_size=vocab_size,
        n_layers=n_layers,
        attn_backend="torch",  # flash attention needs a GPU
        sliding_window=SlidingWindowAttentionConfig(
            pattern=[window, -1], force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=True
        ),
    )
    model = config.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    return model


def forward(model, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None, **extras) -> torch.Tensor:
    if document_ids is not None:  # [B, T] ids -> the lengths of each row's runs of one id, row after row
        lengths = [torch.unique_consecutive(row, return_counts=True)[1] for row in document_ids]
        extras["doc_lens"] = torch.nn.utils.rnn.pad_sequence(lengths, batch_first=True)
        extras["max_doc_lens"] = [int(row.max()) for row in lengths]
    return model(input_ids, **extras)
