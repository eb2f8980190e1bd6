"""The starter configs `fwdcheck init` writes: each source's model section, valid exactly as written, and the
sections every source shares.

A source's record (fwdcheck/config/sources.py) names its model section here, so `init` offers exactly the
sources whose record has one; `compose` puts a whole config together. Every template runs as written except the
checkpoint one, which names a weights file the user replaces: it validates, and until then its run stops with one
exit-2 line naming the missing file. The keys a user changes are commented, and each key left commented out
validates once uncommented (hf's `path:` in place of `config:`), so that editing a template never starts from an
error.
"""

from __future__ import annotations

from collections.abc import Sequence

_HEADER = """\
# fwdcheck config: `fwdcheck run {name}`
# Other model sources: `fwdcheck init --source {others}` writes their starter config.
"""

REFERENCE = """\
model:
  source: reference        # fwdcheck's built-in transformer, readable in fwdcheck/model/reference.py
  vocab_size: 16
  d_model: 8
  n_heads: 2
  # n_kv_heads: 1          # fewer key/value heads than n_heads: grouped-query attention
  n_layers: 2
  d_ff: 32
  positional: rope         # rope | learned | none
  attention: sdpa          # sdpa | eager
  mask: bool               # bool | float | is_causal: three correct ways to pass the causal mask
  bugs: []                 # plant one to watch a check fail: no-causal-mask, inverted-bool-mask, float-mask-01, ...
"""

PYTHON = """\
model:
  source: python
  # Replace the factory with your own: 'package.module:callable' returning an nn.Module whose forward(input_ids)
  # returns logits [B, T, V]. This one builds fwdcheck's reference transformer, so the config runs as written.
  factory: "fwdcheck.model.reference:build"
  # Keyword arguments for the factory. Size ones (n_layers, d_model, n_heads, vocab_size, d_ff, ...) let
  # `fwdcheck shrink` write a small copy of a model too big to run here.
  kwargs: {vocab_size: 16, d_model: 8, n_heads: 2, n_layers: 2}
  python_path: []          # directories put on sys.path first, relative to this file (its own folder always is)
  # attention: {pattern: bidirectional}  # causal (default) | bidirectional | prefix (+ prefix_length) | encoder-decoder
  # vocab_size: 16         # when neither model.config.vocab_size nor an nn.Embedding tells it
  # forward: "mypkg.adapters:logits"     # (model, input_ids, **kw) -> logits, for another call convention
  # rope: {base: 10000, pairing: half}   # declared rotary settings, compared with what the rope check measures
"""

HF = """\
model:
  source: hf               # a Hugging Face transformers model, built offline (pip install 'fwdcheck[hf]')
  # path: my-model         # a directory with config.json (and weights, optionally), instead of `config:`
  config:                  # an inline config: model_type and small sizes, randomly initialised (seeded)
    model_type: llama
    vocab_size: 64
    hidden_size: 32
    intermediate_size: 96
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    max_position_embeddings: 128
  # class: BertForMaskedLM # a class other than AutoModelForCausalLM
  # attention: {pattern: bidirectional}  # read off the model (is_encoder_decoder, is_causal); declare to override
# future-token and mask-audit run over every code path the model offers (attention implementation, output_attentions,
# attention_mask, batch size); narrow them with e.g. `code_paths: {attention_mask: [ones], batch_size: [2]}`.
"""

CHECKPOINT = """\
model:
  source: checkpoint
  # Replace with your weights: a .safetensors file or a .pt/.pth state dict, relative to this file. Until the file
  # exists the run stops with one line (exit 2) naming it.
  path: model.safetensors
  # Replace the factory with the one that builds the architecture the weights belong to ('package.module:callable',
  # built on the meta device, then the weights assigned). This one is fwdcheck's reference transformer.
  factory: "fwdcheck.model.reference:build"
  kwargs: {vocab_size: 16, d_model: 8, n_heads: 2, n_layers: 2}   # keyword arguments for the factory
  python_path: []          # directories put on sys.path first, relative to this file (its own folder always is)
  strict: true             # false: a missing or unexpected key is a warning, not an error
  trust_checkpoint: false  # true allows a pickle that runs code when it is loaded: only for files you trust
"""

_COMMON = """\
inputs:
  batch_size: 2
  seq_len: 8               # tokens per row, at least 2
  seed: 0
device: cpu                # cpu | cuda | auto (cuda when available)
dtype: float32             # float32 | bfloat16 | float16; tolerances follow the dtype
# checks: [default, grad-reach]   # omitted: the default checks, each where it applies (`fwdcheck list`)
# tolerance: {rtol: 1.3e-6, atol: 1e-5, noise_factor: 10}
# ignore: [{code: FWD203, reason: "why this finding does not count"}]
"""


def compose(model: str, name: str, others: Sequence[str]) -> str:
    """A whole starter config: the header (its run line, `name` being the file it is written to, and the other
    sources `init` offers), the source's model section, and the sections every source shares."""
    return _HEADER.format(name=name, others="|".join(others)) + model + _COMMON
