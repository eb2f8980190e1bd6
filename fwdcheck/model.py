"""ModelUnderTest: one face over every model source, and the loaders that build it.

Whatever the source, a check asks the same questions: what is the vocabulary, how long may a sequence be, does forward
take position_ids, and what are the logits [B, T, V] for these ids. Loaders never judge the model; they only build it
and say clearly when they cannot.
"""

from __future__ import annotations

import builtins
import inspect
import pkgutil
import re
import sys
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from fwdcheck.config import CheckpointModel, Config, FactoryModel, HFModel, PythonModel, ReferenceModel, RopeSpec
from fwdcheck.errors import ModelLoadError, ModelRaised, first_line

Rotary = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B,h,T,d_h], positions [T]) -> rotated x

# Attribute names under which model configs commonly keep each dimension (HF, nanoGPT, gpt-fast, ...).
_CONFIG_NAMES = {
    "d": ("hidden_size", "d_model", "n_embd", "dim", "embed_dim"),
    "h": ("num_attention_heads", "n_heads", "n_head", "num_heads"),
    "h_kv": ("num_key_value_heads", "n_kv_heads", "n_local_heads", "n_kv_head", "num_kv_heads", "n_query_groups"),
    "d_ff": ("intermediate_size", "d_ff", "n_inner", "ffn_dim", "hidden_dim"),
    "V": ("vocab_size", "n_vocab"),
    "L": ("num_hidden_layers", "n_layers", "n_layer", "num_layers"),
}
_MAX_POSITION_NAMES = ("max_position_embeddings", "max_seq_len", "block_size", "n_positions", "n_ctx")


