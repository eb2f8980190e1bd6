"""`fwdcheck shrink`: the same architecture with 2 layers and small widths, so that every check runs in seconds.

`fwdcheck run --meta` checks the shapes of a model too big for this machine; the checks that need numbers (future
tokens, masks, RoPE) run on a shrunk copy instead. What makes a bug in attention code (the mask, the head grouping,
the rotary pairing and frequencies, the sliding window, tied embeddings) is kept; what only costs memory and time
(depth, width, vocabulary, learned position tables) is cut. The result is a new fwdcheck config whose model is
randomly initialised: weights are never shrunk.

Every source can be shrunk when its config says the sizes: `source: hf` (a directory with config.json, or an inline
config), `source: reference`, and a factory's (`python`, `checkpoint`) when its `kwargs:` name them in a spelling
models use (n_layers, d_model, n_heads, vocab_size, d_ff, ... as nanoGPT, gpt-fast, litgpt and transformers spell
them). A factory whose sizes live in its code gets one line saying so. A checkpoint's shrunk copy is `source: python`:
the same factory, randomly initialised.

The shrunk config is written where the user is (the working directory) by default, so paths in it that pointed
next to the original (a factory's modules, `path:` entries) are rewritten to still find them from there.

Each source's record (fwdcheck/config/sources.py) names its rules here: a function of the `Original` config
returning the shrunk model section and its `Edits`; a source whose record names none is refused in one line.

Nothing heavy at import time: torch and transformers (and fwdcheck.model.sources.hf, which imports torch) are imported
by the functions that need them.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fwdcheck.config.schema import (
    HF_WEIGHT_FILES,
    CheckpointModel,
    Dims,
    HFModel,
    Inputs,
    PythonModel,
    ReferenceModel,
    config_from_dict,
    load_config,
)
from fwdcheck.config.sources import SOURCES, resolve
from fwdcheck.errors import ConfigError, UsageError
from fwdcheck.model.config_keys import CONFIG_KEYS, Spellings, extended
from fwdcheck.model.sources.shrink_built import MAX_SHRUNK_PARAMETERS as MAX_SHRUNK_PARAMETERS
from fwdcheck.model.sources.shrink_built import STILL_TOO_BIG as STILL_TOO_BIG
from fwdcheck.model.sources.shrink_built import Counted, count_hf, verify_hf
from fwdcheck.model.sources.shrink_nested import shrink_sub_configs

LAYERS = 2  # enough for one layer to feed another (and for one of each layer type, usually two)
MAX_KV_HEADS = 2  # two kv groups: a head mixed into the wrong group shows
MAX_HEADS = 16
HEAD_DIM = 16  # eight rotary pairs: enough to measure the pairing and the frequencies
VOCAB = 512
# A sliding window a short test sequence reaches past. Shorter than 4 tokens: transformers only builds a sliding mask
# once the sequence is longer than the window (and then repeats the kv heads for sdpa), and the shape ledger names its
# axes in a second pass at T=4; a window of 4..8 would give that pass another code path than the main one.
WINDOW = 3
LEARNED_POSITIONS = 256  # learned absolute position tables are capped (rotary ones cost nothing and are kept)

# A Hugging Face config's sizes, by what they mean (fwdcheck/model/config_keys.py; the first present one is the
# model's): the shared spellings, and those of encoder-decoder models (encoder_layers, num_decoder_layers,
# encoder_ffn_dim, ...), T5 (d_kv), ChatGLM (multi_query_group_num, ffn_hidden_size) and mixtures of experts.
HF_KEYS = extended(
    CONFIG_KEYS,
    L=("encoder_layers", "decoder_layers", "num_decoder_layers"),
    h=("encoder_attention_heads",),
    h_kv=("multi_query_group_num",),
    d_h=("d_kv", "d_head"),
    d_ff=(
        "ffn_hidden_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
    ),
)
EMBED_KEYS = ("word_embed_proj_dim", "embedding_size")  # embedding widths that follow the hidden size
# Sizes by what their names say, whatever the architecture: the depth of a stack (ProphetNet's num_encoder_layers,
# Mllama's num_global_layers) and the head count of another attention (num_decoder_attention_heads), each cut as the
# model's own.
STACK_DEPTH = re.compile(r"(num_|n_)?(encoder_|decoder_|global_)(hidden_)?layers")
OTHER_HEADS = re.compile(r"(num_|n_)?(encoder_|decoder_|cross_)?attention_heads")
WINDOW_KEYS = ("sliding_window", "attention_chunk_size")
ROTARY_KEYS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "rotary_dim",
    "rotary_pct",
    "partial_rotary_factor",
    "rotary_emb_base",
)
# Bookkeeping that says where the config came from, not what the model is; quantization needs real weights.
DROPPED_KEYS = (
    "_name_or_path",
    "_commit_hash",
    "transformers_version",
    "architectures",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "torch_dtype",
    "quantization_config",
)


@dataclass
class Shrunk:
    """The new config (as a YAML document and as text), what changed (key, old, new), notes for the user, and the
    parameter counts where the source's rules counted them (a Hugging Face config, built on the meta device)."""

    document: dict[str, Any]
    text: str
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    parameters: Counted | None = None
    cut: bool = True  # whether anything was cut (False: only what follows the cuts, or nothing, changed)


