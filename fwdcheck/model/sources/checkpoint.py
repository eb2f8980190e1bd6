"""The `checkpoint` source: the user's factory builds the architecture, a weights file fills it.

In the style of gpt-fast: the factory runs on the meta device (no memory, no initialisation), then the checkpoint's
tensors are assigned into it (`load_state_dict(..., assign=True)`): the parameters are the file's tensors, in the
file's dtype, with no copy. Two things a file cannot supply make that model unusable: non-persistent buffers (RoPE
inv_freq caches and the like, computed in __init__) and keys the file lacks. Either one, and the factory is run again
on the CPU (real, seeded initialisation) and the checkpoint copied into it; missing keys then keep their fresh init.

Nothing about the match is silent. Missing and unexpected keys are an error naming them, as load_state_dict's strict
default makes them (`strict: false` loads the file anyway, with a warning saying which keys), a key
that looks renamed says from what, and a shape mismatch names the key and both shapes. A pickle that needs code to
load is refused, naming the code, unless the config trusts the file; one that calls into os or sys is refused even
then. Every way a file can be unusable is one ModelLoadError line, and torch's warnings while reading it are notes.
"""

from __future__ import annotations

import json
import pickletools
import re
import warnings
from collections import Counter
from collections.abc import Mapping
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fwdcheck.config.callables import on_sys_path, search_dirs
from fwdcheck.config.reading import regular_file
from fwdcheck.config.schema import CheckpointModel, Config
from fwdcheck.errors import ModelLoadError
from fwdcheck.model.sources.factory import FactoryParts, call_factory, import_factory_parts, model_from_module
from fwdcheck.model.tested import ModelUnderTest

SAFETENSORS = (".safetensors",)
TORCH = (".pt", ".pth", ".bin", ".ckpt")
SUPPORTED = ", ".join([*SAFETENSORS, *TORCH, ".index.json (sharded)"])
# Where training scripts nest the weights: Lightning and most loops ("state_dict"), gpt-fast/nanoGPT-style dicts
# ("model"), "model_state_dict" (the PyTorch tutorials), "module" (DeepSpeed).
WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module")
# Prefixes a wrapper adds to every key: DistributedDataParallel ("module.") and torch.compile ("_orig_mod.").
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
SHOWN = 5  # keys named in a note or an error before "and N more"

_ZIP_MAGIC = b"PK\x03\x04"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def load_checkpoint(spec: CheckpointModel, config: Config) -> ModelUnderTest:
    """Build spec.factory's model and load spec.path into it. ModelLoadError (exit 2) when that cannot be done."""
    path = spec.path
    kind = checkpoint_kind(path)
    search = search_dirs(spec.python_path, config.source_path)
    parts = import_factory_parts(spec, search)
    notes: list[str] = []
    # Read the file first: a corrupt or refused checkpoint fails before the factory runs at all.
    state_dict, file_format = read_checkpoint(path, kind, trust=spec.trust_checkpoint, search=search, notes=notes)

    rng = torch.get_rng_state()  # a CPU rebuild initialises exactly as `source: python` would with the same seed
    module = _build_on_meta(spec, parts, search, notes)
    built_on = "meta"
    if module is None:
        built_on = "cpu"
        torch.set_rng_state(rng)
        module = call_factory(spec, parts, search)
    state_dict = _strip_wrapper_prefixes(state_dict, set(module.state_dict()), notes)
    match = _load(module, state_dict, spec, path, assign=built_on == "meta")
    _check_strict(match, spec, path)
    _describe_match(match, config, notes)

    leftover = _meta_tensors(module) if built_on == "meta" else []
    if leftover:
        module = _rebuilt_on_cpu(spec, parts, search, state_dict, match, leftover, rng, notes)
        built_on = "cpu"

    loaded = model_from_module(module, spec, parts, source="checkpoint", label=f"{spec.factory} <- {path.name}")
    loaded.weights_loaded = True
    dtypes = Counter(_dtype(t) for t in state_dict.values() if isinstance(t, torch.Tensor))
    loaded.extra.update(
        checkpoint=str(path),
        format=file_format,
        tensors=sum(dtypes.values()),
        dtypes=dict(dtypes),
        built_on=built_on,
        missing_keys=list(match.missing),
        unexpected_keys=list(match.unexpected),
        renamed_keys=dict(match.renamed),
        notes=notes,
    )
    return loaded


