"""The YAML config, validated by pydantic. Paths are resolved relative to the config file.

The validation problems become one ConfigError line naming the file and, for each problem, the YAML path of the key,
e.g. `toy.yaml: model.n_head: unknown key; did you mean 'n_heads'?; inputs.seq_len: Input should be greater than or
equal to 2 (got 1)`.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import operator
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from fwdcheck.config.bugs import BUGS
from fwdcheck.config.dtypes import DTYPE_SPELLINGS
from fwdcheck.config.hub_cache import NotCached, cached_snapshot, fetch_command, looks_like_hub_id
from fwdcheck.config.reading import MAX_DEPTH, check_yaml_structure, nesting_depth, regular_file
from fwdcheck.config.rename import parse_rule
from fwdcheck.config.sources import SOURCES, resolve
from fwdcheck.config.tolerance_bounds import bounded_atol, bounded_noise_factor, bounded_rtol
from fwdcheck.config.validation_words import in_plain_words
from fwdcheck.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

    Bug = str  # a Literal of the names in BUGS, which a type checker cannot read off the tuple
else:
    Bug = Literal[tuple(BUGS)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CheckOptions(Strict):
    """The base of a check's options model (Check.options): read from the config's `options:` section under the
    check's name, with the command-line flags the check declares on top. Keep it in a module free of torch: the
    command line validates it before any model loads."""


class RopeSpec(Strict):
    """What the model declares about its rotary embedding; the rope check compares it with what it measures."""

    base: float | None = Field(
        10000.0, gt=1.0, description="None: frequencies rescaled (llama3, yarn, ...); the base is then not compared"
    )
    pairing: Literal["half", "interleaved"] | None = Field(
        "half", description="None: not stated (a library's config says nothing of it); measured, not compared"
    )
    rotary_dim: PositiveInt | None = None


class Dims(Strict):
    """Symbolic dimensions the model declares, for when fwdcheck cannot read them off a config object: the shape
    ledger names axes by them (h in [B,h,T,T]) and the rope check tests the head size d_h."""

    d: PositiveInt | None = Field(None, description="model width")
    h: PositiveInt | None = Field(None, description="query heads")
    h_kv: PositiveInt | None = Field(None, description="key/value heads (GQA, multi-query); default h")
    d_h: PositiveInt | None = Field(None, description="head size (of queries and keys); default d / h")
    d_v: PositiveInt | None = Field(
        None, description="value head size, where it differs from d_h (MLA's v_head_dim); default d_h"
    )
    d_ff: PositiveInt | None = Field(None, description="feed-forward width")
    V: PositiveInt | None = Field(None, description="vocabulary (the logits' last axis)")

    def declared(self) -> dict[str, int]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ModelSpec(Strict):
    """What every `model:` section can say about the files it names: a source's config class overrides these."""

    # Whether the models this source builds shard themselves over ranks (a tensor-parallel plan of their own), so
    # that a distributed run needs no `distributed.parallelize`: known from the config, before any model loads.
    shards_itself: ClassVar[bool] = False
    if TYPE_CHECKING:  # each source's class declares the field, `source: Literal["name"]`, which pydantic reads

        @property
        def source(self) -> str: ...

    def resolve_paths(self, base: Path) -> None:
        """Make the paths this section names absolute, relative to `base` (the config file's folder)."""

    def files_read(self) -> list[tuple[str, Path]]:
        """The files loading this model reads, named as an error names them (no report may overwrite one)."""
        return []

    def code(self) -> list[tuple[str, str]]:
        """The model code this section names, as (what it is, "module:attribute"): the factory, the forward
        adapter, the rotary function."""
        return []

    def code_dirs(self) -> list[Path]:
        """The directories this section puts on sys.path for the model's code."""
        return []


def _resolve(path: Path, base: Path) -> Path:
    return path if path.is_absolute() else (base / path).resolve()


def shards(index: Path) -> list[Path]:
    """The files a sharded checkpoint's index (*.index.json) names; nothing for any other file, or a broken one
    (the loader reports that)."""
    if not index.name.endswith(".index.json") or not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        return [index.parent / name for name in set(weight_map.values()) if isinstance(name, str)]
    except (OSError, ValueError, AttributeError, RecursionError):
        return []


