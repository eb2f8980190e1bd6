"""The `hf` source: Hugging Face transformers models, built offline from a local config (weights optional).

Nothing here touches the network: the load runs with HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE set, from a directory
holding config.json or from an inline config. `trust_remote_code` stays off unless the config sets it, and then the
report says the model's own code ran.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import inspect
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn
from pydantic import ValidationError

from fwdcheck.config.reading import MAX_DEPTH, nesting_depth, regular_file
from fwdcheck.config.schema import HF_WEIGHT_FILES, Config, HFModel, RopeSpec, describe_validation_error
from fwdcheck.errors import ModelLoadError, first_line
from fwdcheck.model.capabilities import (
    ASSUMED_CAUSAL,
    AttentionSwitch,
    Cache,
    Loss,
    Packing,
    Positions,
    declared_pattern,
)
from fwdcheck.model.config_keys import CONFIG_KEYS, head_widths
from fwdcheck.model.library_logs import kept_as_notes
from fwdcheck.model.sources.attention_declared import declare_attention, transformers_windows
from fwdcheck.model.sources.hf_parallel import tensor_parallel
from fwdcheck.model.sources.hf_rotary import find_rotary, rotary_axes
from fwdcheck.model.sources.pattern import fill_pattern
from fwdcheck.model.sources.seq2seq import hold_source, seq2seq_class
from fwdcheck.model.sources.vlm_image import hold_image
from fwdcheck.model.tested import ModelUnderTest, extract_logits, layer_stack_of

LOGGERS = ("transformers",)  # the library's root logger: what it logs while the model runs becomes the run's notes
# The largest model built with random weights. Random weights check the model's code, and the code is the same at
# any width: a larger one only costs memory and minutes (transformers' default Llama, what a config naming only its
# model_type builds, is 6.7B parameters, 27 GB in float32). `fwdcheck shrink` keeps the architecture at small widths.
MAX_RANDOM_PARAMETERS = 1_000_000_000
# The sizes a config gives, by transformers' standard names (the first of each row; attribute_map has each
# architecture's spelling).
# 0-based position_ids that move the logits by more than this fraction of their scale are not the model's own count:
# rounding between two orders of the same arithmetic stays near 1e-7 in float32, a shifted position moves them by
# far more than 1e-3.
POSITIONS_MOVE = 1e-4
SIZE_KEYS = tuple(CONFIG_KEYS[symbol][0] for symbol in ("V", "d", "d_ff", "L", "h"))


def require_transformers():
    try:
        import transformers  # imported on use: an optional package, and seconds to import
    except ImportError:
        raise ModelLoadError("source: hf needs the transformers package: pip install 'fwdcheck[hf]'") from None
    return transformers


@contextmanager
def offline():
    """No hub access while loading; the environment is put back afterwards."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def no_progress_bars(transformers) -> Iterator[None]:
    """transformers' progress bars ("Loading weights" on stderr, ahead of the report) off while it loads, and put
    back as found."""
    bars = getattr(getattr(transformers, "utils", None), "logging", None)
    if bars is None or not hasattr(bars, "is_progress_bar_enabled"):
        yield
        return
    enabled = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            bars.enable_progress_bar()


