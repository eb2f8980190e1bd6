"""Capabilities read off the module itself, whichever source built it.

A transformers model built by a Python factory, loaded from a checkpoint or handed to check_model is driven as a
transformers model (a vision-language model with an image too: vlm_image.py); the reference transformer built by a
factory is driven as the reference. What a config declares
(`cache:`, `loss:`, `packing:`, `attention:`) is applied by its source after this, and wins.
"""

from __future__ import annotations

from fwdcheck.model.capabilities import AttentionSwitch
from fwdcheck.model.reference import ReferenceTransformer
from fwdcheck.model.sources.hf import add_transformers_capabilities, is_transformers_model, text_config
from fwdcheck.model.sources.hf_rotary import rotary_axes
from fwdcheck.model.sources.pattern import fill_pattern
from fwdcheck.model.sources.reference import add_reference_capabilities
from fwdcheck.model.sources.vlm_image import hold_image
from fwdcheck.model.tested import ModelUnderTest


def detect_capabilities(model: ModelUnderTest) -> ModelUnderTest:
    """Fill in what the module shows it can do. A `forward:` adapter drives the model its own way, so only the
    attention switch, the attention pattern and a multi-axis rotary embedding's axes (the module's own, whatever
    calls it) are read then."""
    module = model.module
    fill_pattern(model)
    if model.rotary_axes is None and is_transformers_model(module):
        model.rotary_axes = rotary_axes(module, text_config(module.config), f"{type(module).__name__}'s config")
    if model.forward_adapter is None:
        if is_transformers_model(module):
            add_transformers_capabilities(model)
            hold_image(model)  # a vision-language model runs its text path with an image too
        elif isinstance(module, ReferenceTransformer):
            add_reference_capabilities(model)
    if model.attention is None:
        model.attention = AttentionSwitch.on(module)
    return model
