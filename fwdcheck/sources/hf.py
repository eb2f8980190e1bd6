"""The `hf` source: Hugging Face transformers models, built offline from a local config (weights optional).

Nothing here touches the network: the load runs with HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE set, from a directory
holding config.json or from an inline config. `trust_remote_code` stays off unless the config sets it, and then the
report says the model's own code ran.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from pydantic import ValidationError

from fwdcheck.config import (HF_WEIGHT_FILES, MAX_DEPTH, Config, HFModel, RopeSpec, describe_validation_error,
                             nesting_depth, regular_file)
from fwdcheck.config_keys import CONFIG_KEYS
from fwdcheck.errors import ModelLoadError
from fwdcheck.model import ModelUnderTest

# Architectures whose rotary embedding pairs dim 2i with 2i+1 (GPT-J's rotate_every_two); the rest use rotate_half.
INTERLEAVED = {"gptj", "codegen"}
# The largest model built with random weights. Random weights check the model's code, and the code is the same at
# any width: a larger one only costs memory and minutes (transformers' default Llama, what a config naming only its
# model_type builds, is 6.7B parameters, 27 GB in float32). `fwdcheck shrink` keeps the architecture at small widths.
MAX_RANDOM_PARAMETERS = 1_000_000_000
# The sizes a config gives, by transformers' standard names (the first of each row; attribute_map has each
# architecture's spelling).
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


def load_hf(spec: HFModel, config: Config) -> ModelUnderTest:
    """Build the model the config's directory or inline config describes: its weights when the directory holds
    them, else seeded random ones (or none, on the meta device, with `meta: true`)."""
    transformers = require_transformers()
    notes = []
    if spec.trust_remote_code:
        notes.append(f"trust_remote_code is on: Python code shipped with {spec.path or 'the config'} ran")
    with offline(), library_messages(notes):
        hf_config = _hf_config(spec, transformers)
        cls = _model_class(spec, transformers)
        has_weights = spec.path is not None and any((spec.path / f).exists() for f in HF_WEIGHT_FILES)
        for name in HF_WEIGHT_FILES if has_weights else ():  # a FIFO would hold from_pretrained until someone writes
            regular_file(spec.path / name, str(spec.path / name), ModelLoadError, what="weights file")
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
            raise ModelLoadError(f"transformers could not build {cls.__name__} from "
                                 f"{spec.path or 'the inline config'}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, nn.Module):  # pragma: no cover - transformers always returns modules
        raise ModelLoadError(f"{cls.__name__} did not build an nn.Module")
    return hf_model_under_test(module, spec, notes)


def hf_model_under_test(module: nn.Module, spec: HFModel, notes: list[str]) -> ModelUnderTest:
    cfg = module.config
    # By transformers' standard names (attribute_map answers them for every architecture it ships) and a few older
    # spellings, not by all of CONFIG_KEYS: its others would add dims (T5's d_ff) these models' reports do not show.
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    dims = {"V": cfg.vocab_size}
    if hidden:
        dims["d"] = hidden
    if heads:
        dims["h"] = heads
        dims["h_kv"] = kv_heads(cfg, heads)
        dims["d_h"] = getattr(cfg, "head_dim", None) or (hidden // heads if hidden else None)
    d_ff = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or getattr(cfg, "ffn_dim", None)
    if d_ff:
        dims["d_ff"] = d_ff
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    if layers:
        dims["L"] = layers
    max_positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    where = str(spec.path) if spec.path else "inline config"
    rope = spec.rope or declared_rope(cfg, str(spec.path / "config.json") if spec.path else "the inline config")
    return ModelUnderTest(
        module=module,
        label=f"{cfg.model_type} {type(module).__name__} ({where})",
        source="hf",
        vocab_size=cfg.vocab_size,
        max_positions=max_positions,
        causal=spec.causal,
        dims={k: v for k, v in dims.items() if v},
        rope=rope,
        rotary=find_rotary(module),
        rotary_discovered=True,
        forward_kwargs={"position_ids", "attention_mask", "output_attentions"},
        attn_implementations=attn_implementations(module),
        extra={"notes": notes, "model_type": cfg.model_type},
    )


def kv_heads(cfg, heads: int) -> int:
    """Key/value heads, across spellings: num_key_value_heads (Llama), num_kv_heads (Falcon), multi_query (Falcon,
    GPT-BigCode: one shared head unless the new decoder architecture is on)."""
    if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        return 1
    return getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None) or heads


def _hf_config(spec: HFModel, transformers) -> Any:
    if spec.config is not None:
        inline = dict(spec.config)
        model_type = inline.pop("model_type")
        try:
            return transformers.AutoConfig.for_model(model_type, **inline)
        except Exception as exc:
            raise ModelLoadError(f"inline config: {type(exc).__name__}: {exc}") from exc
    path = spec.path
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
        raise ModelLoadError(f"{config_json}: nested more than {MAX_DEPTH} levels deep; a model config is a few "
                             "levels deep")
    if not isinstance(document, dict):
        raise ModelLoadError(f"{config_json}: holds a JSON {type(document).__name__}, not an object of settings")
    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"{config_json}: {type(exc).__name__}: {exc}") from exc


def _model_class(spec: HFModel, transformers):
    name = spec.model_class or "AutoModelForCausalLM"
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ModelLoadError(f"transformers {transformers.__version__} has no class '{name}'")
    return cls


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
            key in spec.config or hf_config.attribute_map.get(key) in spec.config for key in SIZE_KEYS):
        raise ModelLoadError(f"model.config gives no sizes: transformers' default {hf_config.model_type} would build a "
                             f"{size}, {limit}; give {', '.join(SIZE_KEYS)}, or {shrink}")
    where = "model.config" if spec.config is not None else f"{spec.path / 'config.json'}"
    raise ModelLoadError(f"{where} would build a {size} with random weights (no weights file beside it), {limit}; "
                         f"{shrink}, or check its shapes alone with `--meta`")


def declared_rope(cfg, where: str = "the model config") -> RopeSpec | None:
    """What a Hugging Face config says about its rotary embedding, across the spellings architectures use.

    transformers accepts values no rotary embedding can have (rope_theta 1.0, a rotary_dim of 0, a fraction given as
    text); each is one ModelLoadError line naming the key and the value, `where` naming the config."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = {}
    theta_key, theta = next(((k, v) for k, v in (("rope_theta", params.get("rope_theta")),
                                                 ("rope_theta", getattr(cfg, "rope_theta", None)),
                                                 ("rotary_emb_base", getattr(cfg, "rotary_emb_base", None)))
                             if v is not None), ("rope_theta", None))
    rotary_dim = getattr(cfg, "rotary_dim", None)
    if theta is None and rotary_dim is None:
        return None  # learned or sinusoidal absolute positions, ALiBi, ...
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    try:
        head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
        partial = params.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or \
            getattr(cfg, "rotary_pct", None)
        if rotary_dim is None and partial and head_dim:
            rotary_dim = int(head_dim * partial)
        # rescaled frequencies (llama3, yarn, ...) have no single base to compare
        base = (10000.0 if theta is None else float(theta)) if rope_type == "default" else None
        return RopeSpec(base=base, pairing="interleaved" if cfg.model_type in INTERLEAVED else "half",
                        rotary_dim=rotary_dim)
    except ValidationError as exc:
        problem = describe_validation_error(exc)
        key = {"base": theta_key}.get(problem.split(":")[0], problem.split(":")[0])
        raise ModelLoadError(f"{where}: {key}: {problem.split(': ', 1)[-1]}; not a usable rotary embedding "
                             "(set `rope:` in the config to declare its settings yourself)") from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ModelLoadError(f"{where}: its rotary settings cannot be read ({type(exc).__name__}: {exc}); set "
                             "`rope:` in the config to declare them yourself") from None


