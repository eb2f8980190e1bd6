"""`fwdcheck shrink` for a Hugging Face config made of configs: a vision-language model's text_config and
vision_config, an audio model's audio_config, an encoder-decoder's encoder and decoder.

Each sub-config is shrunk by the same rules as a whole config (shrink.py's shrink_hf_dict, handed in: this module
imports no rules of its own), its changes named `text_config.hidden_size` and so on. Then what ties the parts
together is made to agree again: a width elsewhere that was the text model's hidden size (LLaVA's projector output,
PaliGemma's top-level hidden_size and its vision tower's projection_dim) follows it; token ids the top level names
(image_token_id, boi_token_index, ...) that fall outside the shrunk vocabulary move to distinct ids at its end; and
a multi-axis rotary embedding's sections (Qwen2-VL's mrope_section, which must sum to half the head size) are scaled
to the new head size. The image path's own sizes (image and patch sizes, token counts, the merger's width) are made
to agree by shrink_image.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fwdcheck.model.sources.shrink_image import fit_image_path

# The keys holding a sub-config, as transformers' to_dict() writes them.
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "speech_config", "encoder", "decoder")
WIDTH_KEYS = ("hidden_size", "projection_dim", "text_hidden_size", "projector_hidden_size", "mm_hidden_size")
TOKEN_SUFFIXES = ("_token_id", "_token_index")
# Multi-axis rotary sections the modeling code assumes when a config gives none (transformers' Qwen2-VL and
# Qwen2.5-VL text models), which a smaller head no longer fits.
MROPE_DEFAULTS = {"qwen2_vl_text": [16, 24, 24], "qwen2_5_vl_text": [16, 24, 24]}


def shrink_sub_configs(e: Any, seq_len: int, shrink_one: Callable[[dict[str, Any], int], Any]) -> None:
    """Shrink each sub-config of `e.data` in place with `shrink_one` (its changes recorded on `e`), then make the
    widths, token ids and rotary sections that tie them together agree. `e` is shrink.py's Edits."""
    data = e.data
    before: dict[str, dict[str, Any]] = {}
    for key in SUB_CONFIGS:
        sub = data.get(key)
        if not isinstance(sub, dict) or "model_type" not in sub:
            continue
        before[key] = dict(sub)
        if _patch_merger(sub):
            _shrink_patch_merger(e, key, sub)
            continue
        edits = shrink_one(sub, seq_len)
        e.changes.extend((f"{key}.{name}", old, new) for name, old, new in edits.changes)
        e.notes.extend(edits.notes)
    if not before:
        return
    text = data.get("text_config") if "text_config" in before else None
    if text is not None:
        _follow_text_width(e, before["text_config"], text)
        _sections(e, "text_config", before["text_config"], text)
        _tokens_inside(e, int(text.get("vocab_size") or data.get("vocab_size") or 0))
    e.changes.extend(fit_image_path(data))  # image and patch sizes, token counts, the merger's width


def _follow_text_width(e: Any, old_text: dict[str, Any], text: dict[str, Any]) -> None:
    """Widths at the top level or in another sub-config that were the text model's hidden size follow it."""
    old, new = old_text.get("hidden_size"), text.get("hidden_size")
    if not isinstance(old, int) or not isinstance(new, int) or old == new:
        return
    for key in WIDTH_KEYS:
        if e.data.get(key) == old:
            e.set(key, new)
    for name in SUB_CONFIGS:
        sub = e.data.get(name)
        if name == "text_config" or not isinstance(sub, dict):
            continue
        if _patch_merger(sub) and sub.get("hidden_size") != new:  # what it hands the text model: the text width
            e.changes.append((f"{name}.hidden_size", sub.get("hidden_size"), new))
            sub["hidden_size"] = new
        for key in ("projection_dim", "out_hidden_size", "text_hidden_size"):
            if sub.get(key) == old:
                e.changes.append((f"{name}.{key}", old, new))
                sub[key] = new


def _patch_merger(sub: dict[str, Any]) -> bool:
    """A vision tower sized by depth and embed_dim whose hidden_size is the width its patch merger hands the text
    model (Qwen2-VL's, Qwen2.5-VL's), not its own."""
    return isinstance(sub.get("depth"), int) and isinstance(sub.get("embed_dim"), int)


