"""Whether the train path computes what the eval path computes, and where the two part.

A model trains in train() mode with gradients recorded and is checked, served and evaluated in eval() mode without
them. With every dropout forced to zero the two must give the same logits: a branch taken only in training
(`if self.training:` dropping a mask, a train-only scaling, another kernel under `torch.is_grad_enabled()`) computes
something the eval checks never saw. future-token judges the train cell of the code-path matrix this way (FWD108),
grad-causality its own train-mode forward (FWD126); both hold the change to future-token's bar (the dtype's tolerance
scaled to the logits, or noise_factor x the run-to-run noise floor when that is larger), and both name the first
module, in the order modules complete, whose output differs between one eval and one train forward of the same row.

A norm that uses the batch's statistics in train mode (nn.BatchNorm with running statistics) differs by design, as
does a model that updates its own state as it trains, where that state is all that parts the paths (spectral norm's
power iteration moves its vectors, and the weight it divides by, at every train-mode forward; eval reads them as they
stand, and computes the train path's logits from the state one train-mode forward leaves): a warning that says so,
not a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.nn as nn

from fwdcheck.checks.leak_entry import first_apart, kept_outputs
from fwdcheck.errors import ModelRaised
from fwdcheck.model.tested import ModelUnderTest, extract_logits
from fwdcheck.result import Finding, Status
from fwdcheck.run.model_state import KeptBuffers
from fwdcheck.run.session import Session, position_change
from fwdcheck.run.train_path import eval_path, train_path


def train_apart(
    code: str,
    model: ModelUnderTest,
    session: Session,
    change: torch.Tensor,
    scale: float,
    locate: Callable[[], str | None],
    metrics: dict,
    updated: Collection[str] = (),
) -> list[Finding]:
    """The finding `code` when the train path's logits differ from the eval path's by more than the threshold.
    `change`: per row and position, the largest |change| between the two [B, T]; `scale`: the eval logits' largest
    |value|; `locate()`: the first module where they part (run only when they do); `updated`: the buffers (dotted
    names) the train-mode forwards wrote. metrics gets the largest change."""
    largest = float(change.max())
    metrics["train_eval_change"] = largest
    threshold = session.threshold(scale, *session.floors(largest, scale))
    if largest <= threshold:
        return []
    module = locate()
    found = dict(model.module.named_modules()).get(module or "")
    batch_statistics = isinstance(found, nn.modules.batchnorm._NormBase) and found.track_running_stats
    own_state = not batch_statistics and bool(updated) and _state_explains(model, session, scale, threshold)
    moved = int((~(change <= threshold)).sum())  # NaN counts
    message = (
        f"train-mode logits (dropout off, gradients on) differ from the eval-mode logits by {largest:.3g} "
        f"(threshold {threshold:.3g}) at {moved} of {change.numel()} positions: the train path computes "
        "something the eval checks never saw"
    )
    if module is not None:
        message += f"; first seen at the output of {module}"
    if batch_statistics:  # normalised by the batch's statistics in training: by design, though samples mix
        message += " (a norm that uses the batch's statistics in train mode, by design)"
    elif own_state:  # computed from state the forward updates as it trains: by design, eval reads it as it stands
        names = sorted(updated)
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        message += (
            f" (state the train-mode forward updates as it runs, {shown}: eval computes the train path's logits "
            "from the state one train-mode forward leaves, as spectral norm's power iteration does; by design)"
        )
    by_design = batch_statistics or own_state
    return [Finding(code, Status.WARN if by_design else Status.FAIL, message, where=module, module=module)]


def _state_explains(model: ModelUnderTest, session: Session, scale: float, threshold: float) -> bool:
    """Whether the state a train-mode forward updates is all that parts the paths: one train-mode forward of the
    session's inputs, then an eval one from the state it left, agree within the threshold. The state is put back
    after both."""
    ids = session.inputs
    kept = KeptBuffers(model.module)
    try:
        with train_path(model.module, gradients=False):
            trained = extract_logits(model.forward(ids)).float()  # (B, T, V)
        with eval_path(model.module):
            evaluated = extract_logits(model.forward(ids)).float()  # (B, T, V)
    except ModelRaised:
        return False
    finally:
        kept.put_back()
    session.forward_tokens += 2 * ids.numel()
    return float(position_change(trained, evaluated).max()) <= threshold


def first_module_apart(
    model: ModelUnderTest, evaluate: Callable[[], object], train: Callable[[], object]
) -> str | None:
    """The first module whose output differs between `evaluate()` and `train()`, two forwards of the same row, one on
    each path; None when none does (or they went through other modules)."""
    return first_apart(kept_outputs(model, evaluate), kept_outputs(model, train))
