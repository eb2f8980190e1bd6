"""What a model declares about its attention: the sliding window or attention chunk of each layer and the scale, as a
config's own `window:`, `chunk:` and `scale:` say them (they win), or as a transformers config does (read here for
the window and chunk; the scale's knobs are read by attention-stats beside the attention module's own `scaling`).

A transformers config's window is read as transformers 5's models read it.

A width counts the keys a query may read, itself included: transformers' masking_utils keeps key j for query i
when `j > i - sliding_window` (sliding_window_overlay), so `sliding_window: 4` reads the query and the three tokens
before it, whichever model uses it (Mistral, Qwen2, Phi-3, Gemma 2 and 3, Cohere2, Starcoder2, ...). GPT-Neo's
local layers keep the same band, `window_size` keys (tril(bias) xor tril(bias, -window_size)).

Which layers slide:
  `layer_types` (the per-layer list transformers 5 configs carry: Qwen2 builds it from use_sliding_window and
    max_window_layers, Gemma 2 alternates): "sliding_attention" reads `sliding_window`, "full_attention" every earlier
    key, "chunked_attention" the keys of its own chunk of `attention_chunk_size` tokens (Llama 4: masking_utils'
    chunked_overlay keeps key j for query i when j // size == i // size, counted from the first real token);
    another kind (a recurrent or linear mixer) is not a band, and not judged.
  no `layer_types`, `sliding_window` set (Mistral, Phi-3, Mixtral): every layer slides, as their models build one
    sliding mask for all layers; `use_sliding_window: false` turns it off where the config has that switch.
  GPT-Neo: `attention_layers` ("local" / "global") with `window_size`.
Longformer's and LED's `attention_window` is two-sided over an encoder: not a causal band, not read here; nor is an
`attention_chunk_size` without "chunked_attention" layers (Gemma 4's and Gemma 3n's audio conformers: chunks with
context on both sides, over an encoder).
"""

from __future__ import annotations

from typing import Any

from fwdcheck.model.capabilities import Chunks, Windows
from fwdcheck.model.tested import ModelUnderTest

FULL_KINDS = {"full_attention", "attention", "global"}
SLIDING_KINDS = {"sliding_attention", "local"}
CHUNKED_KINDS = {"chunked_attention"}


PER_LAYER = object()  # a setting a heterogeneous config keeps per layer and refuses to read globally


def _read(config: Any, name: str, default: Any = None) -> Any:
    """config.name, or PER_LAYER where transformers' heterogeneous configs refuse a global read of a per-layer
    attribute (AmbiguousGlobalPerLayerAttributeError: read it off config.per_layer_config[i] instead)."""
    try:
        return getattr(config, name, default)
    except Exception:
        return PER_LAYER


def transformers_windows(config: Any, where: str) -> Windows | None:
    """The windows and chunks the config declares, or None when it declares none (every layer full causal
    attention)."""
    width = _read(config, "sliding_window")
    if width is PER_LAYER:
        return _per_layer_windows(config, where)
    if _read(config, "use_sliding_window", True) is False:
        width = None
    kinds = _read(config, "layer_types")
    if not isinstance(kinds, (list, tuple)):
        kinds = getattr(config, "attention_layers", None)  # GPT-Neo
        width = getattr(config, "window_size", None) if isinstance(kinds, (list, tuple)) else width
    width = width if _positive(width) else None
    if not isinstance(kinds, (list, tuple)):
        return Windows(f"{where}: sliding_window {width}, every layer", every=width) if width else None
    size = _read(config, "attention_chunk_size")
    chunk = Chunks(size) if _positive(size) else None
    layers: list[int | Chunks | str | None] = []
    for kind in kinds:
        if kind in SLIDING_KINDS:
            layers.append(width or f"a {kind} layer without a sliding window in force")
        elif kind in FULL_KINDS:
            layers.append(None)
        elif kind in CHUNKED_KINDS:
            layers.append(chunk or f"a {kind} layer without a positive attention_chunk_size ({size!r})")
        else:
            layers.append(f"a {kind} layer: no sliding band to judge")
    if not any(isinstance(w, (int, Chunks)) for w in layers):
        return None
    said = [
        f"sliding_window {width} on the layers its layer kinds call sliding" if width and width in layers else "",
        f"attention_chunk_size {size} on its chunked_attention layers" if chunk and chunk in layers else "",
    ]
    return Windows(f"{where}: {' and '.join(s for s in said if s)}", layers=tuple(layers))


def _positive(value: Any) -> bool:
    """A width or size a config sets: a positive int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _per_layer_windows(config: Any, where: str) -> Windows | None:
    """The windows of a heterogeneous config, layer by layer from its per_layer_config (a layer whose kind is full
    attention, or whose width is unset, has none); None when it has no such list or no layer slides."""
    per_layer = _read(config, "per_layer_config")
    if not isinstance(per_layer, (list, tuple)):
        return None
    layers: list[int | str | None] = []
    for layer in per_layer:
        width, kind = _read(layer, "sliding_window"), _read(layer, "layer_type")
        slides = isinstance(width, int) and not isinstance(width, bool) and width > 0 and kind not in FULL_KINDS
        layers.append(width if slides else None)
    if not any(isinstance(w, int) for w in layers):
        return None
    return Windows(f"{where}: sliding_window per layer (per_layer_config)", layers=tuple(layers))


def declare_attention(model: ModelUnderTest, spec: Any) -> None:
    """A config section's own `window:`, `chunk:` and `scale:`, over whatever the model's library declared (a
    `window:` or `chunk:` replaces the library's windows and chunks whole: a layer neither names is full
    attention)."""
    window, chunk, scale = getattr(spec, "window", None), getattr(spec, "chunk", None), getattr(spec, "scale", None)
    if window is not None or chunk is not None:
        keys = " and ".join(f"model.{k}" for k, v in (("window", window), ("chunk", chunk)) if v is not None)
        model.windows = Windows.declared(window, f"declared in the config ({keys})", chunk=chunk)
    if scale is not None:
        model.scale = float(scale)
        model.origins["scale"] = "declared in the config (model.scale)"