class ReferenceModel(ModelSpec):
    source: Literal["reference"]
    vocab_size: PositiveInt = 16
    d_model: PositiveInt = 8
    n_heads: PositiveInt = 2
    n_kv_heads: PositiveInt | None = None
    n_layers: PositiveInt = 2
    d_ff: PositiveInt = 32
    max_seq_len: PositiveInt = 64
    positional: Literal["rope", "learned", "none"] = "rope"
    rope: RopeSpec = Field(default_factory=RopeSpec)
    norm: Literal["pre", "post"] = "pre"
    attention: Literal["sdpa", "eager"] = "sdpa"
    mask: Literal["bool", "float", "is_causal"] = "bool"
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = False
    init_std: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="weights of linear layers and "
        "embeddings drawn from normal(0, init_std) (GPT-2 uses 0.02); default PyTorch's "
        "own initialisation",
    )
    window: PositiveInt | None = Field(
        None, description="a sliding attention window: each query reads itself and the window - 1 keys before it"
    )
    bugs: list[Bug] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> ReferenceModel:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {kv}")
        head_dim = self.d_model // self.n_heads
        if self.positional == "rope":
            rotary = self.rope.rotary_dim or head_dim
            if rotary % 2 or rotary > head_dim:
                raise ValueError(f"rope.rotary_dim {rotary} must be even and at most the head size {head_dim}")
        return self


class AttentionSpec(Strict):
    """The attention pattern the model has by design, where the model cannot show it (fwdcheck reads it off a
    transformers model: is_encoder_decoder, is_decoder, its attention modules' is_causal). Every check judges
    against it."""

    pattern: Literal["causal", "bidirectional", "prefix", "encoder-decoder"] = Field(
        description="causal (a decoder), bidirectional (an encoder), prefix (a prefix-LM: the first prefix_length "
        "tokens read each other, the rest is causal) or encoder-decoder (the decoder's tokens under test, causal, "
        "reading all of a source held fixed)"
    )
    prefix_length: PositiveInt | None = Field(None, description="prefix: how many leading tokens form the prefix")

    @model_validator(mode="after")
    def _prefix_has_a_length(self) -> AttentionSpec:
        if self.pattern == "prefix" and self.prefix_length is None:
            raise ValueError("pattern 'prefix' needs a prefix_length (the leading tokens that read each other)")
        if self.pattern != "prefix" and self.prefix_length is not None:
            raise ValueError(f"prefix_length is for pattern 'prefix', not {self.pattern!r}")
        return self


def pattern_agrees(causal: bool | None, attention: AttentionSpec | None) -> None:
    """`causal:` (the former key) and `attention.pattern` may both be given only when they agree."""
    if causal is None or attention is None:
        return
    if causal != (attention.pattern in ("causal", "encoder-decoder")):
        raise ValueError(
            f"causal: {str(causal).lower()} contradicts attention.pattern {attention.pattern!r}; give one of them"
        )


def declared_attention_agrees(window: int | list | None, chunk: int | list | None) -> None:
    """`window:` and `chunk:` may both be given only as lists of one entry per layer that never name one layer
    twice: a layer slides, is chunked, or is neither (full attention)."""
    if window is None or chunk is None:
        return
    if not isinstance(window, list) or not isinstance(chunk, list):
        key, value, other = ("window", window, "chunk") if not isinstance(window, list) else ("chunk", chunk, "window")
        raise ValueError(
            f"{key}: {value} is one {key} for every layer, and {other}: is given too: give both as lists, one entry "
            "per layer, null where the other (or full attention) holds it"
        )
    if len(window) != len(chunk):
        raise ValueError(f"window: has {len(window)} entries and chunk: {len(chunk)}; give one per layer in each")
    both = [i for i, (w, c) in enumerate(zip(window, chunk, strict=True)) if w is not None and c is not None]
    if both:
        raise ValueError(
            f"layer {both[0]} is given both a window ({window[both[0]]}) and a chunk ({chunk[both[0]]}): a layer "
            "slides or is chunked, not both (null in one of the lists)"
        )


