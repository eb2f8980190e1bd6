"""The Python API: check any nn.Module from code, a test or a notebook.

    report = fwdcheck.check_model(model, vocab_size=32000)
    report.raise_for_failures()
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fwdcheck.config import Dims, FactoryModel, HFModel, Paths, RopeSpec
from fwdcheck.errors import UsageError
from fwdcheck.model import ModelUnderTest
from fwdcheck.registry import select
from fwdcheck.report import Report
from fwdcheck.runner import run_model
from fwdcheck.session import Settings
from fwdcheck.sources.factory import FactoryParts, model_from_module
from fwdcheck.sources.hf import hf_model_under_test


def check_model(
    model: nn.Module,
    checks: list[str] | None = None,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
    min_seq_len: int | None = None,
    device: str | None = None,
    dtype: str = "float32",
    seed: int = 0,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    causal: bool = True,
    rope: dict[str, Any] | None = None,
    dims: dict[str, int] | None = None,
    forward: Any = None,
    exhaustive: bool = False,
    paths: dict[str, Any] | None = None,
    fail_on: str = "fail",
) -> Report:
    """Run fwdcheck's checks (all registered ones when `checks` is None) on an nn.Module whose forward takes
    input_ids [B, T] and returns logits [B, T, V] (a tensor, .logits, or a tuple led by them).

    The model is left as found: mode, device, dtype, parameters, dropout probabilities, hooks and RNG state.
    device None means the device the model's parameters are on. `forward` is an optional adapter
    (model, input_ids, **kw) -> logits for unusual call conventions. `dims` declares sizes fwdcheck cannot read off
    a config object ({"h": 12, "h_kv": 4}); `min_seq_len` the shortest sequence forward accepts. Hugging Face models get the code-path matrix
    by default, as from the command line; `paths` narrows it ({"enabled": False} turns it off).
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"check_model needs a torch.nn.Module, not {type(model).__name__}")
    under_test = _wrap(model, vocab_size, max_positions, causal, rope, dims, forward)
    if device is None:
        first = next(model.parameters(), None)
        device = str(first.device) if first is not None else "cpu"
    settings = Settings(device=device, dtype=dtype, batch_size=batch_size, seq_len=seq_len, min_seq_len=min_seq_len,
                        seed=seed,
                        exhaustive=exhaustive, paths=Paths(**(paths or {})))
    return run_model(under_test, settings, select(checks), fail_on=fail_on)


def _wrap(model, vocab_size, max_positions, causal, rope, dims, forward) -> ModelUnderTest:
    """A ModelUnderTest for a module handed over directly; Hugging Face modules keep their richer description."""
    if hasattr(model, "config") and hasattr(model.config, "model_type") and forward is None:
        spec = HFModel(source="hf", config={"model_type": model.config.model_type}, causal=causal,
                       rope=RopeSpec(**rope) if rope else None)
        return hf_model_under_test(model, spec, notes=[])
    spec = FactoryModel(factory="api:check_model", vocab_size=vocab_size, max_positions=max_positions, causal=causal,
                        rope=RopeSpec(**rope) if rope else None, dims=Dims(**dims) if dims else None)
    parts = FactoryParts(factory=lambda: model, forward=forward, rotary=None)
    return model_from_module(model, spec, parts, source="python", label=type(model).__name__)