def _rebuilt_on_cpu(
    spec: CheckpointModel,
    parts: FactoryParts,
    search: list[Path],
    state_dict: dict[str, Any],
    match: Match,
    leftover: list[str],
    rng: torch.Tensor,
    notes: list[str],
) -> nn.Module:
    """The model built on the CPU (from the RNG state `rng`) and the checkpoint copied into it, for a model that
    built on the meta device leaves `leftover` tensors there; notes say why, and what copying converted.
    ModelLoadError when even the CPU build leaves tensors on the meta device."""
    path = spec.path
    torch.set_rng_state(rng)  # initialised as `source: python` would be with the same seed
    module = call_factory(spec, parts, search)
    _load(module, state_dict, spec, path, assign=False)
    stored = [n for n in leftover if n not in match.missing]
    why: list[str] = []
    if stored:
        one = len(stored) == 1
        why.append(
            f"{_names(stored)} {'is' if one else 'are'} not stored in checkpoints "
            f"({'a non-persistent buffer' if one else 'non-persistent buffers'} computed in __init__)"
        )
    if match.missing:
        why.append("keys are missing from the checkpoint")
    notes.append(
        f"built the model on the CPU, not the meta device: {'; '.join(why)}; the checkpoint was copied into it"
    )
    model_state = module.state_dict()
    cast = Counter(
        f"{_dtype(t)} -> {_dtype(model_state[k])}"
        for k, t in state_dict.items()
        if isinstance(t, torch.Tensor) and k in model_state and t.dtype != model_state[k].dtype
    )
    if cast:
        notes.append(
            "copying converted the checkpoint's tensors to the dtype the factory built: "
            + ", ".join(f"{n} {edit}" for edit, n in cast.items())
        )
    still = _meta_tensors(module)
    if still:
        raise ModelLoadError(
            f"factory '{spec.factory}' leaves {_names(still)} on the meta device even when "
            "built normally; fwdcheck cannot run it"
        )
    return module


# ---------------------------------------------------------------------------------------------------------------------
# Reading the file


