"""Every per-dtype tolerance fwdcheck judges by, in one table: a row per dtype, a column per kind of comparison.

The columns differ because they compare different things, each with its own rounding:
  logits             the logits of two forwards of one model: (rtol, atol) as torch.testing.assert_close uses them,
                     rtol scaled by the largest |logit|; a change must also exceed the noise floor the session measures.
  rotation           rotated vectors and their dot products, relative to their own scale (rope, rope-precision): a
                     rotation is exact up to rounding, but its sin and cos, and every product with them, are rounded in
                     the dtype, and no noise floor is measured beside them.
  attention_weights  how far a weight may be from softmax(c . q . k) and still be reproduced by c (attention-stats):
                     the model rounded q . k to the dtype before its softmax, and the weights after it.
  backends           one model under two attention implementations or SDPA kernels: (rtol, atol) of Hugging Face's
                     own eager-vs-SDPA test (test_eager_matches_sdpa_inference), never below the session's threshold.

The config's `tolerance:` replaces only the logits column.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Tolerances(NamedTuple):
    logits: tuple[float, float]  # (rtol, atol)
    rotation: float  # relative
    attention_weights: float  # absolute, on weights in [0, 1]
    backends: tuple[float, float]  # (rtol, atol)


TOLERANCES = {
    torch.float32: Tolerances(logits=(1.3e-6, 1e-5), rotation=1e-4, attention_weights=1e-4, backends=(1e-4, 1e-6)),
    torch.bfloat16: Tolerances(logits=(1.6e-2, 1e-5), rotation=3e-2, attention_weights=2e-2, backends=(1e-2, 1e-2)),
    torch.float16: Tolerances(logits=(1e-3, 1e-5), rotation=5e-3, attention_weights=5e-3, backends=(5e-3, 5e-3)),
}
