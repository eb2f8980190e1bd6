"""What a model can do, as the checks ask it: the interfaces a ModelUnderTest carries beside its module.

A check that needs more than `logits(ids)` (a loss from labels, decoding through a cache, packed documents, another
attention implementation) asks the model for the interface ("is `model.loss` None?"), never which source built it.
Each source fills in what it knows (a config's `loss:` section, the reference model's own), and detection on the
module fills in the rest (fwdcheck/model/sources/detect.py: a transformers model is driven as one whoever built it).
Where an interface is absent the source may say why in `ModelUnderTest.unavailable`, which the check's skip shows.

Torch-free: these are descriptions, and the callables they hold are the sources' own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast


@dataclass(frozen=True)
class AttentionSwitch:
    """Attention implementations the model can be switched between, as transformers' `set_attn_implementation` and
    `config._attn_implementation` offer them (the interface its ALL_ATTENTION_FUNCTIONS registry serves)."""

    implementations: tuple[str, ...]  # those that run without extra packages ("eager", "sdpa")
    current: Callable[[], str]  # the one the model runs now
    switch: Callable[[str], None]  # make this one run from the next forward on

    @contextmanager
    def using(self, implementation: str | None) -> Iterator[None]:
        """The block runs `implementation` (None: whatever runs now); the one running before is put back."""
        if implementation is None:
            yield
            return
        original = self.current()
        self.switch(implementation)
        try:
            yield
        finally:
            self.switch(original)

    @classmethod
    def on(cls, module: Any) -> AttentionSwitch | None:
        """The module's switch when it has transformers' (config._attn_implementation read,
        set_attn_implementation(name) called), whatever class offers it; None otherwise. The implementations offered
        are those that need no extra package: eager, sdpa where the class says it supports it (_supports_sdpa), and
        flex_attention where it does (_supports_flex_attn) and torch has it."""
        config: Any = getattr(module, "config", None)
        if not callable(getattr(module, "set_attn_implementation", None)) or not isinstance(
            getattr(config, "_attn_implementation", None), str
        ):
            return None
        offered: tuple[str, ...] = ("eager", "sdpa") if getattr(module, "_supports_sdpa", False) else ("eager",)
        if getattr(module, "_supports_flex_attn", False) and _flex_attention_available():
            offered += ("flex_attention",)
        return cls(offered, current=lambda: config._attn_implementation, switch=module.set_attn_implementation)

    def ordered(self) -> list[str]:
        """Every implementation, the one running now first."""
        current = self.current()
        return [current, *(i for i in self.implementations if i != current)]


def _flex_attention_available() -> bool:
    """Whether torch offers flex_attention (2.5 on), asked without importing torch here."""
    try:
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Cache:
    """How the model decodes incrementally through its KV cache (the kv-cache check).

    past_key_values: forward(input_ids, past_key_values=cache, use_cache=True) returns the logits and the cache.
      With `new_cache`, the caller makes the empty cache up front and passes the new tokens' position_ids (and
      cache_position where forward takes it), as transformers' generate does; without, the first call gets no cache
      and the model derives positions from the cache itself.
    input_pos: model.<setup>(max_batch_size, max_seq_length) allocates the cache, then forward(input_ids, input_pos)
      runs the tokens at positions input_pos [T] (gpt-fast; litgpt's set_kv_cache)."""

    style: Literal["past_key_values", "input_pos"]
    origin: str  # where fwdcheck learnt it, for the report
    setup: str | None = None  # input_pos: the method that allocates the cache
    new_cache: Callable[[Any], Any] | None = None  # past_key_values: module -> an empty cache, made as generate does


@dataclass(frozen=True)
class Loss:
    """How forward computes its training loss from labels (the label-shift check): forward(input_ids,
    <argument>=labels) returns the loss at `output` beside the logits."""

    argument: str
    shifted_by: Literal["model", "caller"]  # model: labels line up with input_ids; caller: labels[t] is token t + 1
    output: int | str  # a tuple index, or an attribute / key name
    ignore_index: int
    origin: str

    @property
    def caller_shifts(self) -> int:
        """1 when labels arrive already shifted by one (nanoGPT's targets), else 0."""
        return 1 if self.shifted_by == "caller" else 0


@dataclass(frozen=True)
class Chunks:
    """Chunked attention: the sequence cut into chunks of `size` tokens from its first, each query reading the keys of
    its own chunk up to itself (positions size * (p // size) .. p), none of an earlier chunk. Llama 4's
    `attention_chunk_size` on its "chunked_attention" layers; a config's own `chunk:`."""

    size: int


@dataclass(frozen=True)
class Windows:
    """The sliding attention window or the attention chunk the model declares, per layer (mask-audit compares the
    keys each call's mask allows with it). A width counts the keys a query may read, itself included: transformers'
    `sliding_window` (its masks keep key j for query i when j > i - sliding_window), GPT-Neo's `window_size`,
    flash-attn's window_size left + 1, and a config's own `window:`. A chunk (Chunks) is no band: a query reads
    back to its chunk's first token, however near."""

    origin: str  # where fwdcheck read it, for the report
    every: int | Chunks | None = None  # one width (or chunk) for every attention layer (layers left empty)
    # Per layer index: a width, a chunk, None for full causal attention, or a str saying why the layer's pattern is
    # nothing fwdcheck judges (a recurrent layer, a chunked layer without its size).
    layers: tuple[int | Chunks | str | None, ...] = ()

    def of(self, layer: int | None) -> int | Chunks | str | None:
        """The declared width or chunk of a layer (None: full attention; a str: why it is not judged)."""
        if not self.layers:
            return self.every
        if layer is None or not 0 <= layer < len(self.layers):
            return f"the window is declared per layer, and this call's layer index is {layer}"
        return self.layers[layer]

    @classmethod
    def declared(
        cls, window: int | list[int | None] | None, origin: str, chunk: int | list[int | None] | None = None
    ) -> Windows:
        """A config's `window:` and `chunk:`: one width (or chunk size) for every layer, or a list of one per layer
        (None where the other list, or full attention, holds the layer). The config's validation keeps the two from
        declaring one layer twice (config.schema.declared_attention_agrees)."""
        widths = window if isinstance(window, list) else None
        sizes = chunk if isinstance(chunk, list) else None
        if widths is None and sizes is None:  # one for every layer
            return cls(origin, every=Chunks(chunk) if isinstance(chunk, int) else cast(int | None, window))
        layers = len(widths if widths is not None else sizes or [])
        widths, sizes = widths or [None] * layers, sizes or [None] * layers
        return cls(origin, layers=tuple(Chunks(c) if c is not None else w for w, c in zip(widths, sizes, strict=True)))

    @property
    def widest(self) -> int | None:
        """The most keys a query may read under any layer's declared restriction: the widest window, or the largest
        chunk (its last query reads all of it). A row longer than this reaches past every band the model declares
        and crosses a boundary of every chunk; None when the model declares neither."""
        spans = [w.size if isinstance(w, Chunks) else w for w in (self.every, *self.layers)]
        return max((s for s in spans if isinstance(s, int)), default=None)

    @property
    def chunked(self) -> bool:
        """Whether any layer declares chunked attention."""
        return any(isinstance(w, Chunks) for w in (self.every, *self.layers))


# How forward is told where packed documents are:
#   document_ids   <argument>=[N, T] integer ids, one per document
#   mask           <argument>=[N, 1, T, T] booleans, True = may attend, causal within each document
#   additive-mask  <argument>=[N, 1, T, T] floats, 0 where it may attend, the dtype's lowest elsewhere
#   positions      nothing but position_ids restarting per document: the model finds the documents from them
PackingForm = Literal["document_ids", "mask", "additive-mask", "positions"]


@dataclass(frozen=True)
class Packing:
    """How forward isolates documents packed into one row (the packing check)."""

    form: PackingForm
    description: str  # how the report names the way, e.g. "document_ids (the reference model's packed path)"
    argument: str | None = None  # the keyword taking the ids or the mask; None for `positions`
    position_ids: bool = False  # also pass position_ids restarting at 0 in each document
    fixed: tuple[tuple[str, Any], ...] = ()  # keyword arguments every packed call takes as they are (use_cache=False)
    # Layers whose state runs along the whole row (a recurrent, linear-attention or convolution mixer), which no mask
    # or position resets: "linear_attention layers". The report names them when documents are not isolated.
    carries_state: str | None = None


# How the model learns where each token sits:
#   given  forward takes position_ids counted from 0, and reads them: fwdcheck hands positions over where a check
#          needs other ones than 0..T-1 (left padding, an offset, documents packed in a row, a cached decode)
#   own    the model counts its positions itself (from the padding in input_ids, from its cache) in a convention of
#          its own, or takes none: fwdcheck passes no position_ids and lets it (RoBERTa counts from padding_idx + 1)
PositionsForm = Literal["given", "own"]


@dataclass(frozen=True)
class Positions:
    """How forward is told the tokens' positions, and how fwdcheck learnt it (the report's reason when `own`)."""

    form: PositionsForm
    origin: str

    @property
    def given(self) -> bool:
        """Whether fwdcheck may hand the model 0-based position_ids."""
        return self.form == "given"


# How a multi-axis rotary embedding lays its sections over the rotary pairs (pair p: frequency index p):
#   contiguous   the sections one after the other: pairs 0..s0-1 turn with axis 0, the next s1 with axis 1, ...
#                (Qwen2-VL and Qwen2.5-VL's M-RoPE)
#   interleaved  pair p turns with axis p mod n while p < n * s[p mod n], else with axis 0 (Qwen3-VL's M-RoPE)
SectionLayout = Literal["contiguous", "interleaved"]


@dataclass(frozen=True)
class RotaryAxes:
    """A rotary embedding over several position axes (M-RoPE: time, height and width), as the model declares it:
    forward takes position_ids [axes, B, T], and each axis turns its own section of the rotary pairs. For text
    tokens every axis holds the same positions, so the sections only show when the axes are driven apart."""

    names: tuple[str, ...]  # the axes, in the order of position_ids' first dimension
    sections: tuple[int, ...] | None  # rotary pairs per axis, as declared; None: not stated
    layout: SectionLayout | None  # None: not stated, and either layout of the sections is accepted
    origin: str  # where the sections (and the layout, when stated) were read
    # Why the sections cannot be judged per axis (a modeling code that lays them out its own way); None: they can
    own_layout: str | None = None

    def pair_axes(self, pairs: int, layout: SectionLayout) -> list[int] | None:
        """The axis each of `pairs` rotary pairs turns with under this layout of the declared sections, as the
        modeling code lays them out; None when the sections do not lay out over that many pairs (contiguous
        sections that do not sum to it)."""
        sections = self.sections
        if not sections or len(sections) != len(self.names):
            return None
        if layout == "contiguous":
            if sum(sections) != pairs:
                return None
            return [axis for axis, size in enumerate(sections) for _ in range(size)]
        n = len(sections)
        return [p % n if p % n and p < n * sections[p % n] else 0 for p in range(pairs)]


# Which keys each token may read, by the model's design:
#   causal           every token reads itself and the tokens before it (a decoder-only language model)
#   bidirectional    every token reads every token (an encoder: BERT, a masked LM)
#   prefix           the first prefix_length tokens read each other and nothing after them; the tokens after read
#                    every earlier token (a prefix-LM: PaliGemma's image and prompt, T5's prefix-LM objective)
#   encoder-decoder  the tokens under test are the decoder's, causal over themselves, each reading all of a source
#                    held fixed through cross-attention (T5, BART, nn.Transformer)
PatternKind = Literal["causal", "bidirectional", "prefix", "encoder-decoder"]


@dataclass(frozen=True)
class AttentionPattern:
    """The attention pattern the model has by design, and where fwdcheck learnt it (the config, the model's own
    attributes). Checks judge against it: a bidirectional encoder reading the future is no leak, a prefix-LM's
    prefix reading itself both ways is none either, and an encoder-decoder's cross-attention must read all of its
    source."""

    kind: PatternKind
    origin: str
    prefix_length: int | None = None  # prefix: how many leading tokens form the prefix

    @property
    def causal(self) -> bool:
        """Whether every token under test reads only itself and earlier tokens (the decoder's, for an
        encoder-decoder)."""
        return self.kind in ("causal", "encoder-decoder")

    @property
    def bidirectional(self) -> bool:
        return self.kind == "bidirectional"

    def first_causal_position(self, length: int) -> int | None:
        """The first position from which changing the tokens must leave every earlier position's logits alone: 1
        for a causal model (any cut), the prefix's length for a prefix-LM (a cut inside the prefix moves the prefix
        by design), None where no cut of `length` tokens is judged (bidirectional, or a prefix as long as the
        sequence)."""
        if self.kind == "bidirectional":
            return None
        if self.kind == "prefix":
            start = max(self.prefix_length or 0, 1)
            return start if start < length else None
        return 1

    def describe(self) -> str:
        """How a report names it: 'bidirectional by design (BertSelfAttention.is_causal is False)'."""
        what = {
            "causal": "causal",
            "bidirectional": "bidirectional by design",
            "prefix": f"prefix-LM by design (the first {self.prefix_length} tokens read each other)",
            "encoder-decoder": "encoder-decoder (the decoder causal over its tokens, reading all of the source)",
        }[self.kind]
        return f"{what} ({self.origin})"


ASSUMED_CAUSAL = AttentionPattern("causal", "assumed: nothing declares or shows another attention pattern")


def declared_pattern(causal: bool | None, attention: Any = None) -> AttentionPattern | None:
    """The pattern a model section declares (`attention: {pattern: ..., prefix_length: N}`, or the former
    `causal: false`), or None where it declares none and the model's own attributes decide."""
    if attention is not None:
        return AttentionPattern(attention.pattern, "model.attention in the config", attention.prefix_length)
    if causal is None:
        return None
    if causal:
        return AttentionPattern("causal", "model.causal: true in the config")
    return AttentionPattern("bidirectional", "model.causal: false in the config")


@dataclass(frozen=True)
class HeldSource:
    """An encoder-decoder driven without an adapter: the tokens under test are its decoder's, handed over as
    `argument`, while its source goes in as `keyword`, held fixed. `draw(rows, variant)` gives the source for a
    forward of that many rows: one row drawn once (seeded) and repeated, so that every decoder row reads the same
    source wherever it sits in a batch; variant 1 is another source, to show that the decoder reads it."""

    argument: str  # the keyword of the tokens under test: decoder_input_ids
    keyword: str  # the keyword of the source: input_ids
    mask_argument: str  # where an attention_mask for the tokens under test goes: decoder_attention_mask
    draw: Callable[[int, int], Any]  # (rows, variant) -> the source [rows, S]
    description: str  # what was held fixed, for the report
    fixed: tuple[tuple[str, Any], ...] = ()  # keyword arguments every call takes as they are (use_cache=False)


class ImageNotDrawn(Exception):
    """Why a vision-language model's image path cannot be driven without an adapter (its text path still runs)."""


@dataclass
class HeldImage:
    """A vision-language model driven with an image and no adapter: the image's tokens (and the ids a processor
    puts around them) come before the tokens under test, its pixels go in beside them, both held fixed, and the
    logits are those of the tokens under test. `prepare(module)` finds, once, how the model takes an image (it runs
    model code, so it is called where the model is placed for the run); it raises ImageNotDrawn with the reason where
    no image can be driven. `call(module, input_ids, variant, **kwargs)` runs forward on input_ids [B, T] with the
    image of that variant (0: the one held fixed; 1: another, to show that the text reads its image) and returns the
    logits [B, T, V] of the tokens under test."""

    prepare: Callable[[Any], None]
    call: Callable[..., Any]
    prefix_length: Callable[[], int]  # ids put before the tokens under test, once prepared
    description: Callable[[], str]  # what was held fixed, for the report, once prepared
    # Why the text after the image is causal by design in the image run, where the token types it is handed make it
    # a causal suffix (PaliGemma's prefix-LM: its attention modules say is_causal False, its mask is causal after
    # the prefix the token types mark); None where they say nothing of it
    suffix: Callable[[], str | None] = lambda: None
