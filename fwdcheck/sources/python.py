"""The `python` source: the user's factory builds the model, randomly initialised (load_model seeds it)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from fwdcheck.config import Config, PythonModel
from fwdcheck.model import ModelUnderTest
from fwdcheck.sources.factory import call_factory, import_factory_parts, model_from_module, search_dirs


def load_python(spec: PythonModel, config: Config) -> ModelUnderTest:
    """Import the factory and build its model (on the meta device with `meta: true`), with what the config declares
    for the checks that drive forward in ways of its own."""
    with torch.device("meta") if config.meta else nullcontext():
        search = search_dirs(spec.path, config)
        parts = import_factory_parts(spec, search)
        loaded = model_from_module(call_factory(spec, parts, search), spec, parts, source="python")
        if spec.cache is not None:
            loaded.extra["cache"] = spec.cache.model_dump()  # how the kv-cache check decodes through the model
        if spec.loss is not None:
            loaded.extra["loss"] = spec.loss.model_dump()  # how the label-shift check asks forward for its loss
        if spec.packing is not None:
            loaded.extra["packing"] = spec.packing.model_dump()  # how the packing check hands forward its documents
        return loaded