class FactoryModel(ModelSpec):
    """A model built by the user's own callable: the fields `python` and `checkpoint` sources share."""

    factory: str = Field(description="'package.module:callable' returning an nn.Module")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    forward: str | None = Field(
        None,
        description="'module:callable' adapter (model, input_ids, **extras) -> logits, which every check "
        "calls (extras: position_ids, labels, document ids, cache keywords)",
    )
    vocab_size: PositiveInt | None = None
    max_positions: PositiveInt | None = None
    causal: bool | None = Field(
        None, description="false for bidirectional encoders (attention.pattern's former spelling)"
    )
    attention: AttentionSpec | None = Field(None, description="the attention pattern by design (default: causal)")
    rope: RopeSpec | None = Field(None, description="declared rotary settings, compared with what is measured")
    rotary_function: str | None = Field(
        None, description="'module:callable' (x [B,h,T,d_h], positions [T]) -> rotated x, tested on its own"
    )
    dims: Dims | None = Field(
        None, description="declared sizes (d, h, h_kv, d_h, d_ff, V) where no model config object says them"
    )
    window: PositiveInt | list[PositiveInt | None] | None = Field(
        None,
        description="the sliding attention window: the keys a query may read, itself included (a list: one per "
        "layer, null for full causal attention); mask-audit compares each layer's mask with it",
    )
    chunk: PositiveInt | list[PositiveInt | None] | None = Field(
        None,
        description="chunked attention's chunk size: the sequence cut into chunks of this many tokens, a query "
        "reading its own chunk's keys up to itself (a list: one per layer, null for a layer that is not chunked); "
        "mask-audit compares each layer's mask with it",
    )
    scale: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="the factor attention applies to q . k when it is not 1/sqrt(d_h) (1 for a model that folds the "
        "scale into its weights, as T5); attention-stats judges the effective scale against it",
    )

    @model_validator(mode="after")
    def _one_pattern(self) -> FactoryModel:
        pattern_agrees(self.causal, self.attention)
        declared_attention_agrees(self.window, self.chunk)
        return self

    def code(self) -> list[tuple[str, str]]:
        named = [("the factory", self.factory), ("the forward adapter", self.forward)]
        named.append(("the rotary function", self.rotary_function))
        return [(what, reference) for what, reference in named if reference]

    @field_validator("factory", "forward", "rotary_function")
    @classmethod
    def _module_colon_callable(cls, value: str | None) -> str | None:
        if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
            module, dot, name = value.rpartition(".")
            hint = f"; did you mean '{module}:{name}'?" if dot and module and name and ":" not in value else ""
            raise ValueError(f"'{value}' is not of the form 'package.module:callable'{hint}")
        return value


class CacheSpec(Strict):
    """How to run the model incrementally through its KV cache, for the kv-cache check.

    hf: forward(input_ids, past_key_values=cache, use_cache=True) returns the logits and the cache (an object with
    .past_key_values or .cache, or a tuple (logits, cache)); the first call gets no cache, and positions are left to
    the model. gpt-fast: model.<setup>(max_batch_size, max_seq_length) allocates the cache, then
    forward(input_ids, input_pos) runs the tokens at positions input_pos [T] (litgpt: setup set_kv_cache)."""

    style: Literal["hf", "gpt-fast"]
    setup: str = Field(
        "setup_caches",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="gpt-fast: the model's method that allocates the cache",
    )


class LossSpec(Strict):
    """How forward computes its training loss, for the label-shift check: forward(input_ids, <argument>=labels)
    returns the loss beside the logits. Hugging Face: labels are the input ids and the model shifts them
    (argument labels, shifted_by model, output loss). nanoGPT: targets[t] is the token after position t, shifted by
    the caller (argument targets, shifted_by caller, output 1, ignore_index -1)."""

    argument: str = Field(
        "labels",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the keyword forward takes the labels by: labels (Hugging Face) or targets (nanoGPT)",
    )
    shifted_by: Literal["model", "caller"] = Field(
        "model",
        description="model: labels line up with input_ids and "
        "forward shifts them; caller: labels[t] is already the token after "
        "position t",
    )
    output: int | str = Field(
        "loss",
        description="where the loss is in forward's output: a tuple index (nanoGPT's "
        "(logits, loss): 1), or an attribute or key name",
    )
    ignore_index: int = Field(-100, description="the label value the loss skips (nanoGPT uses -1)")