def checkpoint_kind(path: Path) -> str:
    """'safetensors', 'torch' or 'index' for a file that exists and has a supported name; else ModelLoadError."""
    if not path.exists():
        raise ModelLoadError(f"checkpoint {path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"checkpoint {path}: is a directory, not a checkpoint file{_directory_hint(path)}")
    regular_file(path, f"checkpoint {path}", ModelLoadError, what="checkpoint")
    name = path.name.lower()
    if name.endswith(".index.json"):
        return "index"
    if path.suffix.lower() in SAFETENSORS:
        return "safetensors"
    if path.suffix.lower() in TORCH:
        return "torch"
    what = f"unknown extension '{path.suffix}'" if path.suffix else "no file extension to tell the format by"
    raise ModelLoadError(f"checkpoint {path}: {what}; supported: {SUPPORTED}")


def _directory_hint(path: Path) -> str:
    if (path / "config.json").is_file():
        return " (it holds a config.json: for a Hugging Face model directory use `source: hf`)"
    files = sorted(
        p.name
        for p in path.iterdir()
        if p.is_file() and (p.suffix.lower() in SAFETENSORS + TORCH or p.name.endswith(".index.json"))
    )
    if files:
        return f" (point model.path at one of: {', '.join(files[:SHOWN])})"
    return ""


def read_checkpoint(
    path: Path, kind: str, *, trust: bool, search: list[Path], notes: list[str]
) -> tuple[dict[str, Any], str]:
    """The state dict in the file (unwrapped), and a name for its format."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ModelLoadError(f"checkpoint {path}: cannot be read ({exc.strerror or exc})") from None
    if size == 0:
        raise ModelLoadError(f"checkpoint {path}: the file is empty (0 bytes)")
    if kind == "index":
        return _read_sharded(path, trust=trust, search=search, notes=notes), "sharded"
    if kind == "safetensors":
        tensors = _read_safetensors(path, head)
        if not tensors:
            raise ModelLoadError(f"checkpoint {path}: holds no tensors (a valid safetensors file with an empty header)")
        return tensors, "safetensors"
    obj = _read_torch(path, head, trust=trust, search=search, notes=notes)
    state_dict = unwrap_state_dict(obj, path, notes)
    empty = [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.is_meta]
    if empty:  # loading would fail on the first one, as "Cannot copy out of meta tensor", or leave it without values
        raise ModelLoadError(
            f"checkpoint {path}: {_names(empty)} {'holds' if len(empty) == 1 else 'hold'} no data "
            "(meta tensors: saved from a model built on the meta device, before its weights were "
            "loaded)"
        )
    return state_dict, "torch zip" if head.startswith(_ZIP_MAGIC) else "torch legacy pickle"


def _read_safetensors(path: Path, head: bytes) -> dict[str, torch.Tensor]:
    try:  # imported on use: an optional package, needed only for .safetensors files
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:
        raise ModelLoadError(
            f"checkpoint {path}: reading .safetensors needs the safetensors package "
            "(pip install safetensors, or fwdcheck[hf])"
        ) from None
    duplicated = _duplicate_header_keys(path)
    if duplicated:
        raise ModelLoadError(
            f"checkpoint {path}: the safetensors header names {_names(duplicated)} more than once; "
            "which tensor the file means is ambiguous (the reader would keep the last silently)"
        )
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        hint = " (it starts like a torch.save zip archive: name it .pt)" if head.startswith(_ZIP_MAGIC) else ""
        raise ModelLoadError(
            f"checkpoint {path}: not a readable safetensors file, corrupt or truncated ({_one_line(exc)}){hint}"
        ) from None


def _duplicate_header_keys(path: Path) -> list[str]:
    """Keys a safetensors header (8 bytes of length, then a JSON object) names twice. The safetensors reader keeps
    the last of them without a word. An unreadable header gives none: the reader then says what is wrong with it."""
    try:
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= 100_000_000:
                return []
            header = f.read(length)
        pairs = json.loads(header, object_pairs_hook=lambda items: items)
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(pairs, list):
        return []
    seen: set[str] = set()
    duplicated: list[str] = []
    for key, _ in pairs:
        if key in seen and key not in duplicated:
            duplicated.append(key)
        seen.add(key)
    return duplicated


def _read_torch(path: Path, head: bytes, *, trust: bool, search: list[Path], notes: list[str]) -> Any:
    """torch.load with weights_only=True; a pickle that needs code only when the config trusts the file."""
    is_zip = head.startswith(_ZIP_MAGIC)
    is_pickle = head[:1] == b"\x80"  # the PROTO opcode a legacy torch.save starts with
    if not (is_zip or is_pickle):
        hint = " (it starts like a safetensors file: name it .safetensors)" if _looks_safetensors(head) else ""
        raise ModelLoadError(
            f"checkpoint {path}: not a torch.save file (neither a zip archive nor a pickle), "
            f"corrupt or another format{hint}"
        )
    try:
        return _torch_load(path, weights_only=True, mmap=is_zip, notes=notes)
    except _Refused as exc:
        refusal = exc
    if refusal.blocked:
        raise ModelLoadError(
            f"checkpoint {path}: refused: unpickling it needs code: it calls {refusal.needs}, from module "
            f"{refusal.blocked}, which no checkpoint has a use for; refused even with trust_checkpoint: true (a pickle "
            "can run arbitrary code when loaded)"
        )
    if not trust:
        if refusal.opcode:
            raise ModelLoadError(
                f"checkpoint {path}: {refusal.needs}, which torch.load(weights_only=True) does not read (opcode "
                f"{refusal.opcode}); save it again with torch.save's default protocol or as .safetensors, or set "
                "trust_checkpoint: true to unpickle it in full, only for a file you trust (a pickle can run arbitrary "
                "code when loaded)"
            )
        raise ModelLoadError(
            f"checkpoint {path}: refused: unpickling it needs code ({refusal.needs}), which weights_only refused to "
            "run; a pickle can run arbitrary code when loaded; set trust_checkpoint: true only for files you trust "
            "(or save model.state_dict() instead of the whole model)"
        )
    try:
        with on_sys_path(search):  # the pickled classes import from the user's code
            obj = _torch_load(path, weights_only=False, mmap=is_zip, notes=notes)
    except (ModuleNotFoundError, AttributeError, ImportError) as exc:
        raise ModelLoadError(
            f"checkpoint {path}: unpickling needs code that cannot be imported ({_one_line(exc)}); "
            "add its directory to model.python_path"
        ) from None
    except Exception as exc:
        raise ModelLoadError(f"checkpoint {path}: unpickling raised {type(exc).__name__}: {_one_line(exc)}") from None
    why = f"the file pickles {refusal.needs}" if not refusal.opcode else refusal.needs
    notes.append(f"loaded with weights_only=False (trust_checkpoint: true): {why}")
    return obj


class _Refused(Exception):
    """torch.load(weights_only=True) would not read the file: the global it would need to call, or (`opcode`) the
    pickle feature it does not read."""

    def __init__(self, needs: str, blocked: str | None = None, opcode: str | None = None):
        super().__init__(needs)
        self.needs = needs  # a global ('posix.system'), or how the file was written ('written with pickle protocol 4')
        self.blocked = blocked  # the module of a global torch never unpickles (os, sys, ...), else None
        self.opcode = opcode


_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_BLOCKED = re.compile(r"unsupported GLOBAL (\S+) whose module (\S+) is blocked")
_OPERAND = re.compile(r"Unsupported operand (\d+)")
_PROTOCOL = re.compile(r"Detected pickle protocol (\d+)")
_OPCODES = {op.code: op.name for op in pickletools.opcodes}


def _torch_load(path: Path, *, weights_only: bool, mmap: bool, notes: list[str]) -> Any:
    """torch.load, its warnings kept as notes (not printed ahead of the report), and weights_only's refusals told
    apart from damage: _Refused for a file that needs code or pickle features it does not read, ModelLoadError for a
    file that is corrupt or truncated. With weights_only=False errors propagate as raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # mmap: tensors are paged in from the file as they are read, never copied up front (zip format only).
            obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=weights_only)
        except Exception as exc:  # UnpicklingError for refused globals, RuntimeError/EOFError/... for damaged files
            if not weights_only:
                raise
            raise _refusal(path, exc, caught) from None
    for w in caught:
        if not _PROTOCOL.search(str(w.message)):  # the protocol is a fact of the file, not worth a note once it loads
            note = f"torch warned while loading: {_one_line(w.message)}"
            if note not in notes:
                notes.append(note)
    return obj