@dataclass(frozen=True)
class Original:
    """The config being shrunk, as a source's rules read it: its file, its YAML document as written, its validated
    model section, and where the shrunk copy is written (paths in it are rewritten to be found from there)."""

    path: Path
    raw: dict[str, Any]
    spec: Any  # the source's config class (a ModelSpec)
    output: Path

    @property
    def model(self) -> dict[str, Any]:
        """The model section as written."""
        return self.raw["model"]


class Edits:
    """A config dictionary being rewritten, remembering every value it changes; `keys` are the spellings its sizes
    are read under (a Hugging Face config's own first, from its class's attribute_map)."""

    def __init__(self, data: dict[str, Any], keys: Spellings | None = None):
        self.data = data
        self.keys: Spellings = keys or HF_KEYS
        self.changes: list[tuple[str, Any, Any]] = []
        self.notes: list[str] = []
        self.parameters: Counted | None = None  # the model's parameters before and after, where they were counted

    def first(self, keys: tuple[str, ...]) -> str | None:
        """The first of these keys the config sets (to anything but null)."""
        return next((k for k in keys if self.data.get(k) is not None), None)

    def first_count(self, keys: tuple[str, ...]) -> str | None:
        """The first of these keys the config sets to one positive number (not a list per stage, as a hierarchical
        vision tower's num_heads: [3, 6, 12, 24])."""
        return next((k for k in keys if _count(self.data.get(k))), None)

    def set(self, key: str, value: Any) -> None:
        old = self.data.get(key)
        if old != value:
            self.changes.extend(_differences(key, old, value))
            self.data[key] = value


