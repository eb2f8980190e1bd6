"""The bar two ways of computing the same values must meet: Hugging Face's own eager-vs-SDPA test bar for the dtype
(float32 atol 1e-6, rtol 1e-4; float16 5e-3; bfloat16 1e-2; fwdcheck/run/tolerances.py), never below the session's
threshold (its tolerance and noise floor). backends holds two attention implementations to it, compile the compiled
model against the eager one.
"""

from __future__ import annotations

from fwdcheck.run.tolerances import TOLERANCES


def tolerance(session, scale: float, noise: float = 0.0, rounding: float = 0.0) -> float:
    """The bar for values of magnitude `scale`: Hugging Face's eager-vs-SDPA bar, never below the session's."""
    rtol, atol = TOLERANCES[session.dtype].backends
    return max(atol + rtol * scale, session.threshold(scale, noise, rounding))
