"""The shape ledger on transformers' architectures whose tensors the config's sizes do not describe: multi-head
latent attention (head_dim is the rotated part only), heads per layer, n-gram streams, value heads of their own size.
A size fwdcheck read off a library's config and the tensor contradicts is a number in the ledger, never a failure;
a layout whose batch or sequence axis is out of place still fails."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.conftest import run_checks  # noqa: E402
from tests.test_hf_rope_declared import MLA, tiny  # noqa: E402


def ledger(spec: dict):
    return run_checks(spec, ["shape-ledger"]).result("shape-ledger")


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("deepseek_v3", MLA),
        ("deepseek_v32", {}),
        ("minicpm3", {}),
        ("glm4_moe_lite", {}),
        ("glm_moe_dsa", {}),
        ("kimi_linear", {}),
        ("laguna", {}),
        ("prophetnet", {}),
        ("inkling_text", {}),
    ],
)
def test_sizes_the_config_does_not_describe_are_numbers_not_failures(model_type, fields):
    result = ledger(tiny(model_type, **fields))
    assert result.status.value == "pass", result.findings
    # or every size is the config's: value heads of their own width are named d_v (v_head_dim), as in kimi_linear
    assert any("sizes other than the config's" in note for note in result.data["notes"]) or (
        model_type == "kimi_linear" and "d_v" in result.data["dims"]
    ), (result.data["notes"], result.data["dims"])


@pytest.mark.slow
def test_a_missing_transpose_in_a_transformers_model_still_fails(monkeypatch):
    """Llama's eager attention handed q, k, v as [B, T, h, d_h]: attention over the heads of one position."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.eager_attention_forward

    def untransposed(module, query, key, value, attention_mask, **kwargs):
        out, weights = original(
            module, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, **kwargs
        )
        return out.transpose(1, 2), weights

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", untransposed)
    spec = tiny("llama", attn_implementation="eager")
    result = ledger(spec)
    assert "FWD402" in {f.code for f in result.findings if f.status.value == "fail"}, result.findings


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_attention_over_blocks_at_every_position_is_no_swapped_layout(model_type):
    """Inkling 2's block attention residuals: one learned query per position attends over the outputs of earlier
    blocks ([B,T,1,d] against [B,T,blocks,d]); the sequence is a batch axis there by design."""
    result = ledger(tiny(model_type))
    assert result.status.value == "pass", result.findings
    assert any("of learned queries" in note for note in result.data["notes"]), result.data["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["hy_v4", "deepseek_v4"])
def test_parallel_residual_streams_are_a_layout(model_type):
    """Hyper-connections keep several residual streams of the model's width: each block returns [B,T,streams,d]."""
    result = ledger(tiny(model_type))
    assert result.status.value == "pass", result.findings
    assert any(row["role"] == "hidden" and len(row["dims"]) == 4 and row["ok"] for row in result.data["entries"])
