"""The Python API: check any nn.Module from code, a test or a notebook.

report = fwdcheck.check_model(model, vocab_size=32000)
report.raise_for_failures()
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from pydantic import ValidationError

from fwdcheck.config.schema import (
    AttentionSpec,
    CodePaths,
    Inputs,
    RunConfig,
    describe_validation_error,
    pattern_agrees,
)
from fwdcheck.errors import UsageError
from fwdcheck.model.sources import from_module
from fwdcheck.report import Report
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.plan import resolve
from fwdcheck.run.runner import Run


def check_model(
    model: nn.Module,
    checks: list[str] | None = None,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
    min_seq_len: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    causal: bool | None = None,
    attention: dict[str, Any] | None = None,
    rope: dict[str, Any] | None = None,
    dims: dict[str, int] | None = None,
    forward: Any = None,
    window: int | list[int | None] | None = None,
    chunk: int | list[int | None] | None = None,
    scale: float | None = None,
    exhaustive: bool = False,
    options: dict[str, dict[str, Any]] | None = None,
    code_paths: dict[str, Any] | None = None,
    fail_on: str = "fail",
    paths: dict[str, Any] | None = None,
) -> Report:
    """Run fwdcheck's checks (the default ones when `checks` is None) on an nn.Module whose forward takes
    input_ids [B, T] (by keyword where it takes no positional argument) and returns logits [B, T, V] (a tensor,
    .logits, a mapping's "logits", or a tuple led by them).

    The model is left as found: mode, device, dtype, parameters, dropout probabilities, hooks and RNG state.
    device None means the device the model's parameters are on; dtype None, the dtype they are in (as the model
    was handed over). `forward` is an optional adapter (model, input_ids, **extras) -> logits
    for other call conventions, which every check calls (docs/configuration.md: the adapter contract). `dims`
    declares sizes fwdcheck cannot read off a config object ({"h": 12, "h_kv": 4});
    `min_seq_len` the shortest sequence forward accepts. `window` declares the sliding attention window (keys a
    query may read, itself included; a list: one per layer, None for full attention), `chunk` the chunk size of
    chunked attention (a query reads its own chunk's keys up to itself; a list: one per layer, None where a layer
    is not chunked) and `scale` the factor attention applies to q . k when it is not 1/sqrt(d_h). `attention`
    declares the attention pattern by design ({"pattern": "bidirectional"}, {"pattern": "prefix",
    "prefix_length": 4}; `causal=False` is the former spelling of the first); without it, a transformers model's own
    attributes say, else the model is taken as causal. Hugging Face models get the code-path matrix by default, as
    from the command line; `code_paths` narrows it ({"enabled": False} turns it off; `paths` is its former name,
    still taken). `options` are the checks' own, as a config's `options:` section ({"future-token": {"exhaustive":
    True}}, which `exhaustive=True` still sets). The arguments are validated as
    a config file's keys are: a wrong one is a UsageError naming it.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"check_model needs a torch.nn.Module, not {type(model).__name__}")
    if device is None:
        first = next(model.parameters(), None)
        device = str(first.device) if first is not None else "cpu"
    try:
        inputs = Inputs(batch_size=batch_size, seq_len=seq_len, min_seq_len=min_seq_len, seed=seed)
        config = RunConfig(
            inputs=inputs,
            device=device,
            options=options or {},
            code_paths=CodePaths(**(code_paths or paths or {})),
            **({"exhaustive": True} if exhaustive else {}),  # the former key: each check's thorough variant
            **({"dtype": dtype} if dtype is not None else {}),  # none named: the model's own (Settings.in_own_dtype)
        )
        pattern = AttentionSpec(**attention) if attention is not None else None
        pattern_agrees(causal, pattern)
    except ValidationError as exc:
        raise UsageError(f"check_model: {describe_validation_error(exc)}") from None
    except ValueError as exc:
        raise UsageError(f"check_model: {exc}") from None
    run = Run.build(resolve(config, Overrides(checks=checks, fail_on=fail_on)))
    try:
        under_test = from_module(
            model,
            vocab_size=vocab_size,
            max_positions=max_positions,
            causal=causal,
            attention=pattern,
            rope=rope,
            dims=dims,
            forward=forward,
            window=window,
            chunk=chunk,
            scale=scale,
        )
    except ValidationError as exc:  # a declaration (window, chunk, dims, ...) refused as a config file's would be
        raise UsageError(f"check_model: {describe_validation_error(exc)}") from None
    return run.check(under_test)
