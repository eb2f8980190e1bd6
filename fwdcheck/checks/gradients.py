"""What the gradient checks share: one forward whose logits keep their autograd graph, counted among the session's
forwards. grad-causality backpropagates from it to the input embeddings, grad-reach to every parameter. A model
that cannot record gradients on this device (a kernel without a backward there) makes both skip, saying why, as the
train path's cell runs on without them (fwdcheck/run/train_path.py: gradients_or_not).
"""

from __future__ import annotations

import torch

from fwdcheck.errors import ModelRaised, SkipCheck
from fwdcheck.model.tested import ModelUnderTest, extract_logits
from fwdcheck.run.session import Session
from fwdcheck.run.train_path import gradients_or_not


def logits_with_graph(model: ModelUnderTest, session: Session, ids: torch.Tensor, handles: list) -> torch.Tensor:
    """The logits [B, T, V] of one forward of ids [B, T] with their autograd graph, counted among the session's
    forwards; the hooks behind `handles` removed however the forward ends."""
    try:
        output, refused = gradients_or_not(lambda: model.forward(ids))
        if refused is not None:
            raise SkipCheck(
                f"the model cannot record gradients here ({refused}; without them it runs): the environment's "
                "limit, not a bug of the model's; run on a device where its kernels have a backward"
            )
        logits = extract_logits(output, keep_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    session.forward_tokens += ids.numel()
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        raise ModelRaised(f"forward returned logits {list(logits.shape)} for input_ids {list(ids.shape)}")
    return logits
