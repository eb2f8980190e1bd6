"""The attention pattern a model has by design, read off the module itself (capabilities.AttentionPattern).

What a config declares (`attention:`, or the former `causal: false`) wins; where it declares nothing, the model says:
a transformers config that is an encoder-decoder (`is_encoder_decoder`), a causal language model class or a config
that is a decoder (`is_decoder`), attention modules that all say `is_causal = False` (BERT's, RoBERTa's, ...), a
masked language model class (DeBERTa's attention has no such flag), and torch's nn.Transformer. A model that says
nothing is assumed causal, and the report says it was assumed. Read whether or not a `forward:` adapter drives the
model: the pattern is the model's, however it is called.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn

from fwdcheck.model.capabilities import ASSUMED_CAUSAL, AttentionPattern


def read_pattern(module: nn.Module) -> AttentionPattern | None:
    """The pattern the module shows, or None where it shows none."""
    name = type(module).__name__
    torch_transformer = next((m for m in module.modules() if isinstance(m, nn.Transformer)), None)
    if torch_transformer is not None:
        return AttentionPattern("encoder-decoder", f"{name} holds a torch.nn.Transformer")
    config: Any = getattr(module, "config", None)
    modeling = sys.modules.get("transformers.modeling_utils")
    if config is None or modeling is None or not isinstance(module, modeling.PreTrainedModel):
        return None
    config_name = type(config).__name__
    if getattr(config, "causal", None) is False and _in_mapping(name, "MODEL_FOR_MASKED_LM_MAPPING_NAMES"):
        # XLM's one LM head class is both transformers' causal and masked LM: its config's causal flag says which
        return AttentionPattern("bidirectional", f"{config_name}.causal is False")
    if _in_mapping(name, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):  # BartForCausalLM: the decoder alone
        return AttentionPattern("causal", f"{name} is one of transformers' causal language models")
    if getattr(config, "is_encoder_decoder", False) is True:
        return AttentionPattern("encoder-decoder", f"{config_name}.is_encoder_decoder is True")
    if getattr(config, "is_decoder", False) is True:
        return AttentionPattern("causal", f"{config_name}.is_decoder is True")
    flags: dict[str, bool] = {}
    for sub in module.modules():
        flag = getattr(sub, "is_causal", None)
        if sub is not module and isinstance(flag, bool):
            flags[type(sub).__name__] = flags.get(type(sub).__name__, False) or flag
    if flags and not any(flags.values()):
        return AttentionPattern("bidirectional", f"{', '.join(sorted(flags))}.is_causal is False")
    if not flags and _in_mapping(name, "MODEL_FOR_MASKED_LM_MAPPING_NAMES"):
        return AttentionPattern("bidirectional", f"{name} is one of transformers' masked language models")
    return None


def fill_pattern(model: Any) -> None:
    """The model's pattern read off its module, unless the config declared one (a ModelUnderTest, whose pattern is
    ASSUMED_CAUSAL until something says otherwise)."""
    if model.pattern is ASSUMED_CAUSAL:
        model.pattern = read_pattern(model.module) or ASSUMED_CAUSAL


def _in_mapping(class_name: str, mapping: str) -> bool:
    """Whether transformers' auto mapping of that name lists the class."""
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for value in getattr(modeling_auto, mapping, {}).values():
        names.update([value] if isinstance(value, str) else value)
    return class_name in names
