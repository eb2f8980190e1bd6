"""`fwdcheck shrink` for a vision-language model: the sizes its image path is made of, made to agree after the widths
and depths have shrunk, so that an image still runs through the shrunk model.

What must hold is read from what the fields mean, not from a table of architectures:

- a config made of a text and a vision model states at its top level the text model's width (the width image
  features are embedded at: PaliGemma's hidden_size, Ovis 2's visual embedding table);
- a vision tower whose merger hands the text model its features (Qwen2-VL's hidden_size beside embed_dim, Qwen2.5-VL's
  and Qwen3-VL's out_hidden_size) hands them at the text model's hidden size;
- the patch grid (image_size / patch_size a side) is at most MAX_GRID patches a side, a small image having few
  patches and the image run holding its tokens before the text; and it is a multiple of the factor that merges
  patches into one token (Idefics 3's pixel-shuffle scale_factor, Aya Vision's downsample_factor, Pixtral's
  spatial_merge_size, InternVL's 1 / downsample_ratio): the image side is rounded down to a multiple of patch times
  factor;
- a count of image tokens per image (PaliGemma's image_seq_length, Gemma 3's pooled mm_tokens_per_image) that was the
  grid's token count follows the new grid; one that is a square pooled from the grid (Gemma 3 pools its patches
  into 16 x 16) keeps a side that divides the grid (the pooling kernel is the grid over that side), the largest one
  no larger than before;
- the vision tower's layers the projector reads (LLaVA's vision_feature_layer, VipLLaVA's five vision_feature_layers)
  are layers the shrunk tower has: an index past its hidden states takes the last (or, counted from the end, the
  first), so the projector still reads as many.

The changes are returned as (name, old, new), named as shrink lists them (`vision_config.image_size`).
"""

from __future__ import annotations

import math
from typing import Any

MAX_GRID = 24  # 24 x 24 patches: LLaVA's 336-pixel image of 14-pixel patches, kept as it is
# Keys of a factor that merges factor x factor patches into one token; the grid must be a multiple of it.
MERGE_KEYS = ("scale_factor", "downsample_factor", "spatial_merge_size", "merge_size")
RATIO_KEYS = ("downsample_ratio", "pixel_shuffle_ratio")  # the same, as the fraction of a side kept (InternVL's 0.5)
# Counts of an image's tokens, fixed by the config rather than read off the vision tower.
COUNT_KEYS = ("image_seq_length", "image_seq_len", "num_image_tokens", "mm_tokens_per_image")
# A vision tower's width handed to the text model by its patch merger, where the config states it.
MERGER_OUTPUT_KEYS = ("out_hidden_size",)
# The vision tower's hidden states the projector reads, by index (negative: from the end).
FEATURE_LAYER_KEYS = ("vision_feature_layer", "vision_feature_layers")


def fit_image_path(data: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Make the image path of a config made of configs agree (module docstring), in place; the changes made."""
    changes: list[tuple[str, Any, Any]] = []
    vision, text = data.get("vision_config"), data.get("text_config")
    if not isinstance(vision, dict):
        return changes
    width = text.get("hidden_size") if isinstance(text, dict) else None

    def put(where: dict[str, Any], prefix: str, key: str, value: Any) -> None:
        if where.get(key) != value:
            changes.append((prefix + key, where.get(key), value))
            where[key] = value

    if isinstance(width, int):
        if isinstance(data.get("hidden_size"), int):
            put(data, "", "hidden_size", width)
        if _patch_merger(vision):
            put(vision, "vision_config.", "hidden_size", width)
        for key in MERGER_OUTPUT_KEYS:
            if isinstance(vision.get(key), int):
                put(vision, "vision_config.", key, width)

    layers = vision.get("num_hidden_layers")
    if isinstance(layers, int) and layers > 0:
        for key in FEATURE_LAYER_KEYS:
            value = data.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                put(data, "", key, _inside(value, layers + 1))
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                put(data, "", key, [_inside(v, layers + 1) for v in value])

    image, patch = vision.get("image_size"), vision.get("patch_size")
    if not _size(image) or not _size(patch):
        return changes
    factor = _merge_factor(data, vision)
    old_grid = _grid(image, patch)
    new_image = _fitted(image, patch, factor)
    put(vision, "vision_config.", "image_size", new_image)
    new_grid = _grid(new_image, patch)
    for where, prefix in ((data, ""), (vision, "vision_config.")):
        for key in COUNT_KEYS:
            count = where.get(key)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                put(where, prefix, key, _count(count, old_grid, new_grid, factor))
    return changes


def _patch_merger(vision: dict[str, Any]) -> bool:
    """A vision tower sized by depth and embed_dim, whose hidden_size is the width its patch merger hands the text
    model (Qwen2-VL's), not its own."""
    return isinstance(vision.get("depth"), int) and isinstance(vision.get("embed_dim"), int)


def _inside(index: int, states: int) -> int:
    """A hidden-state index among `states` (the embeddings' and each layer's); one past them taken at its end."""
    return min(index, states - 1) if index >= 0 else max(index, -states)


def _size(value: Any) -> bool:
    """An image or patch size: one positive integer, or two (height, width)."""
    values = value if isinstance(value, list | tuple) and len(value) == 2 else [value]
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _pair(value: Any) -> tuple[int, int]:
    return (value[0], value[1]) if isinstance(value, list | tuple) else (value, value)


def _grid(image: Any, patch: Any) -> tuple[int, int]:
    (ih, iw), (ph, pw) = _pair(image), _pair(patch)
    return ih // ph, iw // pw


def _merge_factor(data: dict[str, Any], vision: dict[str, Any]) -> int:
    """The factor patches are merged by before they become tokens, where the config or its vision tower names one."""
    factor = 1
    for where in (data, vision):
        for key in MERGE_KEYS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                factor = math.lcm(factor, value)
        for key in RATIO_KEYS:
            value = where.get(key)
            if isinstance(value, int | float) and 0 < value < 1 and round(1 / value) * value == 1:
                factor = math.lcm(factor, round(1 / value))
    return factor


def _fitted(image: Any, patch: Any, factor: int) -> Any:
    """The image side(s) at most MAX_GRID patches a side, the grid a multiple of `factor` (at least one factor)."""
    sides = []
    for side, p in zip(_pair(image), _pair(patch), strict=True):
        grid = min(side // p, MAX_GRID)
        grid = max(factor, grid - grid % factor)
        sides.append(grid * p if grid != side // p or side % p == 0 else side)
    if not isinstance(image, list | tuple):
        return sides[0]
    return type(image)(sides)


def _count(count: int, old: tuple[int, int], new: tuple[int, int], factor: int) -> int:
    """An image's token count on the new grid: the merged grid's count where it was the old one's; a square pooled
    from the grid with a side that divides it."""
    (oh, ow), (nh, nw) = old, new
    if count == (oh // factor) * (ow // factor):
        return (nh // factor) * (nw // factor)
    side = math.isqrt(count)
    if side * side != count or nh != nw:
        return count
    if nh % side == 0:
        return count
    return max(d for d in range(1, min(side, nh) + 1) if nh % d == 0) ** 2
