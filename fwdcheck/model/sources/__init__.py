"""Model sources: each `source:` a config can name is one row in SOURCES (fwdcheck/config/sources.py) and one module
here, whose loader turns its config into a ModelUnderTest.

    reference   fwdcheck's built-in transformer                          reference.py
    python      the user's factory, randomly initialised                 python.py
    checkpoint  the user's factory, filled from a weights file           checkpoint.py
    hf          a Hugging Face transformers model, built offline         hf.py

A `Source` record holds all that fwdcheck knows of a source: its name, its config class, its loader, its starter
config (`fwdcheck init --source NAME`) and its rules for `fwdcheck shrink`. Everything that lists the sources is read
off SOURCES: the config's `model:` section (validated as the class its `source:` names), load_model's dispatch, the
starter configs `init` offers and the command line's `--source` help, and shrink's dispatch (shrink.py). The table
sits in the config layer, below this package, because a config file is validated through it.

factory.py holds what the factory-based sources share; detect.py reads capabilities off the module itself (a
transformers model or the reference transformer is driven as one whichever source built it); shrink.py writes a
small copy of a source's config by the rules its record names. Loaders never judge the model; they only build it,
fill in its capabilities (fwdcheck/model/capabilities.py) and say clearly (ModelLoadError, exit 2) when they cannot.
Nothing outside this package names a source: checks ask the capabilities (tests/test_layout.py holds the rule).

Adding a source is one module (its config class, a ModelSpec with a `source: Literal["name"]` field and
`resolve_paths` / `files_read` if it names files, and its loader, which turns that class and the Config into a
ModelUnderTest) and its row in SOURCES: a config file naming it validates and load_model loads it; with a starter
config, `init` offers it; with rules (a torch-free function, as shrink.py's), `shrink` shrinks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fwdcheck.config import templates
from fwdcheck.config.sources import SOURCES, resolve
from fwdcheck.errors import UsageError

if TYPE_CHECKING:  # the package itself stays torch- and pydantic-free: `fwdcheck --help`, `init` and `shrink` read it
    import torch.nn as nn

    from fwdcheck.config.schema import Config
    from fwdcheck.model.tested import ModelUnderTest


def load_model(config: Config) -> ModelUnderTest:
    """Build the model the config names. Raises ModelLoadError (exit 2) when it cannot be built at all."""
    import torch

    loader = resolve(SOURCES[config.model.source].loader)
    with torch.random.fork_rng(devices=[]):  # the user's RNG state is not ours to advance
        torch.manual_seed(config.inputs.seed)
        return loader(config.model, config)


def starters() -> dict[str, str]:
    """The sources `fwdcheck init --source` offers, in the table's order, with their model sections."""
    return {name: source.template for name, source in SOURCES.items() if source.template is not None}


def starter_config(source: str, name: str) -> str:
    """The commented starter config for a model source; `name` is the file it is written to, for its run line."""
    offered = starters()
    if source not in offered:
        known = f"known: {', '.join(offered)}"
        raise UsageError(
            f"`source: {source}` has no starter config; {known}"
            if source in SOURCES
            else f"unknown source {source!r}; {known}"
        )
    return templates.compose(offered[source], name, [other for other in offered if other != source])


def from_module(
    module: nn.Module,
    *,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    causal: bool | None = None,
    attention: Any = None,
    rope: dict[str, Any] | None = None,
    dims: dict[str, int] | None = None,
    forward: Callable[..., Any] | None = None,
    window: int | list[int | None] | None = None,
    chunk: int | list[int | None] | None = None,
    scale: float | None = None,
) -> ModelUnderTest:
    """A ModelUnderTest for a module handed over directly (fwdcheck.check_model): a transformers model keeps its
    config's description unless a forward adapter drives it; any other module is read as a factory's would be."""
    from fwdcheck.config.schema import Dims, FactoryModel, HFModel, RopeSpec
    from fwdcheck.model.sources.factory import FactoryParts, model_from_module
    from fwdcheck.model.sources.hf import hf_model_under_test, is_transformers_model

    declared_rope = RopeSpec(**rope) if rope else None
    if forward is None and is_transformers_model(module):
        hf_config: Any = module.config  # a transformers PretrainedConfig
        hf_spec = HFModel(
            source="hf",
            config={"model_type": hf_config.model_type},
            causal=causal,
            attention=attention,
            rope=declared_rope,
            window=window,
            chunk=chunk,
            scale=scale,
        )
        return hf_model_under_test(module, hf_spec, notes=[])
    spec = FactoryModel(
        factory="api:check_model",
        vocab_size=vocab_size,
        max_positions=max_positions,
        causal=causal,
        attention=attention,
        rope=declared_rope,
        dims=Dims(**dims) if dims else None,
        window=window,
        chunk=chunk,
        scale=scale,
    )
    parts = FactoryParts(factory=lambda: module, forward=forward, rotary=None)
    return model_from_module(module, spec, parts, source="python", label=type(module).__name__)
