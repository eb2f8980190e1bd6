"""When a tolerance would excuse any change, and is therefore refused.

A tolerance says how far two results may part and still count as equal; set high enough it turns every check that
compares into one that cannot fail (a leaking model passes with exit 0). Such a tolerance is refused when the config,
or a golden file, is read, with the rule it broke in one line. The rule, for every kind of tolerance fwdcheck reads:

  - finite: infinity excuses any change by definition (NaN is refused by every bound already).
  - rtol below 1: rtol is relative to the largest |value| (the logits' for a config, the tensor's for a golden file);
    at 1, replacing every value by zero, which erases the output, is within tolerance.
  - atol below 1: a logit is a log-odds, and a change of 1 multiplies a token's odds by e. No rounding moves a logit
    that far (the per-dtype defaults are 1e-5), and a randomly initialised model's logits are near 0.1, so at 1 any
    change to such a model is within tolerance.
  - noise_factor at most 1000: a change must exceed this many noise floors. Three orders of magnitude above the
    run-to-run noise is no longer noise; beyond it the noise floor, not the model, decides the verdict.
"""

from __future__ import annotations

import math

RTOL_BELOW = 1.0
ATOL_BELOW = 1.0
NOISE_FACTOR_AT_MOST = 1000.0


def _finite(value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number: {value:g} excuses any change")


def bounded_rtol(value: float | None) -> float | None:
    """rtol as given, or ValueError naming the rule it breaks (the module's docstring)."""
    if value is not None:
        _finite(value)
        if value >= RTOL_BELOW:
            raise ValueError(
                f"must be below {RTOL_BELOW:g}: it is relative to the largest |value|, so at {value:g} "
                "replacing every value by zero counts as no change"
            )
    return value


def bounded_atol(value: float | None) -> float | None:
    """atol as given, or ValueError naming the rule it breaks (the module's docstring)."""
    if value is not None:
        _finite(value)
        if value >= ATOL_BELOW:
            raise ValueError(
                f"must be below {ATOL_BELOW:g}: a logit change of 1 multiplies a token's odds by e, and a "
                f"random model's logits are near 0.1, so {value:g} excuses any change"
            )
    return value


def bounded_noise_factor(value: float) -> float:
    """noise_factor as given, or ValueError naming the rule it breaks (the module's docstring)."""
    _finite(value)
    if value > NOISE_FACTOR_AT_MOST:
        raise ValueError(
            f"must be at most {NOISE_FACTOR_AT_MOST:g}: a change that many times the run-to-run noise "
            "is not noise, and beyond it the noise floor decides every verdict"
        )
    return value
