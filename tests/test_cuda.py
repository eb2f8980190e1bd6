"""The same checks on CUDA, in bfloat16 with tolerances following the dtype. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_checks, statuses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_reference_passes_on_cuda(dtype):
    report = run_checks({"source": "reference", "vocab_size": 64, "d_model": 32, "n_heads": 4}, device="cuda",
                        dtype=dtype, inputs={"batch_size": 2, "seq_len": 16})
    assert set(statuses(report).values()) == {"pass"}
    assert report.environment["device"].startswith("cuda")


@pytest.mark.parametrize("bug, check", [("no-causal-mask", "future-token"), ("inverted-bool-mask", "mask-audit"),
                                        ("rope-k-unrotated", "rope"), ("batch-mix", "future-token")])
def test_planted_bugs_fail_on_cuda(bug, check):
    report = run_checks({"source": "reference", "vocab_size": 64, "d_model": 32, "n_heads": 4, "bugs": [bug]},
                        device="cuda", dtype="bfloat16", inputs={"batch_size": 2, "seq_len": 16})
    assert statuses(report)[check] == "fail"
