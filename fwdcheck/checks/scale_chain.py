"""attention-stats' chain from the projections to the softmax: the factor q and k were multiplied by between the
linear layers that computed them and the attention call, so that the effective scale of q . k is measured whole
(q_proj(x) * scaling handed to an SDPA that scales again is 1/d_h, OPT's shipped bug), not the kernel's argument alone.

How a factor is found, without knowing the model's layout: the observed forward keeps the output of every linear
layer (nn.Linear, transformers' Conv1D) of the first row. Each head's q at the call, at each token, is then a
vector of d_h numbers; a projection's output splits into chunks of d_h numbers per token. q is the projection's
chunk times a factor c, rotated by its position (RoPE keeps a vector's norm), exactly when the ratio of their norms
is c at every token. So each head of q is matched to the chunk whose norm ratio is the same at every token (a fused
qkv projection, split or interleaved per head as GPT-NeoX's, finds its q chunks the same way); the factor is that
ratio, and it must be one number for all heads. Anything else between the projection and the call (a q/k norm, a
bias added to q, a per-head temperature) makes the ratio vary: the factor is then not measured, and said so - a
finding needs it measured.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

MIN_TOKENS = 3  # tokens whose ratio must agree: fewer is no evidence
# The relative spread over tokens (and over heads) a constant ratio may show: the rounding of the dtype the model
# ran in, across a rotation and a multiplication.
SPREAD = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def is_projection(module: nn.Module) -> bool:
    """A linear layer: torch's, or transformers' GPT-2-style Conv1D (a weight of [in, out], no convolution)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def keep_projections(module: nn.Module, vocab_size: int) -> tuple[dict[str, torch.Tensor], list]:
    """Forward hooks that keep each linear layer's output (the output head, as wide as the vocabulary, excepted):
    the table they fill and the handles that remove them."""
    outputs: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_hook(partial(_keep, outputs, name))
        for name, m in module.named_modules()
        if is_projection(m) and _width(m) != vocab_size
    ]
    return outputs, handles


def _width(module: nn.Module) -> int | None:
    return getattr(module, "out_features", None) or getattr(module, "nf", None)


def _keep(outputs: dict, name: str, module, args, output) -> None:
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        outputs[name] = output.detach()


def factor(x: torch.Tensor, projections: dict[str, torch.Tensor], scope: str) -> tuple[float | None, str]:
    """The one factor x (a call's q or k, (.., T, d_h), of one batch row) is its projection's output times, and
    where it was found; (None, why) when no linear layer in `scope` gives it up to that factor."""
    d_h, T = x.shape[-1], x.shape[-2]
    tolerance = SPREAD.get(x.dtype, 3e-2)
    at_call = x.detach().double().reshape(-1, T, d_h).norm(dim=-1)  # (heads, T)
    candidates = {  # the outputs of one batch row, [1, T, N] or [T, N], N in chunks of d_h
        name: y
        for name, y in projections.items()
        if name.startswith(scope)
        and y.dim() >= 2
        and y.shape[-2] == T
        and y.shape[-1] % d_h == 0
        and y.numel() == T * y.shape[-1]
    }
    if not candidates:
        return None, f"no linear layer in {scope or 'the model'} has an output of {T} tokens in chunks of {d_h}"
    if T < MIN_TOKENS:
        return None, f"{T} tokens are too few to tell a constant factor"
    norms = {name: y.double().reshape(T, -1, d_h).norm(dim=-1).T for name, y in candidates.items()}  # (chunks, T)
    found = _matching_chunks(at_call, norms, tolerance)
    if found is None:
        return None, (
            "a head of it is no constant multiple of any linear layer's output (a norm, a bias or a per-token "
            "factor between the projection and the call)"
        )
    factors, where = found
    if float((factors.max() - factors.min()) / factors.mean()) > tolerance:
        return (
            None,
            f"its heads are multiplied by different factors ({float(factors.min()):.4g} to {float(factors.max()):.4g})",
        )
    return float(factors.mean()), where


def _matching_chunks(
    heads: torch.Tensor, norms: dict[str, torch.Tensor], tolerance: float
) -> tuple[torch.Tensor, str] | None:
    """Each head's factor (heads,) and the projection its chunks came from: for every head (heads: (heads, T) norms at
    the call), the d_h chunk whose norm (norms: per linear layer, (chunks, T)) the head's is a constant multiple of at
    every token; None when some head has none. A token where both are zero (a padding token's zero embedding,
    projected without bias) says nothing; one where only one of them is zero rules the chunk out."""
    best_spread = torch.full((heads.shape[0],), torch.inf, dtype=torch.float64)  # (heads,)
    best_factor = torch.zeros_like(best_spread)
    best_name = [""] * heads.shape[0]
    for name, chunks in norms.items():
        h, c = heads[:, None, :], chunks[None, :, :]  # (heads, 1, T), (1, chunks, T)
        live = (c > 0) & (h > 0)  # (heads, chunks, T)
        consistent = (live | ((c == 0) & (h == 0))).all(-1) & (live.sum(-1) >= MIN_TOKENS)  # (heads, chunks)
        ratio = h / c.where(c > 0, torch.ones_like(c))  # (heads, chunks, T)
        top = ratio.where(live, torch.full_like(ratio, -torch.inf)).amax(-1)
        bottom = ratio.where(live, torch.full_like(ratio, torch.inf)).amin(-1)
        mean = ratio.where(live, torch.zeros_like(ratio)).sum(-1) / live.sum(-1).clamp_min(1)  # (heads, chunks)
        spread = ((top - bottom) / mean).where(consistent, torch.full_like(mean, torch.inf))  # (heads, chunks)
        spread_here, chunk = spread.min(-1)  # (heads,)
        better = spread_here < best_spread
        best_spread = torch.where(better, spread_here, best_spread)
        best_factor = torch.where(better, mean.gather(-1, chunk[:, None])[:, 0], best_factor)
        best_name = [name if b else n for b, n in zip(better.tolist(), best_name, strict=True)]
    if not bool((best_spread <= tolerance).all()):
        return None
    return best_factor, best_name[0]
