"""Every causal-LM architecture the installed transformers ships, built tiny from its own config class's defaults.

The list is not written by hand: it is transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, and each architecture's config
is its config class's defaults, shrunk by `fwdcheck shrink`'s rules (fwdcheck/model/sources/shrink.py), every nested
model config (a multimodal model's text_config, vision_config, ...) shrunk alike. An architecture that cannot be built
that way offline is left out with the reason (`left_out`), never dropped silently.

    python -m tests.arch_sweep            # print docs/compatibility.md's per-family table
    python -m tests.arch_sweep --write    # rewrite it between its markers
    python -m tests.arch_sweep --run      # run the sweep and print each architecture's statuses

tests/test_arch_sweep.py runs the four causal checks (CHECKS) on each (the slow tier) and holds the expectations.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fwdcheck.model.sources.shrink import DROPPED_KEYS, shrink_hf_dict
from fwdcheck.model.sources.shrink_built import MAX_SHRUNK_PARAMETERS
from fwdcheck.model.sources.shrink_image import fit_image_path
from tests.doc_sections import DOCS, read_section, write_sections

# A tiny model is at most this many parameters: past it a shrunk default config kept something wide (a vision tower,
# a byte-level patcher) that the rules do not know how to cut, and the forward passes would cost minutes on a CPU;
# `fwdcheck shrink` exits 4 past the same limit.
MAX_PARAMETERS = MAX_SHRUNK_PARAMETERS
SEQ_LEN = 8


@dataclass(frozen=True)
class Sweep:
    """One of transformers' auto mappings swept: which mapping, the class that builds its models, and how a user
    names that class in a config (None where `fwdcheck run` builds it by default)."""

    mapping: str
    auto_class: str
    named_class: str | None
    what: str  # what the page calls its architectures


# The causal-LM sweep is this module's own (its section of docs/compatibility.md below); the other families' sweeps
# (tests/family_sweep.py) build and run their models through the same functions, by kind.
SWEEPS = {
    "causal-lm": Sweep("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", None, "causal-LM"),
    "seq2seq": Sweep(
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", "AutoModelForSeq2SeqLM", "seq2seq"
    ),
    "image-text-to-text": Sweep(
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
        "AutoModelForImageTextToText",
        "AutoModelForImageTextToText",
        "image-text-to-text",
    ),
    "masked-lm": Sweep(
        "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", "AutoModelForMaskedLM", "masked-LM"
    ),
}


@functools.cache
def architectures(kind: str = "causal-lm") -> tuple[str, ...]:
    """Every model_type the sweep's transformers auto class can build (its mapping's keys), sorted."""
    from transformers.models.auto import modeling_auto

    return tuple(sorted(getattr(modeling_auto, SWEEPS[kind].mapping)))


# Mixtures of experts keep routing (more experts than each token takes) at four experts, two per token.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k", "moe_topk")
# Experts routed by groups (DeepSeek V3's group-limited routing): two groups, dividing the experts kept.
EXPERT_GROUP_KEYS = ("n_group", "num_expert_group")


def _shrunk(data: dict[str, Any], parts_first: bool = True) -> dict[str, Any]:
    """A config dictionary and every model config nested in it, shrunk by fwdcheck shrink's rules, read through the
    config class's own spellings (attribute_map), with fewer experts and per-layer settings of the layers kept.

    parts_first (the causal-LM sweep's order) shrinks each nested config before the whole; otherwise the whole is
    shrunk first, so that shrink's own rules for a config made of configs (shrink_nested.py: the projector following
    the text width, the image token inside the vocabulary, rotary sections scaled) see the parts' sizes change, and
    the nested configs get this module's further rules afterwards."""
    from transformers import CONFIG_MAPPING

    data = {k: v for k, v in data.items() if k not in DROPPED_KEYS}
    nested = [k for k, v in data.items() if isinstance(v, dict) and v.get("model_type") in CONFIG_MAPPING]
    if not parts_first:
        shrink_hf_dict(data, SEQ_LEN)
    for key in nested:
        data[key] = _shrunk(data[key], parts_first)
    for key in EXPERT_KEYS:
        if isinstance(data.get(key), int) and data[key] > 4:
            data[key] = 4
    for key in EXPERTS_PER_TOKEN_KEYS:
        if isinstance(data.get(key), int) and data[key] > 2:
            data[key] = 2
    experts = next((data[k] for k in EXPERT_KEYS if isinstance(data.get(k), int)), None)
    for key in EXPERT_GROUP_KEYS:
        if isinstance(data.get(key), int) and experts and data[key] > 1:
            data[key] = math.gcd(2, experts)
            if isinstance(data.get("topk_group"), int):
                data["topk_group"] = min(data["topk_group"], data[key])
    attribute_map = getattr(CONFIG_MAPPING.get(data.get("model_type")), "attribute_map", {}) or {}
    original = dict(data)
    # shrink reads the standard names; an architecture spelling them its own way (BART's encoder_attention_heads and
    # d_model) gets them for the rules, and each of its own spellings that held the same value takes the new one.
    aliases = {
        standard: own
        for standard, own in attribute_map.items()
        if standard in STANDARD_SIZES and own in data and standard not in data
    }
    for standard, own in aliases.items():
        data[standard] = data[own]
    shrink_hf_dict(data, SEQ_LEN)
    for standard, own in aliases.items():
        value = data.pop(standard)
        role = STANDARD_SIZES[standard]
        for key in list(data):
            if key == own or (role in key and original.get(key) == original[own] and isinstance(data[key], int)):
                data[key] = value
    for key in [k for k in data if k.endswith("vocab_size") and k != "vocab_size"]:  # decoder_vocab_size (Marian)
        if isinstance(data[key], int) and isinstance(data.get("vocab_size"), int):
            data[key] = min(data[key], data["vocab_size"])
    # Latent attention (MLA): its head parts and low ranks small, the rotary part as wide as the head it shrank with.
    for key in [k for k in data if k.endswith("_head_dim") and isinstance(data[k], int)]:
        data[key] = min(data[key], data["head_dim"] if original.get(key) == original.get("head_dim") else 16)
    if all(isinstance(data.get(k), int) for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")):
        data["qk_head_dim"] = data["qk_nope_head_dim"] + data["qk_rope_head_dim"]  # the query-key head: both parts
    for key in ("kv_lora_rank", "q_lora_rank"):
        if isinstance(data.get(key), int):
            data[key] = min(data[key], 32)
    # Hybrids placing attention every N layers (Jamba): one of the two layers kept is attention.
    for period, offset in (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset")):
        if isinstance(data.get(period), int) and isinstance(data.get(offset), int):
            data[period], data[offset] = 2, 1
    _per_layer_kept(data)
    _axial_positions_fit(data)
    if not parts_first:  # the parts shrunk again above: their image path made to agree again, as shrink's last rule
        fit_image_path(data)
    return data


def _axial_positions_fit(data: dict[str, Any]) -> None:
    """Axial position embeddings (Reformer): their two factors sum to the shrunk width, their shape covers the
    positions kept, and attention chunks fit a row of SEQ_LEN tokens."""
    if not isinstance(data.get("axial_pos_embds_dim"), list) or not isinstance(data.get("hidden_size"), int):
        return
    width = data["hidden_size"]
    data["axial_pos_embds_dim"] = [width // 2, width - width // 2]
    data["axial_pos_shape"] = [4, 4]
    data["max_position_embeddings"] = 16  # the product of the shape: Reformer's positions are exactly its cells
    for key in ("lsh_attn_chunk_length", "local_attn_chunk_length"):
        if isinstance(data.get(key), int):
            data[key] = SEQ_LEN // 2


# The standard names shrink reads, and the part of an architecture's own spellings that says the same role.
STANDARD_SIZES = {"num_attention_heads": "attention_heads", "hidden_size": "hidden_size"}


def _per_layer_kept(data: dict[str, Any]) -> None:
    """Settings keyed by layer index (Gemma 4's per_layer_config) keep the layers the shrunk model has."""
    layers = data.get("num_hidden_layers")
    if not isinstance(layers, int):
        return
    for key, value in list(data.items()):
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            data[key] = {k: v for k, v in value.items() if int(k) < layers}


@dataclass(frozen=True)
class Built:
    """One architecture's tiny inline config, or why it has none."""

    model_type: str
    config: dict[str, Any] | None
    parameters: int = 0
    left_out: str | None = None


def auto_class(kind: str):
    import transformers

    return getattr(transformers, SWEEPS[kind].auto_class)


@functools.cache
def tiny(model_type: str, kind: str = "causal-lm") -> Built:
    """The architecture's config class's defaults, shrunk, checked to build on the meta device within
    MAX_PARAMETERS; where that config does not build or run, once more with the sizes it derives rederived
    (_rederived)."""
    built = _tiny(model_type, kind, rederive=False)
    if built.config is None and "shrunk default config" in (built.left_out or ""):
        again = _tiny(model_type, kind, rederive=True)
        return again if again.config is not None else built
    return built


def _rederived(model_type: str, data: dict[str, Any]) -> dict[str, Any]:
    """A shrunk config's second try: sizes the config class derives from hidden_size, which its defaults' to_dict
    states at the full width and the shrink rules do not know (Zamba 2's attention_hidden_size and mamba_headdim),
    left out so the class derives them at the shrunk width; and a hybrid that places no attention layer
    (attn_layer_indices unset: Bamba, whose forward then cannot build its mask) given one, its last, as released
    configs of it place some."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    base = cls().to_dict()
    if isinstance(base.get("hidden_size"), int):
        wider = cls(hidden_size=2 * base["hidden_size"]).to_dict()
        derived = {k for k in base if k != "hidden_size" and base[k] != wider.get(k)}
        data = {k: v for k, v in data.items() if not (k in derived and v == base[k])}
    layers = data.get("num_hidden_layers")
    if "attn_layer_indices" in data and data["attn_layer_indices"] is None and isinstance(layers, int):
        data["attn_layer_indices"] = [layers - 1]
    return data


def _tiny(model_type: str, kind: str, rederive: bool) -> Built:
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig

    from fwdcheck.model.sources.hf import offline

    cls = auto_class(kind)
    with offline(), warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        try:
            data = _shrunk(_stated(CONFIG_MAPPING[model_type]().to_dict()), parts_first=kind == "causal-lm")
            if rederive:
                data = _rederived(model_type, data)
            if kind == "causal-lm":
                # The flag that makes an architecture's causal-LM head causal, as a user building one sets it: the
                # encoder families' is_decoder, XLM's causal, XLNet's unidirectional attention.
                for flag in ("is_decoder", "causal"):
                    if data.get(flag) is False:
                        data[flag] = True
                if data.get("attn_type") == "bi":
                    data["attn_type"] = "uni"
            if data.get("default_language") is None and data.get("languages"):  # X-MOD runs one language adapter
                data["default_language"] = data["languages"][0]
            rest = {k: v for k, v in data.items() if k != "model_type"}
            hf_config = AutoConfig.for_model(model_type, **rest)
            with torch.device("meta"):
                module = cls.from_config(hf_config)
        except Exception as exc:
            if not _defaults_build(model_type, kind):
                return Built(
                    model_type,
                    None,
                    left_out=f"its config class's own defaults do not build a model, unshrunk ({_said(exc)})",
                )
            return Built(model_type, None, left_out=f"its shrunk default config does not build ({_said(exc)})")
        parameters = sum(p.numel() for p in module.parameters())
        if parameters > MAX_PARAMETERS:
            return Built(
                model_type,
                None,
                parameters,
                f"{parameters / 1e6:.0f}M parameters after shrinking (over {MAX_PARAMETERS / 1e6:.0f}M): "
                "a part the shrink rules do not cut",
            )
        # The model's own forward on a short row, outside fwdcheck: a shrunk config transformers accepts can still
        # break a constraint its config class does not check (a head size the rotary part no longer fits).
        try:
            torch.manual_seed(0)
            module = cls.from_config(hf_config).eval()
            with torch.no_grad():
                module(**own_inputs(module, torch.randint(0, 8, (2, SEQ_LEN))))
        except Exception as exc:
            return Built(
                model_type,
                None,
                parameters,
                f"its shrunk default config builds a model whose own forward raises ({_said(exc)})",
            )
    return Built(model_type, {"model_type": model_type, **rest}, parameters)


def _stated(data: dict[str, Any]) -> dict[str, Any]:
    """Sizes a config class leaves null by default and every released config of it states, as the class derives them
    when built: the head size (hidden / heads) and the kv heads (one per query head)."""
    hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
    if "head_dim" in data and data["head_dim"] is None and isinstance(hidden, int) and isinstance(heads, int):
        data["head_dim"] = hidden // heads
    if "num_key_value_heads" in data and data["num_key_value_heads"] is None and isinstance(heads, int):
        data["num_key_value_heads"] = heads
    routed = any(isinstance(data.get(k), int) for k in EXPERT_KEYS)
    if routed and "num_experts_per_tok" in data and data["num_experts_per_tok"] is None:  # experts each token takes
        data["num_experts_per_tok"] = 2
    return data


def own_inputs(module, ids) -> dict[str, Any]:
    """The tokens as the model's forward takes them: an encoder-decoder's decoder reads them (decoder_input_ids),
    beside the same ids as its source; every other model reads input_ids."""
    import inspect

    if (
        getattr(module.config, "is_encoder_decoder", False)
        and "decoder_input_ids" in inspect.signature(module.forward).parameters
    ):
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids}


def _defaults_build(model_type: str, kind: str = "causal-lm") -> bool:
    """Whether the config class's own defaults, nothing shrunk, build the model (on the meta device)."""
    import torch
    from transformers import CONFIG_MAPPING

    try:
        with torch.device("meta"):
            auto_class(kind).from_config(CONFIG_MAPPING[model_type]())
    except Exception:
        return False
    return True


def _said(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings about the defaults it fills in, off while building."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ----------------------------------------------------------------------------------------------------------------
# Running the sweep, and what it is expected to find

# The checks the sweep judges on every architecture: the causal ones the page reports. The other default checks
# (kv-cache, packing, label-shift, grad-causality, backends, rope-precision, attention-stats) have their own
# transformers tests, on the families that carry their subject; running them on all 150+ would triple the sweep.
CHECKS = ("shape-ledger", "future-token", "mask-audit", "rope")
# The code-path matrix narrowed to what the sweep is about (the matrix has tests of its own): both attention
# implementations and every attention mask (absent, ones, left padding), one batch size, no attention weights.
CODE_PATHS = {"output_attentions": [False], "batch_size": [2]}


def model_section(model_type: str, kind: str = "causal-lm") -> dict[str, Any]:
    """The config's model section a user writes for the tiny model: source hf, the class where fwdcheck run would
    not build it by default, the inline config."""
    built = tiny(model_type, kind)
    assert built.config is not None, built.left_out
    named = SWEEPS[kind].named_class
    return {"source": "hf", **({"class": named} if named else {}), "config": built.config}


@functools.cache
def sweep_report(model_type: str, kind: str = "causal-lm", code_paths: tuple[tuple[str, Any], ...] | None = None):
    """The sweep's four checks (CHECKS) on the tiny model, as `fwdcheck run` runs an inline hf config (the code-path
    matrix narrowed to CODE_PATHS, or to the cells given)."""
    from tests.conftest import run_checks

    return run_checks(
        model_section(model_type, kind),
        list(CHECKS),
        inputs={"batch_size": 2, "seq_len": SEQ_LEN},
        code_paths=dict(code_paths) if code_paths is not None else CODE_PATHS,
    )


def one_check_report(model_type: str, check: str):
    """One check alone on the tiny model, without the code-path matrix, the libraries' warnings silenced; a pytest
    skip with the reason when the architecture is left out."""
    import pytest

    from tests.conftest import run_checks

    built = tiny(model_type)
    if built.config is None:
        pytest.skip(built.left_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_checks(
            {"source": "hf", "config": built.config},
            [check],
            inputs={"batch_size": 2, "seq_len": SEQ_LEN},
            code_paths={"enabled": False},
        )


@dataclass(frozen=True)
class Expected:
    """A failure the sweep expects: the codes it may carry and why."""

    codes: frozenset[str]
    what: str
    evidence: Any = None  # for a true finding: () -> bool, the behaviour shown in plain torch


# Failures of correct models that are fwdcheck's own misreading, known and being fixed apart from this sweep: each
# may fail with exactly its codes until then, or pass. None is known today: every failure is a true finding below.
KNOWN: dict[tuple[str, str], Expected] = {}


def plain(model_type: str, kind: str = "causal-lm"):
    """The tiny model built by transformers alone, seeded, in eval mode."""
    import torch
    from transformers import AutoConfig

    built = tiny(model_type, kind)
    assert built.config is not None, built.left_out
    rest = {k: v for k, v in built.config.items() if k != "model_type"}
    torch.manual_seed(0)
    return auto_class(kind).from_config(AutoConfig.for_model(model_type, **rest)).eval()


_plain = plain


def future_leak(model_type: str, relative: float = 1e-4) -> bool:
    """Whether changing any token of a row moves the logit of an earlier position of the tiny model by more than
    `relative` of the logits' scale, measured directly: one forward per changed position and a comparison, no fwdcheck
    check involved. relative=0.0 asks for any move at all: a causal model's earlier logits stay bitwise the same (a
    masked key's weight is exactly 0.0)."""
    import torch

    model = _plain(model_type)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        for position in range(1, SEQ_LEN):
            changed = ids.clone()
            changed[:, position] = (changed[:, position] + 1) % vocab
            moved = (model(changed).logits[:, :position] - before[:, :position]).abs().max()
            if moved > relative * before.abs().max():
                return True
    return False


def reads_padding(model_type: str) -> bool:
    """Whether, with one left pad masked out by attention_mask (and the real tokens' position_ids from 0 where forward
    takes them), a real token's attention weights give the pad key any weight: transformers' own
    output_attentions, no fwdcheck check involved."""
    import inspect

    import torch

    model = _plain(model_type)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    pad = model.config.get_text_config().pad_token_id or 0
    padded = torch.cat([torch.full((1, 1), pad), ids], dim=1)  # (1, 1 + T)
    mask = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.ones_like(ids)], dim=1)
    kwargs = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.arange(SEQ_LEN)[None]], 1)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(padded, attention_mask=mask, output_attentions=True, **kwargs).attentions
    return any(float(a[..., 1:, 0].max()) > 1e-6 for a in attentions)  # real queries, the pad key


def left_padding_moves(model_type: str) -> bool:
    """Whether one left pad, masked out by attention_mask (and the real tokens' position_ids from 0 where forward
    takes them), moves the logits of the real tokens after it: transformers alone, no fwdcheck check involved."""
    import inspect

    import torch

    model = _plain(model_type)
    config = model.config.get_text_config()
    ids = torch.randint(1, config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.full((1, 1), config.pad_token_id or 0), ids], dim=1)  # (1, 1 + T)
    mask = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.ones_like(ids)], dim=1)
    kwargs = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.arange(SEQ_LEN)[None]], 1)
    with torch.no_grad():
        alone = model(ids).logits
        after_pad = model(padded, attention_mask=mask, **kwargs).logits[:, 1:]
    return bool((after_pad - alone).abs().max() > 1e-4 * alone.abs().max())