def _refusal(path: Path, exc: Exception, caught: list[warnings.WarningMessage]) -> Exception:
    text = str(exc)
    blocked = _BLOCKED.search(text)
    if blocked:
        return _Refused(blocked.group(1), blocked=blocked.group(2))
    allowed = _GLOBAL.search(text)
    if allowed:
        return _Refused(allowed.group(1))
    operand = _OPERAND.search(text)
    if operand:
        code = chr(int(operand.group(1)))
        protocol = next((m.group(1) for w in caught if (m := _PROTOCOL.search(str(w.message)))), None)
        written = f"written with pickle protocol {protocol}" if protocol else "written with an old pickle protocol"
        return _Refused(written, opcode=_OPCODES.get(code, repr(code)))
    return ModelLoadError(
        f"checkpoint {path}: not a readable torch checkpoint, corrupt or truncated ({_unpickling_problem(exc)})"
    )


def _unpickling_problem(exc: Exception) -> str:
    """The line of a weights_only failure that says what went wrong: torch leads with a paragraph on the change of
    its default, and puts the reason after it."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    reasons = [
        line
        for line in lines
        if not line.startswith(("Weights only load failed", "Check the documentation", "Please file an issue"))
    ]
    return (reasons[0] if reasons else _one_line(exc)).removeprefix("WeightsUnpickler error: ")


def _looks_safetensors(head: bytes) -> bool:
    return len(head) == 8 and 0 < int.from_bytes(head, "little") < 100_000_000


def _read_sharded(path: Path, *, trust: bool, search: list[Path], notes: list[str]) -> dict[str, Any]:
    """A Hugging Face style index ({"weight_map": {key: shard file}}): every shard, merged."""
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, AttributeError, UnicodeDecodeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(
            f"checkpoint {path}: not a shard index (a JSON object with a non-empty 'weight_map' of key -> shard file)"
        )
    merged: dict[str, Any] = {}
    for shard_name in sorted(set(weight_map.values())):
        shard = path.parent / shard_name
        try:
            shard_kind = checkpoint_kind(shard)
            if shard_kind == "index":
                raise ModelLoadError(f"checkpoint {shard}: is itself an index")
            merged.update(read_checkpoint(shard, shard_kind, trust=trust, search=search, notes=notes)[0])
        except ModelLoadError as exc:
            raise ModelLoadError(
                f"checkpoint {path}: shard {shard_name}: {str(exc).removeprefix(f'checkpoint {shard}: ')}"
            ) from None
    absent = [k for k in weight_map if k not in merged]
    if absent:
        raise ModelLoadError(f"checkpoint {path}: the index maps {_names(absent)} to shards that do not hold them")
    notes.append(f"merged {len(set(weight_map.values()))} shards listed in {path.name}")
    return merged


def unwrap_state_dict(obj: Any, path: Path, notes: list[str], depth: int = 0) -> dict[str, Any]:
    """A mapping of names to tensors from what torch.load returned: a state dict, a training checkpoint that nests
    one (under 'state_dict', 'model', ...), or (trusted files only) a pickled nn.Module."""
    if isinstance(obj, nn.Module):
        notes.append(f"the file pickles a whole {type(obj).__name__}; its state_dict() was loaded")
        return obj.state_dict()
    if not isinstance(obj, Mapping):
        raise ModelLoadError(
            f"checkpoint {path}: holds no tensors (it holds a {type(obj).__name__}, not a mapping of names to tensors)"
        )
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if tensors and len(tensors) == len(obj):
        return dict(obj)
    if depth < 2:
        for key in WRAPPER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, nn.Module) or (isinstance(inner, Mapping) and _holds_tensors(inner)):
                others = [str(k) for k in obj if k != key]
                ignored = f"; ignored the other top-level keys: {', '.join(others[:8])}" if others else ""
                notes.append(f"unwrapped checkpoint['{key}']{ignored}")
                return unwrap_state_dict(inner, path, notes, depth + 1)
    if tensors:
        ignored_keys = [str(k) for k in obj if k not in tensors]
        notes.append(
            f"loaded the {len(tensors)} top-level tensors; ignored non-tensor entries: {', '.join(ignored_keys[:8])}"
        )
        return tensors
    keys = ", ".join(str(k) for k in list(obj)[:8]) or "none"
    raise ModelLoadError(f"checkpoint {path}: holds no tensors (a {type(obj).__name__} with keys: {keys})")


def _holds_tensors(mapping: Mapping) -> bool:
    return any(isinstance(v, torch.Tensor) for v in mapping.values())


# ---------------------------------------------------------------------------------------------------------------------
# Building and loading


def _build_on_meta(
    spec: CheckpointModel, parts: FactoryParts, search: list[Path], notes: list[str]
) -> nn.Module | None:
    """The factory's module on the meta device, or None (with a note) when the factory cannot run there."""
    try:
        with torch.device("meta"):
            return call_factory(spec, parts, search)
    except ModelLoadError as exc:
        # Factories that compute from values in __init__ (.item(), data-dependent init) fail on meta; the CPU build
        # that follows raises again, as one line, if the factory is simply broken.
        notes.append(f"the factory cannot run on the meta device ({_one_line(exc)}); built on the CPU instead")
        return None


