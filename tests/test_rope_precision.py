"""rope-precision: rotary angles at long positions in the run's dtype against float64; angles computed in half
precision fail, float32 arithmetic (transformers', the reference model's) passes in every dtype."""

from __future__ import annotations

import pytest

from tests.conftest import codes, run_checks

CHECK = "fwdcheck.checks.rope_precision:RopePrecision"
LONG = 131072  # the reference model's max_seq_len: positions only (no table of that size for rope)


def result(report):
    return report.results[0]


def hf_spec(model_type: str, **fields) -> dict:
    from tests import compat

    spec = compat.hf(model_type, **{**compat.LLAMA_LIKE, **fields})
    spec["config"]["max_position_embeddings"] = LONG
    return spec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_model_passes_in_every_dtype(reference, dtype):
    r = result(run_checks(reference(max_seq_len=LONG), [CHECK], dtype=dtype))
    assert r.status.value == "pass", r.findings
    assert [row["position"] for row in r.data["positions"]] == [1024, 8192, 32768, LONG - 1]
    assert r.data["reference_dtype"] == "float64"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_angles_in_model_dtype_fail_in_half_precision(reference, dtype):
    report = run_checks(reference(max_seq_len=LONG, bugs=["rope-angles-in-model-dtype"]), [CHECK], dtype=dtype)
    r = result(report)
    assert r.status.value == "fail"
    assert codes(report, "rope-precision") == {"FWD901", "FWD902"}
    first = next(f for f in r.findings if f.code == "FWD901")
    if dtype == "bfloat16":  # bfloat16 holds no integer above 256 exactly: off at the shortest long position
        assert "at position 1024" in first.message
    assert report.exit_code == 1


def test_angles_in_model_dtype_are_harmless_in_float32(reference):
    """In a float32 run the mistake computes what correct code computes: no false alarm, errors reported."""
    r = result(run_checks(reference(max_seq_len=LONG, bugs=["rope-angles-in-model-dtype"]), [CHECK]))
    assert r.status.value == "pass"
    assert 0 < r.metrics["max_angle_error"] < r.data["positions"][-1]["angle_bar"]


def test_positions_are_capped_at_the_model_maximum(reference):
    r = result(run_checks(reference(max_seq_len=4096), [CHECK]))
    assert [row["position"] for row in r.data["positions"]] == [1024, 4095]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_hf_rotary_passes(model_type, dtype):
    """transformers computes position_ids.float() * inv_freq.float() with autocast off: no finding in any dtype."""
    r = result(
        run_checks(hf_spec(model_type, num_key_value_heads=2), [CHECK], code_paths={"enabled": False}, dtype=dtype)
    )
    assert r.status.value == "pass", r.findings
    if dtype != "float32":  # the run cast inv_freq with the model: listed, not judged
        assert any("inv_freq" in b for b in r.data["buffers"])


def test_no_rotary_skips(reference):
    r = result(run_checks(reference(positional="learned"), [CHECK]))
    assert r.status.value == "skip"
    assert "no rotary embedding" in r.summary


def test_rotary_found_by_convention_that_cannot_be_called_alone_skips():
    from tests import compat

    r = result(run_checks(compat.CASES["GPT-J (interleaved rotary)"][0], [CHECK], code_paths={"enabled": False}))
    assert r.status.value == "skip"
    assert "cannot be called alone" in r.summary