def _differences(key: str, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for a changed value; inside mappings, one row per changed entry (rope_parameters.long_factor)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [(key, old, new)]
    rows = []
    for sub in dict.fromkeys([*old, *new]):
        if old.get(sub) != new.get(sub):
            rows.extend(_differences(f"{key}.{sub}", old.get(sub), new.get(sub)))
    return rows


# Changes that follow the others, or say how the copy runs, but cut nothing: a config whose only changes are these
# had nothing to shrink (an already small Hugging Face config is only written in float32).
FOLLOWING_KEYS = ("dtype", "meta", "source", "python_path")


def size_changes(changes: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """The changes that cut the model: every one but FOLLOWING_KEYS (at any sub-config's level)."""
    return [change for change in changes if change[0].rsplit(".", 1)[-1] not in FOLLOWING_KEYS]


def default_output(config_path: Path) -> Path:
    """CONFIG's stem + .shrunk.yaml, in the working directory: a config read from a shared or read-only place (a
    checkout of sample configs, a model's repository) is not written into."""
    return Path(f"{config_path.stem}.shrunk.yaml")


def shrink_file(config_path: Path, output: Path) -> Shrunk:
    """Read and validate a fwdcheck config; return the shrunk one (nothing is written here)."""
    config = load_config(config_path)  # every validation problem is reported as for `fwdcheck run`
    raw = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    rules = SOURCES[config.model.source].shrink
    if rules is None:  # a source whose record names no rules of its own
        raise UsageError(f"{config_path}: fwdcheck shrink has no rules for `source: {config.model.source}` models")
    block, edits = resolve(rules)(Original(config_path, raw, config.model, output))
    document = {key: value for key, value in raw.items() if key != "meta"}  # a shrunk config runs with values
    document["model"] = block
    changes, notes = edits.changes, edits.notes
    if raw.get("meta"):
        changes.append(("meta", True, None))
    # A sliding window the test sequence does not reach past is never exercised: lengthen the sequence.
    window = (block.get("config") or block.get("kwargs") or {}).get("sliding_window")
    if window and _seq_len(raw) <= window:
        inputs = dict(document.get("inputs") or {})
        inputs["seq_len"] = 2 * window
        document["inputs"] = inputs
        changes.append(("inputs.seq_len", _seq_len(raw), 2 * window))
        notes.append(
            f"inputs.seq_len raised to {2 * window} so the test sequence reaches past the sliding window of {window}"
        )
    try:
        config_from_dict(copy.deepcopy(document), origin=output)
    except ConfigError as exc:  # pragma: no cover - the rules above keep every field valid
        raise UsageError(f"the shrunk config does not validate ({exc}); nothing written") from None
    header = (
        f"# Shrunk by `fwdcheck shrink` from {config_path.name}: the same architecture with {LAYERS} layers and "
        "small widths,\n# randomly initialised, so that every check runs in seconds. "
        f"Run it with `fwdcheck run {output.name}`.\n"
    )
    text = header + yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    # Cut: a change that is a size, or, from rules that record none, a model section other than the original's.
    cut = bool(size_changes(changes)) or (not changes and block != raw["model"])
    return Shrunk(document, text, changes, notes, edits.parameters, cut)


class _Dumper(yaml.SafeDumper):
    """Block style for mappings, one line for a list of scalars (layer_types, token ids, checks)."""


_Dumper.add_representer(
    list,
    lambda dumper, data: dumper.represent_sequence(
        "tag:yaml.org,2002:seq", data, flow_style=all(not isinstance(v, (dict, list)) for v in data)
    ),
)


def _seq_len(raw: dict) -> int:
    return int((raw.get("inputs") or {}).get("seq_len", Inputs().seq_len))


# ----------------------------------------------------------------------------------------------------------------
# The rules, shared by every source.


def shrink_heads(heads: int, kv_heads: int) -> tuple[int, int]:
    """(heads, kv heads): at most two kv heads, the same number of query heads per kv head, at most 16 heads."""
    group = max(heads // kv_heads, 1)
    kv = min(kv_heads, MAX_KV_HEADS)
    if kv * group > MAX_HEADS:  # two groups do not fit: one kv head still keeps the ratio
        kv = 1
    # A group larger than the cap cannot keep its ratio; it stays grouped-query (MQA stays MQA) with 16 heads.
    return min(kv * group, MAX_HEADS), kv


def shrunk_head_size(old_head: int, partial: float | None) -> int:
    """Head size 16 (a smaller one is kept), doubled back while a partial rotary factor would leave no even number
    of rotary dims."""
    new_head = min(old_head, HEAD_DIM)
    while partial and (int(new_head * partial) % 2 or int(new_head * partial) < 2) and new_head < old_head:
        new_head *= 2
    return new_head


def scaled_width(old: int, old_hidden: int, new_hidden: int) -> int:
    """A width keeping its ratio to the hidden size, rounded up to a multiple of 8."""
    return max(8, math.ceil(old * new_hidden / old_hidden / 8) * 8)


def even_rotary(old_rotary: int, old_head: int, new_head: int) -> int:
    """An absolute rotary dim scaled with the head size, kept even and at least 2."""
    return min(max(2, round(old_rotary * new_head / old_head) // 2 * 2), new_head)


def resample(values: list, length: int) -> list:
    """A per-frequency list (longrope's factors) at `length` evenly spaced points, the first and last kept."""
    if length == 1 or len(values) == 1:
        return values[:1] * length
    return [values[round(i * (len(values) - 1) / (length - 1))] for i in range(length)]


def clamp_token(value: Any, vocab: int) -> Any:
    """A token id (or a list of them) inside the new vocabulary: ids past it become vocab - 1."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return min(value, vocab - 1)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(dict.fromkeys(min(v, vocab - 1) for v in value))  # [128001, 128009] -> [511], not [511, 511]
    return value


def keep_layers(layer_types: list | None, count: int) -> list[int]:
    """Which original layers the shrunk model keeps: the first of each layer type (in order), then the first ones."""
    if not layer_types:
        return list(range(count))
    firsts = list(dict.fromkeys(layer_types))  # types in order of first appearance
    chosen = [layer_types.index(t) for t in firsts][: max(count, len(firsts))]
    rest = [i for i in range(len(layer_types)) if i not in chosen]
    return sorted(chosen + rest[: max(0, count - len(chosen))])


# ----------------------------------------------------------------------------------------------------------------
# source: hf


def shrink_hf_dict(data: dict[str, Any], seq_len: int = 8) -> Edits:
    """Shrink a Hugging Face config dictionary in place (the keys as config.json spells them), rule by rule."""
    e = Edits(data, own_spellings(data))
    before_layers = {k: v for k, v in data.items() if isinstance(v, list) and "layer" in k}
    _fewer_layers(e)
    head_key, hidden_key = e.first_count(e.keys["h"]), e.first_count(e.keys["d"])
    old_hidden = data.get(hidden_key) if hidden_key else None
    old_heads = data.get(head_key) if head_key else None
    old_head = _fewer_heads(e, head_key, old_hidden)
    # Another attention's heads (a decoder's): as many as the model's own when they were as many, else as few.
    for key in [k for k in data if k != head_key and OTHER_HEADS.fullmatch(k) and _count(data[k])]:
        own = data[head_key] if head_key is not None and data[key] == old_heads else None
        e.set(key, own or shrink_heads(data[key], data[key])[0])
    partial = _partial_rotary(data)
    new_head = _smaller_heads(e, old_head, partial, head_key, hidden_key)

    # Feed-forward and embedding widths keep their ratio to the hidden size (rounded up to a multiple of 8), and a
    # width handed on that is a multiple of it keeps the multiple.
    if old_hidden and hidden_key:
        for key in e.keys["d_ff"] + EMBED_KEYS:
            if isinstance(data.get(key), int):
                e.set(key, scaled_width(data[key], old_hidden, data[hidden_key]))
        _concatenated_outputs(e, before_layers, old_hidden, data[hidden_key])

    # RoPE: theta, scaling type and factors, partial factor: unchanged. An absolute rotary_dim (GPT-J, CodeGen)
    # scales with the head size; longrope's per-frequency factors are resampled to the new number of pairs.
    if old_head and new_head is not None and new_head != old_head:  # (new_head is set with old_head)
        if isinstance(data.get("rotary_dim"), int):
            e.set("rotary_dim", even_rotary(data["rotary_dim"], old_head, new_head))
        for key in ("rope_parameters", "rope_scaling"):
            params = data.get(key)
            if isinstance(params, dict):
                e.set(key, _resample_factors(params, old_head, new_head, partial))

    _state_space_heads(e, hidden_key)
    _fewer_tokens_and_positions(e, seq_len)
    # Tied embeddings, activations, norms, biases, dropout, soft-capping: unchanged. Values in float32.
    e.set("dtype", "float32")
    shrink_sub_configs(e, seq_len, shrink_hf_dict)  # text_config, vision_config, encoder, decoder, ...
    return e


def own_spellings(data: dict[str, Any]) -> Spellings:
    """HF_KEYS with the config's own spellings first: those its transformers config class maps the standard names to
    (attribute_map: Mllama's vision tower says attention_heads, ProphetNet num_encoder_attention_heads), and the
    depths of its stacks (STACK_DEPTH). The standard name a config does not hold is read under its own."""
    own: dict[str, tuple[str, ...]] = {}
    try:
        from transformers import CONFIG_MAPPING  # on use: configs of other sources need none

        cls = CONFIG_MAPPING[data["model_type"]]
    except (ImportError, KeyError):
        cls = None
    # standard name -> symbol; not the head size: a class may map head_dim to a part of the head (DeepSeek-style
    # latent attention's qk_rope_head_dim), which the whole head's rules would cut out of step with the rest
    symbols = {names[0]: symbol for symbol, names in HF_KEYS.items() if symbol != "d_h"}
    for standard, spelled in (getattr(cls, "attribute_map", None) or {}).items():
        if standard in symbols and spelled in data and standard not in data:
            own[symbols[standard]] = (spelled,)
    depths = tuple(k for k in data if STACK_DEPTH.fullmatch(k) and _count(data[k]))
    keys = {symbol: (*own.get(symbol, ()), *names) for symbol, names in HF_KEYS.items()}
    keys["L"] = (*keys["L"], *depths)
    return {symbol: tuple(dict.fromkeys(names)) for symbol, names in keys.items()}  # each spelling once


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _concatenated_outputs(e: Edits, layer_lists: dict[str, list], old_hidden: int, new_hidden: int) -> None:
    """A width that is the hidden states of some listed layers and the last one side by side: (1 + the list's
    length) x the hidden size before (Mllama's vision_output_dim, 7680 = 6 x 1280 for intermediate_layers_indices
    [3, 7, 15, 23, 30]), the same after."""
    for key, value in list(e.data.items()):
        if not _count(value) or "layer" in key or value == old_hidden:
            continue
        for name, layers in layer_lists.items():
            now = e.data.get(name)
            if value == old_hidden * (1 + len(layers)) and isinstance(now, list):
                e.set(key, new_hidden * (1 + len(now)))
                break


def _fewer_layers(e: Edits) -> None:
    """Depth: 2 layers (a 1-layer model stays 1). Per-layer lists (layer_types, ...) keep the same layers, and one
    layer of each type when the model mixes them (sliding and full attention, say), even if that takes a few more."""
    data = e.data
    layer_key = e.first(e.keys["L"])
    if not layer_key:
        return
    old_layers = data[layer_key]
    types = _layer_types(data, old_layers)
    depth = min(old_layers, LAYERS)
    pattern = _layer_pattern(data, old_layers)
    if pattern:  # one of each block in a repeating pattern (Recurrent Gemma: recurrent, recurrent, attention)
        depth = min(old_layers, max(depth, max(pattern.index(t) for t in pattern) + 1))
    kept = keep_layers(types, depth)
    for key in e.keys["L"]:
        if isinstance(data.get(key), int):
            e.set(key, min(data[key], len(kept)))
    if old_layers <= len(kept):
        return
    renumbered = {old: new for new, old in enumerate(kept)}
    for key, value in list(data.items()):
        if not isinstance(value, list):
            continue
        if len(value) == old_layers:
            kept_values = [value[i] for i in kept]
            # A per-layer list of layer indices (the layer whose kv cache each layer reads) points at kept layers.
            if _layer_indices(key, value, old_layers) and all(v in renumbered for v in kept_values):
                kept_values = [renumbered[v] for v in kept_values]
            e.set(key, kept_values)
        elif _layer_indices(key, value, old_layers):  # which layers do something (index_layers: [4, 14, 19, 29])
            among_kept = [renumbered[i] for i in value if i in renumbered]
            # None of them kept: each moves to the last layer kept before it, so that some layer still does it
            # (Mllama's cross-attention layers), and a list whose length sets a width keeps its length (the vision
            # layers whose outputs Mllama's projector reads side by side).
            e.set(key, among_kept or [renumbered[max(k for k in kept if k <= i)] for i in value])
    _layer_counts(e, layer_key, old_layers, len(kept))


def _layer_types(data: dict, layers: int) -> list | None:
    """The kind of each layer, under the names configs keep it: layer_types, or another per-layer list of names
    (Zamba's layers_block_type)."""
    candidates = ["layer_types", *(k for k in data if "type" in k and k != "layer_types")]
    for key in candidates:
        value = data.get(key)
        if isinstance(value, list) and len(value) == layers and all(isinstance(v, str) for v in value):
            return value
    return None


def _layer_pattern(data: dict, layers: int) -> list | None:
    """A shorter list of block kinds the layers repeat (Recurrent Gemma's block_types)."""
    for key, value in data.items():
        if (
            "type" in key
            and isinstance(value, list)
            and 1 < len(value) < layers
            and all(isinstance(v, str) for v in value)
            and len(set(value)) > 1
        ):
            return value
    return None


def _layer_indices(key: str, value: list, layers: int) -> bool:
    """A list named for layers whose entries are all layer numbers."""
    return (
        "layer" in key
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value)
    )


def _layer_counts(e: Edits, layer_key: str, old_layers: int, new_layers: int) -> None:
    """Counts of layers with a role follow the depth: parts that add up to it (n_input_layers + n_recurrent_layers
    + n_output_layers) still do, one layer each at least, and a count of layers sharing another's cache keeps its share
    (rounded down: a layer of each type still computes its own)."""
    data = e.data
    counts = [
        k
        for k, v in data.items()
        if k != layer_key
        and k not in e.keys["L"]
        and k.endswith("_layers")
        and isinstance(v, int)
        and not isinstance(v, bool)
        and 0 <= v < old_layers
    ]
    parts = [k for k in counts if k.startswith("n_")]
    if len(parts) > 1 and sum(data[k] for k in parts) == old_layers and new_layers >= len(parts):
        largest = max(parts, key=lambda k: data[k])
        for key in parts:
            e.set(key, 1)
        e.set(largest, new_layers - len(parts) + 1)
        counts = [k for k in counts if k not in parts]
    for key in counts:
        if "shared" in key:
            e.set(key, data[key] * new_layers // old_layers)


# State-space layers (Mamba 2, Bamba, Granite hybrid): heads x head size is the expanded hidden size, whatever the
# attention heads are; (heads, head size, expansion) under each architecture's spelling.
STATE_SPACE_HEADS = (  # heads, head size, expansion, groups, and the inner size when a config states it outright
    ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_n_groups", "mamba_d_ssm"),
    ("num_heads", "head_dim", "expand", "n_groups", None),
)


def _state_space_heads(e: Edits, hidden_key: str | None) -> None:
    """A state-space mixer's heads x head size equal to its inner size (stated outright, as Falcon-H1's mamba_d_ssm,
    or the shrunk hidden size x its expansion): the head size at most 16, the head count what that leaves (a
    multiple of the groups' count when one is set)."""
    data = e.data
    hidden = data.get(hidden_key) if hidden_key else None
    for heads_key, size_key, expand_key, groups_key, inner_key in STATE_SPACE_HEADS:
        values = [data.get(k) for k in (heads_key, size_key, expand_key)]
        if not isinstance(hidden, int) or not all(isinstance(v, int) and v > 0 for v in values):
            continue
        stated = data.get(inner_key) if inner_key else None
        inner = stated if isinstance(stated, int) and stated > 0 else data[expand_key] * hidden
        if data[heads_key] * data[size_key] != inner:
            size = min(data[size_key], HEAD_DIM)
            while inner % size:
                size //= 2
            e.set(size_key, size)
            e.set(heads_key, inner // size)
        groups = data.get(groups_key)
        if isinstance(groups, int) and groups > 0 and data[heads_key] % groups:  # heads share B and C by groups
            e.set(groups_key, math.gcd(groups, data[heads_key]))


def _fewer_heads(e: Edits, head_key: str | None, old_hidden: int | None) -> int | None:
    """Heads: at most 2 kv heads, the query heads per kv head kept (MQA stays MQA), at most 16 heads. Returns the
    head size before (None without a head count, or a head size to read)."""
    data = e.data
    if not head_key:
        return None
    kv_key = e.first_count(e.keys["h_kv"])
    heads = data[head_key]
    old_head = data.get("head_dim") or data.get("d_kv") or (old_hidden // heads if old_hidden else None)
    multi_query = data.get("multi_query") and not data.get("new_decoder_architecture")  # Falcon, GPT-BigCode
    kv = 1 if multi_query else (data[kv_key] if kv_key else heads)
    new_heads, new_kv = shrink_heads(heads, kv)
    e.set(head_key, new_heads)
    if kv_key:
        e.set(kv_key, new_heads if multi_query else new_kv)  # Falcon ignores num_kv_heads under multi_query
    return old_head


def _smaller_heads(
    e: Edits, old_head: int | None, partial: float | None, head_key: str | None, hidden_key: str | None
) -> int | None:
    """Head size 16 (a smaller one is kept); a partial rotary factor must still leave an even number of rotary dims.
    Set explicitly when the config names it; the hidden size is heads x head size. Returns the new head size."""
    data = e.data
    if not old_head:
        return old_head
    new_head = shrunk_head_size(old_head, partial)
    for key in e.keys["d_h"]:
        if data.get(key) is not None:
            e.set(key, new_head)
    if data.get("query_pre_attn_scalar") == old_head:  # Gemma's attention scale, the head size by default
        e.set("query_pre_attn_scalar", new_head)
    if hidden_key and head_key:  # (a head size is read only with a head count)
        e.set(hidden_key, data[head_key] * new_head)
    return new_head


def _fewer_tokens_and_positions(e: Edits, seq_len: int) -> None:
    """The vocabulary, the attention window and a learned position table, each small, the test sequence still
    reaching past the window and fitting the table."""
    data = e.data
    # Vocabulary at most 512; special token ids past it are clamped to the last id.
    if isinstance(data.get("vocab_size"), int):
        e.set("vocab_size", min(data["vocab_size"], VOCAB))
        # Other tables over the vocabulary (Gemma 3n's per-layer input embeddings) are no larger.
        for key in [k for k in data if k.startswith("vocab_size_") and isinstance(data[k], int)]:
            e.set(key, min(data[key], data["vocab_size"]))
        for key in [k for k in data if k.endswith("_token_id") or k.endswith("_token_ids")]:
            e.set(key, clamp_token(data[key], data["vocab_size"]))

    # The mask type is kept: a sliding window stays, small enough for a short test sequence to reach past it.
    for key in WINDOW_KEYS:
        if isinstance(data.get(key), int) and data[key] > WINDOW:
            e.set(key, WINDOW)

    # Positions: rotary models keep max_position_embeddings (it costs nothing and rope scaling may depend on it);
    # learned absolute tables (GPT-2, OPT, BERT) are capped at 256, never below the test sequence.
    if not _rotary(data):
        for key in e.keys["max_positions"]:
            if isinstance(data.get(key), int):
                e.set(key, min(data[key], max(LEARNED_POSITIONS, seq_len)))


def _partial_rotary(data: dict) -> float | None:
    rope = data.get("rope_parameters")
    params = rope if isinstance(rope, dict) else {}
    factor = params.get("partial_rotary_factor") or data.get("partial_rotary_factor") or data.get("rotary_pct")
    return factor if factor and factor < 1 else None


def _rotary(data: dict) -> bool:
    return any(data.get(key) for key in ROTARY_KEYS) or data.get("position_embedding_type") == "rotary"


def _resample_factors(params: dict, old_head: int, new_head: int, partial: float | None) -> dict:
    """longrope's short_factor / long_factor hold one entry per rotary pair: resample them to the new pair count."""
    old_pairs, new_pairs = int(old_head * (partial or 1)) // 2, int(new_head * (partial or 1)) // 2
    out = dict(params)
    for key in ("short_factor", "long_factor"):
        if isinstance(out.get(key), list) and len(out[key]) == old_pairs:
            out[key] = resample(out[key], new_pairs)
    for key, value in out.items():  # per layer type (Gemma 3: {sliding_attention: {...}, full_attention: {...}})
        if isinstance(value, dict):
            out[key] = _resample_factors(value, old_head, new_head, partial)
    return out


def shrink_hf(original: Original) -> tuple[dict, Edits]:
    """`source: hf`: the transformers config (inline or a directory's config.json), shrunk and written inline."""
    raw_model, spec = original.model, original.spec
    assert isinstance(spec, HFModel)  # the record's own config class
    if spec.trust_remote_code:
        raise UsageError(
            f"{spec.path or 'the inline config'}: shrink does not run a model's own code "
            "(trust_remote_code); copy the directory and lower its config.json by hand"
        )
    hf_config = load_hf_config(spec)
    data = {k: v for k, v in hf_config.to_dict().items() if k not in DROPPED_KEYS}
    listed = set(hf_config.to_diff_dict())  # what the config sets apart from the library's defaults
    before = copy.deepcopy(data)
    edits = shrink_hf_dict(data, _seq_len(original.raw))
    # The written config: the keys the original set, plus every key the rules changed; model_type first.
    config = {"model_type": data["model_type"]}
    config.update(
        {k: v for k, v in data.items() if k != "model_type" and (k in listed or k not in before or v != before[k])}
    )
    block: dict[str, Any] = {"source": "hf"}
    for key in ("class", "causal", "attention"):
        if key in raw_model:
            block[key] = raw_model[key]
    if raw_model.get("rope") is not None:  # the user's own declaration: an absolute rotary dim scales as above
        rope = dict(raw_model["rope"])
        old_head = before.get("head_dim") or _head_of(before)
        new_head = data.get("head_dim") or _head_of(data)
        if rope.get("rotary_dim") and old_head and new_head:
            new_rotary = even_rotary(rope["rotary_dim"], old_head, new_head)
            edits.changes.append(("rope.rotary_dim", rope["rotary_dim"], new_rotary))
            rope["rotary_dim"] = new_rotary
        block["rope"] = rope
    block["config"] = config
    after, largest = verify_hf(config, spec.model_class)
    edits.parameters = Counted(count_hf(hf_config, spec.model_class), after, largest)
    if spec.path is not None and any((spec.path / f).exists() for f in HF_WEIGHT_FILES):
        edits.notes.append(f"the weights in {spec.path} are not carried over: the shrunk model is randomly initialised")
    return block, edits


def _head_of(data: dict) -> int | None:
    keys = own_spellings(data)
    heads = next((data[k] for k in keys["h"] if data.get(k)), None)
    hidden = next((data[k] for k in keys["d"] if data.get(k)), None)
    return hidden // heads if heads and hidden else None


def load_hf_config(spec: HFModel):
    """The model's transformers config, offline, exactly as `fwdcheck run` reads it."""
    from fwdcheck.model.sources.hf import _hf_config, offline, require_transformers  # on use: it imports torch

    transformers = require_transformers()
    with offline():
        return _hf_config(spec, transformers)


# ----------------------------------------------------------------------------------------------------------------
# source: reference


def shrink_reference_dict(data: dict[str, Any]) -> Edits:
    """Shrink a reference model's fields in place, by the same rules as a Hugging Face config."""
    defaults = ReferenceModel(source="reference")
    e = Edits(data)

    def get(key: str) -> Any:  # the value the model is built with: the config's, or the field's default
        return data[key] if data.get(key) is not None else getattr(defaults, key)

    def put(key: str, value: Any) -> None:  # a field left at its default is written only when it changes
        if value != get(key):
            e.changes.append((key, get(key), value))
            data[key] = value

    # Depth: 2 layers.
    put("n_layers", min(get("n_layers"), LAYERS))
    # Heads: at most 2 kv heads, the ratio kept (n_kv_heads only when the config sets it).
    heads, old_d_model = get("n_heads"), get("d_model")
    new_heads, new_kv = shrink_heads(heads, get("n_kv_heads") or heads)
    put("n_heads", new_heads)
    if data.get("n_kv_heads") is not None:
        put("n_kv_heads", new_kv)
    # Head size 16 (a smaller one is kept), or more when the declared rope.rotary_dim needs it; rope itself unchanged.
    rotary = ((data.get("rope") or {}).get("rotary_dim") or 0) if get("positional") == "rope" else 0
    head = min(old_d_model // heads, max(HEAD_DIM, rotary))
    put("d_model", new_heads * head)
    # Feed-forward width keeps its ratio to d_model.
    put("d_ff", scaled_width(get("d_ff"), old_d_model, new_heads * head))
    # Vocabulary at most 512. max_seq_len, positional, rope, mask, attention, norm and planted bugs: unchanged.
    put("vocab_size", min(get("vocab_size"), VOCAB))
    return e


def shrink_reference(original: Original) -> tuple[dict, Edits]:
    """`source: reference`: its own fields, shrunk."""
    block = dict(original.model)
    edits = shrink_reference_dict(block)
    return block, edits


# ----------------------------------------------------------------------------------------------------------------
# source: python and checkpoint: the factory's keyword arguments


# A factory's keyword arguments, by the symbols of fwdcheck/model/config_keys.py and two of shrink's own (rotary_dim,
# windows): the Hugging Face spellings, plus gpt-fast's n_local_heads and litgpt's n_query_groups, head_size and
# padded_vocab_size.
KWARG_KEYS: Spellings = {
    **extended(HF_KEYS, h_kv=("n_local_heads", "n_query_groups"), d_h=("head_size",), V=("padded_vocab_size",)),
    "rotary_dim": ("rotary_dim",),
    "windows": WINDOW_KEYS,
}
# Position limits (block_size, max_seq_len) are kept: once the width is cut a position table costs little, and a
# rotary cache may be sized by them.
del KWARG_KEYS["max_positions"]
# The config's own `dims:` declaration, keyed by the symbols themselves, shrunk alike so that it keeps describing the
# shrunk model.
DIMS_KEYS: Spellings = {symbol: (symbol,) for symbol in Dims.model_fields}
PARTIAL_ROTARY_KEYS = ("partial_rotary_factor", "rotary_pct", "rotary_percentage")
# Model keys written anew: the sys.path directories (to be found from where the shrunk config lies), and what only
# loading a checkpoint's weights needs (the shrunk copy has none).
REWRITTEN_KEYS = ("path", "python_path", "trust_checkpoint", "strict")


def shrink_sizes(data: dict[str, Any], keys: Spellings, partial: float | None = None) -> Edits:
    """Shrink the sizes a mapping names by the rules of a Hugging Face config, in place. No key is added: a factory
    may not accept one it was not given. A width is cut only when the heads say how (heads x head size)."""
    e = Edits(data)
    for key in keys.get("L", ()):
        if isinstance(data.get(key), int):
            e.set(key, min(data[key], LAYERS))

    head_key, kv_key, hidden_key = e.first(keys.get("h", ())), e.first(keys.get("h_kv", ())), e.first(keys.get("d", ()))
    head_dim_key = e.first(keys.get("d_h", ()))
    old_hidden = data.get(hidden_key) if hidden_key else None
    heads = data.get(head_key) if head_key else None
    old_head = data[head_dim_key] if head_dim_key else (old_hidden // heads if old_hidden and heads else None)
    if heads and head_key:  # (heads are read only with their key)
        new_heads, new_kv = shrink_heads(heads, data[kv_key] if kv_key else heads)
        e.set(head_key, new_heads)
        if kv_key:
            e.set(kv_key, new_kv)
    if old_head:
        new_head = shrunk_head_size(old_head, partial)
        for key in keys.get("d_h", ()):
            if data.get(key) is not None:
                e.set(key, new_head)
        for key in keys.get("rotary_dim", ()):
            if isinstance(data.get(key), int):
                e.set(key, even_rotary(data[key], old_head, new_head))
        if hidden_key and heads and head_key:
            e.set(hidden_key, data[head_key] * new_head)
    if old_hidden and hidden_key and data.get(hidden_key) != old_hidden:  # (old_hidden is read only with its key)
        for key in keys.get("d_ff", ()):
            if isinstance(data.get(key), int):
                e.set(key, scaled_width(data[key], old_hidden, data[hidden_key]))

    for key in keys.get("V", ()):
        if isinstance(data.get(key), int):
            e.set(key, min(data[key], VOCAB))
    vocab_key = e.first(keys.get("V", ()))
    if vocab_key:
        for key in [k for k in data if k.endswith(("_token_id", "_token_ids"))]:
            e.set(key, clamp_token(data[key], data[vocab_key]))
    for key in keys.get("windows", ()):
        if isinstance(data.get(key), int) and data[key] > WINDOW:
            e.set(key, WINDOW)
    return e


def shrink_factory(original: Original) -> tuple[dict, Edits]:
    """A python (or checkpoint) model block with its factory's size kwargs shrunk, as a `source: python` block."""
    raw_model, spec, config_path, output = original.model, original.spec, original.path, original.output
    assert isinstance(spec, (PythonModel, CheckpointModel))  # the records' own config classes
    known = [key for key in spec.kwargs if any(key in names for names in KWARG_KEYS.values())]
    if not known:
        given = f"its kwargs ({', '.join(spec.kwargs)}) name" if spec.kwargs else "it has no `kwargs:`, so it names"
        raise UsageError(
            f"{config_path}: cannot shrink this `source: {spec.source}` config: {given} no size "
            f"(n_layers, d_model, n_heads, vocab_size, d_ff, ...); give the factory its sizes as "
            "`kwargs:`, or lower them in its code"
        )
    kwargs = copy.deepcopy(raw_model["kwargs"])
    partial = next((kwargs[k] for k in PARTIAL_ROTARY_KEYS if isinstance(kwargs.get(k), float) and kwargs[k] < 1), None)
    block = {key: value for key, value in raw_model.items() if key not in REWRITTEN_KEYS}
    block["source"] = "python"
    block["kwargs"] = kwargs
    edits = Edits(block)
    edits.changes = [(f"kwargs.{key}", old, new) for key, old, new in shrink_sizes(kwargs, KWARG_KEYS, partial).changes]
    if isinstance(spec, CheckpointModel):
        edits.changes.append(("source", "checkpoint", "python"))
        edits.notes.append(
            f"the weights in {spec.path} are not carried over: the shrunk model is the factory's, "
            "randomly initialised (source: python)"
        )
    # The declarations that describe the model's sizes follow them.
    if spec.vocab_size is not None:
        edits.set("vocab_size", min(spec.vocab_size, VOCAB))
    if raw_model.get("dims"):
        dims = dict(raw_model["dims"])
        edits.changes += [(f"dims.{key}", old, new) for key, old, new in shrink_sizes(dims, DIMS_KEYS, partial).changes]
        block["dims"] = dims
    old_head, new_head = _kwargs_head(raw_model["kwargs"]), _kwargs_head(kwargs)
    if (raw_model.get("rope") or {}).get("rotary_dim") and old_head and new_head:
        rope = dict(raw_model["rope"])
        rope["rotary_dim"] = even_rotary(rope["rotary_dim"], old_head, new_head)
        edits.changes.append(("rope.rotary_dim", raw_model["rope"]["rotary_dim"], rope["rotary_dim"]))
        block["rope"] = rope
    # The factory's modules are found on sys.path: the configured directories and the config's own folder, which
    # is no longer the written config's folder when it is written elsewhere.
    search = [*spec.python_path, config_path.parent]
    written = _paths_from(search, output.parent)
    before = raw_model.get("python_path", None if isinstance(spec, CheckpointModel) else raw_model.get("path"))
    if written or before is not None:
        block["python_path"] = written
    if written != (before or []):
        edits.changes.append(("python_path", before, written))
    return block, edits


def _kwargs_head(kwargs: dict) -> int | None:
    """The head size a factory's kwargs give: named, or the width over the heads."""
    head_dim = next((kwargs[k] for k in KWARG_KEYS["d_h"] if kwargs.get(k)), None)
    heads = next((kwargs[k] for k in KWARG_KEYS["h"] if kwargs.get(k)), None)
    hidden = next((kwargs[k] for k in KWARG_KEYS["d"] if kwargs.get(k)), None)
    return head_dim or (hidden // heads if heads and hidden else None)


def _paths_from(directories: list[Path], folder: Path) -> list[str]:
    """Directories as a config in `folder` names them: relative below it, absolute elsewhere; the folder itself is
    left out (a config's own folder is always on sys.path)."""
    folder = folder.resolve()
    shown = []
    for directory in directories:
        directory = directory.resolve()
        if directory == folder:
            continue
        shown.append(str(directory.relative_to(folder)) if folder in directory.parents else str(directory))
    return list(dict.fromkeys(shown))
