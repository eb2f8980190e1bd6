"""ModelUnderTest: one face over every model source.

Whatever the source, a check asks the same questions: what is the vocabulary, how long may a sequence be, does forward
take position_ids, and what are the logits [B, T, V] for these ids. The sources (fwdcheck/model/sources/) build it; this
module knows none of them.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.parametrize import ParametrizationList

from fwdcheck.config.schema import RopeSpec
from fwdcheck.errors import ModelRaised, UsageError, model_failure
from fwdcheck.model.call_convention import adapter_hint
from fwdcheck.model.calling import adapter_takes, call_convention_hint, call_forward
from fwdcheck.model.capabilities import (
    ASSUMED_CAUSAL,
    AttentionPattern,
    AttentionSwitch,
    Cache,
    HeldImage,
    HeldSource,
    Loss,
    Packing,
    Positions,
    RotaryAxes,
    Windows,
)
from fwdcheck.model.default_device import global_default_device, set_global_default_device
from fwdcheck.observe.frames import logits_in
from fwdcheck.observe.observer import compiled_eagerly

# Implementations whose library compiles the kernel on first use (transformers' flex_attention: tens of seconds on
# CPU, again for new shapes). Their cells run torch.compile'd code eagerly: flex_attention computes its mask's math
# either way, and nothing in a default run compiles.
COMPILING_IMPLEMENTATIONS = frozenset({"flex_attention"})

Rotary = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B,h,T,d_h], positions [T]) -> rotated x


@contextmanager
def _both(first: AbstractContextManager, second: AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def layer_stack_of(module: nn.Module) -> str | None:
    """Dotted name of the nn.ModuleList holding the most blocks in `module`, or None. An nn.ModuleDict keyed by layer
    numbers ("0", "1", ...: OLMo-core's and torchtitan's `blocks`/`layers`, kept by number so that pipeline stages can
    drop some) is a layer stack too. A parametrization's list (torch.nn.utils.parametrize: spectral_norm,
    weight_norm, orthogonal) computes a weight, not the hidden states: never the layer stack."""
    lists = [(n, len(m)) for n, m in module.named_modules() if _numbered_blocks(m) and len(m)]
    return max(lists, key=lambda item: item[1])[0] if lists else None


def _numbered_blocks(m: nn.Module) -> bool:
    """Whether `m` holds modules by number: an nn.ModuleList (not a parametrization's), or an nn.ModuleDict whose
    keys are all numbers."""
    if isinstance(m, nn.ModuleList):
        return not isinstance(m, ParametrizationList)
    return isinstance(m, nn.ModuleDict) and all(key.isdigit() for key in m)


@dataclass
class ModelUnderTest:
    module: nn.Module
    label: str  # how the report names the model
    source: str  # the config's `source:`, for the report only: checks ask the capabilities below, never this
    vocab_size: int
    max_positions: int | None = None
    # The attention pattern by design (capabilities.AttentionPattern): declared by the config, read off the model by
    # its source or detection, else assumed causal. Every check judges against it.
    pattern: AttentionPattern = ASSUMED_CAUSAL
    dims: dict[str, int] = field(default_factory=dict)  # known symbolic dimensions: d, h, h_kv, d_h, V, d_ff, L
    # The dims the user declared; None: all of `dims`. The others were read off a library's config: the shape ledger
    # names axes by them, but a tensor that differs from them is no finding.
    declared_dims: set[str] | None = None
    rope: RopeSpec | None = None  # what the model declares about its rotary embedding, if anything
    rotary: Rotary | None = None  # the model's rotary function, when it can be called on its own
    forward_adapter: Callable[..., Any] | None = None
    rotary_discovered: bool = False  # the rotary function was found by convention, not named by the user
    forward_kwargs: set[str] | None = None  # keyword arguments forward takes; None: read its signature
    padding: int = 0  # left-padding tokens a path view adds before the inputs (its logits are of the real tokens)
    extra: dict[str, Any] = field(default_factory=dict)  # shown in the report's model section; extra["notes"]

    # Capabilities (fwdcheck/model/capabilities.py): what the model can do beyond logits(ids), filled in by its source
    # or detected on the module (fwdcheck/model/sources/detect.py). None: not offered; `unavailable` may say why.
    origins: dict[str, str] = field(default_factory=dict)  # "rope", "dims": where each declaration came from
    attention: AttentionSwitch | None = None  # switchable attention implementations
    matrix_by_default: bool = False  # forward picks its code path by its arguments: the code-path matrix runs
    cache: Cache | None = None  # decoding through a KV cache
    loss: Loss | None = None  # a training loss from labels
    packing: Packing | None = None  # documents packed into one row, isolated
    positions: Positions | None = None  # how forward learns positions; None: position_ids when forward takes them
    rotary_in_layers: Rotary | None = None  # the rotation as the layers apply it (their precision), when exposed
    rotary_axes: RotaryAxes | None = None  # a rotary embedding over several position axes (M-RoPE), as declared
    windows: Windows | None = None  # the sliding attention window it declares; None: full causal attention
    # The factor attention should apply to q . k when it is not 1/sqrt(d_h) (a config's `scale:`), where it came from
    # in origins["scale"]; None: what the model's own config says, else 1/sqrt(d_h)
    scale: float | None = None
    weights_at_init: bool = False  # the weights are known to be as initialised (random), not trained or loaded
    weights_loaded: bool = False  # the weights were read from a file (a checkpoint, a pretrained directory)
    library_loggers: tuple[str, ...] = ()  # loggers of the model's library, whose messages become the run's notes
    # (module, the mesh's {dimension: size}) -> the sharded module and how, in words
    tensor_parallel: Callable[[nn.Module, dict[str, int]], tuple[nn.Module, str]] | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # capability -> why the model does not offer it
    # An encoder-decoder driven without an adapter: its decoder's tokens are under test, its source held fixed
    # (capabilities.HeldSource); source_variant 1 runs it on another source.
    held: HeldSource | None = None
    source_variant: int = 0
    # A vision-language model that can be driven with an image (capabilities.HeldImage). image_variant None: its
    # text path alone (the default run); 0: with the image held fixed before the tokens under test (the image run's
    # cell); 1: with another image.
    image: HeldImage | None = None
    image_variant: int | None = None

    def using_attention(self, implementation: str | None) -> AbstractContextManager[None]:
        """The block runs this attention implementation (None: whichever runs now), the original put back after."""
        if implementation is None:
            return nullcontext()
        if self.attention is None:
            raise UsageError(
                f"attention implementation {implementation!r} asked for, but the model has no attention "
                "switch (transformers' set_attn_implementation)"
            )
        if implementation in COMPILING_IMPLEMENTATIONS:
            return _both(self.attention.using(implementation), compiled_eagerly())
        return self.attention.using(implementation)

    @property
    def causal(self) -> bool:
        """Whether every token under test reads only itself and earlier tokens: a causal model, or the decoder of
        an encoder-decoder (not a bidirectional encoder, nor a prefix-LM's prefix)."""
        return self.pattern.causal

    def why_not(self, capability: str, default: str) -> str:
        """Why the model does not offer a capability: its source's reason, else `default`."""
        return self.unavailable.get(capability, default)

    def accepts(self, name: str) -> bool:
        """Whether forward takes this keyword argument."""
        if self.forward_kwargs is not None:
            return name in self.forward_kwargs
        if self.forward_adapter is not None:
            return False
        return _accepts(self.module.forward, name)

    @property
    def held_prefix(self) -> int:
        """Ids the module sees before the tokens under test that are held fixed, not drawn (an image's tokens):
        they are read by the tokens under test, and what they read among themselves is the model's design."""
        return self.image.prefix_length() if self.image is not None and self.image_variant is not None else 0

    @property
    def layer_stack(self) -> str | None:
        """Dotted name of the nn.ModuleList holding the most blocks: the transformer's layers, if it has one."""
        return layer_stack_of(self.module)

    def block_of(self, module_name: str) -> str | None:
        """The block (e.g. 'layers.3') a submodule belongs to, or None."""
        stack = self.layer_stack
        if stack is None or not module_name.startswith(f"{stack}."):
            return None
        index = module_name[len(stack) + 1 :].split(".")[0]
        return f"{stack}.{index}" if index.isdigit() else None

    def layer_of(self, module_name: str) -> int | None:
        """The index of the block a submodule belongs to (3 for 'layers.3.attn'), or None."""
        block = self.block_of(module_name)
        return int(block.rsplit(".", 1)[1]) if block else None

    @property
    def accepts_position_ids(self) -> bool:
        """Whether fwdcheck may hand forward 0-based position_ids: the positions capability when the source learnt
        it, else whether forward takes the keyword."""
        if self.positions is not None:
            return self.positions.given
        return self.accepts("position_ids")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> Any:
        """The model's raw output, through the config's `forward:` adapter when it names one; any exception becomes
        ModelRaised naming the model-code frame it came from, and a call that does not fit forward's signature
        says what to do about it."""
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        with model_code("the model raised", hint=call_convention_hint):
            if self.forward_adapter is not None:
                return call_forward(self.module, self.forward_adapter, input_ids, **kwargs)
            return self.drive(self.module, input_ids, **kwargs)

    def call(self, input_ids: torch.Tensor, **extras: Any) -> Any:
        """The model's forward with the extras a check passes (labels, document ids, a 4-D mask), through the
        config's `forward:` adapter when it takes them (fwdcheck/model/calling.py: the adapter contract), else the
        module's own forward (as `drive` calls it): the raw output, exceptions as forward() reports them."""
        adapter = self.forward_adapter
        if adapter is not None and not adapter_takes(adapter, extras):
            adapter = None  # a logits adapter would drop them: the module takes them itself, as without one
        with model_code("the model raised", hint=call_convention_hint):
            if adapter is not None:
                return call_forward(self.module, adapter, input_ids, **extras)
            return self.drive(self.module, input_ids, **extras)

    def drive(self, module: nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """`module` called on the tokens under test: by its own call convention (fwdcheck/model/calling.py), or, for
        an encoder-decoder whose source is held fixed, as its decoder's tokens beside that source (an attention_mask
        then is the decoder's); for a vision-language model run with its image, after the image's tokens, beside its
        pixels (the logits then are the tokens under test's)."""
        if self.image is not None and self.image_variant is not None:
            return self.image.call(module, input_ids, self.image_variant, **kwargs)
        if self.held is None:
            return call_forward(module, None, input_ids, **kwargs)
        if "attention_mask" in kwargs:
            kwargs[self.held.mask_argument] = kwargs.pop("attention_mask")
        source = self.held.draw(input_ids.shape[0], self.source_variant).to(input_ids.device)  # (B, S)
        return module(**{self.held.keyword: source, self.held.argument: input_ids}, **dict(self.held.fixed), **kwargs)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] for input_ids [B, T], or ModelRaised saying why the output cannot be checked."""
        output = self.forward(input_ids, position_ids)
        logits = extract_logits(output)
        B, T = input_ids.shape
        if logits.dim() != 3 or logits.shape[0] != B:
            hint = (
                " for every position; [B, V] has no positions axis: the logits of one position only (the last, "
                "nanoGPT-style, squeezed)? name a `forward:` adapter in the config that returns every position"
                if logits.dim() == 2 and logits.shape[0] == B
                else ""
            )
            raise ModelRaised(
                f"forward returned a tensor of shape {list(logits.shape)} for input_ids {[B, T]}; "
                f"fwdcheck needs logits [B, T, V]{hint}"
            )
        if logits.shape[1] == 1 and T > 1:  # said alike at every length: one finding, not one per check
            raise ModelRaised(
                "forward returned the logits of the last position only ([B, 1, V] for input_ids [B, T]), as "
                "nanoGPT-style models do unless targets are given; checking them would compare the wrong positions"
                + adapter_hint("model(input_ids, targets=input_ids)[0]")
            )
        if logits.shape[1] != T:
            raise ModelRaised(
                f"forward returned logits for {logits.shape[1]} positions of {T} ({list(logits.shape)}); "
                "checking them would compare the wrong positions"
            )
        unusable = _unusable(logits, input_ids)
        if unusable:
            raise ModelRaised(f"forward returned logits {list(logits.shape)} {unusable}")
        return logits


def _unusable(logits: torch.Tensor, input_ids: torch.Tensor) -> str | None:
    """Why logits of the right shape still cannot be compared, or None. Each of these used to reach a check's
    arithmetic and fail there, as an error of fwdcheck's."""
    if logits.shape[2] == 0:
        return "with an empty vocabulary axis (V = 0): a head with no outputs, or the logits sliced to nothing"
    if logits.layout != torch.strided:
        return (
            f"as a {str(logits.layout).removeprefix('torch.')} tensor; fwdcheck needs dense logits "
            "(call .to_dense() in a `forward:` adapter)"
        )
    if logits.is_meta and not input_ids.is_meta:
        return (
            f"on the meta device (shapes, no values) for inputs on {input_ids.device}: a parameter or buffer "
            "left on meta, or a tensor created with device='meta'"
        )
    if logits.is_complex():
        return f"of dtype {str(logits.dtype).removeprefix('torch.')}; logits are real numbers"
    return None


@contextmanager
def model_code(
    what: str,
    frame: Callable[[BaseException], tuple[str, int, str] | None] | None = None,
    hint: Callable[[BaseException], str] | None = None,
) -> Iterator[None]:
    """Runs model code: what it raises is the model's failure, ModelRaised(f"{what} {describe(exc)}") naming the
    line of model code that raised (model_frame, or `frame` where a caller knows better), followed by what `hint`
    says of the exception (a call that did not fit forward's signature: fwdcheck/model/calling.py); a ModelRaised
    from within, Ctrl-C and fwdcheck's own exceptions (model_failure) pass through untouched.

        with model_code("the rotary function raised"):  # "the rotary function raised ValueError: ..."
            out = model.rotary(x, positions)
    """
    dtype, device = torch.get_default_dtype(), global_default_device()
    try:
        yield
    except BaseException as exc:
        if not model_failure(exc):
            raise
        said = hint(exc) if hint is not None else ""
        raise ModelRaised(f"{what} {describe(exc)}{said}", frame=(frame or model_frame)(exc)) from exc
    finally:
        put_back_defaults(dtype, device)


def put_back_defaults(dtype: torch.dtype, device: torch.device | None) -> None:
    """torch's default dtype and device as they were before model code ran: a model that sets the default device to
    meta (or the default dtype to float64) as it runs must not move fwdcheck's own tensors, nor the next forward's.
    Said as a warning (a run's notes)."""
    changed = []
    if torch.get_default_dtype() != dtype:
        changed.append(f"torch.get_default_dtype() ({dtype} -> {torch.get_default_dtype()})")
        torch.set_default_dtype(dtype)
    now = global_default_device()  # never a `with torch.device()` block's: that one ends by itself
    if now != device:
        changed.append(f"torch's default device ({device or 'none'} -> {now or 'none'})")
        set_global_default_device(device)  # the model's torch.set_default_device undone
    if changed:
        warnings.warn(
            f"the model changed {' and '.join(changed)} as it ran; put back after it", RuntimeWarning, stacklevel=2
        )


def describe(exc: BaseException) -> str:
    """'TypeName: message' of an exception from model code, even one whose __str__ raises."""
    try:
        message = str(exc)
    except Exception:
        message = "<its message cannot be shown: its __str__ raised>"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def extract_logits(output: Any, keep_graph: bool = False) -> torch.Tensor:
    """Logits from what forward returned (a tensor, an object with .logits, a mapping, or a tuple led by them), as
    fwdcheck's own copy: a model may return a view of one buffer it reuses (a static cache's output, a CUDA graph's,
    an `out=` kernel's), which its next forward overwrites, and two forwards compared would then be one tensor
    compared with itself (`.float()` of float32 logits is no copy). With keep_graph the copy stays in the autograd
    graph of a forward run with gradients (a check that backpropagates from the logits).

    Reading the output runs model code too (a `.logits` property, a mapping's `get`): what it raises is the model's
    error (ModelRaised), like an exception from forward itself."""
    with model_code(f"reading the logits from what forward returned ({type(output).__name__}) raised"):
        logits = _extract_logits(output)
    return logits.clone() if keep_graph else logits.detach().clone()


def _extract_logits(output: Any) -> torch.Tensor:
    logits = logits_in(output)  # the one rule every check reads the logits by (fwdcheck/observe/frames.py)
    if logits is not None:
        return logits
    keys = list(output)[:6] if isinstance(output, Mapping) else []
    call = f"model(input_ids)[{keys[0]!r}]" if keys else "model(input_ids)..."
    listed = f" (keys {', '.join(map(repr, keys))})" if keys else ""
    raise ModelRaised(
        f"forward returned {type(output).__name__}{listed}; fwdcheck needs logits [B, T, V]: a tensor, an object "
        "with .logits, a mapping with a 'logits' entry, or a tuple whose first non-scalar item is the logits"
        f"{adapter_hint(call)}"
    )


def model_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """The innermost traceback frame outside torch and fwdcheck, (file, line, function): the line of model code
    that raised."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return None
    f = frames[-1]
    return f.filename, f.lineno or 0, f.name


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