def load_hf(spec: HFModel, config: Config) -> ModelUnderTest:
    """Build the model the config's directory or inline config describes: its weights when the directory holds
    them, else seeded random ones (or none, on the meta device, with `meta: true`)."""
    transformers = require_transformers()
    notes = []
    if spec.trust_remote_code:
        notes.append(f"trust_remote_code is on: Python code shipped with {spec.path or 'the config'} ran")
    with offline(), kept_as_notes(LOGGERS, notes), no_progress_bars(transformers):
        hf_config = _hf_config(spec, transformers)
        cls = _model_class(spec, transformers, hf_config)
        has_weights = spec.path is not None and any((spec.path / f).exists() for f in HF_WEIGHT_FILES)
        for name in HF_WEIGHT_FILES if has_weights else ():  # a FIFO would hold from_pretrained until someone writes
            assert spec.path is not None  # has_weights
            regular_file(spec.path / name, str(spec.path / name), ModelLoadError, what="weights file")
        # before any meta-device block (refuse_oversized counts on meta too): import-time tensors are real ones
        import_model_class(cls, hf_config, spec.trust_remote_code)
        try:
            if config.meta:
                with torch.device("meta"):
                    module = _from_config(cls, hf_config, spec)
            elif has_weights:
                module = cls.from_pretrained(spec.path, config=hf_config, trust_remote_code=spec.trust_remote_code)
                notes.append(f"weights loaded from {spec.path}")
            else:
                refuse_oversized(cls, hf_config, spec)
                module = _from_config(cls, hf_config, spec)
                notes.append("no weights in the config's directory: random initialisation (seeded)")
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(
                f"transformers could not build {cls.__name__} from "
                f"{spec.path or 'the inline config'}: {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(module, nn.Module):  # pragma: no cover - transformers always returns modules
        raise ModelLoadError(f"{cls.__name__} did not build an nn.Module")
    model = hf_model_under_test(module, spec, notes, weights_at_init=not has_weights and not config.meta)
    model.weights_loaded = has_weights
    return model


def hf_model_under_test(
    module: nn.Module, spec: HFModel, notes: list[str], weights_at_init: bool = False
) -> ModelUnderTest:
    top: Any = module.config  # a transformers PretrainedConfig
    # A multimodal model keeps its language model's settings in a config of their own (text_config); its sizes,
    # positions and rope are that one's. get_text_config() is the config itself for a text-only model.
    cfg: Any = text_config(top)
    dims = config_dims(cfg, top.model_type)
    # A sentinel (XLNet's -1: no limit) or an absent field is no limit on the length.
    max_positions = config_size(cfg, "max_position_embeddings", "n_positions")
    where = str(spec.path) if spec.path else "inline config"
    config_file = str(spec.path / "config.json") if spec.path else "the inline config"
    origins = {"dims": f"{config_file} (transformers' {type(cfg).__name__})"}
    rope, origins["rope"] = model_rope(module, spec, cfg, config_file)
    model = ModelUnderTest(
        module=module,
        label=f"{top.model_type} {type(module).__name__} ({where})",
        source="hf",
        vocab_size=dims["V"],
        max_positions=max_positions,
        pattern=declared_pattern(spec.causal, spec.attention) or ASSUMED_CAUSAL,
        dims={k: v for k, v in dims.items() if v},
        declared_dims=set(),  # all read off the config by fwdcheck
        rope=rope,
        rotary=find_rotary(module, cfg),
        rotary_discovered=True,
        forward_kwargs={"position_ids", "attention_mask", "output_attentions"},
        weights_at_init=weights_at_init,
        origins=origins,
        extra={"notes": notes, "model_type": top.model_type},
    )
    model.rotary_axes = rotary_axes(module, cfg, config_file)
    fill_pattern(model)
    add_transformers_capabilities(model)
    declare_attention(model, spec)
    hold_source(model)
    hold_image(model)
    return model


def config_dims(cfg: Any, model_type: str) -> dict[str, int]:
    """The sizes a (text) config gives, by the names a report shows (V, d, h, h_kv, d_h, d_ff, L); the vocabulary
    size is required, the others only where the config states them."""
    # By transformers' standard names (attribute_map answers them for every architecture it ships) and a few older
    # spellings, not by all of CONFIG_KEYS: its others would add dims (T5's d_ff) these models' reports do not show.
    heads = config_size(cfg, "num_attention_heads", "n_head")
    hidden = config_size(cfg, "hidden_size", "n_embd")
    vocab_size = config_size(cfg, "vocab_size")
    if vocab_size is None:
        raise ModelLoadError(
            f"{model_type}'s config gives no vocabulary size ({type(cfg).__name__}.vocab_size is "
            f"{getattr(cfg, 'vocab_size', None)!r}); fwdcheck needs it to draw input ids"
        )
    dims = {"V": vocab_size}
    if hidden:
        dims["d"] = hidden
    if heads:
        dims["h"] = heads
        dims["h_kv"] = kv_heads(cfg, heads)
        head_dim = config_size(cfg, "head_dim") or (hidden // heads if hidden else None)
        if head_dim:
            dims["d_h"] = head_dim
    value_width = head_widths(cfg).get("d_v")  # MLA's v_head_dim: values narrower than queries and keys
    if value_width:
        dims["d_v"] = value_width
    d_ff = config_size(cfg, "intermediate_size", "n_inner", "ffn_dim")
    if d_ff:
        dims["d_ff"] = d_ff
    layers = config_size(cfg, "num_hidden_layers", "n_layer")
    if layers:
        dims["L"] = layers
    return dims


def model_rope(module: nn.Module, spec: HFModel, cfg: Any, config_file: str) -> tuple[RopeSpec | None, str]:
    """The rotary embedding the model declares, and where that came from: the config's `rope:`, else its Hugging
    Face config's settings (declared_rope), but only for a model that builds a rotary embedding."""
    rope, origin = (
        (spec.rope, "the config's `rope:`") if spec.rope else declared_rope(cfg, config_file, settings_read(module))
    )
    if rope is not None and not spec.rope and not builds_rotary(module):
        # transformers gives every config rope settings, also where a setting of the model switches rotary
        # embeddings off (Granite MoE hybrid's position_embedding_type None, Zamba 2's use_mem_rope False): only a
        # model that builds one declares one.
        rope = None
        origin = (
            f"none declared: {config_file} holds rope settings, but {type(module).__name__} builds no rotary "
            "embedding (the config switches it off)"
        )
    return rope, origin


def text_config(config: Any) -> Any:
    """The language model's config: get_text_config() where transformers offers it (a composite config's
    text_config, else the config itself)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # releases whose get_text_config takes no arguments
        return get()


def config_size(cfg: Any, *names: str) -> int | None:
    """The first of these settings the config gives, as one positive whole number. None when none is given, or the
    first given is not one: a sentinel (0, -1 for unlimited), a list per layer (Gemma 3n's intermediate_size), a
    fraction or text. A size fwdcheck cannot read as one number is left unnamed, never guessed."""
    value = next((v for v in (getattr(cfg, name, None) for name in names) if v is not None), None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def kv_heads(cfg, heads: int) -> int:
    """Key/value heads, across spellings: num_key_value_heads (Llama), num_kv_heads (Falcon), multi_query (Falcon,
    GPT-BigCode: one shared head unless the new decoder architecture is on)."""
    if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        return 1
    return config_size(cfg, "num_key_value_heads", "num_kv_heads") or heads


def _hf_config(spec: HFModel, transformers) -> Any:
    if spec.config is not None:
        inline = dict(spec.config)
        model_type = inline.pop("model_type")
        try:
            built = transformers.AutoConfig.for_model(model_type, **inline)
        except Exception as exc:
            raise ModelLoadError(f"inline config: {type(exc).__name__}: {exc}") from exc
        refuse_unknown_keys(type(built), inline, transformers)
        return built
    path = spec.path
    assert path is not None  # the schema asks for exactly one of config and path
    if not path.exists():
        raise ModelLoadError(f"{path}: no such directory")
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory; source hf wants a directory holding config.json")
    config_json = path / "config.json"
    if not config_json.exists():
        raise ModelLoadError(f"{path}: no config.json in this directory")
    regular_file(config_json, str(config_json), ModelLoadError, what="model config")
    try:
        document = json.loads(config_json.read_text(encoding="utf-8"))
    except RecursionError:
        raise ModelLoadError(f"{config_json}: nested too deeply to read") from None
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{config_json}: not valid JSON ({exc})") from None
    # transformers copies and compares configs recursively; one nested past any real config's depth is refused here.
    if nesting_depth(document) > MAX_DEPTH:
        raise ModelLoadError(
            f"{config_json}: nested more than {MAX_DEPTH} levels deep; a model config is a few levels deep"
        )
    if not isinstance(document, dict):
        raise ModelLoadError(f"{config_json}: holds a JSON {type(document).__name__}, not an object of settings")
    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"{config_json}: {type(exc).__name__}: {exc}") from exc


# Keys of former transformers releases a config class still takes through **kwargs and turns into its own (Llama's
# rope_theta into rope_parameters), or that every config takes: never in a class's signature, always meant.
# GPT-2's n_ctx: its former context length, which every GPT-2 config.json on the hub still carries.
ACCEPTED_KEYS = {"rope_theta", "rope_scaling", "torch_dtype", "attn_implementation", "use_return_dict", "n_ctx"}


def refuse_unknown_keys(cls: type, inline: dict[str, Any], transformers) -> None:
    """An inline config key its config class does not know is a typo (GPT-2's `n_layers` for `n_layer`): transformers
    keeps it as an attribute nothing reads and builds the default size. A key is known when the class's __init__
    takes it, its attribute_map names it, a default config carries it, or it is one every config takes. Any other
    key counts as known when it changes something else in the built config (a former spelling converted), or when
    the code of the class's module, or of transformers' config base, names it (a key read from **kwargs, perhaps
    given at its default value): only a key nothing could read is refused."""
    signature = {
        name
        for klass in (cls, transformers.PretrainedConfig)
        for name, parameter in inspect.signature(klass).parameters.items()
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD
    }
    baseline = cls().to_dict()
    known = signature | set(getattr(cls, "attribute_map", {})) | set(baseline) | ACCEPTED_KEYS
    unknown = []
    for key in (key for key in inline if key not in known):
        with_key = cls(**{key: inline[key]}).to_dict()
        with_key.pop(key, None)
        if with_key == baseline and not re.search(rf"\b{re.escape(key)}\b", _config_code(cls)):
            unknown.append(key)
    if not unknown:
        return
    problems = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known - {"_name_or_path"}), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"model.config.{key}: unknown to {cls.__name__}{hint}")
    raise ModelLoadError("; ".join(problems))


@functools.cache
def _config_code(cls: type) -> str:
    """The source of a config class's module and of the transformers modules every config reads its kwargs in."""
    import transformers.configuration_utils

    modules = [m for m in (inspect.getmodule(cls), transformers.configuration_utils) if m is not None]
    with suppress(ImportError):
        import transformers.modeling_rope_utils

        modules.append(transformers.modeling_rope_utils)
    texts = []
    for module in modules:
        with suppress(OSError, TypeError):
            texts.append(inspect.getsource(module))
    return "\n".join(texts)


def _model_class(spec: HFModel, transformers, hf_config: Any):
    """The class the config names, else AutoModelForSeq2SeqLM for an encoder-decoder, else AutoModelForCausalLM."""
    name = spec.model_class or seq2seq_class(hf_config) or "AutoModelForCausalLM"
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ModelLoadError(f"transformers {transformers.__version__} has no class '{name}'")
    return cls


def import_model_class(cls, hf_config, trust_remote_code: bool = False) -> None:
    """Imports the module that defines the class from_config will build (an Auto class resolves it lazily, at the
    first build), so its import-time code runs on the default device and never inside a meta-device block: on
    transformers 4.46 a modeling file imports torchao, whose import-time tensors fail on meta, and every hf config
    exited 2. What cannot be resolved here is left to from_config, which says why in its own words."""
    remote = getattr(hf_config, "auto_map", None) or {}
    try:
        if trust_remote_code and cls.__name__ in remote:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            repo, _, reference = remote[cls.__name__].rpartition("--")  # "repo--module.Class" or "module.Class"
            get_class_from_dynamic_module(reference, repo or hf_config.name_or_path)
        elif type(hf_config) in getattr(cls, "_model_mapping", {}):
            cls._model_mapping[type(hf_config)]  # the lookup imports the modeling module
    except Exception:  # from_config raises the same, as one ModelLoadError line
        return


def _from_config(cls, hf_config, spec: HFModel) -> nn.Module:
    if hasattr(cls, "from_config"):  # the Auto classes
        return cls.from_config(hf_config, trust_remote_code=spec.trust_remote_code)
    return cls(hf_config)


def refuse_oversized(cls, hf_config, spec: HFModel) -> None:
    """A ModelLoadError when the config would build more than MAX_RANDOM_PARAMETERS with random weights; counted on
    the meta device first, which allocates nothing and takes milliseconds even for a 70B config."""
    with torch.device("meta"):
        parameters = sum(p.numel() for p in _from_config(cls, hf_config, spec).parameters())
    if parameters <= MAX_RANDOM_PARAMETERS:
        return
    size = f"{parameters / 1e9:.1f}B-parameter model"
    limit = f"over the limit of {MAX_RANDOM_PARAMETERS / 1e9:g}B for random weights"
    shrink = "run `fwdcheck shrink` on this config (the same architecture at small widths)"
    if spec.config is not None and not any(
        key in spec.config or hf_config.attribute_map.get(key) in spec.config for key in SIZE_KEYS
    ):
        raise ModelLoadError(
            f"model.config gives no sizes: transformers' default {hf_config.model_type} would build a "
            f"{size}, {limit}; give {', '.join(SIZE_KEYS)}, or {shrink}"
        )
    where = "model.config" if spec.config is not None else f"{cast(Path, spec.path) / 'config.json'}"
    raise ModelLoadError(
        f"{where} would build a {size} with random weights (no weights file beside it), {limit}; "
        f"{shrink}, or check its shapes alone with `--meta`"
    )


def declared_rope(cfg, where: str = "the model config", read: set[str] | None = None) -> tuple[RopeSpec | None, str]:
    """What a Hugging Face config states about its rotary embedding, across the spellings architectures use, and
    where each value came from (for the report). With `read` (the settings the model's class reads, settings_read),
    only those count: MiniMax M3's config carries a rotary_dim its modeling code never reads.

    Only what the config states: its base and rotary dim. The pairing is the modeling code's business, never a
    config's (Cohere's rotate_half pairs neighbours, DeepSeek's rope_interleave reorders the weights before a half
    rotation), so it is left undeclared: measured and reported, not compared. A base the config does not give is
    not assumed either.

    transformers accepts values no rotary embedding can have (rope_theta 1.0, a rotary_dim of 0, a fraction given as
    text); each is one ModelLoadError line naming the key and the value, `where` naming the config."""

    def setting(key: str) -> Any:
        return getattr(cfg, key, None) if read is None or key in read else None

    params = setting("rope_parameters") or setting("rope_scaling") or {}
    if not isinstance(params, dict):
        params = {}
    theta_key, theta = next(
        (
            (k, v)
            for k, v in (
                ("rope_theta", params.get("rope_theta")),
                ("rope_theta", setting("rope_theta")),
                ("rotary_emb_base", setting("rotary_emb_base")),
            )
            if v is not None
        ),
        ("rope_theta", None),
    )
    rotary_dim = setting("rotary_dim")
    if theta is None and rotary_dim is None:
        return None, f"none declared: {where} gives no rope settings"  # learned or sinusoidal positions, ALiBi, ...
    rope_type = params.get("rope_type", params.get("type", "default"))
    try:
        rotary_dim, dim_origin = _declared_rotary_dim(cfg, params, setting, rotary_dim)
        base, base_origin = _declared_base(theta_key, theta, rope_type)
        spec = RopeSpec(base=base, pairing=None, rotary_dim=rotary_dim)
    except ValidationError as exc:
        problem = describe_validation_error(exc)
        key = {"base": theta_key}.get(problem.split(":")[0], problem.split(":")[0])
        raise ModelLoadError(
            f"{where}: {key}: {problem.split(': ', 1)[-1]}; not a usable rotary embedding "
            "(set `rope:` in the config to declare its settings yourself)"
        ) from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ModelLoadError(
            f"{where}: its rotary settings cannot be read ({type(exc).__name__}: {exc}); set "
            "`rope:` in the config to declare them yourself"
        ) from None
    return spec, f"read off {where}: {base_origin}, {dim_origin}; pairing not stated (measured, not compared)"


def _declared_rotary_dim(cfg, params: dict, setting: Callable[[str], Any], rotary_dim: Any) -> tuple[Any, str]:
    """The rotary dim a config states (rotary_dim), else the head size times a partial rotary factor where it gives
    one, and where it came from: 'rotary dim: head size' when it states neither. Raises TypeError or ValueError on
    values that are no sizes (declared_rope names them)."""
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    partial_key, partial = next(
        (
            (k, v)
            for k, v in (
                ("rope_parameters.partial_rotary_factor", params.get("partial_rotary_factor")),
                ("partial_rotary_factor", setting("partial_rotary_factor")),
                ("rotary_pct", setting("rotary_pct")),
            )
            if v
        ),
        (None, None),
    )
    dim_origin = f"rotary dim {rotary_dim} from rotary_dim" if rotary_dim is not None else "rotary dim: head size"
    if rotary_dim is None and partial and head_dim:
        rotary_dim = int(head_dim * partial)
        dim_origin = f"rotary dim {rotary_dim} from head size {head_dim} x {partial_key} {partial}"
    return rotary_dim, dim_origin


def _declared_base(theta_key: str, theta: Any, rope_type: str) -> tuple[float | None, str]:
    """The base a config states, and where it came from; None where it gives none or rescales the frequencies."""
    # rescaled frequencies (llama3, yarn, ...) have no single base to compare
    base = float(theta) if theta is not None and rope_type == "default" else None
    base_origin = (
        f"base {base:g} from {theta_key}"
        if base is not None
        else f"base not compared (rope_type {rope_type} rescales the frequencies)"
        if theta is not None
        else "base not stated"
    )
    return base, base_origin


def settings_read(module: nn.Module) -> set[str] | None:
    """The config settings a transformers model's class reads while it builds itself: the model rebuilt on the meta
    device (no memory, no values) from a copy of its config that records each attribute read. None when it cannot
    be rebuilt so (then every setting counts, as before)."""
    config: Any = module.config
    read: set[str] = set()
    base = type(config)

    class Recording(base):  # type: ignore[valid-type, misc]
        def __getattribute__(self, name: str) -> Any:
            read.add(name)
            return super().__getattribute__(name)

    try:
        recording = copy.deepcopy(config)
        recording.__class__ = Recording
        with torch.device("meta"), kept_as_notes(LOGGERS, []):
            type(module)(recording)
    except Exception:
        return None
    return read


def builds_rotary(module: nn.Module) -> bool:
    """Whether a transformers model built a rotary embedding: a module whose class names it, as every modeling file
    that rotates calls it (LlamaRotaryEmbedding, GPTJRotaryEmbedding, ...)."""
    return any("rotary" in type(m).__name__.lower() for m in module.modules())


# ---------------------------------------------------------------------------------------------------------------------
# What a transformers model can do, whoever built it (this source, a Python factory, a module handed to check_model)


def is_transformers_model(module: nn.Module) -> bool:
    """Whether the module is a transformers PreTrainedModel (asked without importing transformers: a model of it has
    imported it already)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def add_transformers_capabilities(model: ModelUnderTest) -> None:
    """Fill in the interfaces every transformers model offers: its attention switch, generate's cache protocol, the
    causal-LM loss, its tensor-parallel plan, the way it isolates packed documents, and its library's log."""
    module = model.module
    model.attention = AttentionSwitch.on(module)
    model.windows = transformers_windows(text_config(module.config), f"transformers' {type(module.config).__name__}")
    model.matrix_by_default = True  # attention implementation, output_attentions and attention_mask pick its path
    model.library_loggers = LOGGERS
    if own_cache_class(module):  # generate makes no cache for these: the model makes its own on the first call
        model.cache = Cache("past_key_values", origin="transformers' generate (the model's own cache class)")
    else:
        model.cache = Cache(
            "past_key_values", origin="transformers' generate (a DynamicCache made up front)", new_cache=dynamic_cache
        )
    model.tensor_parallel = tensor_parallel
    model.positions = positions_of(module)
    if not is_causal_lm(module):
        reason = f"{type(module).__name__} is not one of transformers' causal language models"
        model.unavailable["loss"] = f"{reason}: its loss (if any) is not next-token cross-entropy"
        model.unavailable["packing"] = f"{reason}: documents packed for causal training do not apply"
        return
    model.loss = loss_convention(module)
    if not model.positions.given:
        model.unavailable["packing"] = (
            f"{type(module).__name__} {model.positions.origin}: fwdcheck cannot start each packed document's "
            "positions at 0"
        )
        return
    carries_state = stateful_layers(module)
    if mask_builder_reads_positions(module):
        model.packing = Packing(
            "positions",
            "position_ids restarting per document, no attention_mask, use_cache=False (transformers' mask "
            f"builder finds the documents from the positions{' for the attention layers' if carries_state else ''})",
            position_ids=True,
            fixed=(("use_cache", False),),
            carries_state=carries_state,
        )
        return
    window = windowed(text_config(module.config))
    if window:
        model.unavailable["packing"] = (
            f"{type(module).__name__} does not find packed documents from position_ids, "
            f"and one 4-D attention_mask cannot carry its own attention pattern ({window})"
        )
        return
    refused = refuses_4d_mask(module, with_positions=model.positions.given)
    if refused:
        model.unavailable["packing"] = (
            f"{type(module).__name__} takes only 2-D attention masks (a 4-D one {refused}); one 2-D mask cannot keep "
            "packed documents apart"
        )
        return
    model.packing = Packing(
        "additive-mask",
        "a 4-D block-diagonal causal attention_mask (additive) with position_ids restarting per document",
        argument="attention_mask",
        position_ids=True,
        carries_state=carries_state,
    )


# Layer kinds of transformers' configs that attend (keys and values per token, which a mask or positions separate);
# every other kind a config names (mamba, linear_attention, conv, ...) keeps a state along the row.
ATTENTION_KINDS = {"attention", "full_attention", "sliding_attention", "chunked_attention", "global", "local"}


def stateful_layers(module: nn.Module) -> str | None:
    """The model's layers whose state runs along the whole row, as its config names their kinds (layer_types,
    layers_block_type), e.g. "mamba layers"; for a model with no attention module at all, its layers' class. None
    for a model that only attends."""
    config = text_config(module.config)
    for key in ("layer_types", "layers_block_type", "block_types"):
        kinds = getattr(config, key, None)
        if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
            stateful = sorted({k for k in kinds if k.lower() not in ATTENTION_KINDS})
            return f"{' and '.join(stateful)} layers ({key})" if stateful else None
    if any(type(m).__name__.endswith("Attention") for m in module.modules()):
        return None
    stack = layer_stack_of(module)
    blocks = dict(module.named_modules()).get(stack) if stack else None
    kind = type(blocks[0]).__name__ if isinstance(blocks, nn.ModuleList) and len(blocks) else "layers"
    return f"{kind} layers (no attention: a recurrent or convolution mixer)"


# A forward that shifts its labels itself: transformers' shared causal-LM loss, or the shift written out.
_SHIFTS = re.compile(r"loss_function|shift_labels|shift_logits|\[\s*(?:\.\.\.|:)\s*,\s*1\s*:")
_OWN_CROSS_ENTROPY = re.compile(r"CrossEntropyLoss|cross_entropy")


def loss_convention(module: nn.Module) -> Loss:
    """How the causal LM's forward lines its labels up, read off its source: transformers' convention (labels =
    input ids, the model shifts them: its shared loss_function, or a shift written out), or, for a forward that
    scores each position's logits against the label at the same position with a cross-entropy of its own (XLNet:
    labels are the targets of each prediction, its docs say), the caller's shift."""
    convention = Loss("labels", "model", "loss", -100, "transformers' causal-LM convention (labels = input ids)")
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return convention
    if _SHIFTS.search(source) or not _OWN_CROSS_ENTROPY.search(source):
        return convention
    return Loss(
        "labels",
        "caller",
        "loss",
        -100,
        f"{type(module).__name__}.forward's own cross-entropy of logits against labels at the same position, no "
        "shift: labels are the caller's next tokens",
    )


def own_cache_class(module: nn.Module) -> bool:
    """Whether generate leaves the cache to the model (its own cache class: MiniMax, xLSTM, ...) rather than making
    a DynamicCache up front, as transformers' _supports_default_dynamic_cache says."""
    supports = getattr(module, "_supports_default_dynamic_cache", None)
    try:
        return callable(supports) and not supports()
    except Exception:  # a release whose method asks for more: generate's default, a DynamicCache
        return False


def refuses_4d_mask(module: nn.Module, with_positions: bool) -> str | None:
    """How the model refuses a 4-D additive attention mask of one short row (all keys of the past allowed), with
    position_ids as packing passes them (OPT counts positions from a 2-D mask when given none), or None when it takes
    one (or there are no values to run: the meta device)."""
    vocab = config_size(text_config(module.config), "vocab_size")
    parameter = next(module.parameters(), None)
    if parameter is None or parameter.is_meta or vocab is None:
        return None
    length = 4
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(parameter.device)
    lowest = torch.finfo(parameter.dtype if parameter.is_floating_point() else torch.float32).min
    causal = torch.ones(length, length, dtype=torch.bool, device=parameter.device).tril()
    mask = torch.zeros(1, 1, length, length, device=parameter.device).masked_fill(~causal, lowest)  # (1, 1, T, T)
    if parameter.is_floating_point():
        mask = mask.to(parameter.dtype)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            positions = {"position_ids": torch.arange(length, device=ids.device)[None]} if with_positions else {}
            module(ids, attention_mask=mask, **positions)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {first_line(exc)[:120]}"
    finally:
        module.train(was_training)
    return None


def positions_of(module: nn.Module) -> Positions:
    """How a transformers model learns its positions, from what it reads: position_ids named in forward's signature
    (a name swallowed by **kwargs is not read: the BART-family decoders), then, where the weights have values, the
    observed effect of 0-based position_ids on the logits of one short row. Positions that move the logits of the
    model's own count are in another convention (RoBERTa counts from padding_idx + 1): the model keeps its own."""
    name = type(module).__name__
    parameters: Mapping[str, inspect.Parameter]
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    taken = parameters.get("position_ids")
    if taken is None or taken.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
        return Positions("own", "takes no position_ids (forward does not name them, so they cannot be given)")
    signature = f"{name}.forward names position_ids"
    vocab = config_size(text_config(module.config), "vocab_size")
    parameter = next(module.parameters(), None)
    if parameter is None or parameter.is_meta or vocab is None:
        return Positions("given", f"{signature} (not run: no values to observe)")
    length = 6
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(parameter.device)
    zero_based = torch.arange(length, device=parameter.device)[None]  # (1, T)
    fixed = {"use_cache": False} if "use_cache" in parameters else {}  # no cache made, none kept
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            own = extract_logits(module(ids, **fixed)).float()
            given = extract_logits(module(ids, position_ids=zero_based, **fixed)).float()
    except Exception:  # the checks run the model and report what it raises; here there is nothing to observe
        return Positions("given", f"{signature} (its forward raised when observed)")
    finally:
        module.train(was_training)
    scale = own.abs().max().clamp_min(1e-6)
    if torch.isfinite(own).all() and ((own - given).abs().max() / scale) > POSITIONS_MOVE:
        return Positions(
            "own",
            "counts its own positions in another convention (position_ids = 0..T-1 move the logits of its own "
            f"count by {float((own - given).abs().max() / scale):.1e} of their scale)",
        )
    return Positions("given", f"{signature}, and 0-based positions reproduce its own count")


def is_causal_lm(module: nn.Module) -> bool:
    """Whether a transformers model is one of the classes AutoModelForCausalLM builds (their loss shifts labels)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return type(module).__name__ in names


def dynamic_cache(module: nn.Module) -> Any:
    """An empty cache for the first call, as generate makes it: the layer types (sliding window, ...) from the
    config; None for a model with a cache class of its own (MiniMax, Mamba), which its forward makes, as generate
    leaves it to."""
    from transformers import DynamicCache

    supports = getattr(module, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return None
    config: Any = module.config  # a transformers PretrainedConfig
    # generate's own: the decoder's text config, which holds the layers (BLT's top config has none of its own)
    decoder = getattr(config, "get_text_config", None)
    config = decoder(decoder=True) if callable(decoder) else config
    try:
        return DynamicCache(config=config)
    except TypeError:  # releases whose DynamicCache takes no config
        return DynamicCache()


def mask_builder_reads_positions(module: nn.Module) -> bool:
    """Whether a transformers model hands position_ids to the masking_utils mask builder, which then finds packed
    documents from positions that restart and keeps each one to itself: its base model's forward calls a *mask*
    function with position_ids=..., or with **kwargs from a dict holding "position_ids", and its modeling module
    uses masking_utils' create_causal_mask."""
    base = getattr(module, "base_model", module)
    masking = sys.modules.get("transformers.masking_utils")
    modeling = sys.modules.get(type(base).__module__)
    if masking is None or getattr(modeling, "create_causal_mask", None) is not masking.create_causal_mask:
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(base).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    holding_positions = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "position_ids" for k in node.value.keys)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if "mask" not in called.lower():
            continue
        for keyword in node.keywords:
            if keyword.arg == "position_ids":
                return True
            if keyword.arg is None and isinstance(keyword.value, ast.Name) and keyword.value.id in holding_positions:
                return True
    return False


def windowed(config) -> str | None:
    """Why one 4-D mask for every layer cannot stand for this model's own masks (sliding-window or chunked
    attention), or None."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return f"sliding_window {window}"
    if getattr(config, "attention_chunk_size", None):
        return f"attention_chunk_size {config.attention_chunk_size}"
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        return f"layer_types {sorted(kinds)}"
    return None
