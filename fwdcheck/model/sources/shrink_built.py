"""`fwdcheck shrink`'s shrunk Hugging Face config, built on the meta device: refused when transformers cannot build it,
and counted, beside the original, so that the command says how far it shrank and names what it could not cut.

Nothing heavy at import time: torch and transformers are imported by the functions that need them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fwdcheck.errors import UsageError

# A shrunk model past this still keeps a part the rules do not know how to cut (a speech encoder spelling its sizes
# its own way, RWKV's blocks): `fwdcheck shrink` exits 4 naming that part. The family sweeps leave such a model out.
MAX_SHRUNK_PARAMETERS = 120_000_000
STILL_TOO_BIG = 4  # `fwdcheck shrink`'s exit code when the model is still past it


@dataclass(frozen=True)
class Counted:
    """A model's parameters before and after shrinking (None where the original does not build), and after, the
    largest of its top-level parts: what to lower by hand when the shrunk model is still big."""

    before: int | None
    after: int
    largest: tuple[str, int] | None = None

    @property
    def too_big(self) -> bool:
        return self.after > MAX_SHRUNK_PARAMETERS


def verify_hf(config: dict, model_class: str | None) -> tuple[int, tuple[str, int] | None]:
    """Refuse to write a shrunk config transformers cannot build: read it back and build it on the meta device.
    Returns its parameter count and its largest top-level part (name, parameters)."""
    from fwdcheck.model.sources.hf import require_transformers

    transformers = require_transformers()
    rest = dict(config)
    model_type = rest.pop("model_type")
    try:
        module = _built_on_meta(transformers.AutoConfig.for_model, model_type, rest, model_class)
    except Exception as exc:
        raise UsageError(
            f"transformers {transformers.__version__} cannot build the shrunk {model_type} config "
            f"({type(exc).__name__}: {exc}); nothing written — lower the original's sizes by hand "
            "instead"
        ) from None
    return _parameters(module), _largest_part(module)


def count_hf(hf_config: Any, model_class: str | None) -> int | None:
    """The original model's parameters, built on the meta device as `fwdcheck run` would build it; None where its
    config does not build."""
    try:
        return _parameters(_built_on_meta(lambda *_: hf_config, hf_config.model_type, {}, model_class))
    except Exception:  # the original need not build: its shrunk copy is what must
        return None


def _built_on_meta(make_config, model_type: str, rest: dict, model_class: str | None):
    """The class `fwdcheck run` builds for the config (hf.py's _model_class), built on the meta device, offline."""
    import torch  # on use: shrinking a reference or factory config needs none

    from fwdcheck.model.sources.hf import import_model_class, offline, require_transformers
    from fwdcheck.model.sources.seq2seq import seq2seq_class

    transformers = require_transformers()
    with offline():
        hf_config = make_config(model_type, **rest)
        name = model_class or seq2seq_class(hf_config) or "AutoModelForCausalLM"
        cls = getattr(transformers, name)
        import_model_class(cls, hf_config)  # before the meta device: import-time tensors are real ones
        with torch.device("meta"):
            return cls.from_config(hf_config) if hasattr(cls, "from_config") else cls(hf_config)


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _largest_part(module) -> tuple[str, int] | None:
    """The module's largest part, followed down through wrappers that hold one part almost all the parameters
    (model -> model.vision_tower): the dotted name of the first part holding under 90% of its parent's."""
    name, total = "", _parameters(module)
    while True:
        children = [(n, c, _parameters(c)) for n, c in module.named_children()]
        if not children or total == 0:
            return (name, total) if name else None
        child_name, child, count = max(children, key=lambda item: item[2])
        name, module = f"{name}.{child_name}" if name else child_name, child
        if count < 0.9 * total:
            return name, count
        total = count