def raises_with_padding_mask(model_type: str) -> bool:
    """Whether the tiny model's own forward raises on a batch of two rows given an attention_mask (all ones), while
    the same rows without it run: transformers alone, no fwdcheck check involved."""
    import torch

    model = _plain(model_type)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        try:
            model(ids, attention_mask=torch.ones_like(ids))
        except RuntimeError:
            return True
    return False


# DeepSeek V3.2's sparse attention and its relatives that transformers builds tiny (qwen4_exp and dots3_note are left
# out above): an indexer keeps each query's index_topk best-scoring keys at or before it. At the sweep's length every
# key is kept (index_topk 2048); below the row's length a query may not keep its own key, and mask-audit judges the
# selected keys against the causal bound (a passing FWD210 note) instead of failing them as a strict causal mask.
SPARSE_SELECTION = ("axk2", "deepseek_v32", "glm_moe_dsa")
SELECTED_KEYS = 4


def _selecting(model_type: str) -> dict[str, Any]:
    built = tiny(model_type)
    assert built.config is not None, built.left_out
    return {**built.config, "index_topk": SELECTED_KEYS}


def selection_skips_itself(model_type: str) -> bool:
    """Whether, with index_topk below the row's length, the indexer's selection leaves some query without its own
    key: its output (the [B, T, k] indices each query attends) read by a forward hook, no fwdcheck check involved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _selecting(model_type)
    torch.manual_seed(0)
    rest = {k: v for k, v in config.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **rest)).eval()
    selected: list[torch.Tensor] = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer"):
            module.register_forward_hook(lambda m, args, out: selected.append(out))
    ids = torch.randint(0, rest["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    own = torch.arange(SEQ_LEN)[None, :, None]  # (1, T, 1): each query's own position
    return bool(selected) and any(bool((~(indices.long() == own).any(-1)).any()) for indices in selected)


def selection_report(model_type: str):
    """mask-audit on the tiny model with index_topk below the row's length, as the sweep runs it."""
    from tests.conftest import run_checks

    return run_checks(
        {"source": "hf", "config": _selecting(model_type)},
        ["mask-audit"],
        inputs={"batch_size": 2, "seq_len": SEQ_LEN},
        code_paths=CODE_PATHS,
    )


