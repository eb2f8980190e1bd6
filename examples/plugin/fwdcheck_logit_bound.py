"""fwdcheck-logit-bound: a third-party fwdcheck check, registered through the entry-point group `fwdcheck.checks`.

At initialisation a language model's logits should be finite, of order one, and still depend on the token: the loss
on random targets then starts near ln V. Three classic initialisation bugs break that without any error:

- tied input/output embeddings with `nn.Embedding`'s default N(0, 1) init (instead of std ~0.02): logits of order
  sqrt(d), an initial loss far above ln V, and the first steps spent undoing it;
- a missing final norm, or an output projection initialised with std 1: the same;
- NaN or Inf already in the forward pass (a division by a zero-initialised scale, log of 0, an overflow in float16).

The opposite, logits that do not vary over the vocabulary at all, is usually a zero-initialised read-out; some recipes
do that on purpose, so it is a warning, not a failure.
"""

from __future__ import annotations

import math
import os

import torch

from fwdcheck.errors import SkipCheck
from fwdcheck.result import Check, CheckResult, Finding, Status

__version__ = "0.1.0"


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


class LogitBound(Check):
    """Subclass and set `bound` / `min_std` to change the limits for a project, then name the subclass in a config's
    `checks:` as `mypkg.checks:MyLogitBound`; or set FWDCHECK_LOGIT_BOUND / FWDCHECK_LOGIT_MIN_STD."""

    name = "logit-bound"
    description = "logits at initialisation are finite, of bounded magnitude and not collapsed to a constant"
    codes = {
        "LOGIT101": "logits hold NaN or Inf",
        "LOGIT102": "max |logit| exceeds the bound: the initial loss sits far above ln V",
        "LOGIT103": "logits do not vary over the vocabulary (std ~0): a collapsed read-out",
    }
    explain = """\
Runs the session's shared baseline forward (no extra forward pass) and reads its logits [B, T, V]:
  LOGIT101  every logit must be finite.
  LOGIT102  max |logit| must stay below the bound (default 30). At initialisation logits of order one give an initial
            loss near ln V; logits in the tens put it tens of nats higher and the first steps are spent undoing it.
  LOGIT103  the standard deviation over the vocabulary must not be ~0 at every position (warning).
The summary also gives the loss on random targets next to ln V, the number to compare with your first training step.
Why: these bugs run without an error and only show up as a bad first loss or an early divergence.
How to fix: LOGIT102 -> initialise nn.Embedding with std ~0.02 when it is tied to the output layer (nn.Embedding's
default is N(0, 1)), put the final norm back before the output projection, initialise the output projection with std
~1/sqrt(d). LOGIT101 -> run the model in float32 and find the first module with non-finite output (fwdcheck run
--debug shows where the forward raised). LOGIT103 -> look for a norm weight initialised to zero or a collapsed final
norm (a read-out matrix initialised to zero is no longer one: fwdcheck gives it small random values for the run).
Limits: meant for freshly initialised models (reference, python factories, hf without weights): a checkpoint is
skipped; trained models may have large logits. Change the limits with FWDCHECK_LOGIT_BOUND, FWDCHECK_LOGIT_MIN_STD or
a subclass."""
    needs_values = True

    bound: float = 30.0
    min_std: float = 1e-4

    def run(self, model, session) -> CheckResult:
        bound = _env_float("FWDCHECK_LOGIT_BOUND", self.bound)
        min_std = _env_float("FWDCHECK_LOGIT_MIN_STD", self.min_std)
        notes = model.extra.get("notes", []) if isinstance(model.extra, dict) else []
        if model.source == "checkpoint" or any(str(n).startswith("weights loaded") for n in notes):
            raise SkipCheck("trained weights were loaded: the bound is about logits at initialisation")

        logits = session.baseline()  # [B, T, V] float32, computed once and shared with the other checks
        B, T, V = logits.shape
        finite = logits.isfinite()
        if not bool(finite.all()):
            bad = (~finite.all(-1)).nonzero().tolist()
            shown = ", ".join(f"row {b} pos {t}" for b, t in bad[:4]) + (
                f" and {len(bad) - 4} more" if len(bad) > 4 else ""
            )
            message = (
                f"logits hold NaN or Inf at {len(bad)} of {B * T} positions "
                f"({int((logits != logits).sum())} NaN, {int(logits.isinf().sum())} Inf)"
            )
            return CheckResult.from_findings(
                self.name,
                [Finding("LOGIT101", Status.FAIL, message, shown)],
                summary=message,
                metrics={"nonfinite_positions": len(bad)},
            )

        magnitude = logits.abs()
        max_abs = float(magnitude.max())
        flat = int(magnitude.argmax())
        b, t, v = flat // (T * V), (flat // V) % T, flat % V
        std = logits.std(-1, unbiased=False) if V > 1 else logits.new_zeros(B, T)  # over the vocabulary
        mean_std = float(std.mean())
        # Own generator: drawing from session.random_ids would shift every later check's inputs.
        generator = torch.Generator().manual_seed(session.settings.inputs.seed)
        targets = torch.randint(0, V, (B, T), generator=generator).to(logits.device)
        loss = float((logits.logsumexp(-1) - logits.gather(-1, targets[..., None])[..., 0]).mean())
        ln_v = math.log(V)

        findings = []
        if max_abs > bound:
            findings.append(
                Finding(
                    "LOGIT102",
                    Status.FAIL,
                    f"max |logit| {max_abs:.3g} exceeds the bound {bound:g} (std over the vocabulary {mean_std:.3g}); "
                    f"loss on random targets {loss:.3g} vs ln V {ln_v:.3g}: tied embeddings left at nn.Embedding's "
                    "N(0, 1) init, a missing final norm, or an output projection initialised with std 1?",
                    f"row {b} pos {t} token {v}",
                )
            )
        if float(std.max()) < min_std:
            findings.append(
                Finding(
                    "LOGIT103",
                    Status.WARN,
                    f"logits do not vary over the vocabulary (std {float(std.max()):.3g} < {min_std:g} at every "
                    "position): a collapsed final norm or a norm weight initialised to zero",
                    "every position",
                )
            )
        if findings:
            summary = findings[0].message.split(":")[0]
        else:
            summary = (
                f"max |logit| {max_abs:.3g} (bound {bound:g}), std {mean_std:.3g}; loss on random targets "
                f"{loss:.3g} vs ln V {ln_v:.3g}"
            )
        return CheckResult.from_findings(
            self.name,
            findings,
            summary,
            metrics={
                "max_abs_logit": max_abs,
                "bound": bound,
                "mean_std": mean_std,
                "random_target_loss": loss,
                "ln_vocab": ln_v,
            },
        )