class PackingSpec(Strict):
    """How forward isolates documents packed into one row, for the packing check."""

    argument: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the keyword forward takes the documents by")
    form: Literal["document_ids", "mask"] = Field(
        "document_ids",
        description="document_ids: [B, T] integers, one "
        "per document; mask: [B, 1, T, T] booleans, True = may attend, "
        "causal within each document",
    )
    position_ids: bool = Field(
        False,
        description="also pass position_ids restarting at 0 in each document (when "
        "forward does not restart them itself)",
    )


class PythonModel(FactoryModel):
    source: Literal["python"]
    python_path: list[Path] = Field(
        default_factory=list, description="directories put on sys.path before the import (as source checkpoint's)"
    )
    # `path:` is python_path's former name, still read with a note: it names the model's files in the other sources
    # (the weights file of `checkpoint`, the directory of `hf`)
    path: list[Path] | None = Field(None, description="the former name of python_path, still read")
    cache: CacheSpec | None = Field(None, description="how to decode through the model's KV cache (kv-cache check)")
    loss: LossSpec | None = Field(None, description="how forward computes its loss from labels (label-shift check)")
    packing: PackingSpec | None = Field(None, description="how forward isolates packed documents (packing check)")

    @model_validator(mode="after")
    def _former_path(self) -> PythonModel:
        if self.path is not None:
            if self.python_path:
                raise ValueError("give python_path alone: path is its former name")
            self.python_path = list(self.path)
        return self

    @property
    def former_spellings(self) -> list[str]:
        """A note for each key given in a former spelling."""
        if self.path is None:
            return []
        return ["model.path: python_path's former name (sys.path directories), still read; write python_path"]

    def resolve_paths(self, base: Path) -> None:
        self.python_path = [_resolve(p, base) for p in self.python_path]

    def code_dirs(self) -> list[Path]:
        return list(self.python_path)


class CheckpointModel(FactoryModel):
    source: Literal["checkpoint"]
    path: Path = Field(description="a .safetensors file, or a .pt/.pth state dict")
    python_path: list[Path] = Field(default_factory=list, description="directories put on sys.path first")
    trust_checkpoint: bool = Field(False, description="allow a pickle that runs code when loaded (weights_only=False)")
    strict: bool = Field(
        True,
        description="missing or unexpected keys are a load error (exit 2), as load_state_dict's default is; false: "
        "a warning, and missing keys keep their seeded initialisation",
    )

    def resolve_paths(self, base: Path) -> None:
        self.path = _resolve(self.path, base)
        self.python_path = [_resolve(p, base) for p in self.python_path]

    def files_read(self) -> list[tuple[str, Path]]:
        return [("the checkpoint", self.path), *(("a checkpoint shard", shard) for shard in shards(self.path))]

    def code_dirs(self) -> list[Path]:
        return list(self.python_path)


# The weights a Hugging Face model directory may hold, as from_pretrained looks for them.
HF_WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)


class HFModel(ModelSpec):
    # protected_namespaces: pydantic before 2.10 warns at import that `model_class` starts with `model_`
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())
    shards_itself: ClassVar[bool] = True  # transformers' tp_plan

    source: Literal["hf"]
    path: Path | None = Field(
        None,
        description="a directory with config.json (and weights, optionally), or a hub id (org/name) read from the "
        "local Hugging Face cache",
    )
    config: dict[str, Any] | None = Field(None, description="an inline config with model_type, instead of path")
    model_class: str | None = Field(
        None, alias="class", description="e.g. BertForMaskedLM; default AutoModelForCausalLM"
    )
    trust_remote_code: bool = False
    causal: bool | None = Field(
        None, description="false for bidirectional encoders (attention.pattern's former spelling)"
    )
    attention: AttentionSpec | None = Field(
        None, description="the attention pattern by design (default: read off the model, else causal)"
    )
    rope: RopeSpec | None = Field(None, description="override what the config declares about its rotary embedding")
    window: PositiveInt | list[PositiveInt | None] | None = Field(
        None, description="override the sliding window the config declares (as a python model's window:)"
    )
    chunk: PositiveInt | list[PositiveInt | None] | None = Field(
        None,
        description="override the attention chunk the config declares (as a python model's chunk:); a window: or "
        "chunk: replaces both of the config's declarations",
    )
    scale: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="override the attention scale (as a python model's scale:)"
    )

    @model_validator(mode="after")
    def _one_origin(self) -> HFModel:
        if (self.path is None) == (self.config is None):
            raise ValueError("give exactly one of 'path' (a directory with config.json) and 'config' (inline)")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("an inline 'config' needs a 'model_type' (e.g. llama, gpt2)")
        pattern_agrees(self.causal, self.attention)
        declared_attention_agrees(self.window, self.chunk)
        return self

    def resolve_paths(self, base: Path) -> None:
        """A directory relative to the config's, or a hub id (`org/name`) that is no directory here: its snapshot in
        the local Hugging Face cache, never downloaded."""
        if self.path is None:
            return
        local = _resolve(self.path, base)
        given = self.path.as_posix()
        if local.exists() or self.path.is_absolute() or not looks_like_hub_id(given):
            self.path = local
            return
        try:
            self.path = cached_snapshot(given)
        except NotCached as exc:
            raise ConfigError(
                f"model.path: '{given}' is no directory here ({local}) and {exc}; fwdcheck never downloads: fetch "
                f"it with `{fetch_command(given)}` (or set HF_HOME / HF_HUB_CACHE to the cache holding it)"
            ) from None

    def files_read(self) -> list[tuple[str, Path]]:
        if self.path is None:
            return []
        files = []
        for name in ("config.json", *HF_WEIGHT_FILES):
            files.append((f"the model's {name}", self.path / name))
            files += [("a weights shard of the model", shard) for shard in shards(self.path / name)]
        return files