def decoding_after_prefill_moves(model_type: str) -> bool:
    """Whether, after a cached prefill of half the row, the next token decoded alone through the cache gets other
    logits than the full forward gives it: transformers alone."""
    return _after_prefill(model_type, (1,))[0] > 0


def chunk_after_prefill_moves(model_type: str, chunk: int = 2) -> bool:
    """Whether, after a cached prefill of half the row, decoding the next `chunk` tokens in one forward through the
    cache gives other logits than the full forward, while one token at a time does not: transformers alone."""
    one, several = _after_prefill(model_type, (1, chunk))
    return one == 0 and several > 0


def _after_prefill(model_type: str, chunks: tuple[int, ...]) -> list[float]:
    """For each chunk size n, how far the n tokens after a cached prefill of half the row, decoded in one forward
    through the cache, part from the full forward's logits, beyond 1e-4 of their scale (0 within it)."""
    import inspect

    import torch

    model = _plain(model_type)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    half = SEQ_LEN // 2

    def after_prefill(n: int) -> float:
        cached = model(ids[:, :half], use_cache=True)
        cache = getattr(cached, "cache", None) or getattr(cached, "past_key_values", None)
        return float(
            (model(ids[:, half : half + n], **{name: cache}, use_cache=True).logits - full[:, half : half + n])
            .abs()
            .max()
        )

    with torch.no_grad():
        full = model(ids).logits
        bar = 1e-4 * float(full.abs().max())
        return [moved if (moved := after_prefill(n)) > bar else 0.0 for n in chunks]