def find_rotary(module: nn.Module):
    """The model's rotary embedding as a function (x [B,h,T,d_h], positions [T]) -> rotated x, when the modeling
    file follows the common layout: a *RotaryEmbedding module returning (cos, sin) and apply_rotary_pos_emb(q, k,
    cos, sin) beside the attention class. None otherwise (the probe through the model still runs)."""
    rotary_emb = next((m for m in module.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    attention = next((m for m in module.modules() if type(m).__name__.endswith("Attention")), None)
    apply = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None) if attention else None
    if rotary_emb is None or apply is None:
        return None

    def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_emb(x, positions[None].expand(x.shape[0], -1))
        rotated, _ = apply(x, x, cos, sin)
        return rotated

    return rotary


def attn_implementations(module: nn.Module) -> list[str]:
    """The attention implementations this model can switch between without extra packages."""
    found = ["eager"]
    if getattr(module, "_supports_sdpa", False):
        found.append("sdpa")
    return found


@contextmanager
def using_attn_implementation(module: nn.Module, implementation: str | None):
    """Switch the attention implementation for the duration, and put the original back."""
    if implementation is None:
        yield
        return
    config = module.config
    original = config._attn_implementation
    module.set_attn_implementation(implementation)
    try:
        yield
    finally:
        module.set_attn_implementation(original)


@contextmanager
def library_messages(notes: list[str]):
    """What transformers logs during the block goes into `notes` (each distinct message once) instead of onto stderr
    ahead of the report, e.g. "`sdpa` attention does not support `output_attentions=True`" when the code-path matrix
    asks for attentions. Nested, the outermost one keeps the messages: a run's code-path cells have sessions of their
    own inside the run's. (Python warnings, the library's or the model's, are the caller's to collect: the command
    line makes them notes too.)"""
    logger = logging.getLogger("transformers")  # the library's root logger: its own handler, no propagation
    if "transformers" not in sys.modules or any(isinstance(h, _NoteHandler) for h in logger.handlers):
        yield
        return
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [_NoteHandler(notes)], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate


class _NoteHandler(logging.Handler):
    """Collects log records as notes: each distinct message once, on one line."""

    def __init__(self, notes: list[str]):
        super().__init__()
        self.notes = notes

    def emit(self, record: logging.LogRecord) -> None:
        try:
            note = "transformers: " + " ".join(record.getMessage().split())
        except Exception:  # arguments that do not fit the message: logging's own report of it
            self.handleError(record)
            return
        if note not in self.notes:
            self.notes.append(note)
