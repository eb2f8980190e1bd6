"""The matrix of code paths a model offers, for the checks whose bugs hide on paths a default run never takes.

Leaks that reached users lived on an eager fallback used only when attention weights are requested, a mask dropped
when nothing is padded, a kernel chosen for batch size 1, a fast path in eval. So future-token and mask-audit run once
per cell of: attention implementation x output_attentions x attention_mask (absent / all ones / left padding) x batch
size, each cell a view of the same model whose forward applies that path, and each cell is reported.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from fwdcheck.config import Paths
from fwdcheck.model import ModelUnderTest, extract_logits

PATH_CHECKS = ("future-token", "mask-audit")
LEFT_PADDING = 3  # pad tokens put before every row in the left-pad cells


@dataclass(frozen=True)
class CodePath:
    attn_implementation: str | None  # None: whatever the model uses
    output_attentions: bool | None  # None: not passed
    attention_mask: str  # absent | ones | left-pad
    batch_size: int

    @property
    def label(self) -> str:
        parts = [self.attn_implementation or "default attention", f"mask {self.attention_mask}"]
        if self.output_attentions is not None:
            parts.append(f"output_attentions={self.output_attentions}")
        parts.append(f"B={self.batch_size}")
        return ", ".join(parts)


def path_cells(model: ModelUnderTest, paths: Paths, batch_size: int) -> list[CodePath]:
    """Every cell of the matrix; empty when the matrix is off (the default for models not from Hugging Face)."""
    enabled = paths.enabled if paths.enabled is not None else model.source == "hf"
    if not enabled:
        return []
    implementations = paths.attn_implementation or model.attn_implementations or [None]
    implementations = [i for i in implementations if not model.attn_implementations or i in model.attn_implementations]
    attentions = paths.output_attentions or ([False, True] if model.accepts("output_attentions") else [None])
    masks = paths.attention_mask
    if masks is None:
        masks = ["absent"]
        if model.accepts("attention_mask"):
            masks.append("ones")
            if model.accepts("position_ids"):  # left padding is only fair when positions can skip the pads
                masks.append("left-pad")
    batches = paths.batch_size or sorted({1, max(batch_size, 2)})
    return [CodePath(*cell) for cell in itertools.product(implementations, attentions, masks, batches)]


def path_view(model: ModelUnderTest, path: CodePath) -> ModelUnderTest:
    """The same module, with a forward that takes this path. Its logits are those of the real tokens only."""
    padding = LEFT_PADDING if path.attention_mask == "left-pad" else 0
    pad_id = getattr(getattr(model.module, "config", None), "pad_token_id", None) or 0

    def forward(module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        B, T = input_ids.shape
        kwargs = {}
        if path.output_attentions is not None:
            kwargs["output_attentions"] = path.output_attentions
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if path.attention_mask == "ones":
            kwargs["attention_mask"] = torch.ones_like(input_ids)
        elif padding:
            pads = torch.full((B, padding), pad_id, dtype=input_ids.dtype, device=input_ids.device)
            input_ids = torch.cat([pads, input_ids], dim=1)  # (B, P + T)
            mask = torch.cat([torch.zeros_like(pads), torch.ones(B, T, dtype=pads.dtype, device=pads.device)], 1)
            kwargs["attention_mask"] = mask
            if position_ids is None:  # as generate() does: real tokens count from 0, pads sit at 1
                position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            else:
                position_ids = torch.cat([torch.ones_like(pads), position_ids], dim=1)
            kwargs["position_ids"] = position_ids
        output = model.forward_adapter(module, input_ids, **kwargs) if model.forward_adapter else \
            module(input_ids, **kwargs)
        return extract_logits(output)[:, padding:]  # (B, T, V): the real tokens

    takes = {"position_ids"} if model.accepts("position_ids") else set()
    return dataclasses.replace(model, forward_adapter=forward, padding=padding, forward_kwargs=takes,
                               label=f"{model.label} [{path.label}]")


def plain_view(model: ModelUnderTest, path: CodePath) -> ModelUnderTest:
    """The same cell without padding: what the left-padded real tokens must reproduce."""
    return path_view(model, dataclasses.replace(path, attention_mask="absent"))
