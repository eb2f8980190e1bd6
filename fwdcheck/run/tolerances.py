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
  golden             a module's output or a parameter against the fingerprint a golden file holds
  (fwdcheck/checks/golden.py),
                     and two implementations of one model module by module (fwdcheck diff): (rtol, atol), rtol scaled
                     by the tensor's own largest |value|. A golden file must survive another CPU, thread count or
                     torch patch release, each of which reorders float sums. Measured on an 8-layer reference model
                     (d=128, B=4, T=64), this CPU's AVX-512 kernels against its baseline ones (ATEN_CPU_CAPABILITY=
                     default, MKL and oneDNN held to SSE4): every output within 6e-7 of its abs-max in float32, 1.6e-2
                     in bfloat16 (two units in the last place), 2e-3 in float16; thread counts changed no bit at that
                     size. So float32 allows 1e-4 (about 160 times what was measured; a thousand float32 eps), and
                     bfloat16 and float16 about ten units in the last place: what deeper models accumulate, far below
                     what a dropped scale or a swapped head moves (a change of order one). A golden file keeps the
                     tolerance it was made with.

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
    golden: tuple[float, float]  # (rtol, atol)


TOLERANCES = {
    torch.float32: Tolerances(
        logits=(1.3e-6, 1e-5), rotation=1e-4, attention_weights=1e-4, backends=(1e-4, 1e-6), golden=(1e-4, 1e-6)
    ),
    torch.bfloat16: Tolerances(
        logits=(1.6e-2, 1e-5), rotation=3e-2, attention_weights=2e-2, backends=(1e-2, 1e-2), golden=(8e-2, 1e-3)
    ),
    torch.float16: Tolerances(
        logits=(1e-3, 1e-5), rotation=5e-3, attention_weights=5e-3, backends=(5e-3, 5e-3), golden=(1e-2, 1e-4)
    ),
}