def model_classes() -> dict[str, type[ModelSpec]]:
    """Each `source:` a config can name -> its config class (a ModelSpec with `source: Literal["name"]`), read off the
    table of sources (config/sources.py) in its order: a row added there is a source a config file can name."""
    return {name: resolve(source.spec) for name, source in SOURCES.items()}


@functools.lru_cache(maxsize=8)
def _model_by_source(classes: tuple[type[ModelSpec], ...]) -> TypeAdapter[Any]:
    """The `model:` section validated as pydantic's union of the sources' classes discriminated by `source:`: the
    class the key names validates the section, and an unknown or missing key is the union's own error, each error
    located in the section as before. Built once per set of sources."""
    union: Any = functools.reduce(operator.or_, classes)
    return TypeAdapter(Annotated[union, Field(discriminator="source")])


class CodePaths(Strict):
    """The matrix of code paths the checks that declare per_code_path run over (future-token and mask-audit among the
    built-ins). A list narrows one axis; omitted axes take every value the model offers (Hugging Face models) or just
    the default path (other models). The train path is one more cell for every model, unless `train: false`; a
    vision-language model's image run is one more, unless `image: false`. A cell
    whose path the model cannot run (its forward raises there) is not judged, with the model's reason, and the other
    cells still count; the model raising on the default path stays an error."""

    enabled: bool | None = Field(
        None,
        description="default: on for source hf, off otherwise (then only the train path runs); false: no cell of "
        "the matrix nor the train path (a vision-language model's image run stays, unless image: false)",
    )
    train: bool = Field(
        True, description="the train path as one more cell: train() mode, every dropout zeroed, gradients on"
    )
    image: bool = Field(
        True,
        description="a vision-language model from source hf: the text path run once more with an image held fixed "
        "before it (one more cell, also with enabled: false)",
    )
    attn_implementation: list[Literal["eager", "sdpa", "flex_attention"]] | None = None
    output_attentions: list[bool] | None = None
    attention_mask: list[Literal["absent", "ones", "left-pad"]] | None = None
    batch_size: list[PositiveInt] | None = None
    seq_len: int | None = Field(
        None,
        ge=2,
        description="tokens per row in each cell; default 8, never more than "
        "inputs.seq_len nor less than the model accepts",
    )


class Inputs(Strict):
    batch_size: PositiveInt = 2
    seq_len: int = Field(8, ge=2, description="at least 2: a future token needs a past")
    seed: int = Field(0, ge=-(2**63), le=2**64 - 1, description="a torch seed: a 64-bit integer")
    min_seq_len: PositiveInt | None = Field(
        None,
        description="the shortest sequence forward accepts (e.g. code that "
        "asserts T > 1); shorter passes are skipped with a note. Default: found "
        "out by running",
    )

    @model_validator(mode="after")
    def _min_fits(self) -> Inputs:
        if self.min_seq_len is not None and self.min_seq_len > self.seq_len:
            raise ValueError(f"min_seq_len {self.min_seq_len} exceeds seq_len {self.seq_len}")
        return self


