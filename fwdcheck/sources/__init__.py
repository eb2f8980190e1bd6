"""Model sources: each `source:` a config can name is one module here, turning its config into a ModelUnderTest.

    reference   fwdcheck's built-in transformer                          reference.py
    python      the user's factory, randomly initialised                 python.py
    checkpoint  the user's factory, filled from a weights file           checkpoint.py
    hf          a Hugging Face transformers model, built offline         hf.py

factory.py holds what the factory-based sources share. Loaders never judge the model; they only build it and say
clearly (ModelLoadError, exit 2) when they cannot.

Adding a source takes one config class in fwdcheck/config.py (a ModelSpec with a `source: Literal["name"]` field,
added to the ModelSource union; `resolve_paths` and `files_read` if it names files), one module here whose loader
turns that class and the Config into a ModelUnderTest, and its row in LOADERS. tests/test_sources.py holds LOADERS and the union to the same sources. (`fwdcheck init --source`
offers the new source once fwdcheck/templates.py has a starter config for it.)
"""

from __future__ import annotations

import pkgutil

import torch

from fwdcheck.config import Config
from fwdcheck.model import ModelUnderTest

# Each source's loader, (spec, config) -> ModelUnderTest, as 'module:function': imported when a config names the
# source. (transformers and safetensors are imported by the hf and checkpoint loaders themselves, when they run.)
LOADERS = {
    "reference": "fwdcheck.sources.reference:load_reference",
    "python": "fwdcheck.sources.python:load_python",
    "checkpoint": "fwdcheck.sources.checkpoint:load_checkpoint",
    "hf": "fwdcheck.sources.hf:load_hf",
}


def load_model(config: Config) -> ModelUnderTest:
    """Build the model the config names. Raises ModelLoadError (exit 2) when it cannot be built at all."""
    with torch.random.fork_rng(devices=[]):  # the user's RNG state is not ours to advance
        torch.manual_seed(config.inputs.seed)
        return pkgutil.resolve_name(LOADERS[config.model.source])(config.model, config)
