"""Model sources: each `source:` a config can name is one module here, turning its config into a ModelUnderTest.

    reference   fwdcheck's built-in transformer                          reference.py
    python      the user's factory, randomly initialised                 python.py
    checkpoint  the user's factory, filled from a weights file           checkpoint.py
    hf          a Hugging Face transformers model, built offline         hf.py

factory.py holds what the factory-based sources share; detect.py reads capabilities off the module itself (a
transformers model or the reference transformer is driven as one whichever source built it); shrink.py writes a
small copy of each source's config (`fwdcheck shrink`). Loaders never judge the model; they only build it, fill in
its capabilities (fwdcheck/model/capabilities.py) and say clearly (ModelLoadError, exit 2) when they cannot. Nothing
outside this package names a source: checks ask the capabilities (tests/test_layout.py holds the rule).

Adding a source takes one config class in fwdcheck/config/schema.py (a ModelSpec with a `source: Literal["name"]` field,
added to the ModelSource union; `resolve_paths` and `files_read` if it names files), one module here whose loader
turns that class and the Config into a ModelUnderTest, and its row in LOADERS. tests/test_sources.py holds LOADERS
and the union to the same sources. (`fwdcheck init --source` offers the new source once fwdcheck/config/templates.py has
a starter config for it; `fwdcheck shrink` once shrink.py has rules for it.)
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fwdcheck.config.schema import Config, Dims, FactoryModel, HFModel, RopeSpec

if TYPE_CHECKING:  # the package itself stays torch-free: `fwdcheck shrink` (sources/shrink.py) never loads torch
    import torch.nn as nn

    from fwdcheck.model.under_test import ModelUnderTest

# Each source's loader, (spec, config) -> ModelUnderTest, as 'module:function': imported when a config names the
# source. (transformers and safetensors are imported by the hf and checkpoint loaders themselves, when they run.)
LOADERS = {
    "reference": "fwdcheck.model.sources.reference:load_reference",
    "python": "fwdcheck.model.sources.python:load_python",
    "checkpoint": "fwdcheck.model.sources.checkpoint:load_checkpoint",
    "hf": "fwdcheck.model.sources.hf:load_hf",
}


def load_model(config: Config) -> ModelUnderTest:
    """Build the model the config names. Raises ModelLoadError (exit 2) when it cannot be built at all."""
    import torch

    with torch.random.fork_rng(devices=[]):  # the user's RNG state is not ours to advance
        torch.manual_seed(config.inputs.seed)
        return pkgutil.resolve_name(LOADERS[config.model.source])(config.model, config)


def from_module(
    module: nn.Module,
    *,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    causal: bool = True,
    rope: dict[str, Any] | None = None,
    dims: dict[str, int] | None = None,
    forward: Callable[..., Any] | None = None,
) -> ModelUnderTest:
    """A ModelUnderTest for a module handed over directly (fwdcheck.check_model): a transformers model keeps its
    config's description unless a forward adapter drives it; any other module is read as a factory's would be."""
    from fwdcheck.model.sources.factory import FactoryParts, model_from_module
    from fwdcheck.model.sources.hf import hf_model_under_test, is_transformers_model

    declared_rope = RopeSpec(**rope) if rope else None
    if forward is None and is_transformers_model(module):
        hf_config: Any = module.config  # a transformers PretrainedConfig
        hf_spec = HFModel(source="hf", config={"model_type": hf_config.model_type}, causal=causal, rope=declared_rope)
        return hf_model_under_test(module, hf_spec, notes=[])
    spec = FactoryModel(
        factory="api:check_model",
        vocab_size=vocab_size,
        max_positions=max_positions,
        causal=causal,
        rope=declared_rope,
        dims=Dims(**dims) if dims else None,
    )
    parts = FactoryParts(factory=lambda: module, forward=forward, rotary=None)
    return model_from_module(module, spec, parts, source="python", label=type(module).__name__)
