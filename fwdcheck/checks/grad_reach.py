"""grad-reach: on the path that trains, every parameter that requires grad gets a gradient from the logits, and a
finite one.

A parameter that gets no gradient never trains, and nothing in a loss curve says so: a layer built in __init__ and
never called in forward, a branch whose output is .detach()ed or computed under torch.no_grad(), a discrete choice
(top-k, argmax) as the only path to it. One whose gradient is NaN or Inf cannot train either (an overflow in the
backward, a sqrt or log at 0).

What runs: one forward of the session's inputs in train() mode with every dropout forced to zero and gradients
enabled (the path that trains), then one backward of a random projection of every position's logits, asking
torch.autograd.grad for the gradient of every parameter that requires grad. A random direction over the vocabulary
reaches every parameter a real loss reaches, except for directions of measure zero. The modules holding parameters
directly are watched by forward pre-hooks, to tell a parameter whose module never ran from one whose module ran but
passed no gradient back.

This is a training step's full cost (the weights' gradients are most of a backward), which is why it is its own
check and not part of grad-causality: that one asks for the gradient at the input embeddings alone.

The model is left as found: mode, buffers a train-mode forward writes, hooks, and every parameter's .grad (never
written: gradients are asked for, not accumulated) are put back by ModelState.
"""

from __future__ import annotations

import torch

from fwdcheck.checks.grad_reach_spec import SPEC
from fwdcheck.checks.gradients import logits_with_graph
from fwdcheck.checks.wording import listed
from fwdcheck.errors import ModelRaised, SkipCheck, first_line
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.model_state import ModelState
from fwdcheck.run.session import Session
from fwdcheck.run.train_path import train_path


def finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite. A finite sum has no NaN or Inf among its terms (either makes it NaN or Inf),
    and a sum is the cheapest pass over a tensor (a max |value| costs several): only a sum that is not finite, which
    finite values could give by overflowing, is looked at value by value."""
    tensor = tensor.detach()
    return bool(tensor.sum(dtype=torch.float32).isfinite()) or bool(tensor.isfinite().all())


class GradReach(Check, declared=SPEC):
    name = "grad-reach"

    def key_number(self, result: CheckResult) -> str:
        m = result.metrics
        if "parameters" not in m:
            return ""
        return f"{m['parameters'] - m['parameters_without_gradient']} / {m['parameters']}"

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        params = [(name, p) for name, p in model.module.named_parameters() if p.requires_grad]
        if not params:
            raise SkipCheck("no parameter requires grad: nothing of this model trains")
        # The eval path first (the session's shared logits): a model whose forward raises there too is the model's
        # error, as every check reports it, not a train path it cannot run
        session.reference()
        ids = session.inputs  # (B, T)
        generator = torch.Generator().manual_seed(session.settings.inputs.seed)
        called: set[str] = set()
        state = ModelState.take(model.module)
        try:
            with train_path(model.module):
                handles = [
                    module.register_forward_pre_hook(lambda *_, name=name: called.add(name))
                    for name, module in model.module.named_modules()
                    if next(module.parameters(recurse=False), None) is not None  # to tell a layer never called
                ]
                try:
                    logits = logits_with_graph(model, session, ids, handles)  # (B, T, V)
                except ModelRaised as exc:  # as the train cell and grad-causality: no verdict on a path it cannot run
                    raise SkipCheck(f"the model cannot run in train mode (dropout off): {exc}") from None
                if not logits.requires_grad:
                    raise SkipCheck("the logits carry no gradient: the forward is detached or run under no_grad")
                direction = torch.randn(logits.shape[-1], generator=generator).to(logits.device)  # (V,)
                loss = (logits.float() * direction).sum()
                try:
                    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
                except RuntimeError as exc:  # no backward for some operation (a kernel without one)
                    raise SkipCheck(f"the backward cannot run: {first_line(exc)}") from None
        finally:
            written = state.restore()
            if written:
                session.notes.append(f"grad-reach: the train-mode forward wrote {listed(written)} in place; put back")
        metrics: dict = {}
        findings = self._judge(params, grads, called, metrics)
        bad = [f for f in findings if f.status != Status.PASS]
        summary = bad[0].message if bad else f"all {len(params)} parameters that require grad get a finite gradient"
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics)

    @staticmethod
    def _judge(params, grads, called: set[str], metrics: dict) -> list[Finding]:
        """Those that get none are told apart by whether the module holding them ran: never called (a layer built
        and forgotten, a branch for inputs this run did not give), or ran and passed no gradient back (a .detach(),
        torch.no_grad(), a discrete choice)."""
        none = [name for (name, _), g in zip(params, grads, strict=True) if g is None]
        nonfinite = [name for (name, _), g in zip(params, grads, strict=True) if g is not None and not finite(g)]
        metrics["parameters"] = len(params)
        metrics["parameters_without_gradient"] = len(none)
        findings = []
        if none:
            never = [n for n in none if n.rpartition(".")[0] not in called]
            ran = [n for n in none if n not in never]
            said = []
            if never:
                said.append(f"in modules never called in forward: {listed(never)}")
            if ran:
                said.append(
                    f"in modules that ran but passed no gradient back (a .detach(), no_grad, a discrete choice): "
                    f"{listed(ran)}"
                )
            metrics["parameters_never_called"] = len(never)
            findings.append(
                Finding(
                    "FWD124",
                    Status.WARN,
                    f"{len(none)} of {len(params)} parameters that require grad get no gradient from the logits, "
                    + "; ".join(said),
                    where=none[0],
                )
            )
        if nonfinite:
            findings.append(
                Finding("FWD125", Status.FAIL, f"NaN or Inf in the gradient of {listed(nonfinite)}", where=nonfinite[0])
            )
        return findings