class Tolerance(Strict):
    """A tolerance that would excuse any change is refused (fwdcheck/config/tolerance_bounds.py says the rule)."""

    rtol: Annotated[float | None, AfterValidator(bounded_rtol)] = Field(
        None, ge=0.0, description="relative to the largest |logit|, below 1; default per dtype"
    )
    atol: Annotated[float | None, AfterValidator(bounded_atol)] = Field(
        None, ge=0.0, description="absolute floor, below 1; default per dtype"
    )
    noise_factor: Annotated[float, AfterValidator(bounded_noise_factor)] = Field(
        10.0, ge=1.0, description="a change must exceed this many noise floors to count (1 to 1000)"
    )


MAX_RANKS = 256


class Distributed(Strict):
    """How the model runs sharded across processes, as it will train: every rank builds the same model from the same
    seed, the parallelize function shards it over a device mesh of all ranks (its dimensions named by `mesh`), and
    the checks run on the sharded model (the sharding check compares it with the unsharded one)."""

    nproc: PositiveInt = Field(
        1, le=MAX_RANKS, description="processes (ranks) on this machine; 1: not distributed; default: the mesh's"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl on CUDA, gloo on the CPU")
    parallelize: str | None = Field(
        None,
        description="'module:function' taking (model, device_mesh) and returning "
        "the sharded model (DTensor parallelize_module, fully_shard, your own); "
        "default for Hugging Face models: their own tensor-parallel plan",
    )
    context_parallel: bool = Field(
        False,
        description="also split the sequence across the ranks (torch's "
        "context_parallel around each forward); CUDA only",
    )
    mesh: dict[str, PositiveInt] | None = Field(
        None,
        description="the device mesh's dimensions, names and sizes in order (e.g. {dp_shard: 2, tp: 2}); their "
        "product is the number of ranks (nproc may be left out); omitted: one dimension 'ranks' of nproc",
    )

    @model_validator(mode="after")
    def _mesh_fits(self) -> Distributed:
        if self.mesh is None:
            return self
        if not self.mesh:
            raise ValueError("mesh names no dimension: give each a name and a size, e.g. {dp_shard: 2, tp: 2}")
        for name in self.mesh:
            if not name.isidentifier():
                raise ValueError(f"mesh dimension '{name}' is not a name (letters, digits and _, not first a digit)")
        ranks = math.prod(self.mesh.values())
        sizes = " x ".join(f"{name} {size}" for name, size in self.mesh.items())
        if "nproc" not in self.model_fields_set:
            if ranks > MAX_RANKS:
                raise ValueError(f"mesh {sizes} makes {ranks} ranks, more than {MAX_RANKS}")
            self.nproc = ranks  # the mesh says how many ranks
        elif self.nproc != ranks:
            raise ValueError(f"nproc {self.nproc} but mesh {sizes} makes {ranks} ranks; leave nproc out")
        return self


class Ignore(Strict):
    code: str = Field(pattern=r"^[A-Z][A-Z0-9]*\d{3}$", description="a finding code, e.g. FWD203")
    reason: str = Field(min_length=1, description="why: required, and shown beside the ignored finding")


class RunConfig(Strict):
    """How to check a model, whatever the model: every key of a config but `model:`. The Python API builds one from
    its keyword arguments, so a wrong value is refused there as it is in a YAML file."""

    inputs: Inputs = Field(default_factory=Inputs)
    device: str = Field("cpu", description="cpu | cuda | cuda:N | auto (cuda when available)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="omitted: the dtype the model's parameters are in (a model handed over in bfloat16 runs in "
        "bfloat16), float32 when they are in another",
    )
    checks: list[str] | None = Field(
        None,
        description="omitted: the checks `fwdcheck list` marks default; "
        "`default` and `all` may be listed beside check names",
    )
    tolerance: Tolerance = Field(default_factory=Tolerance)
    options: dict[str, dict[str, Any] | None] = Field(
        default_factory=dict,
        description="each check's own options, under its name "
        "(`fwdcheck explain CHECK` lists them), e.g. {future-token: {exhaustive: true}}",
    )
    # `paths:` is the key's former name, still read
    code_paths: CodePaths = Field(default_factory=CodePaths, validation_alias=AliasChoices("code_paths", "paths"))
    meta: bool = Field(False, description="build on the meta device: shapes only, no weights allocated")
    ignore: list[Ignore] = Field(default_factory=list, description="finding codes that do not count, with reasons")
    timeout_s: float = Field(600.0, gt=0, description="per-check time limit: a hung forward ends as an error")
    distributed: Distributed = Field(default_factory=Distributed, description="run sharded across processes")

    @model_validator(mode="before")
    @classmethod
    def _former_spellings(cls, data: Any) -> Any:
        """Top-level keys of former releases that became checks' own options, still read (Check.former_keys:
        `exhaustive: true` turns on each check's thorough variant), unless the check's own section says otherwise."""
        known = {*cls.model_fields, "paths"}  # `paths`: code_paths' former name, an alias
        if not isinstance(data, dict) or all(key in known for key in data):
            return data
        from fwdcheck.config.registry import former_keys

        former = former_keys()
        data = dict(data)
        options = data.get("options") or {}
        for key in [key for key in data if key in former]:
            given = data.pop(key)
            if not isinstance(options, dict):
                continue  # `options:` itself is refused, naming it
            options = dict(options)
            for check, option in former[key]:
                section = options.get(check) or {}
                if isinstance(section, dict):
                    options[check] = {option: given, **section}
        if options:
            data["options"] = options
        return data

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", value):
            raise ValueError("expected cpu, cuda, cuda:N or auto")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_spellings(cls, value: Any) -> Any:
        """bf16, fp16, fp32 and torch's own spellings (torch.bfloat16, half) as the names they stand for."""
        return DTYPE_SPELLINGS.get(value, value) if isinstance(value, str) else value


def _rename_rule(rule: str) -> str:
    parse_rule(rule)  # a ValueError names the rule and what is wrong with it
    return rule


class DiffSpec(Strict):
    """How `fwdcheck diff A B` pairs the first model's names with this config's model (read from B's config)."""

    rename: list[Annotated[str, AfterValidator(_rename_rule)]] = Field(
        default_factory=list,
        description="regex rules 'PATTERN -> REPLACEMENT', applied in order to the first model's "
        "parameter and module names to give this model's (e.g. 'transformer\\.h\\.(\\d+) -> layers.\\1')",
    )


class _ModelSection(Strict):
    # The config class of the source the section's `source:` names, chosen through the table of sources; serialized
    # as that class, not as the base the field is typed with.
    model: SerializeAsAny[ModelSpec]

    @field_validator("model", mode="plain")
    @classmethod
    def _by_source(cls, value: Any) -> ModelSpec:
        spec: ModelSpec = _model_by_source(tuple(model_classes().values())).validate_python(value)
        return spec


# _ModelSection last among the bases puts `model` first among the fields: in the schema and in lists of valid keys.
class Config(RunConfig, _ModelSection):
    """A whole config file: the model to check and how to check it."""

    diff: DiffSpec = Field(
        default_factory=DiffSpec, description="for `fwdcheck diff A THIS`: how A's names map to this model's"
    )
    source_path: Path | None = Field(None, exclude=True, description="the file this config came from")

    @model_validator(mode="before")
    @classmethod
    def _source_path_is_not_a_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "source_path" in data:
            raise ValueError("source_path: unknown key (fwdcheck sets it to the config file's path)")
        return data


def config_for(path: str | Path | None, factory: str | None) -> Config:
    """The run's config: the file at `path`, or for `fwdcheck run --model pkg.module:factory` that factory's alone."""
    if path is not None:
        return load_config(path)
    return config_from_dict({"model": {"source": "python", "factory": factory}})


def load_config(path: str | Path) -> Config:
    """Read, parse and validate a config file; paths inside it become absolute, relative to the file."""
    path = Path(path)
    regular_file(path, str(path), ConfigError, what="config file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.__class__.__name__}: {exc})") from None
    try:
        check_yaml_structure(text, str(path))
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from None
    except ValueError as exc:  # PyYAML's scanner lets some of its own errors out unwrapped (an escape past U+10FFFF)
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:  # the structure check bounds the depth; this is the backstop should a loader recurse more
        raise ConfigError(f"{path}: nested too deeply to read (a config is at most {MAX_DEPTH} levels deep)") from None
    if document is None:
        raise ConfigError(f"{path}: the file is empty; `fwdcheck init` writes a starter config")
    return config_from_dict(document, origin=path)


def config_from_dict(document: Any, origin: Path | None = None) -> Config:
    name = str(origin) if origin else "config"
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise ConfigError(f"{name}: the top level must be a mapping with a 'model' key, not a {kind}")
    if nesting_depth(document) > MAX_DEPTH:  # a dict built in Python never went through the YAML structure check
        raise ConfigError(
            f"{name}: nested more than {MAX_DEPTH} levels deep (or holds itself); a config is a few levels deep"
        )
    try:
        config = Config.model_validate(document)
    except ValidationError as exc:
        raise ConfigError(f"{name}: {describe_validation_error(exc)}") from None
    except RecursionError:  # pragma: no cover - the depth check above keeps pydantic well inside its limits
        raise ConfigError(f"{name}: nested too deeply to validate") from None
    config.source_path = origin
    try:
        config.model.resolve_paths(origin.parent if origin else Path.cwd())
    except ConfigError as exc:  # a path the file names, not found where it says
        raise ConfigError(f"{name}: {exc}") from None
    return config


# How many problems a config error lists; a file wrong in more places is likely not a fwdcheck config at all.
MAX_PROBLEMS = 10


def describe_validation_error(exc: ValidationError) -> str:
    """Every problem as `yaml.path: what is wrong`, on one line joined by '; ', up to MAX_PROBLEMS of them."""
    # An unknown key usually explains a missing one next to it (a typo), so unknown keys come first.
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    listed: set[tuple] = set()  # mappings whose valid keys the line already names: named once, not per unknown key
    problems = list(dict.fromkeys(_describe_problem(error, listed) for error in errors))
    shown = "; ".join(problems[:MAX_PROBLEMS])
    more = len(problems) - MAX_PROBLEMS
    return shown + (f"; and {more} more" if more > 0 else "")


def _describe_problem(error: ErrorDetails, listed: set[tuple]) -> str:
    loc = _yaml_loc(error["loc"])
    if error["type"] == "extra_forbidden":
        mapping = tuple(error["loc"][:-1])
        hint = _did_you_mean(error["loc"], name_valid_keys=mapping not in listed)
        listed.add(mapping)
        return f"{loc}: unknown key{hint}"
    if error["type"] == "missing":
        return f"{loc}: required key is missing"
    if error["type"] == "union_tag_invalid":
        return (
            f"{loc or 'model'}.source: unknown source {error['input'].get('source')!r}; "
            f"known: {', '.join(model_classes())}"
        )
    if error["type"] == "union_tag_not_found":
        return f"{loc or 'model'}: the 'source' key is missing ({' | '.join(model_classes())})"
    got = error.get("input")
    shown = f" (got {got!r})" if not isinstance(got, (dict, list)) else ""
    if error["type"] == "value_error":  # fwdcheck's own words, the value named once
        text = error["msg"].removeprefix("Value error, ")
        shown = "" if isinstance(got, str) and got in text else shown
    else:
        text = in_plain_words(error)
    return f"{loc}: {text}{shown}" if loc else f"{text}{shown}"


def _yaml_loc(loc: tuple) -> str:
    """pydantic's location as a YAML path, without the discriminator tag it inserts: model.bugs[0]."""
    text = ""
    sources = model_classes()
    for i, part in enumerate(loc):
        if i == 1 and loc[0] == "model" and part in sources:
            continue
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _did_you_mean(loc: tuple, *, name_valid_keys: bool) -> str:
    """Walk the schema along loc to the mapping holding the unknown key and suggest the closest valid key; with no
    close one, name the valid keys (when asked to)."""
    cls: type[BaseModel] | None = Config
    path = list(loc)
    key = str(path.pop())
    while path and cls is not None:
        part = path.pop(0)
        if cls is Config and part == "model":
            cls = model_classes().get(path.pop(0)) if path else None
            continue
        annotation = cls.model_fields[part].annotation if part in cls.model_fields else None
        candidates = getattr(annotation, "__args__", (annotation,))
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if cls is None:
        return ""
    # each key as a config writes it: `class:`, the alias of a field Python cannot name `class`
    valid = [field.alias or name for name, field in cls.model_fields.items() if name != "source_path"]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f"; valid keys: {', '.join(valid)}" if name_valid_keys else ""
