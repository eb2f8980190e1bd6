"""Every module's output in one forward, by forward hooks, and the fingerprint of a tensor: what the numeric contract
(--save-golden / --expect-golden, fwdcheck/checks/golden.py) records and `fwdcheck diff` (fwdcheck/run/diff.py)
compares.

Forward hooks do not change what runs (a torch function mode can: torch's TransformerEncoder fast path switches off
under one), so what is recorded is what the model computes untouched. A post-hook fires when a module's output is
complete, so the records come in the order outputs do, each child before its parent. A module called several times
in one forward (a shared layer, decode steps) is recorded per call: `name`, `name#2`, ...

A fingerprint stands for a tensor in a file of a few KB and is compared within a tolerance, never bitwise: another
CPU, thread count or torch patch release reorders float sums and moves every value by a little. Each number of it is
a mean or an extreme of the elements (mean, std, abs-max, a few values at fixed indices, and the digest: means of the
elements under fixed +-1 patterns), so that a change of at most `tol` in every element moves each number by at most
`tol`: one tolerance judges them all, and within-tolerance rounding can never fail a comparison. A real change
anywhere moves the digest: the values at fixed indices alone would miss one elsewhere, and the mean, std and abs-max
miss a permutation (two heads swapped).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from fwdcheck.observe.frames import first_tensor

SAMPLED = 4  # values at fixed indices: the first element, two between, the last
DIGEST_ROWS = 4  # +-1 patterns
DIGEST_PERIOD = 4093  # a prime: no row length of a real layout is a multiple of it, so no row hides behind another
BLOCK = DIGEST_PERIOD * 1024  # elements read at once, as float64: 32 MiB however large the tensor
SIGNIFICANT = 6  # digits kept of each number: far finer than any tolerance, and a file that rounding noise leaves alone
LOGITS = "(logits)"  # the logits as every model gives them ([B, T, V]), after the modules: no module's name


def call_names() -> Callable[[str], str]:
    """A namer for the calls of one forward: a module's first call is its name, the next `name#2`, then `name#3`."""
    calls: dict[str, int] = {}

    def name_of(name: str) -> str:
        calls[name] = calls.get(name, 0) + 1
        return name if calls[name] == 1 else f"{name}#{calls[name]}"

    return name_of


@contextmanager
def module_outputs(model: nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Inside, each call of every submodule (not the root: its output is the logits, which the caller has in the form
    every model gives them) adds (its call's name, a copy of its output) to the list yielded, as the output is
    complete: the first tensor of it (a tuple's first, a Hugging Face output's last_hidden_state). A copy, because
    model code may write into a tensor after returning it (an in-place residual add); calls that return no tensor
    are skipped. The hooks are removed on the way out, also when the forward raises."""
    name_of = call_names()
    outputs: list[tuple[str, torch.Tensor]] = []
    handles = []

    def hook_for(name: str):
        def hook(module, args, output):
            tensor = first_tensor(output)
            if tensor is not None:
                outputs.append((name_of(name), tensor.detach().clone()))

        return hook

    try:
        for name, module in model.named_modules():
            if name:
                handles.append(module.register_forward_hook(hook_for(name)))
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def recorded_forward(model, ids: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One forward of `model` (a ModelUnderTest) on ids [B, T] without gradients: every submodule call's output in
    the order they came (module_outputs), then the logits [B, T, V] as LOGITS. The model's exceptions are ModelRaised,
    as ModelUnderTest.logits raises them."""
    with torch.no_grad(), module_outputs(model.module) as calls:
        logits = model.logits(ids)
    return [*calls, (LOGITS, logits)]


def digest_patterns(device: torch.device) -> torch.Tensor:
    """(DIGEST_ROWS, DIGEST_PERIOD) of +-1, the same on every machine and torch release: bits of a multiplicative
    hash (Knuth's 2654435761) in integer arithmetic, not a random generator's draws."""
    i = torch.arange(DIGEST_PERIOD, dtype=torch.int64, device=device)
    rows = [((i * 2654435761 + 40503 * (row + 1)) % 2**32 >> (13 + row)) & 1 for row in range(DIGEST_ROWS)]
    return (torch.stack(rows) * 2 - 1).double()  # (DIGEST_ROWS, DIGEST_PERIOD)


def sampled_indices(n: int) -> list[int]:
    """The flat indices of the values kept: evenly spread from the first element to the last."""
    return sorted({k * (n - 1) // (SAMPLED - 1) for k in range(SAMPLED)}) if n else []


def rounded(x: float) -> float:
    """x to SIGNIFICANT digits, -0.0 as 0.0."""
    return float(f"{x:.{SIGNIFICANT}g}") + 0.0


def fingerprint(tensor: torch.Tensor) -> dict:
    """shape, dtype, mean, std, abs-max, values at fixed indices and the digest of a tensor, in float64 and rounded
    to SIGNIFICANT digits; `nonfinite` counts NaN and Inf elements, which the statistics leave out (a value kept at
    a NaN or Inf is None). One pass, a block at a time."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    flat = (tensor.to_dense() if tensor.layout != torch.strided else tensor).detach().reshape(-1)
    n = flat.numel()
    patterns = digest_patterns(flat.device)
    count, mean, m2, absmax, nonfinite = 0, 0.0, 0.0, 0.0, 0
    folded = torch.zeros(DIGEST_PERIOD, dtype=torch.float64, device=flat.device)
    for start in range(0, n, BLOCK):
        block = flat[start : start + BLOCK].double()
        finite = block.isfinite()
        kept = int(finite.sum())
        nonfinite += block.numel() - kept
        block = torch.where(finite, block, 0.0)
        if kept:  # Chan et al.'s pairwise update of the mean and the sum of squared deviations
            block_mean = float(block.sum()) / kept
            block_m2 = float(torch.where(finite, block - block_mean, 0.0).square().sum())
            delta = block_mean - mean
            total = count + kept
            mean += delta * kept / total
            m2 += block_m2 + delta * delta * count * kept / total
            count = total
            absmax = max(absmax, float(block.abs().max()))
        padded = torch.nn.functional.pad(block, (0, -block.numel() % DIGEST_PERIOD))
        folded += padded.view(-1, DIGEST_PERIOD).sum(0)  # (DIGEST_PERIOD,): element i adds to slot i mod the period
    digest = (patterns @ folded / max(n, 1)).tolist()  # (DIGEST_ROWS,)
    values = [float(v) for v in flat[sampled_indices(n)].double().tolist()]
    entry = {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "mean": rounded(mean),
        "std": rounded(math.sqrt(m2 / count) if count else 0.0),
        "absmax": rounded(absmax),
        "values": [rounded(v) if math.isfinite(v) else None for v in values],
        "digest": [rounded(d) for d in digest],
    }
    if nonfinite:
        entry["nonfinite"] = nonfinite
    return entry
