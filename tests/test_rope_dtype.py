"""A model handed over in bfloat16 or float16 with no `dtype:`: it runs in its own dtype (as torchinfo and
transformers run it), not cast to float32; and run in float32 on purpose, rope blames the tables rounded in bfloat16,
not the rotation. Both ways: a correct Llama-style model passes, the same model rotating q only still fails.

Shapes: B (batch), T (sequence), nh (heads), hs (head size).
"""

from __future__ import annotations

import pytest
import torch

import fwdcheck
from tests import models
from tests.conftest import run_checks


class QOnlyAttention(models.LlamaAttention):
    """Bug: the rotation is applied to q and not to k."""

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, _ = models.apply_rotary_pos_emb(q, k, cos, sin, self.cfg.rope_pairing)
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)  # (B, nh, T, hs)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


def llama_in(dtype: str = "bfloat16", bug: str = "none") -> torch.nn.Module:
    """tests.models.llama made in `dtype` (`GPT(...).to(torch.bfloat16)`, rotary tables included), with q alone
    rotated when `bug` is "q-only"."""
    model = models.llama()
    if bug == "q-only":
        for layer in model.layers:
            correct = layer.self_attn
            layer.self_attn = QOnlyAttention(correct.cfg)
            layer.self_attn.load_state_dict(correct.state_dict())
    return model.to(getattr(torch, dtype))


def rope(made_in: str, bug: str = "none", **top):
    """rope on the model made in `made_in`; `top` the config's other keys (dtype: among them)."""
    kwargs = {"dtype": made_in, "bug": bug}
    model = {"source": "python", "factory": "tests.test_rope_dtype:llama_in", "kwargs": kwargs}
    report = run_checks(model, ["rope"], **top)
    return report, report.result("rope")


def failing(result) -> set[str]:
    return {f.code for f in result.findings if f.status.value == "fail"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_with_no_dtype_runs_in_its_own(dtype):
    report, result = rope(dtype)
    assert result.status.value == "pass", (result.summary, [f.message for f in result.findings])
    assert report.environment["dtype"] == dtype
    assert f"no dtype in the config: run in the model's own {dtype}" in " ".join(report.notes)
    assert not any("cast to" in note for note in report.notes)
    assert "rounded_tables" not in result.data  # the tables are in the run's dtype: nothing to blame


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_rotation_bug_in_half_precision_still_fails(dtype):
    _, result = rope(dtype, "q-only")
    assert "FWD301" in failing(result), result.summary


def test_cast_to_float32_on_purpose_the_bfloat16_tables_are_blamed_not_the_rotation():
    """dtype: float32 named: the model is cast, its cos/sin tables keep their bfloat16 rounding. Judged at float32's
    tolerance that rounding was FWD306 "not a rotation" (pair norms drifting 2.6e-3, q . k 5.2e-3 off n - m) and
    FWD304 (the logits 3.1e-4 off under a shift); the tables are now named and the rotation judged by their
    precision."""
    report, result = rope("bfloat16", dtype="float32")
    assert result.status.value == "pass", (result.summary, [f.message for f in result.findings])
    assert report.environment["dtype"] == "float32"
    assert result.data["rounded_tables"] == {
        "buffers": ["rotary_emb.cos_cached", "rotary_emb.sin_cached"],
        "dtype": "bfloat16",
    }
    said = next(note for note in report.notes if note.startswith("rope: buffers"))
    assert "hold values rounded in bfloat16 in a float32 run" in said and "the tables'" in said
    assert result.metrics["logits_shift_change"] > 1e-4  # what the rounding moves: beyond float32's own tolerance


def test_cast_to_float32_on_purpose_a_rotation_bug_still_fails():
    _, result = rope("bfloat16", "q-only", dtype="float32")
    assert "FWD301" in failing(result), result.summary


def test_a_float32_model_has_no_rounded_tables():
    _, result = rope("float32")
    assert result.status.value == "pass" and "rounded_tables" not in result.data


def test_the_python_api_keeps_the_model_s_dtype_and_leaves_it_as_found():
    model = llama_in("bfloat16")
    before = {name: p.clone() for name, p in model.state_dict().items()}
    report = fwdcheck.check_model(model, ["rope", "future-token"])
    assert report.environment["dtype"] == "bfloat16" and report.ok, [r.summary for r in report.results]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