@dataclass
class ModelUnderTest:
    module: nn.Module
    label: str  # how the report names the model
    source: str  # reference | python | ...
    vocab_size: int
    max_positions: int | None = None
    causal: bool = True
    dims: dict[str, int] = field(default_factory=dict)  # known symbolic dimensions: d, h, h_kv, d_h, V, d_ff, L
    rope: RopeSpec | None = None  # what the model declares about its rotary embedding, if anything
    rotary: Rotary | None = None  # the model's rotary function, when it can be called on its own
    forward_adapter: Callable[..., Any] | None = None
    rotary_discovered: bool = False  # the rotary function was found by convention, not named by the user
    forward_kwargs: set[str] | None = None  # keyword arguments forward takes; None: read its signature
    attn_implementations: list[str] = field(default_factory=list)  # switchable implementations (Hugging Face)
    padding: int = 0  # left-padding tokens a path view adds before the inputs (its logits are of the real tokens)
    extra: dict[str, Any] = field(default_factory=dict)  # shown in the report's model section; extra["notes"]

    def accepts(self, name: str) -> bool:
        """Whether forward takes this keyword argument."""
        if self.forward_kwargs is not None:
            return name in self.forward_kwargs
        if self.forward_adapter is not None:
            return False
        return _accepts(self.module.forward, name)

    @property
    def layer_stack(self) -> str | None:
        """Dotted name of the nn.ModuleList holding the most blocks: the transformer's layers, if it has one."""
        lists = [(n, len(m)) for n, m in self.module.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        return max(lists, key=lambda item: item[1])[0] if lists else None

    def block_of(self, module_name: str) -> str | None:
        """The block (e.g. 'layers.3') a submodule belongs to, or None."""
        stack = self.layer_stack
        if stack is None or not module_name.startswith(f"{stack}."):
            return None
        index = module_name[len(stack) + 1:].split(".")[0]
        return f"{stack}.{index}" if index.isdigit() else None

    @property
    def accepts_position_ids(self) -> bool:
        return self.accepts("position_ids")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> Any:
        """The model's raw output; any exception becomes ModelRaised naming the model-code frame it came from."""
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        try:
            if self.forward_adapter is not None:
                return self.forward_adapter(self.module, input_ids, **kwargs)
            return self.module(input_ids, **kwargs)
        except ModelRaised:
            raise
        except BaseException as exc:
            if not model_failure(exc):
                raise
            raise ModelRaised(f"the model raised {describe(exc)}", frame=model_frame(exc)) from exc

    def call(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """The module's own forward with keyword arguments of its own (labels, document ids, a 4-D mask): the raw
        output, exceptions as forward() reports them. The `forward:` adapter is not used: it turns a call into
        logits, and these calls ask forward for something else beside them."""
        try:
            return self.module(input_ids, **kwargs)
        except ModelRaised:
            raise
        except BaseException as exc:
            if not model_failure(exc):
                raise
            raise ModelRaised(f"the model raised {describe(exc)}", frame=model_frame(exc)) from exc

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
        if logits.shape[1] != T:
            hint = (
                " (nanoGPT-style models return only the last position unless targets are given; "
                "name a `forward:` adapter in the config that returns every position)"
                if logits.shape[1] == 1
                else ""
            )
            raise ModelRaised(
                f"forward returned logits for {logits.shape[1]} positions of {T} ({list(logits.shape)}){hint}; "
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
        return (f"as a {str(logits.layout).removeprefix('torch.')} tensor; fwdcheck needs dense logits "
                "(call .to_dense() in a `forward:` adapter)")
    if logits.is_meta and not input_ids.is_meta:
        return (f"on the meta device (shapes, no values) for inputs on {input_ids.device}: a parameter or buffer "
                "left on meta, or a tensor created with device='meta'")
    if logits.is_complex():
        return f"of dtype {str(logits.dtype).removeprefix('torch.')}; logits are real numbers"
    return None


_EXCEPTION_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11 on


# BaseExceptions that are no reason to end a run when model code raises them: sys.exit() (SystemExit), a generator
# or coroutine closed inside forward (GeneratorExit, asyncio's CancelledError), a model's own BaseException subclass.
# Ctrl-C (KeyboardInterrupt) and fwdcheck's own (the runner's time limit) always pass: they stop the run on purpose.
def model_failure(exc: BaseException) -> bool:
    """Whether an exception raised inside model code is the model's failure, to be reported, not propagated."""
    if isinstance(exc, Exception):
        return not isinstance(exc, ModelRaised)
    if isinstance(exc, KeyboardInterrupt) or type(exc).__module__.split(".")[0] == "fwdcheck":
        return False
    if isinstance(exc, _EXCEPTION_GROUP):  # a group holding a Ctrl-C or a time limit is that, not a failure
        return all(model_failure(inner) for inner in exc.exceptions)
    return True


def describe(exc: BaseException) -> str:
    """'TypeName: message' of an exception from model code, even one whose __str__ raises."""
    try:
        message = str(exc)
    except Exception:
        message = "<its message cannot be shown: its __str__ raised>"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def extract_logits(output: Any) -> torch.Tensor:
    """Logits from what forward returned: a tensor, an object with .logits, a mapping, or a tuple led by them.

    Reading the output runs model code too (a `.logits` property, a mapping's `get`): what it raises is the model's
    error (ModelRaised), like an exception from forward itself."""
    try:
        return _extract_logits(output)
    except ModelRaised:
        raise
    except BaseException as exc:
        if not model_failure(exc):
            raise
        raise ModelRaised(f"reading the logits from what forward returned ({type(output).__name__}) raised "
                          f"{describe(exc)}", frame=model_frame(exc)) from exc


def _extract_logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ModelRaised(
        f"forward returned {type(output).__name__}; fwdcheck needs logits [B, T, V]: a tensor, "
        "an object with .logits, or a tuple whose first item is the logits"
    )


def model_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """The innermost traceback frame outside torch and fwdcheck, (file, line, function): the line of model code
    that raised."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
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


# ---------------------------------------------------------------------------------------------------------------------
# Loaders


def load_model(config: Config) -> ModelUnderTest:
    """Build the model the config names. Raises ModelLoadError (exit 2) when it cannot be built at all."""
    spec = config.model
    with torch.random.fork_rng(devices=[]):  # the user's RNG state is not ours to advance
        torch.manual_seed(config.inputs.seed)
        if isinstance(spec, ReferenceModel):
            with torch.device("meta") if config.meta else nullcontext():
                return _load_reference(spec)
        if isinstance(spec, PythonModel):
            with torch.device("meta") if config.meta else nullcontext():
                return _load_python(spec, config)
        if isinstance(spec, CheckpointModel):
            from fwdcheck.checkpoint import load_checkpoint

            return load_checkpoint(spec, config)
        if isinstance(spec, HFModel):
            from fwdcheck.hf import load_hf

            return load_hf(spec, config)
    raise ModelLoadError(f"model source '{spec.source}' is not supported")  # pragma: no cover - schema forbids it


def _load_reference(spec: ReferenceModel) -> ModelUnderTest:
    from fwdcheck.reference import ReferenceConfig, ReferenceTransformer, apply_rope

    fields = spec.model_dump(exclude={"source"})
    cfg = ReferenceConfig(**fields)
    try:
        module = ReferenceTransformer(cfg)
    except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:  # sizes torch cannot allocate
        first = first_line(exc)
        raise ModelLoadError(f"the reference model cannot be built with these sizes: {type(exc).__name__}: "
                             f"{first}") from exc
    rope = rotary = None
    if cfg.positional == "rope":
        rope = RopeSpec(base=cfg.rope.base, pairing=cfg.rope.pairing, rotary_dim=cfg.rotary_dim)
        rotary = partial(apply_rope, base=cfg.rope.base, pairing=cfg.rope.pairing, rotary_dim=cfg.rotary_dim)

    bugs = ", ".join(cfg.bugs) or "none"
    return ModelUnderTest(
        module=module,
        label=f"reference ({cfg.positional}, {cfg.attention}, {cfg.n_layers} layers; planted bugs: {bugs})",
        source="reference",
        vocab_size=cfg.vocab_size,
        max_positions=cfg.max_seq_len,
        dims=dict(d=cfg.d_model, h=cfg.n_heads, h_kv=cfg.n_kv_heads, d_h=cfg.head_dim, V=cfg.vocab_size,
                  d_ff=cfg.d_ff, L=cfg.n_layers),
        rope=rope,
        rotary=rotary,
        extra={"bugs": list(cfg.bugs)},
    )


@dataclass
class FactoryParts:
    """The callables a factory-based config names, imported."""

    factory: Callable[..., Any]
    forward: Callable[..., Any] | None
    rotary: Rotary | None


def import_factory_parts(spec: FactoryModel, search: list[Path]) -> FactoryParts:
    """Import the factory, forward adapter and rotary function with `search` on sys.path."""
    with on_sys_path(search):
        return FactoryParts(
            factory=resolve_callable(spec.factory, what="factory"),
            forward=resolve_callable(spec.forward, what="forward adapter") if spec.forward else None,
            rotary=resolve_callable(spec.rotary_function, what="rotary function") if spec.rotary_function else None,
        )


def call_factory(spec: FactoryModel, parts: FactoryParts, search: list[Path]) -> nn.Module:
    """Call the factory; one clear ModelLoadError when it raises or returns something that is not a module."""
    with on_sys_path(search):
        try:
            module = parts.factory(**spec.kwargs)
        except BaseException as exc:  # SystemExit too: a factory calling sys.exit() (argparse, ...)
            if not model_failure(exc):
                raise
            raise ModelLoadError(f"factory '{spec.factory}' raised {describe(exc)}") from exc
    if not isinstance(module, nn.Module):
        raise ModelLoadError(f"factory '{spec.factory}' returned {type(module).__name__}, not a torch.nn.Module")
    return module


def search_dirs(extra: list[Path], config: Config) -> list[Path]:
    """sys.path additions: the configured directories, then the config file's folder (or the working directory)."""
    return [*extra, config.source_path.parent.resolve() if config.source_path is not None else Path.cwd()]


def model_from_module(module: nn.Module, spec: FactoryModel, parts: FactoryParts, source: str,
                      label: str | None = None) -> ModelUnderTest:
    """Wrap a module built from a factory, reading what its own config (if any) declares."""
    dims = _dims_from_config(getattr(module, "config", None))
    if spec.dims is not None:  # what the user declares wins over what a config object says
        dims.update(spec.dims.declared())
        if "h" in spec.dims.declared() and "h_kv" not in spec.dims.declared():
            dims["h_kv"] = dims["h"]
        if "d" in dims and "h" in dims and "d_h" not in spec.dims.declared() and dims["d"] % dims["h"] == 0:
            dims["d_h"] = dims["d"] // dims["h"]
    vocab = spec.vocab_size or dims.get("V") or _embedding_rows(module)
    if not vocab:
        raise ModelLoadError(
            f"cannot tell the vocabulary size of '{spec.factory}' (no config.vocab_size, no nn.Embedding); "
            "set model.vocab_size in the config"
        )
    dims.setdefault("V", vocab)
    model_cfg = getattr(module, "config", None)
    max_positions = spec.max_positions or next(
        (int(v) for n in _MAX_POSITION_NAMES if isinstance(v := getattr(model_cfg, n, None), int)), None
    )
    return ModelUnderTest(
        module=module,
        label=label or spec.factory,
        source=source,
        vocab_size=vocab,
        max_positions=max_positions,
        causal=spec.causal,
        dims=dims,
        rope=spec.rope,
        rotary=parts.rotary,
        forward_adapter=parts.forward,
    )


def _load_python(spec: PythonModel, config: Config) -> ModelUnderTest:
    search = search_dirs(spec.path, config)
    parts = import_factory_parts(spec, search)
    loaded = model_from_module(call_factory(spec, parts, search), spec, parts, source="python")
    if spec.cache is not None:
        loaded.extra["cache"] = spec.cache.model_dump()  # how the kv-cache check decodes through the model
    if spec.loss is not None:
        loaded.extra["loss"] = spec.loss.model_dump()  # how the label-shift check asks forward for its loss
    if spec.packing is not None:
        loaded.extra["packing"] = spec.packing.model_dump()  # how the packing check hands forward its documents
    return loaded


_DOTTED = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*")  # what pkgutil.resolve_name accepts before the colon


def resolve_callable(reference: str, what: str) -> Callable:
    """'package.module:attr' -> the object (pkgutil.resolve_name), with one clear ModelLoadError for each way that
    can go wrong."""
    module_name, _, attr = reference.partition(":")
    try:
        obj = pkgutil.resolve_name(reference)
    except ModuleNotFoundError as exc:
        raise ModelLoadError(f"{what} '{reference}': cannot import '{module_name}': {exc}") from exc
    except ValueError as exc:
        if module_name not in sys.modules and not _DOTTED.fullmatch(module_name):  # resolve_name's "invalid format"
            raise ModelLoadError(f"{what} '{reference}': cannot import '{module_name}': not a dotted module name "
                                 "(package.module:attribute)") from exc
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ModelLoadError(f"{what} '{reference}': importing '{module_name}' raised {last}") from exc
    except AttributeError as exc:
        if module_name not in sys.modules:  # raised while importing the module, not looking up the attribute
            raise ModelLoadError(f"{what} '{reference}': importing '{module_name}' raised "
                                 f"{traceback.format_exception_only(type(exc), exc)[-1].strip()}") from exc
        raise ModelLoadError(f"{what} '{reference}': module '{module_name}' has no attribute '{attr}'") from exc
    except BaseException as exc:  # SystemExit too: a script that parses sys.argv or exits at import
        if not model_failure(exc):
            raise
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ModelLoadError(f"{what} '{reference}': importing '{module_name}' raised {last}") from exc
    if not callable(obj):
        raise ModelLoadError(f"{what} '{reference}' is a {type(obj).__name__}, not a callable")
    return obj


@contextmanager
def on_sys_path(directories: list[Path]):
    added = [str(d) for d in directories if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)


def _dims_from_config(model_config: Any) -> dict[str, int]:
    dims = {}
    for symbol, names in _CONFIG_NAMES.items():
        value = next((getattr(model_config, n) for n in names if isinstance(getattr(model_config, n, None), int)), None)
        if value:
            dims[symbol] = value
    if "d" in dims and "h" in dims and dims["d"] % dims["h"] == 0:
        head_size = next((v for n in ("head_dim", "head_size") if isinstance(v := getattr(model_config, n, None), int)),
                         None)  # Hugging Face and gpt-fast say head_dim, litgpt head_size
        dims["d_h"] = head_size or dims["d"] // dims["h"]
    if "h" in dims:
        dims.setdefault("h_kv", dims["h"])
    return dims


def _embedding_rows(module: nn.Module) -> int | None:
    """The token embedding's size: HF's get_input_embeddings, else the first nn.Embedding registered."""
    getter = getattr(module, "get_input_embeddings", None)
    if callable(getter):
        try:
            embedding = getter()
            if isinstance(embedding, nn.Embedding):
                return embedding.num_embeddings
        except Exception:  # a model's own accessor may not be implemented; fall back to the modules
            pass
    first = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return first.num_embeddings if first is not None else None
