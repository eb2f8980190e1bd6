"""A transformers vision-language model driven with an image and no adapter: fwdcheck draws the image itself.

LLaVA, PaliGemma, Gemma 3, Qwen2-VL, Idefics 3 and the others of AutoModelForImageTextToText take input_ids in which
the image's tokens (the config's image_token_id / image_token_index, one per image feature) stand where the image's
features go, and the pixels beside them (pixel_values, with image_sizes, image_grid_thw or pixel_attention_mask where
forward takes them). fwdcheck puts the image's tokens at the start of every row, with the ids the config names to open
and close an image (vision_start / boi before, vision_end / eoi after), and the tokens under test after them; the
logits it judges are those of the tokens under test. The image is one, drawn once with a fixed seed at the size the
vision config declares, in the model's dtype at each call (a float64 twin sees the same pixels), and repeated for every
row; so the image and its tokens are held fixed, and the cuts of future-token lie in the text after them.

How many tokens an image takes is read off the model, not a table: its own get_image_features is called on the drawn
pixels, and each feature it returns is one token (LLaVA's patches without the class token, Gemma 3's pooled 256,
Qwen2-VL's merged patches). Which pixel layout the model takes is tried in turn, from what forward's signature names:
flattened patches with a (t, h, w) grid where it takes image_grid_thw (the grid two merges wide and high), else one
image [C, H, W] per row (with image_sizes where it takes them), or one image of one tile [1, C, H, W] per row (with
pixel_attention_mask where it takes one, which is tried first). The first layout that runs a whole forward is kept.

token_type_ids, where forward takes them, are a per-model convention (PaliGemma marks its prefix, image and prompt,
with 0; Gemma 3 marks the image with 1): the two are tried in one forward, and the one under which the text after the
image stays causal (changing a later text token leaves the first one's logits alone) is kept; where both or neither
do, none are passed and the model builds its default mask. mm_token_type_ids (text 0, image 1, as transformers
documents them) are passed where forward takes them.

What cannot be driven this way (a model whose forward takes no pixel_values, video- or audio-only inputs, a processor
of its own that cuts images into tiles by rules of its own) raises ImageNotDrawn with the reason: the run's text path
runs as before and the report's notes say why no image was drawn.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fwdcheck.errors import model_failure
from fwdcheck.model.capabilities import HeldImage, ImageNotDrawn
from fwdcheck.model.tested import ModelUnderTest, describe
from fwdcheck.observe.frames import logits_in

IMAGE_SEED = 0  # the held image is drawn with this seed; the other image (variant 1) with the next
IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")
# Ids a processor puts around an image's tokens, where the config names them (Qwen2-VL finds an image by its
# vision_start; Gemma 3's processor wraps it in boi and eoi).
OPEN_KEYS = ("vision_start_token_id", "image_start_token_id", "boi_token_id", "boi_token_index")
CLOSE_KEYS = ("vision_end_token_id", "image_end_token_id", "eoi_token_id", "eoi_token_index")
# Words in a config's token id names that mark an id of another modality: a text token drawn with such an id would
# be read as an image (or video) token of its own, so the text never holds one.
MODALITY_WORDS = ("image", "video", "vision", "audio", "boi", "eoi", "boa", "eoa")
# Inputs of other modalities: a model whose forward takes some of these but not pixel_values is one fwdcheck cannot
# draw an image for, and the notes say so.
OTHER_INPUTS = (
    "pixel_values_videos",
    "image_patches",
    "flattened_patches",
    "input_features",
    "input_values",
    "pixel_values_images",
)
TEXT_AFTER = 2  # text tokens after the image in the forwards that try a layout
# The most image tokens the image run holds before the tokens under test: every forward of the run's cell carries
# them, and mask-audit reads each attention call's whole [P + T, P + T] mask. LLaVA's 576 and Gemma 3's 256 fit;
# Pixtral's 3025 at its declared 1540 pixels do not (the text path then runs alone, and the notes say why).
MAX_IMAGE_TOKENS = 1024
PATCHES_PER_TOKEN = 4  # a vision tower merging 2 x 2 patches into one token (Pixtral's, Qwen2-VL's) at the most


class TooLong(Exception):
    """An image that takes more tokens than the image run holds."""


@dataclass
class Layout:
    """How the model takes one image: the keyword arguments of one row's image (variant 0 and 1), the ids put before
    the tokens under test, and the token types."""

    what: str  # in words, for the report
    images: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # per variant: keyword -> one row's tensor
    prefix: torch.Tensor  # (P,) the ids before the tokens under test: open, image tokens, close
    image_tokens: int
    token_types: tuple[int, int] | None = None  # token_type_ids on (the image's ids, the text), or none passed
    types_why: str = ""
    kept: list[str] = field(default_factory=list)  # forward's other keywords the layout passes


def hold_image(model: ModelUnderTest) -> None:
    """Give a vision-language model the image drive (model.image), where forward takes pixel_values beside token ids
    and the config names its image token; otherwise say why not, in the notes, when the model takes images or other
    modalities at all."""
    module = model.module
    config: Any = getattr(module, "config", None)
    parameters = _parameters(module)
    name = type(module).__name__
    takes_other = sorted(p for p in OTHER_INPUTS if p in parameters)
    if "pixel_values" not in parameters:
        if takes_other:
            _not_drawn(model, f"{name}'s forward takes {', '.join(takes_other)} and no pixel_values")
        return
    if model.held is not None:
        _not_drawn(model, f"{name} is an encoder-decoder whose source is held fixed as token ids")
        return
    token = next((getattr(config, k) for k in IMAGE_TOKEN_KEYS if isinstance(getattr(config, k, None), int)), None)
    if token is None:
        _not_drawn(model, f"{type(config).__name__} names no image token ({' / '.join(IMAGE_TOKEN_KEYS)})")
        return
    drive = ImageDrive(name, config, parameters, token, model.vocab_size)
    model.image = HeldImage(drive.prepare, drive.call, drive.prefix_length, drive.description, drive.suffix)


def _not_drawn(model: ModelUnderTest, why: str) -> None:
    reason = f"no image drawn: {why}; the text path ran alone (a `forward:` adapter can hand the model its inputs)"
    model.unavailable["image"] = reason
    model.extra.setdefault("notes", []).append(reason)


def _parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


class ImageDrive:
    """The image held fixed before the tokens under test, for one model: prepared once (prepare), then called for
    every forward of the image run (call)."""

    def __init__(self, name: str, config: Any, parameters: set[str], token: int, vocabulary: int):
        self.name = name
        self.config = config
        self.parameters = parameters
        self.token = token
        self.vocabulary = vocabulary
        self.layout: Layout | None = None
        self.reserved = _modality_ids(config) | {token}
        self.substitute = next((i for i in range(vocabulary) if i not in self.reserved), 0)

    # -- what the report and the session read --------------------------------------------------------------------

    def prefix_length(self) -> int:
        return 0 if self.layout is None else len(self.layout.prefix)

    def suffix(self) -> str | None:
        layout = self.layout
        if layout is None or layout.token_types is None:
            return None
        return (
            f"token_type_ids {layout.token_types[1]} on the text after the image make it a causal suffix (under the "
            "other convention it reads its future)"
        )

    def description(self) -> str:
        layout = self.layout
        if layout is None:
            return "no image (not prepared)"
        types = (
            f"; token_type_ids {layout.token_types[0]} on the image's ids and {layout.token_types[1]} on the text "
            f"({layout.types_why})"
            if layout.token_types is not None
            else (f"; no token_type_ids ({layout.types_why})" if layout.types_why else "")
        )
        replaced = sorted(self.reserved)
        return (
            f"an image, {layout.what}, drawn with seed {IMAGE_SEED} in the model's dtype, and its "
            f"{layout.image_tokens} image tokens (id {self.token}, read off the model's get_image_features) before "
            f"the tokens under test, {len(layout.prefix)} ids in all, the same for every row{types}; text ids of "
            f"the image's own ({', '.join(map(str, replaced[:6]))}) are replaced by {self.substitute}"
        )

    # -- finding how the model takes an image --------------------------------------------------------------------

    def prepare(self, module: nn.Module) -> None:
        """Find the layout once: the first candidate whose image features can be counted and whose whole forward
        runs; ImageNotDrawn with every candidate's reason where none does."""
        if self.layout is not None:
            return
        vision = getattr(self.config, "vision_config", None)
        if vision is None:
            raise ImageNotDrawn(f"{type(self.config).__name__} has no vision_config to size an image by")
        if not callable(getattr(module, "get_image_features", None)):
            raise ImageNotDrawn(f"{self.name} has no get_image_features to count an image's tokens with")
        why = []
        try:
            candidates = self._candidates(vision)
        except TooLong as exc:
            raise ImageNotDrawn(str(exc)) from None
        if not candidates:
            raise ImageNotDrawn(
                f"{type(vision).__name__} gives no image_size of one or two integers to draw an image of, and "
                f"{self.name}'s forward takes no image_grid_thw"
            )
        for what, images in candidates:
            try:
                with torch.no_grad():
                    layout = self._fit(module, what, images)
            except TooLong as exc:
                raise ImageNotDrawn(str(exc)) from None  # another layout of the same image is no shorter
            except Exception as exc:
                if not model_failure(exc):
                    raise
                why.append(f"{what}: {describe(exc)[:160]}")
                continue
            with torch.no_grad():
                self._choose_token_types(module, layout)
            self.layout = layout
            return
        raise ImageNotDrawn(f"{self.name} took none of the image layouts fwdcheck draws ({'; '.join(why)})")

    def _candidates(self, vision: Any) -> list[tuple[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]]:
        """(layout in words, one row's keyword arguments for the held image and the other), in the order tried."""
        channels = _first_int(vision, ("num_channels", "in_channels", "in_chans"), 3)
        patch = _first_int(vision, ("patch_size",), 14)
        if "image_grid_thw" in self.parameters:
            merge = _first_int(vision, ("spatial_merge_size", "merge_size"), 1)
            temporal = _first_int(vision, ("temporal_patch_size",), 1)
            grid = 2 * merge  # patches per side: two merged tokens wide and high
            width = channels * temporal * patch * patch

            def flat(seed: int) -> dict[str, torch.Tensor]:
                return {
                    "pixel_values": _pixels((grid * grid, width), seed),
                    "image_grid_thw": torch.tensor([[1, grid, grid]]),
                }

            what = f"{grid} x {grid} patches of {patch} pixels (pixel_values [{grid * grid}, {width}], image_grid_thw)"
            return [(what, (flat(IMAGE_SEED), flat(IMAGE_SEED + 1)))]
        size = getattr(vision, "image_size", None)
        if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) for s in size):
            height, width_px = size
        elif isinstance(size, int):
            height = width_px = size
        else:
            return []
        shape = (channels, height, width_px)
        patches = (height // patch) * (width_px // patch)
        if patches > PATCHES_PER_TOKEN * MAX_IMAGE_TOKENS:  # not run: the vision tower alone would hold the run up
            raise TooLong(
                f"an image of {channels} x {height} x {width_px} pixels is {patches} patches of {patch}, more than "
                f"the image run holds ({MAX_IMAGE_TOKENS} tokens, at most {PATCHES_PER_TOKEN} patches each)"
            )

        def image(seed: int, tiles: bool, sizes: bool) -> dict[str, torch.Tensor]:
            pixels = _pixels(shape, seed)[None]  # (1, C, H, W): one image of the row
            kwargs = {"pixel_values": pixels[None] if tiles else pixels}  # (1, 1, C, H, W) one image of one tile
            if tiles and "pixel_attention_mask" in self.parameters:
                kwargs["pixel_attention_mask"] = torch.ones(1, 1, height, width_px, dtype=torch.bool)
            if sizes:
                kwargs["image_sizes"] = torch.tensor([[height, width_px]])
            return kwargs

        pixels = f"{channels} x {height} x {width_px} pixels"
        candidates = [(f"{pixels} (pixel_values [1, {channels}, {height}, {width_px}])", False, False)]
        if "image_sizes" in self.parameters:  # read by some vision towers of the class only (Pixtral's, not CLIP's)
            candidates.append(
                (f"{pixels} (pixel_values [1, {channels}, {height}, {width_px}], image_sizes)", False, True)
            )
        tiled = (f"{pixels} as one tile (pixel_values [1, 1, {channels}, {height}, {width_px}])", True, False)
        candidates = [tiled, *candidates] if "pixel_attention_mask" in self.parameters else [*candidates, tiled]
        return [(what, (image(0, tiles, sizes), image(1, tiles, sizes))) for what, tiles, sizes in candidates]

    def _fit(self, module: nn.Module, what: str, images: tuple[dict, dict]) -> Layout:
        """The layout with its image tokens counted off get_image_features, checked by one whole forward."""
        device, dtype = _placement(module)
        held = {k: _to(v, device, dtype) for k, v in images[0].items()}
        get_image_features: Any = getattr(module, "get_image_features")  # noqa: B009 (an nn.Module's attribute)
        accepted = _parameters_of(get_image_features)
        features = get_image_features(**{k: v for k, v in held.items() if k in accepted or "kwargs" in accepted})
        count = _features(features)
        if count <= 0:
            raise ImageNotDrawn(f"get_image_features returned no features for {what}")
        if count > MAX_IMAGE_TOKENS:
            raise TooLong(
                f"an image of {what} takes {count} tokens, more than the image run holds ({MAX_IMAGE_TOKENS})"
            )
        opening = [int(getattr(self.config, k)) for k in OPEN_KEYS if isinstance(getattr(self.config, k, None), int)]
        closing = [int(getattr(self.config, k)) for k in CLOSE_KEYS if isinstance(getattr(self.config, k, None), int)]
        prefix = torch.tensor(opening[:1] + [self.token] * count + closing[:1])
        layout = Layout(what, images, prefix, count)
        text = torch.full((1, TEXT_AFTER), self.substitute, device=device)  # where the model is, as a run's ids
        logits = self.call(module, text, 0, layout=layout)
        if tuple(logits.shape[:2]) != (1, TEXT_AFTER):
            raise ImageNotDrawn(f"forward returned logits {list(logits.shape)} for {len(prefix) + TEXT_AFTER} ids")
        return layout

    def _choose_token_types(self, module: nn.Module, layout: Layout) -> None:
        """token_type_ids under which the text after the image stays causal, where forward takes them: both
        conventions in one forward of four rows (two conventions x a last text token changed), the first text
        token's logits compared."""
        if "token_type_ids" not in self.parameters:
            return
        first, last, other = ((self.substitute + k) % self.vocabulary for k in (1, 2, 3))
        ids = torch.tensor([[first, last], [first, other]] * 2)
        ids = torch.where(torch.isin(ids, torch.tensor(sorted(self.reserved))), self.substitute, ids)
        ids = ids.to(_placement(module)[0])  # where the model is, as a run's ids
        conventions = [(1, 0), (0, 1)]
        types = [c for c in conventions for _ in range(2)]
        logits = self.call(module, ids, 0, layout=layout, types=types)  # (4, 2, V)
        scale = float(logits.abs().max())
        causal = [
            c
            for i, c in enumerate(conventions)
            if float((logits[2 * i, 0] - logits[2 * i + 1, 0]).abs().max()) <= 1e-4 * scale
        ]
        if len(causal) == 1:
            layout.token_types = causal[0]
            layout.types_why = "under the other convention the text after the image reads its future"
        elif causal:
            layout.types_why = "forward takes them, and neither convention changes what the text reads"
        else:
            layout.types_why = (
                "forward takes them, and under both conventions the text after the image reads its future"
            )

    # -- the image run's forwards --------------------------------------------------------------------------------

    def call(
        self,
        module: nn.Module,
        input_ids: torch.Tensor,
        variant: int,
        layout: Layout | None = None,
        types: list[tuple[int, int]] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward on input_ids [B, T] after the image's ids, with the image of `variant` in every row; the logits
        [B, T, V] of the tokens under test. An attention_mask of the tokens under test is extended over the image's
        ids (which are never padding); position_ids, where given, are shifted past them."""
        layout = layout or self.layout
        if layout is None:
            raise ImageNotDrawn("the image drive was called before it was prepared")
        B, T = input_ids.shape
        device, dtype = input_ids.device, _placement(module)[1]
        P = len(layout.prefix)
        text = torch.where(
            torch.isin(input_ids, torch.tensor(sorted(self.reserved), device=device)), self.substitute, input_ids
        )
        ids = torch.cat([layout.prefix.to(device)[None].expand(B, P), text], dim=1)  # (B, P + T)
        image = {k: _to(v, device, dtype).repeat(B, *[1] * (v.dim() - 1)) for k, v in layout.images[variant].items()}
        if "attention_mask" in kwargs and kwargs["attention_mask"] is not None:
            mask = kwargs["attention_mask"]
            kwargs["attention_mask"] = torch.cat([torch.ones(B, P, dtype=mask.dtype, device=device), mask], dim=1)
        if kwargs.get("position_ids") is not None:
            positions = kwargs["position_ids"]
            start = torch.arange(P, device=device, dtype=positions.dtype)[None].expand(B, P)
            kwargs["position_ids"] = torch.cat([start, positions + P], dim=1)
        is_image = (ids == self.token).long()  # (B, P + T)
        if "mm_token_type_ids" in self.parameters:
            kwargs["mm_token_type_ids"] = is_image.int()
        per_row = types or ([layout.token_types] * B if layout.token_types is not None else None)
        if per_row is not None:
            on_image = torch.tensor([t[0] for t in per_row], device=device)[:, None]
            on_text = torch.tensor([t[1] for t in per_row], device=device)[:, None]
            image_part = torch.arange(P + T, device=device)[None] < P  # the image's ids, opening and closing included
            kwargs["token_type_ids"] = torch.where(image_part, on_image, on_text)
        output = module(input_ids=ids, **image, **kwargs)
        logits = logits_in(output)
        if logits is None:
            raise ImageNotDrawn(f"{self.name} returned no logits")
        return logits[:, P:]  # (B, T, V): the tokens under test


def _modality_ids(config: Any) -> set[int]:
    """The ids the config names for images, videos, audio and their markers (its own and its text config's)."""
    ids = set()
    for holder in (config, getattr(config, "text_config", None)):
        for key in dir(holder) if holder is not None else ():
            if key.startswith("_") or not (key.endswith("_token_id") or key.endswith("_token_index")):
                continue
            if not any(word in key for word in MODALITY_WORDS):
                continue
            try:
                value = getattr(holder, key)
            except Exception:  # a deprecated alias that raises on access
                continue
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return ids


def _first_int(config: Any, keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _pixels(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Pixels drawn in float32 from their own generator (never the run's): the same values in every dtype."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _placement(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where the model's floating weights are, and their dtype: the image is drawn in the model's dtype."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def _to(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)


def _parameters_of(function: Any) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _features(output: Any) -> int:
    """How many image features (one token each) get_image_features returned: the rows of its projected features
    (a ModelOutput's pooler_output, where it holds them), a tensor or a sequence of tensors, each [..., d]."""
    pooled = getattr(output, "pooler_output", None)
    found = pooled if pooled is not None else output
    if isinstance(found, torch.Tensor):
        tensors = [found]
    elif isinstance(found, (list, tuple)):
        tensors = [t for t in found if isinstance(t, torch.Tensor)]
    else:
        return 0
    return sum(t.numel() // t.shape[-1] for t in tensors if t.dim() >= 2)
