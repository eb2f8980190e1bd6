"""The same checks on CUDA, in bfloat16 with tolerances following the dtype. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_checks, statuses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_reference_passes_on_cuda(dtype):
    report = run_checks(
        {"source": "reference", "vocab_size": 64, "d_model": 32, "n_heads": 4},
        device="cuda",
        dtype=dtype,
        inputs={"batch_size": 2, "seq_len": 16},
    )
    assert set(statuses(report).values()) == {"pass"}
    assert report.environment["device"].startswith("cuda")


@pytest.mark.parametrize(
    "bug, check",
    [
        ("no-causal-mask", "future-token"),
        ("inverted-bool-mask", "mask-audit"),
        ("rope-k-unrotated", "rope"),
        ("batch-mix", "future-token"),
    ],
)
def test_planted_bugs_fail_on_cuda(bug, check):
    report = run_checks(
        {"source": "reference", "vocab_size": 64, "d_model": 32, "n_heads": 4, "bugs": [bug]},
        device="cuda",
        dtype="bfloat16",
        inputs={"batch_size": 2, "seq_len": 16},
    )
    assert statuses(report)[check] == "fail"


REFERENCE = {"source": "reference", "vocab_size": 64, "d_model": 32, "n_heads": 4}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_backends_compare_every_cuda_kernel_in_bfloat16(attention):
    """On CUDA the flash, efficient and cuDNN kernels run beside math: each must give math's output, and eager and
    SDPA the same logits, in bfloat16 within Hugging Face's bar."""
    result = run_checks(
        {**REFERENCE, "attention": attention},
        ["backends"],
        device="cuda",
        dtype="bfloat16",
        inputs={"batch_size": 2, "seq_len": 16},
    ).result("backends")
    assert result.status.value == "pass", result.summary
    ran = [kernel for kernel, calls in result.data["kernels_ran"].items() if calls]
    assert "math" in ran and len(ran) >= 2  # at least one fused kernel beside math on a GPU


def test_backends_catch_the_eager_scale_bug_on_cuda():
    report = run_checks(
        {**REFERENCE, "bugs": ["eager-scale-1-over-d"]},
        ["backends"],
        device="cuda",
        dtype="bfloat16",
        inputs={"batch_size": 2, "seq_len": 16},
    )
    assert "FWD801" in {f.code for f in report.result("backends").findings}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rope_precision_on_cuda(dtype):
    """Correct angles pass in half precision on CUDA; angles computed in the model's dtype fail there."""
    clean = run_checks({**REFERENCE, "max_seq_len": 4096}, ["rope-precision"], device="cuda", dtype=dtype)
    assert clean.result("rope-precision").status.value == "pass", clean.result("rope-precision").summary
    buggy = run_checks(
        {**REFERENCE, "max_seq_len": 4096, "bugs": ["rope-angles-in-model-dtype"]},
        ["rope-precision"],
        device="cuda",
        dtype=dtype,
    )
    assert "FWD901" in {f.code for f in buggy.result("rope-precision").findings}
