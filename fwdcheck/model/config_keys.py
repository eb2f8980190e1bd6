"""The names model configs keep their sizes under: one table, read wherever fwdcheck looks a size up in a model's
config (the factory sources, the hf source's size check, `fwdcheck shrink`).

Each row is one size, by the symbol fwdcheck names it with (the dims of ModelUnderTest, and max_positions), and holds
its spellings. The first is transformers' standard name, which a Hugging Face config answers to whatever its
architecture calls the size (attribute_map); the others are those of GPT-2 and nanoGPT (n_embd, n_head, n_layer,
n_positions), Meta's Llama (dim, n_heads, n_kv_heads, n_layers, max_seq_len), T5 (d_model, num_heads, d_ff,
num_layers), and so on. A config spells each size one way, so the first spelling present is the model's. (Where a
config transformers builds holds two spellings of one size with different values, one of them is the standard name,
and that one is read.)

A reader that knows spellings only it has a use for adds them to the end of a row (`extended`); none drops one.
"""

from __future__ import annotations

Spellings = dict[str, tuple[str, ...]]  # symbol -> the names a config may keep that size under

CONFIG_KEYS: Spellings = {
    "d": ("hidden_size", "d_model", "n_embd", "dim"),
    "h": ("num_attention_heads", "n_heads", "n_head", "num_heads"),
    "h_kv": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "d_h": ("head_dim",),
    "d_ff": ("intermediate_size", "d_ff", "n_inner", "ffn_dim"),
    "V": ("vocab_size",),
    "L": ("num_hidden_layers", "n_layers", "n_layer", "num_layers"),
    "max_positions": ("max_position_embeddings", "max_seq_len", "n_positions", "n_ctx"),
}


def extended(table: Spellings, **more: tuple[str, ...]) -> Spellings:
    """`table` with more spellings after some rows' own, for a reader that knows them."""
    return {symbol: (*names, *more.get(symbol, ())) for symbol, names in table.items()}


def head_widths(config: object) -> dict[str, int]:
    """The query/key and value head widths of a config that states them apart (multi-head latent attention:
    DeepSeek V2/V3's `qk_nope_head_dim + qk_rope_head_dim` for queries and keys, or `qk_head_dim`, and `v_head_dim`
    for values and the attention output), as d_h and d_v; {} for a config that states no such split."""

    def size(name: str) -> int | None:
        value = getattr(config, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    widths = {}
    nope, rope = size("qk_nope_head_dim"), size("qk_rope_head_dim")
    query_key = size("qk_head_dim") or (nope + rope if nope and rope else None)
    if query_key:
        widths["d_h"] = query_key
    value = size("v_head_dim")
    if value:
        widths["d_v"] = value
    return widths
