"""A transformers model's rotary embedding as the rope checks call it: the rotary function of its text path, and
the position axes a multi-axis rotary embedding (M-RoPE) declares.

A vision-language model builds more than one rotary embedding: its vision tower's (Qwen2-VL's 2-D rotary over patch
rows and columns, Pixtral's) comes first in the module tree, and takes patch coordinates, not token positions. The
tokens under test go through the language model's, so that is the one found: the rotary embedding module built from
the text config, with the apply function of the attention beside it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fwdcheck.model.capabilities import RotaryAxes, SectionLayout

# M-RoPE's axes, in position_ids' order, for three sections (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and their kin).
AXIS_NAMES = {3: ("time", "height", "width"), 2: ("row", "column")}
# transformers' text rotary embeddings that lay their sections out in neither standard way (one after the other in
# time, height, width order, or interleaved as Qwen3-VL's): judged against either, a correct model would fail.
OWN_LAYOUTS = {
    "Ernie4_5_VLMoeTextRotaryEmbedding": "its sections are in height, width, time order, height and width pairs "
    "interleaved, over pre-rotated frequencies",
    "HunYuanVLRotaryEmbedding": "its sections count dims of the doubled frequency table, so one rotary pair may "
    "read two axes",
}


def text_rotary(module: nn.Module, text_config: Any) -> tuple[str, nn.Module] | None:
    """The rotary embedding module of the text path, by name: the *RotaryEmbedding module built from the text
    config (a vision tower's is built from its vision config), else the first one; None when there is none."""
    found = [(name, m) for name, m in module.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not found:
        return None
    return next(((name, m) for name, m in found if getattr(m, "config", None) is text_config), found[0])


def find_rotary(
    module: nn.Module, text_config: Any = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The model's rotary embedding as a function (x [B,h,T,d_h], positions [T]) -> rotated x, when the modeling
    file follows the common layout: a *RotaryEmbedding module returning (cos, sin) and apply_rotary_pos_emb(q, k,
    cos, sin) beside the attention class that uses it. None otherwise (the probe through the model still runs).

    A multi-axis rotary embedding given positions [B, T] puts them on every axis, as for text tokens: the function
    is then a one-axis rotary, and the probe drives its axes apart."""
    chosen = text_rotary(module, text_config if text_config is not None else getattr(module, "config", None))
    if chosen is None:
        return None
    name, rotary_emb = chosen
    # The attention that applies it: one inside the module holding it (a language model's layers), else one holding
    # it (a rotary embedding built inside its attention), else the first.
    scope = name.rpartition(".")[0]
    attentions = [(n, m) for n, m in module.named_modules() if type(m).__name__.endswith("Attention")]
    inside = [m for n, m in attentions if n.startswith(scope)]
    holding = [m for n, m in attentions if name.startswith(f"{n}.")]
    attention = next(iter(inside or holding or [m for _, m in attentions]), None)
    apply = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None) if attention else None
    if apply is None:
        return None

    def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_emb(x, positions[None].expand(x.shape[0], -1))
        rotated, _ = apply(x, x, cos, sin)
        return rotated

    return rotary


def rotary_axes(module: nn.Module, text_config: Any, config_file: str) -> RotaryAxes | None:
    """The position axes of a multi-axis rotary embedding (M-RoPE), as the model declares them: the text config's
    `mrope_section` (in rope_parameters or rope_scaling) and `mrope_interleaved`; where the config states no
    sections, those the text path's rotary embedding module holds (the modeling code's default, which it uses).
    None for a one-axis rotary embedding, or a model that builds none."""
    chosen = text_rotary(module, text_config)
    if chosen is None:
        return None
    rotary_emb = chosen[1]
    stated: dict[str, Any] = {}
    where = ""
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(text_config, key, None)
        if isinstance(params, dict) and ("mrope_section" in params or "mrope_interleaved" in params):
            stated, where = params, key
            break
    sections = stated.get("mrope_section")
    origin = f"{config_file}: {where}.mrope_section"
    if sections is None:
        sections = getattr(rotary_emb, "mrope_section", None)
        origin = (
            f"{type(rotary_emb).__name__}.mrope_section (the modeling code's default: {config_file} states no sections)"
        )
    if not isinstance(sections, (list, tuple)) or len(sections) < 2 or not all(isinstance(s, int) for s in sections):
        return None
    interleaved = stated.get("mrope_interleaved", getattr(rotary_emb, "mrope_interleaved", None))
    layout: SectionLayout | None = None if interleaved is None else "interleaved" if interleaved else "contiguous"
    if layout is not None:
        origin += f", mrope_interleaved {bool(interleaved)}"
    names = AXIS_NAMES.get(len(sections), tuple(f"axis {i}" for i in range(len(sections))))
    own = OWN_LAYOUTS.get(type(rotary_emb).__name__)
    own_layout = f"{type(rotary_emb).__name__} lays its sections out its own way ({own})" if own else None
    return RotaryAxes(names, tuple(sections), layout, origin, own_layout)