def labels_scored_in_place(model_type: str) -> bool:
    """Whether the model's loss for labels = input_ids is the cross-entropy of each position's logits against its
    own token (no shift), as XLNet and the decoder-only heads of BART's family compute it: transformers alone."""
    import torch
    import torch.nn.functional as F

    model = _plain(model_type)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(ids, labels=ids)
        in_place = F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), ids.reshape(-1))
    return bool(torch.isclose(output.loss, in_place, rtol=1e-5))


# label-shift (not a default check), run alone: forwards that score labels in place (the caller shifts), read as such
# from their source, pass; Llama's shared loss shifts them itself.
LABELS_IN_PLACE = ("bart", "xlnet")


# kv-cache (not a default check, run alone): what it finds on the architectures the sweep looks at for it.
# Hybrids whose generate keeps only the last position (config.num_logits_to_keep = 1: Falcon-H1, Nemotron-H) are asked
# for every position (logits_to_keep=0) and pass; Mamba's chunked decode is the model's.
KV_CACHE_PASSES = ("falcon_h1", "mamba2", "nemotron_h", "zamba2")
MAMBA_CHUNKS = (
    "Mamba's torch path scans several new tokens from a zero state, the cached one unread (transformers' own note: "
    "'mamba_selective_scan does not take the past state, it is WRONG if the cache is not empty'): decoding two tokens "
    "at once after a prefill gives other logits, one at a time does not"
)
BAMBA_DECODE = (
    "Bamba's cached decode: the token after a cached prefill gets other logits than the full forward gives it "
    "(plain torch: 7.6e-3 at a logit scale of 0.85, in transformers' own cache and in generate's), while Zamba 2's "
    "mixer of the same kind agrees to 1e-7"
)
KV_CACHE_FINDINGS: dict[str, Expected] = {
    "bamba": Expected(frozenset({"FWD501", "FWD502"}), BAMBA_DECODE, lambda: decoding_after_prefill_moves("bamba")),
    "mamba": Expected(frozenset({"FWD502"}), MAMBA_CHUNKS, lambda: chunk_after_prefill_moves("mamba")),
}


