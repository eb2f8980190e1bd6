"""A transformers encoder-decoder driven as one without an adapter: its decoder's tokens are the tokens under test,
its source held fixed.

T5, BART, Marian, Pegasus, M2M100, Blenderbot, FSMT, LED: forward(input_ids=source, decoder_input_ids=tokens). A config
of a type with no causal language model (T5, M2M100, FSMT, LED) builds AutoModelForSeq2SeqLM by default; the others
(BART builds BartForCausalLM, its decoder alone) with `class: AutoModelForSeq2SeqLM`. fwdcheck draws one source row,
seeded, from the encoder's vocabulary without its special tokens (a pad token would be masked out of the source by the
models that build the source's mask from the pads), and hands every forward that row repeated, with use_cache=False as a
training forward runs (FSMT builds no causal mask for a decoder run with its cache on, which generate feeds one token at
a time): each decoder row reads the same source wherever it sits in a batch, so samples that read each other still show
as such. The report's notes say what was held fixed. A second source, drawn alike, lets mask-audit show that the decoder
reads its source (a dead cross-attention is a finding). An encoder that reads something other than token ids (pixel
values, audio features) is not driven here: a `forward:` adapter drives it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from fwdcheck.errors import ModelLoadError
from fwdcheck.model.capabilities import HeldSource, Positions
from fwdcheck.model.tested import ModelUnderTest

SOURCE_LENGTH = 8  # tokens in the source held fixed
SOURCE_SEED = 0  # the seed the sources are drawn with, the same for every run
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "unk_token_id")


def seq2seq_class(hf_config: Any) -> str | None:
    """AutoModelForSeq2SeqLM where the config is an encoder-decoder that class builds and transformers has no causal
    language model of its type (T5, M2M100, FSMT, LED); None otherwise. A type with one (BART's BartForCausalLM, the
    decoder alone) keeps it: `class: AutoModelForSeq2SeqLM` asks for the encoder-decoder."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    model_type = hf_config.model_type
    if (
        getattr(hf_config, "is_encoder_decoder", False)
        and model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ):
        return "AutoModelForSeq2SeqLM"
    return None


def hold_source(model: ModelUnderTest) -> None:
    """Drive an encoder-decoder's decoder with its source held fixed (model.held), where forward takes
    decoder_input_ids beside token ids for its encoder; otherwise say why not (model.unavailable["source"])."""
    module = model.module
    config: Any = module.config
    parameters = _parameters(module)
    if model.pattern.kind != "encoder-decoder" or "decoder_input_ids" not in parameters:
        return  # a decoder alone (BartForCausalLM), or a model forward drives some other way
    name = type(module).__name__
    main = getattr(module, "main_input_name", "input_ids")
    if main != "input_ids":
        model.unavailable["source"] = (
            f"{name}'s encoder reads {main}, which fwdcheck does not draw: name a `forward:` adapter "
            "(model, input_ids, **kw) that holds the source fixed and hands input_ids to the decoder"
        )
        return
    vocabulary = _source_vocabulary(config)
    sources = _draw_sources(vocabulary, _special_ids(config))

    def draw(rows: int, variant: int) -> torch.Tensor:
        return sources[variant][None].repeat(rows, 1)  # (rows, S): the same source for every row

    held_fixed = (
        f"the encoder's input_ids, {SOURCE_LENGTH} tokens drawn with seed {SOURCE_SEED} from its vocabulary of "
        f"{vocabulary} (special tokens left out), the same for every row; the tokens under test are the decoder's "
        "(decoder_input_ids)"
    )
    fixed = (("use_cache", False),) if "use_cache" in parameters else ()
    if fixed:
        held_fixed += "; use_cache=False, as a training forward with labels runs"
    model.held = HeldSource("decoder_input_ids", "input_ids", "decoder_attention_mask", draw, held_fixed, fixed)
    model.forward_kwargs = {k for k in ("output_attentions",) if k in parameters}
    if "decoder_attention_mask" in parameters:
        model.forward_kwargs.add("attention_mask")  # handed on as decoder_attention_mask
    model.positions = Positions("own", f"{name}'s decoder counts its own positions (forward takes no position_ids)")
    model.cache = None
    model.unavailable["cache"] = f"{name} is an encoder-decoder: kv-cache decodes decoder-only models"
    model.extra.setdefault("notes", []).append(f"held fixed: {held_fixed}")
    model.extra["held_fixed"] = held_fixed


def _parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _source_vocabulary(config: Any) -> int:
    """The encoder's vocabulary: FSMT's src_vocab_size, a shared vocab_size, else the encoder's own config's (a
    transformers EncoderDecoderModel pairs two configs and states none of its own), else its text model's (Florence-2
    states its vocabulary in text_config only)."""
    for holder in (config, getattr(config, "encoder", None), getattr(config, "text_config", None)):
        for key in ("src_vocab_size", "vocab_size"):
            value = getattr(holder, key, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ModelLoadError(f"{type(config).__name__} gives no vocabulary for its encoder's input_ids")


def _special_ids(config: Any) -> set[int]:
    """The special token ids the config names, which a source drawn at random leaves out."""
    ids = set()
    for key in SPECIAL_TOKENS:
        value = getattr(config, key, None)
        if isinstance(value, int):
            ids.add(value)
    return ids


def _draw_sources(vocabulary: int, special: set[int]) -> list[torch.Tensor]:
    """Two sources of SOURCE_LENGTH ids each, seeded, none of them special (where the vocabulary has others)."""
    pool = torch.tensor([i for i in range(vocabulary) if i not in special] or list(range(vocabulary)))
    generator = torch.Generator().manual_seed(SOURCE_SEED)
    return [pool[torch.randint(len(pool), (SOURCE_LENGTH,), generator=generator)] for _ in range(2)]