def _shrink_patch_merger(e: Any, name: str, sub: dict[str, Any]) -> None:
    """Such a tower at 2 blocks of 2 heads of 16 (its hidden_size follows the text model's, below)."""
    heads = sub.get("num_heads")
    new = {"depth": min(sub["depth"], 2)}
    if isinstance(heads, int) and heads:
        new.update(num_heads=min(heads, 2), embed_dim=min(heads, 2) * min(sub["embed_dim"] // heads, 16))
    for key, value in new.items():
        if sub.get(key) != value:
            e.changes.append((f"{name}.{key}", sub.get(key), value))
            sub[key] = value


def _sections(e: Any, name: str, old: dict[str, Any], sub: dict[str, Any]) -> None:
    """A multi-axis rotary embedding's mrope_section (one count of rotary pairs per axis: time, height, width) sums
    to half the head size: scaled to the new head size, each section kept at one pair or more. Where the config
    leaves it to the modeling code's default (Qwen2-VL's [16, 24, 24], for a head of 128), that default is written
    out, scaled, also when the head already had its small size (a config shrunk by hand, whose model raises on the
    default's split); sections the config states for the head it keeps are its own, and kept."""
    new_head = _head(sub)
    if not new_head:
        return
    default = MROPE_DEFAULTS.get(str(sub.get("model_type")))
    keys = [key for key in ("rope_parameters", "rope_scaling") if isinstance(sub.get(key), dict)]
    for key in keys or (["rope_parameters"] if default else []):
        params = sub.get(key) or {}
        stated = params.get("mrope_section")
        sections = stated if stated is not None else default if key == "rope_parameters" else None
        if not isinstance(sections, list) or not all(isinstance(s, int) for s in sections):
            continue
        if sum(sections) == new_head // 2 or (stated is not None and _head(old) == new_head):
            continue
        scaled = _scaled_sections(sections, new_head // 2)
        e.changes.append((f"{name}.{key}.mrope_section", sections, scaled))
        sub[key] = {**params, "mrope_section": scaled}


def _scaled_sections(sections: list[int], total: int) -> list[int]:
    """Sections in the same proportions, each at least 1, summing to `total` (the largest takes the remainder)."""
    whole = sum(sections)
    scaled = [max(1, s * total // whole) for s in sections]
    scaled[scaled.index(max(scaled))] += total - sum(scaled)
    return scaled


def _head(config: dict[str, Any]) -> int | None:
    head = config.get("head_dim")
    if isinstance(head, int):
        return head
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _tokens_inside(e: Any, vocab: int) -> None:
    """Token ids the top level names past the shrunk vocabulary move to distinct ids at its end (the image token,
    the begin/end-of-image tokens and a list of visual indicator ids must stay apart). Read as the config stated
    them: where the whole config's own rule already clamped them onto its last id (Ovis 2 states a vocab_size at
    its top level), the clamp is undone, so ids that were apart are not merged into one."""
    if vocab <= 0:
        return
    stated = {key: old for key, old, _ in reversed(e.changes) if key in e.data}  # each key's first old value
    keys = [k for k in e.data if k.endswith(TOKEN_SUFFIXES) or k.endswith("_token_ids")]
    values = {k: stated.get(k, e.data[k]) for k in keys}
    named = [*values.items(), *(e.data.get("text_config") or {}).items()]  # the text model's own ids too
    taken = {v for _, value in named for v in _ids(value) if v < vocab}
    free = (i for i in range(vocab - 1, -1, -1) if i not in taken)
    moved: dict[int, int] = {}

    def inside(value: int) -> int:
        if value < vocab:
            return value
        if value not in moved:
            moved[value] = next(free)
        return moved[value]

    for key, value in values.items():
        ids = _ids(value)
        if not ids or all(v < vocab for v in ids):
            continue
        new = inside(value) if isinstance(value, int) else [inside(v) for v in ids]
        e.changes[:] = [row for row in e.changes if row[0] != key]
        e.data[key] = value
        e.set(key, new)


def _ids(value: Any) -> list[int]:
    """A token id, or a list of them, as a list (empty for anything else)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return []
