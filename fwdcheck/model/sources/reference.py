"""The `reference` source: fwdcheck's built-in transformer (fwdcheck/model/reference.py), with the bugs the config
plants."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import cast

import torch

from fwdcheck.config.schema import Config, ReferenceModel, RopeSpec
from fwdcheck.errors import ModelLoadError, first_line
from fwdcheck.model.capabilities import AttentionSwitch, Cache, Loss, Packing, Windows
from fwdcheck.model.reference import ReferenceConfig, ReferenceTransformer, apply_rope
from fwdcheck.model.tested import ModelUnderTest


def load_reference(spec: ReferenceModel, config: Config) -> ModelUnderTest:
    """Build the reference model the config describes (on the meta device with `meta: true`)."""
    with torch.device("meta") if config.meta else nullcontext():
        return _build(spec)


def _build(spec: ReferenceModel) -> ModelUnderTest:
    fields = spec.model_dump(exclude={"source"})
    cfg = ReferenceConfig(**fields)
    assert cfg.n_kv_heads is not None  # filled in by ReferenceConfig.__post_init__
    try:
        module = ReferenceTransformer(cfg)
    except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:  # sizes torch cannot allocate
        first = first_line(exc)
        raise ModelLoadError(
            f"the reference model cannot be built with these sizes: {type(exc).__name__}: {first}"
        ) from exc
    rope = rotary = None
    if cfg.positional == "rope":
        rope = RopeSpec(base=cfg.rope.base, pairing=cfg.rope.pairing, rotary_dim=cfg.rotary_dim)
        rotary = partial(apply_rope, base=cfg.rope.base, pairing=cfg.rope.pairing, rotary_dim=cfg.rotary_dim)

    bugs = ", ".join(cfg.bugs) or "none"
    model = ModelUnderTest(
        module=module,
        label=f"reference ({cfg.positional}, {cfg.attention}, {cfg.n_layers} layers; planted bugs: {bugs})",
        source="reference",
        vocab_size=cfg.vocab_size,
        max_positions=cfg.max_seq_len,
        dims=dict(
            d=cfg.d_model,
            h=cfg.n_heads,
            h_kv=cfg.n_kv_heads,
            d_h=cfg.head_dim,
            V=cfg.vocab_size,
            d_ff=cfg.d_ff,
            L=cfg.n_layers,
        ),
        rope=rope,
        rotary=rotary,
        weights_at_init=True,
        origins={"dims": "the config's model section", **({"rope": "the config's model section"} if rope else {})},
        extra={"bugs": list(cfg.bugs)},
    )
    add_reference_capabilities(model)
    return model


def add_reference_capabilities(model: ModelUnderTest) -> None:
    """What the reference transformer offers beside logits, however it was built (fwdcheck/model/reference.py's
    forward): a cache through past_key_values, a loss from labels, packed documents by document_ids, its attention
    switch and the rotation as its layers apply it."""
    module = cast(ReferenceTransformer, model.module)  # the callers' check
    model.cache = Cache("past_key_values", origin="the reference model's (past_key_values, use_cache=True)")
    model.loss = Loss("labels", "model", 1, -100, "the reference model's (labels = input ids, (logits, loss))")
    model.packing = Packing("document_ids", "document_ids (the reference model's packed path)", argument="document_ids")
    model.attention = AttentionSwitch.on(module)
    if module.config.window is not None:
        model.windows = Windows.declared(module.config.window, "the reference model's window")
    if module.config.positional == "rope":
        model.rotary_in_layers = module.rotary  # in the layers' precision, planted bugs included
