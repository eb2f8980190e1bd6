"""What a Hugging Face config declares about RoPE, read as the model reads it, and the rotation measured where the
head holds it: transformers' own architectures built tiny must pass, planted bugs must still fail.

A config never states the pairing (which dims rotate together is the modeling code's business), so it is measured and
reported, not compared; a user's `rope:` still is. A config's rope settings declare nothing on a model that builds no
rotary embedding, nor in keys its class never reads. Multi-head latent attention rotates the last slice of each head.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fwdcheck.checks.rotation import analyze  # noqa: E402
from fwdcheck.config.schema import config_from_dict  # noqa: E402
from fwdcheck.model.sources import load_model  # noqa: E402
from fwdcheck.model.sources.shrink import shrink_hf_dict  # noqa: E402
from tests.conftest import run_checks  # noqa: E402

# Multi-head latent attention at small sizes: q and k heads of [16 unrotated | 8 rotated] dims, v heads of 16.
MLA = dict(qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8, kv_lora_rank=16, q_lora_rank=24)


def tiny(model_type: str, **fields) -> dict:
    """transformers' default config of this architecture, shrunk as `fwdcheck shrink` shrinks it, then `fields`."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type).to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
        config.pop(key, None)
    shrink_hf_dict(config, 8)
    config.update(fields, model_type=model_type)
    return {"source": "hf", "config": config}


def rope_result(spec: dict):
    return run_checks(spec, ["rope"]).result("rope")


def failed(result) -> set[str]:
    return {f.code for f in result.findings if f.status.value == "fail"}


def loaded(spec: dict):
    return load_model(config_from_dict({"model": spec}))


# =====================================================================================================================
# The measurement itself