def reads_past_window(model_type: str) -> bool:
    """Whether the first token moves the logits of positions its config's sliding window keeps it from reaching:
    through L layers of a window of W keys a token reaches (W - 1) L positions ahead at most, so changing token 0
    must leave every position after that alone. Transformers alone, no fwdcheck check involved."""
    import torch

    model = _plain(model_type)
    config = model.config.get_text_config()
    reach = (config.sliding_window - 1) * config.num_hidden_layers
    assert reach < SEQ_LEN - 1, f"a window of {config.sliding_window} over {config.num_hidden_layers} layers"
    ids = torch.randint(0, config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % config.vocab_size
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    return bool((after[:, reach + 1 :] - before[:, reach + 1 :]).abs().max() > 1e-4 * before.abs().max())


def image_moves_nothing(model_type: str, kind: str = "causal-lm") -> bool:
    """Whether the text after an image gives the same logits after another image: the inputs assembled by
    fwdcheck's image drive (the image's tokens, its pixels), the comparison this module's own."""
    import torch

    from fwdcheck.model.sources.vlm_image import IMAGE_TOKEN_KEYS, ImageDrive, _parameters

    model = plain(model_type, kind)
    config = model.config
    token = next(getattr(config, k) for k in IMAGE_TOKEN_KEYS if isinstance(getattr(config, k, None), int))
    drive = ImageDrive(type(model).__name__, config, _parameters(model), token, config.get_text_config().vocab_size)
    with torch.no_grad():
        drive.prepare(model)
        ids = torch.tensor([[3, 4, 5, 6]])
        return bool(torch.equal(drive.call(model, ids, 0), drive.call(model, ids, 1)))


# True findings about transformers: behaviour of the model itself, each shown by its plain-torch evidence.
CPMANT_PREFIX = (
    "CPM-Ant's forward marks every input token as context, and context tokens attend to each other both ways: "
    "a prefix language model, by design"
)
PROPHETNET_LEAK = (
    "ProphetNet's causal LM: changing a later token moves the logits of the positions before it (plain torch: by "
    "about 1e-6 of the logits' scale, where a causal model's stay bitwise the same), and a prefix run alone gives "
    "other logits"
)
XLM_PADDING = (
    "XLM with causal=True builds its attention mask from the causal pattern alone: real tokens give attention "
    "weight to left-padding keys that attention_mask masks out"
)
XLNET_UNI_MASK = (
    "XLNet with attn_type='uni' (its causal attention) raises on any attention_mask over a batch of two rows: the "
    "causal mask [T,T,1,1] and the padding mask [T,T,B,1] are added in place"
)
DEEPSEEK_V4_WINDOWS = (
    "DeepSeek V4's compressed attention pools every compress_rate tokens into one key from the start of the row, "
    "attention_mask unread: a left pad shifts the windows and enters the compressed keys, moving the real tokens"
)
MOSHI_WINDOW = (
    "Moshi's config declares sliding_window (3000 by default) and its attention keeps it, but its decoder builds the "
    "plain causal mask (create_causal_mask): every layer reads every earlier key, tokens past the window included"
)
GOT_OCR2_IMAGE = (
    "GOT-OCR2's architecture built at random from its config: its patch embedding's output is about 1e-8 and the "
    "image features "
    "that reach the text about 1e-20, so the text after another image gives the same logits bit for bit (plain "
    "torch): at initialisation the model reads nothing of its image"
)
FINDINGS: dict[tuple[str, str], Expected] = {
    ("got_ocr2", "mask-audit"): Expected(
        frozenset({"FWD215"}), GOT_OCR2_IMAGE, lambda: image_moves_nothing("got_ocr2")
    ),
    ("moshi", "mask-audit"): Expected(frozenset({"FWD211"}), MOSHI_WINDOW, lambda: reads_past_window("moshi")),
    ("cpmant", "future-token"): Expected(frozenset({"FWD101", "FWD105"}), CPMANT_PREFIX, lambda: future_leak("cpmant")),
    ("cpmant", "mask-audit"): Expected(
        frozenset({"FWD204", "FWD205", "FWD208"}), CPMANT_PREFIX, lambda: future_leak("cpmant")
    ),
    ("prophetnet", "future-token"): Expected(
        frozenset({"FWD101", "FWD105"}), PROPHETNET_LEAK, lambda: future_leak("prophetnet", relative=0.0)
    ),
    ("xlm", "future-token"): Expected(frozenset({"FWD107"}), XLM_PADDING, lambda: reads_padding("xlm")),
    ("xlm", "mask-audit"): Expected(frozenset({"FWD208"}), XLM_PADDING, lambda: reads_padding("xlm")),
    ("deepseek_v4", "future-token"): Expected(
        frozenset({"FWD107"}), DEEPSEEK_V4_WINDOWS, lambda: left_padding_moves("deepseek_v4")
    ),
}

# Code paths a model cannot run: its forward raises on the cell, which is then "not judged" with the model's reason
# while the other cells count (fwdcheck/run/matrix.py: not_judged_where_refused). Each shown in plain torch.
NOT_JUDGED: dict[str, Expected] = {
    "xlnet": Expected(frozenset(), XLNET_UNI_MASK, lambda: raises_with_padding_mask("xlnet")),
}


# ----------------------------------------------------------------------------------------------------------------
# The section of docs/compatibility.md, generated from the runs

PAGE = DOCS / "compatibility.md"
KNOWN_MARK, FINDING_MARK = "†", "‡"


def family(model_type: str) -> str:
    """An architecture's family: its model_type's leading letters (qwen2_moe and qwen3_next are qwen, xlm-roberta is
    xlm)."""
    match = re.match(r"[a-z]+", model_type)
    return match.group(0) if match else model_type


def entry(model_type: str, report) -> str:
    """How the page lists one architecture: its name, and each check that did not pass with its status (a mark
    for a known failure or a true finding)."""
    shown = []
    for check in CHECKS:
        status = report.result(check).status.value
        if status == "pass":
            continue
        mark = FINDING_MARK if (model_type, check) in FINDINGS else KNOWN_MARK if (model_type, check) in KNOWN else ""
        shown.append(f"{check} {status}{mark if status in ('fail', 'warn', 'error') else ''}")
    return f"{model_type} ({', '.join(shown)})" if shown else model_type


def skip_reason(report, check: str) -> str:
    """A skip's reason as the page groups it: the summary, the model's class named generically."""
    cls = (report.model.get("label") or "").split(" ")[1:2]
    summary = report.result(check).summary.strip()
    return summary.replace(cls[0], "the model") if cls else summary


# What a failure of an untouched architecture may be: a finding about the model's numbers, or (the model's own error)
# an error.
OUTCOMES = {False: ("fail", "warn"), True: ("error",)}


def assert_skips_listed(documented: str, report, model_type: str, stale: str) -> None:
    """Every check the report skipped lists the architecture under the skip's reason on the page."""
    for check in CHECKS:
        if report.result(check).status.value == "skip":
            line = f"| {check} | {skip_reason(report, check)} | "
            listed = next((x for x in documented.splitlines() if x.startswith(line)), "")
            assert model_type in listed[len(line) :].rstrip(" |").split(", "), stale


def assert_written_down(report, model_type: str, written) -> None:
    """Every check of the report passes, skips saying why, or fails as `written(check)` (a true finding or a known
    misreading, with its codes) says it may: with those codes, and as an error only where the model's own forward
    raised (FWD002)."""
    for check in CHECKS:
        result = report.result(check)
        status, codes = result.status.value, {f.code for f in result.findings}
        if status == "skip":
            assert result.summary.strip(), f"{model_type} {check}: a skip must say why"
            continue
        if status == "pass":
            continue
        expected = written(check)
        assert expected is not None, f"{model_type} {check}: {status} {sorted(codes)}: {result.summary}"
        assert status in OUTCOMES[expected.codes == {"FWD002"}] and codes <= expected.codes, (
            model_type,
            check,
            status,
            codes,
            result.summary,
        )


def section() -> str:
    import transformers

    names = architectures()
    built = {name: tiny(name) for name in names}
    run = {name: sweep_report(name) for name, b in built.items() if b.config is not None}
    families: dict[str, list[str]] = {}
    for name in names:
        if name in run:
            families.setdefault(family(name), []).append(entry(name, run[name]))
    skips: dict[tuple[str, str], list[str]] = {}
    for name, report in run.items():
        for check in CHECKS:
            if report.result(check).status.value == "skip":
                skips.setdefault((check, skip_reason(report, check)), []).append(name)
    lines = [
        f"transformers {transformers.__version__}: {len(names)} causal-LM architectures enumerated "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), {len(run)} built tiny from their config class's defaults and run, "
        f"{len(names) - len(run)} left out (last table). An architecture listed alone passed the four checks; "
        f"{KNOWN_MARK} marks a known misreading of fwdcheck's being fixed, {FINDING_MARK} a true finding.",
        "",
        "| family | architectures |",
        "| --- | --- |",
        *(f"| {fam} | {', '.join(entries)} |" for fam, entries in sorted(families.items())),
        "",
        "| check | why it skips | architectures |",
        "| --- | --- | --- |",
        *(
            f"| {check} | {reason} | {', '.join(sorted(archs))} |"
            for (check, reason), archs in sorted(skips.items(), key=lambda item: (item[0][0], -len(item[1])))
        ),
        "",
        "True findings about transformers, each shown by a plain-torch test beside it (`tests/test_arch_sweep.py`):",
        "",
        "| architecture | check | codes | what the model does |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {check} | {' '.join(sorted(e.codes))} | {e.what} |"
            for (name, check), e in sorted(FINDINGS.items())
        ),
    ]
    lines += [
        "",
        "Code paths a model cannot run (its forward raises there): those cells are not judged, with the model's "
        "reason, and the other cells count; each shown in plain torch:",
        "",
        "| architecture | what the model does |",
        "| --- | --- |",
        *(f"| {name} | {e.what} |" for name, e in sorted(NOT_JUDGED.items())),
    ]
    lines += [
        "",
        f"kv-cache (not a default check), run alone: passes on {', '.join(KV_CACHE_PASSES)}; true findings, each "
        "shown in plain torch:",
        "",
        "| architecture | codes | what the model does |",
        "| --- | --- | --- |",
        *(f"| {name} | {' '.join(sorted(e.codes))} | {e.what} |" for name, e in sorted(KV_CACHE_FINDINGS.items())),
    ]
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for (name, check), e in KNOWN.items():
        grouped.setdefault((check, " ".join(sorted(e.codes)), e.what), []).append(name)
    if grouped:
        lines += [
            "",
            f"Known misreadings ({KNOWN_MARK}), allowed to fail with these codes until fixed:",
            "",
            "| architectures | check | codes | what fwdcheck misreads |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {', '.join(sorted(n))} | {c} | {codes} | {what} |" for (c, codes, what), n in sorted(grouped.items())
        ]
    else:
        lines += ["", f"Known misreadings of fwdcheck's ({KNOWN_MARK}): none."]
    lines += ["", "| left out | why |", "| --- | --- |"]
    lines += [f"| {name} | {b.left_out} |" for name, b in built.items() if b.config is None]
    return "\n".join(lines)


def documented_section() -> str:
    return read_section(PAGE, "sweep")


def write() -> None:
    write_sections(PAGE, {"sweep": section()})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the section of docs/compatibility.md")
    if parser.parse_args().write:
        write()
    else:
        print(section())
