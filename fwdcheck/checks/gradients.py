"""What the gradient checks share: one forward whose logits keep their autograd graph, counted among the session's
forwards. grad-causality backpropagates from it to the input embeddings, grad-reach to every parameter.
"""

from __future__ import annotations

import torch

from fwdcheck.errors import ModelRaised
from fwdcheck.model.tested import ModelUnderTest, extract_logits
from fwdcheck.run.session import Session


def logits_with_graph(model: ModelUnderTest, session: Session, ids: torch.Tensor, handles: list) -> torch.Tensor:
    """The logits [B, T, V] of one forward of ids [B, T] with their autograd graph, counted among the session's
    forwards; the hooks behind `handles` removed however the forward ends."""
    try:
        logits = extract_logits(model.forward(ids), keep_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    session.forward_tokens += ids.numel()
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        raise ModelRaised(f"forward returned logits {list(logits.shape)} for input_ids {list(ids.shape)}")
    return logits
