"""What the grad-reach check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/grad_reach.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    default=False,  # a training step's backward through every parameter: named when wanted
    applies_when=(
        "runs asked for it (checks: [default, grad-reach]): a backward through every parameter costs about 3 "
        "forwards, more than the default run's whole budget (grad-causality's backward to the embeddings is in it)"
    ),
    order=57,  # beside grad-causality, before plugins
    description="train path: every parameter that requires grad gets a finite gradient from the logits",
    codes={
        "FWD124": "parameters that require grad get no gradient from the logits",
        "FWD125": "a parameter's gradient is NaN or Inf",
    },
    explain="""\
Verifies that training reaches every weight: the model in train() mode with every dropout forced to zero and
gradients enabled, one backward of a random projection of all the logits, and the gradient of every parameter that
requires grad asked for (torch.autograd.grad: no .grad is written). Each must get one, and a finite one.
Why: a parameter that gets no gradient never trains, and no loss curve says so: a layer built but never called, a
branch detached or run under torch.no_grad(), a discrete choice as the only path to it. A NaN or Inf gradient
breaks the first optimiser step.
How to fix: FWD124 -> the names listed: a module registered but not called in forward (the finding says which
never ran), a .detach() or a torch.no_grad() on a branch, a discrete choice (top-k, argmax) as the only path to
them; a parameter meant to stay fixed is declared with requires_grad_(False) or as a buffer. FWD125 -> overflow in
the backward (low precision, an unscaled exp), a sqrt or log at 0.
Limits: gradients are those of the logits (a loss on them); a model's own auxiliary losses are not part of it
(DeepSeek's sparse-attention indexer, trained by a loss of its own, gets none from the logits), and parts the run's
inputs do not use get none: an expert no token of the batch was routed to, an encoder-decoder's cross-attention or
a multimodal model's vision tower on token ids alone (warnings, true for that batch; the finding says which modules
never ran). A model whose logits carry no gradient, or with no parameter that requires grad, skips, saying why.
Cost: one forward with gradients and one full backward, a training step (about 3.6 forward passes at T=128).""",
)
