"""The `python` source: the user's factory builds the model, randomly initialised (load_model seeds it)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import torch

from fwdcheck.config.callables import search_dirs
from fwdcheck.config.schema import Config, PythonModel
from fwdcheck.model.capabilities import Cache, Loss, Packing
from fwdcheck.model.sources.factory import call_factory, import_factory_parts, model_from_module
from fwdcheck.model.tested import ModelUnderTest


def load_python(spec: PythonModel, config: Config) -> ModelUnderTest:
    """Import the factory and build its model (on the meta device with `meta: true`), with what the config declares
    for the checks that drive forward in ways of its own."""
    search = search_dirs(spec.python_path, config.source_path)
    parts = import_factory_parts(spec, search)  # before the meta device: import-time tensors are real ones
    with torch.device("meta") if config.meta else nullcontext():
        loaded = model_from_module(call_factory(spec, parts, search), spec, parts, source="python")
        declare_interfaces(loaded, spec)
        if spec.former_spellings:
            loaded.extra["notes"] = [*loaded.extra.get("notes", []), *spec.former_spellings]
        return loaded


def declare_interfaces(model: ModelUnderTest, spec: PythonModel) -> None:
    """What the config declares for the checks that drive forward in ways of its own; it wins over what was
    detected on the module."""
    if spec.cache is not None:  # how the kv-cache check decodes through the model
        style: Literal["input_pos", "past_key_values"] = (
            "input_pos" if spec.cache.style == "gpt-fast" else "past_key_values"
        )
        model.cache = Cache(
            style,
            origin="declared in the config (model.cache)",
            setup=spec.cache.setup if style == "input_pos" else None,
        )
    if spec.loss is not None:  # how the label-shift check asks forward for its loss
        model.loss = Loss(**spec.loss.model_dump(), origin="declared in the config (model.loss)")
    if spec.packing is not None:  # how the packing check hands forward its documents
        declared = spec.packing
        model.packing = Packing(
            declared.form,
            f"{declared.argument}= ({declared.form}, declared in the config)",
            argument=declared.argument,
            position_ids=declared.position_ids,
        )