def test_a_rotation_in_the_last_slice_of_a_head_is_measured_there():
    """[16 still | 8 rotated in half pairing, base 10000]: the slice, its pairing and base, not a 24-wide
    non-rotation."""
    positions, still, rotary = 32, 16, 8
    x = torch.randn(still + rotary, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)  # (r/2,)
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * theta  # (P, r/2)
    a, b = x[still : still + rotary // 2], x[still + rotary // 2 :]
    X = x.expand(positions, -1).clone()  # (P, D)
    X[:, still : still + rotary // 2] = a * angle.cos() - b * angle.sin()
    X[:, still + rotary // 2 :] = b * angle.cos() + a * angle.sin()
    rotation = analyze(X, tol=1e-6)
    assert (rotation.pairing, rotation.rotary_start, rotation.rotary_dim) == ("half", still, rotary)
    assert rotation.base == pytest.approx(10000.0, rel=0.02)


# =====================================================================================================================
# Correct architectures: no false FWD305 / FWD307


INTERLEAVED = ["cohere", "cohere2", "glm", "glm4", "helium", "ernie4_5", "llama4_text", "gptj", "codegen"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", INTERLEAVED)
def test_architectures_rotating_neighbouring_dims_pass_with_the_pairing_measured(model_type):
    result = rope_result(tiny(model_type))
    assert result.status.value == "pass", result.findings
    assert result.metrics["pairing"] == "interleaved"
    assert result.data["declared"]["pairing"] is None  # the config states none: measured, not compared
    assert "pairing not stated" in result.data["declared_from"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, fields",
    [("deepseek_v3", MLA), ("minicpm3", {}), ("glm4_moe_lite", {}), ("deepseek_v32", {})],
)
def test_latent_attention_heads_are_measured_over_their_rotated_slice(model_type, fields):
    result = rope_result(tiny(model_type, **fields))
    assert result.status.value == "pass", result.findings
    probe = result.data["probe"]
    assert probe["q"]["rotary_start"] > 0 and probe["q"]["rotary_start"] + probe["q"]["rotary_dim"] == probe["head_dim"]
    assert result.metrics["rotary_dim"] == probe["q"]["rotary_dim"]
    assert "of the head" in result.summary


@pytest.mark.slow
def test_a_rotary_dim_the_model_never_reads_is_no_declaration():
    """MiniMax M3's config carries rotary_dim; its rotary embedding reads head_dim and partial_rotary_factor."""
    spec = tiny("minimax_m3_vl_text")
    assert loaded(spec).rope.rotary_dim is None
    result = rope_result(spec)
    assert result.status.value == "pass", result.findings
    assert result.metrics["base"] == pytest.approx(spec["config"]["rope_parameters"]["rope_theta"], rel=0.02)

    # Declared by the user, the same rotary dim is compared, and the base is still measured over the pairs that turn.
    spec["rope"] = {"rotary_dim": spec["config"]["rotary_dim"], "base": 5e6}
    declared = rope_result(spec)
    assert failed(declared) == {"FWD305"}
    message = declared.findings[0].message
    assert "rotary dim 16 (declared 8)" in message and "base" not in message.split(";")[0].split(", ")[-1]
    assert "declared by the config's `rope:`" in message


GRANITE_HYBRID = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, layer_types=["mamba", "attention"])


@pytest.mark.slow
def test_rope_switched_off_by_the_config_is_not_declared():
    off = tiny("granitemoehybrid", position_embedding_type=None, **GRANITE_HYBRID)
    model = loaded(off)
    assert model.rope is None and model.origins["rope"].startswith("none declared")
    result = rope_result(off)
    assert result.status.value == "skip" and "no rotary embedding" in result.summary

    on = tiny("granitemoehybrid", position_embedding_type="rope", **GRANITE_HYBRID)
    assert loaded(on).rope is not None
    assert rope_result(on).status.value == "pass"

    zamba = tiny("zamba2", use_mem_rope=False)
    assert loaded(zamba).rope is None
    assert loaded(tiny("zamba2", use_mem_rope=True)).rope is not None


# =====================================================================================================================
# Planted bugs: still caught


@pytest.mark.slow
def test_a_declared_pairing_the_model_does_not_use_fails():
    """The user says half; Cohere rotates neighbouring dims."""
    spec = tiny("cohere")
    spec["rope"] = {"pairing": "half", "base": spec["config"]["rope_parameters"]["rope_theta"]}
    result = rope_result(spec)
    assert failed(result) == {"FWD305"}
    assert "pairing interleaved (declared half)" in result.findings[0].message


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, family, fields",
    [("deepseek_v3", "deepseek_v3", MLA), ("cohere", "cohere", {}), ("minimax_m3_vl_text", "minimax_m3_vl", {})],
)
def test_rope_on_q_only_still_fails(rope_on_q_only, model_type, family, fields):
    rope_on_q_only(family)
    result = rope_result(tiny(model_type, **fields))
    assert "FWD301" in failed(result), result.findings


def test_the_config_states_no_pairing_and_says_where_each_value_came_from():
    import transformers

    from fwdcheck.model.sources.hf import declared_rope

    config = transformers.AutoConfig.for_model(
        "phi",
        hidden_size=32,
        num_attention_heads=4,
        rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.5},
    )
    rope, origin = declared_rope(config, "config.json")
    assert (rope.base, rope.pairing, rope.rotary_dim) == (500.0, None, 4)
    assert "base 500 from rope_theta" in origin
    assert "rotary dim 4 from head size 8 x rope_parameters.partial_rotary_factor 0.5" in origin
    # Keys the model's class does not read declare nothing.
    unread, origin = declared_rope(config, "config.json", read={"head_dim"})
    assert unread is None and "no rope settings" in origin


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, table",
    [("bert", "bert.embeddings.position_embeddings"), ("roberta", "roberta.embeddings.position_embeddings")],
)
def test_the_table_named_is_the_one_indexed_by_position(model_type, table):
    """BERT and RoBERTa add token-type and position tables: the one whose indices vary over a row of one repeated
    token is the position table; token types (all 0) read nothing that moves."""
    result = rope_result(tiny(model_type))
    assert result.status.value == "skip", result.summary
    assert f"learned table ('{table}' reads the positions)" in result.summary, result.summary
