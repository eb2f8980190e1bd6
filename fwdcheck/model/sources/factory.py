"""What the factory-based sources share (`python`, `checkpoint`, and the modules fwdcheck.check_model is handed):
importing the callables a config names, calling the factory, and reading the sizes off the module it built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from fwdcheck.config.callables import on_sys_path, resolve_callable
from fwdcheck.config.schema import FactoryModel
from fwdcheck.errors import ModelLoadError, model_failure
from fwdcheck.model.capabilities import ASSUMED_CAUSAL, declared_pattern
from fwdcheck.model.config_keys import CONFIG_KEYS, extended, head_widths
from fwdcheck.model.sources.attention_declared import declare_attention
from fwdcheck.model.sources.detect import detect_capabilities
from fwdcheck.model.tested import ModelUnderTest, Rotary, describe

# Where the `config` of a factory's module keeps its sizes (nanoGPT's GPTConfig, gpt-fast's ModelArgs, litgpt's Config,
# a Hugging Face config): the shared spellings, those of nanoGPT and gpt-fast (block_size, n_local_heads) and litgpt
# (n_query_groups, head_size), and a few more (embed_dim, n_kv_head, hidden_dim, n_vocab).
MODULE_CONFIG_KEYS = extended(
    CONFIG_KEYS,
    d=("embed_dim",),
    h_kv=("n_local_heads", "n_kv_head", "n_query_groups"),
    d_h=("head_size",),
    d_ff=("hidden_dim",),
    V=("n_vocab",),
    max_positions=("block_size",),
)
# The dims read off a config object, in the order a model's dims list them.
READ_DIMS = ("d", "h", "h_kv", "d_ff", "V", "L")


@dataclass
class FactoryParts:
    """The callables a factory-based config names, imported."""

    factory: Callable[..., Any]
    forward: Callable[..., Any] | None
    rotary: Rotary | None


def import_factory_parts(spec: FactoryModel, search: list[Path]) -> FactoryParts:
    """Import the factory, forward adapter and rotary function with `search` on sys.path."""
    with on_sys_path(search):
        return FactoryParts(
            factory=resolve_callable(spec.factory, what="factory", looked_in=search),
            forward=resolve_callable(spec.forward, what="forward adapter") if spec.forward else None,
            rotary=resolve_callable(spec.rotary_function, what="rotary function") if spec.rotary_function else None,
        )


def call_factory(spec: FactoryModel, parts: FactoryParts, search: list[Path]) -> nn.Module:
    """Call the factory; one clear ModelLoadError when it raises or returns something that is not a module."""
    with on_sys_path(search):
        try:
            module = parts.factory(**spec.kwargs)
        except BaseException as exc:  # SystemExit too: a factory calling sys.exit() (argparse, ...)
            if not model_failure(exc):
                raise
            raise ModelLoadError(f"factory '{spec.factory}' raised {describe(exc)}") from exc
    if not isinstance(module, nn.Module):
        raise ModelLoadError(f"factory '{spec.factory}' returned {type(module).__name__}, not a torch.nn.Module")
    return module


def model_from_module(
    module: nn.Module, spec: FactoryModel, parts: FactoryParts, source: str, label: str | None = None
) -> ModelUnderTest:
    """Wrap a module built from a factory, reading what its own config (if any) declares."""
    dims = _dims_from_config(getattr(module, "config", None))
    if spec.dims is not None:  # what the user declares wins over what a config object says
        dims.update(spec.dims.declared())
        if "h" in spec.dims.declared() and "h_kv" not in spec.dims.declared():
            dims["h_kv"] = dims["h"]
        if "d" in dims and "h" in dims and "d_h" not in spec.dims.declared() and dims["d"] % dims["h"] == 0:
            dims["d_h"] = dims["d"] // dims["h"]
    vocab = spec.vocab_size or dims.get("V") or _embedding_rows(module)
    if not vocab:
        raise ModelLoadError(
            f"cannot tell the vocabulary size of '{spec.factory}' (no config.vocab_size, no nn.Embedding); "
            "set model.vocab_size in the config"
        )
    dims.setdefault("V", vocab)
    from_config = _first_int(getattr(module, "config", None), MODULE_CONFIG_KEYS["max_positions"])
    max_positions = spec.max_positions or (int(from_config) if from_config is not None else None)
    origins = {}
    if dims:
        origins["dims"] = (
            "declared in the config (model.dims)"
            if spec.dims is not None
            else f"read off {type(module).__name__}.config"
        )
    if spec.rope is not None:
        origins["rope"] = "declared in the config (model.rope)"
    model = detect_capabilities(
        ModelUnderTest(
            module=module,
            label=label or spec.factory,
            source=source,
            vocab_size=vocab,
            max_positions=max_positions,
            pattern=declared_pattern(spec.causal, spec.attention) or ASSUMED_CAUSAL,
            dims=dims,
            rope=spec.rope,
            rotary=parts.rotary,
            forward_adapter=parts.forward,
            origins=origins,
        )
    )
    declare_attention(model, spec)
    return model


def _first_int(model_config: Any, names: tuple[str, ...]) -> int | None:
    """The first of these attributes that the config object holds as an int; None when it holds none."""
    return next((v for n in names if isinstance(v := getattr(model_config, n, None), int)), None)


def _dims_from_config(model_config: Any) -> dict[str, int]:
    dims = {}
    for symbol in READ_DIMS:
        value = _first_int(model_config, MODULE_CONFIG_KEYS[symbol])
        if value:
            dims[symbol] = value
    if "d" in dims and "h" in dims and dims["d"] % dims["h"] == 0:
        # Hugging Face and gpt-fast say head_dim, litgpt head_size
        dims["d_h"] = _first_int(model_config, MODULE_CONFIG_KEYS["d_h"]) or dims["d"] // dims["h"]
    if "h" in dims:
        dims.setdefault("h_kv", dims["h"])
    dims.update(head_widths(model_config))  # MLA: queries and keys of one width, values of another
    return dims


def _embedding_rows(module: nn.Module) -> int | None:
    """The token embedding's size: HF's get_input_embeddings, else the first nn.Embedding registered."""
    getter = getattr(module, "get_input_embeddings", None)
    if callable(getter):
        try:
            embedding = getter()
            if isinstance(embedding, nn.Embedding):
                return embedding.num_embeddings
        except Exception:  # a model's own accessor may not be implemented; fall back to the modules
            pass
    first = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return first.num_embeddings if first is not None else None