class Match:
    """How the checkpoint's keys met the model's."""

    def __init__(self, missing: list[str], unexpected: list[str], renamed: dict[str, str], tied: list[str]):
        self.missing = missing
        self.unexpected = unexpected
        self.renamed = renamed  # checkpoint key -> the model key it looks renamed from
        self.tied = tied  # model keys absent from the file but tied to a key it holds


def _load(module: nn.Module, state_dict: dict[str, Any], spec: CheckpointModel, path: Path, *, assign: bool) -> Match:
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    groups = _tie_groups(module)
    try:
        result = module.load_state_dict(state_dict, strict=False, assign=assign)
    except RuntimeError as exc:
        raise ModelLoadError(_shape_error(exc, state_dict, expected, spec, path)) from None
    if assign:
        _retie(module, groups, state_dict)
    # A tied alias the file does not store (safetensors' save_model drops all but one) is loaded through its twin.
    present = set(state_dict)
    tied = [name for group in groups if present & set(group) for name in group if name not in present]
    missing = [k for k in result.missing_keys if k not in tied]
    unexpected = list(result.unexpected_keys)
    shapes = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    return Match(missing, unexpected, _renames(missing, unexpected, expected, shapes), tied)


def _tie_groups(module: nn.Module) -> list[list[str]]:
    """Names that share one Parameter object (e.g. a language-model head tied to the token embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(module: nn.Module, groups: list[list[str]], state_dict: dict[str, Any]) -> None:
    """assign=True gives each name its own new Parameter, which unties tied weights: tie them again, to the tensor
    a copying load would have left (the last alias in module order that the file holds)."""
    for group in groups:
        present = [name for name in group if name in state_dict]
        if not present:
            continue
        shared = module.get_parameter(present[-1])
        for name in group:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            owner._parameters[leaf] = shared


def _meta_tensors(module: nn.Module) -> list[str]:
    """Parameters, buffers and plain tensor attributes still on the meta device."""
    names = [n for n, p in module.named_parameters() if p.is_meta]
    names += [n for n, b in module.named_buffers() if b.is_meta]
    for prefix, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                names.append(f"{prefix}.{attr}" if prefix else attr)
    return names


def _strip_wrapper_prefixes(state_dict: dict[str, Any], model_keys: set[str], notes: list[str]) -> dict[str, Any]:
    """Keys saved from a DDP- or torch.compile-wrapped model carry 'module.' / '_orig_mod.' on every name."""
    stripped = []
    changed = True
    while changed and state_dict:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state_dict) and not any(k.startswith(prefix) for k in model_keys):
                state_dict = {k[len(prefix) :]: v for k, v in state_dict.items()}
                stripped.append(prefix)
                changed = True
    if stripped:
        notes.append(
            f"stripped the prefix '{''.join(stripped)}' from every checkpoint key "
            "(saved from a DistributedDataParallel or torch.compile wrapper)"
        )
    return state_dict


_COPY_FAILED = re.compile(r'While copying the parameter named "([^"]+)".*an exception occurred : \((.*)\)\.?$')


def _shape_error(
    exc: RuntimeError, state_dict: dict[str, Any], expected: dict[str, tuple], spec: CheckpointModel, path: Path
) -> str:
    mismatched = [
        k
        for k, shape in expected.items()  # in the model's order: the first layer first
        if isinstance(state_dict.get(k), torch.Tensor) and tuple(state_dict[k].shape) != shape
    ]
    if not mismatched:
        # torch says "Error(s) in loading state_dict for X:", then one line per problem, each naming its key (the
        # point of the message): all of them are kept, joined; copies that raised become the key and the reason.
        lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
        copies = [m for line in lines if (m := _COPY_FAILED.match(line))]
        if copies:
            key, reason = copies[0].group(1), copies[0].group(2).strip(" ,'\"")  # torch shows the args: ('why',)
            more = f" (and {len(copies) - 1} more keys)" if len(copies) > 1 else ""
            return (
                f"checkpoint {path.name}: loading '{key}' into the model '{spec.factory}' builds raised "
                f"RuntimeError: {reason}{more}"
            )
        return f"checkpoint {path.name}: loading it into '{spec.factory}' raised RuntimeError: {' '.join(lines)}"
    key = mismatched[0]
    more = f" (and {len(mismatched) - 1} more mismatched)" if len(mismatched) > 1 else ""
    return (
        f"checkpoint {path.name}: '{key}' has shape {list(state_dict[key].shape)} in the checkpoint but "
        f"{list(expected[key])} in the model '{spec.factory}' builds{more}; were the factory kwargs the ones it "
        "was trained with?"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Describing the match


def _renames(
    missing: list[str], unexpected: list[str], expected: dict[str, tuple], shapes: dict[str, tuple]
) -> dict[str, str]:
    """checkpoint key -> model key, for pairs of the same shape whose names differ by a prefix or one component."""
    candidates = []
    for new in unexpected:
        for old in missing:
            if new in shapes and shapes[new] == expected.get(old):
                score = _rename_score(new, old)
                if score is not None:
                    candidates.append((-score, new, old))
    renamed: dict[str, str] = {}
    taken: set[str] = set()
    for _, new, old in sorted(candidates):
        if new not in renamed and old not in taken:
            renamed[new] = old
            taken.add(old)
    return renamed


def _rename_score(a: str, b: str) -> float | None:
    """How alike two dotted names are, or None when they differ by more than a prefix or one component."""
    pa, pb = a.split("."), b.split(".")
    if len(pa) == len(pb):
        differ = [i for i in range(len(pa)) if pa[i] != pb[i]]
        if len(differ) == 1:
            i = differ[0]
            return 1.0 + SequenceMatcher(None, pa[i], pb[i]).ratio()
        return None
    short, long = sorted((pa, pb), key=len)
    if long[-len(short) :] == short:
        return 3.0  # one name is the other with a prefix in front: 'model.layers.0.w' vs 'layers.0.w'
    tail = 0
    while tail < len(short) and short[-1 - tail] == long[-1 - tail]:
        tail += 1
    return 2.0 if tail >= 2 else None  # different prefixes before a common tail: 'backbone.x.l.w' vs 'model.l.w'


def _rename_lines(renamed: dict[str, str]) -> list[str]:
    """One line per renamed key; renames that make the same edit (a prefix added, 'attn' for 'self_attn', ...)
    share one line, so a checkpoint saved under a different top-level name reads as one finding, not hundreds."""
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for new, old in renamed.items():
        groups.setdefault(_rename_edit(new, old), []).append((new, old))
    lines = []
    for (was, now), pairs in groups.items():
        new, old = pairs[0]
        line = f"key '{new}' in the checkpoint looks renamed from '{old}'"
        if len(pairs) > 1:
            edit = (
                f"'{now}.' in front of the model's names"
                if not was
                else f"the model's leading '{was}.' dropped"
                if not now
                else f"'{was}' -> '{now}'"
            )
            line = f"{len(pairs)} keys in the checkpoint look renamed the same way, {edit} (e.g. {line})"
        lines.append(line)
    return lines


def _rename_edit(new: str, old: str) -> tuple[str, str]:
    """(model part, checkpoint part): the two names without their common leading and trailing components."""
    a, b = old.split("."), new.split(".")
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return ".".join(a[head : len(a) - tail]) or "", ".".join(b[head : len(b) - tail]) or ""


def _describe_match(match: Match, config: Config, notes: list[str]) -> None:
    lines = _rename_lines(match.renamed)
    notes += lines[:SHOWN]
    if len(lines) > SHOWN:
        notes.append(f"and {len(lines) - SHOWN} more renames")
    warning = "" if getattr(config.model, "strict", True) else "warning: "  # strict: false loads what does not match
    if match.missing:
        n = len(match.missing)
        notes.append(
            f"{warning}{n} model {'key is' if n == 1 else 'keys are'} missing from the checkpoint and "
            f"{'keeps its' if n == 1 else 'keep their'} fresh initialisation (seed {config.inputs.seed}): "
            f"{_names(match.missing)}"
        )
    if match.unexpected:
        n = len(match.unexpected)
        notes.append(
            f"{warning}{n} checkpoint {'key' if n == 1 else 'keys'} the model does not have "
            f"{'was' if n == 1 else 'were'} ignored: {_names(match.unexpected)}"
        )
    if match.tied:
        one = len(match.tied) == 1
        notes.append(
            f"{_names(match.tied)} {'is' if one else 'are'} not stored in the checkpoint; "
            f"{'it is' if one else 'they are'} tied to a parameter that is, and loaded through it"
        )


def _check_strict(match: Match, spec: CheckpointModel, path: Path) -> None:
    if not spec.strict or not (match.missing or match.unexpected):
        return
    parts = []
    if match.missing:
        parts.append(f"missing {_names(match.missing)}")
    if match.unexpected:
        parts.append(f"unexpected {_names(match.unexpected)}")
    lines = _rename_lines(match.renamed)
    parts += lines[:SHOWN]
    if len(lines) > SHOWN:
        parts.append(f"and {len(lines) - SHOWN} more renames")
    raise ModelLoadError(
        f"checkpoint {path.name} does not match the model '{spec.factory}' builds: "
        + "; ".join(parts)
        + " (`strict: false` loads it anyway, with a warning)"
    )


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _names(keys: list[str]) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _one_line(exc: BaseException | str) -> str:
    """An exception's message as one short line: colour codes out, the first line, the first sentence of a long one."""
    text = _ANSI.sub("", str(exc)).strip()
    line = next((part.strip() for part in text.splitlines() if part.strip()), type(exc).__name__)
    if len(line) > 160 and ". " in line:
        line = line.split(". ")[0]
    return line
