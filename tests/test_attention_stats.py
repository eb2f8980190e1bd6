"""attention-stats: the scale each attention call applies, measured (SDPA's argument; eager weights reproduced by
softmax(c q.k)); warnings only, never a failure."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from tests.conftest import codes, run_checks

CHECK = "fwdcheck.checks.attention_stats:AttentionStats"


def result(report):
    return report.results[0]


class Attention(nn.Module):
    """One causal attention layer, its scale given: the correct 1/sqrt(hs), or a mistake (None: SDPA's default)."""

    def __init__(self, scale: float | None, eager: bool, prescale: float = 1.0):
        super().__init__()
        self.scale, self.eager, self.prescale = scale, eager, prescale
        self.embed = nn.Embedding(32, 64)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.head = nn.Linear(64, 32)

    def forward(self, input_ids):
        B, T = input_ids.shape
        x = self.embed(input_ids)  # (B, T, C)
        q = (self.q_proj(x) * self.prescale).view(B, T, 4, 16).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, 4, 16).transpose(1, 2)
        v = self.v_proj(x).view(B, T, 4, 16).transpose(1, 2)
        if self.eager:
            scores = (q @ k.transpose(-2, -1)) * self.scale  # (B, nh, T, T)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(scores, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.head(y.transpose(1, 2).reshape(B, T, 64))


@pytest.mark.parametrize("eager", [False, True])
def test_one_over_sqrt_d_passes(eager):
    r = fwdcheck.check_model(Attention(16**-0.5 if eager else None, eager), [CHECK]).results[0]
    assert r.status.value == "pass", r.findings
    assert r.metrics["scale_ratio"] == pytest.approx(1.0, rel=1e-2)
    assert r.data["calls"][0]["measured_by"] == ("weights" if eager else "argument")
    assert r.data["at_initialisation"] is False  # a python factory: statistics reported, not judged
    assert "not judged" in r.summary


@pytest.mark.parametrize("eager", [False, True])
def test_missing_scale_warns(eager):
    report = fwdcheck.check_model(Attention(1.0, eager), [CHECK])
    r = report.results[0]
    assert r.status.value == "warn"
    assert {f.code for f in r.findings} == {"FWD951"}
    assert r.metrics["scale_ratio"] == pytest.approx(4.0, rel=1e-2)  # sqrt(16)
    assert report.exit_code == 0  # warn-only


@pytest.mark.parametrize("eager", [False, True])
def test_doubled_scale_warns(eager):
    r = fwdcheck.check_model(Attention(1 / 16, eager), [CHECK]).results[0]
    assert {f.code for f in r.findings} == {"FWD952"}


def test_q_scaled_before_the_call_is_the_scale():
    """OPT and BART multiply q by 1/sqrt(hs) and call attention with scale 1: correct, not a missing scale."""
    r = fwdcheck.check_model(Attention(1.0, False, prescale=16**-0.5), [CHECK]).results[0]
    assert r.status.value == "pass", r.findings
    assert r.data["calls"][0]["q_scaled_before_call"] == pytest.approx(0.25, rel=1e-3)


def test_other_scale_warns():
    r = fwdcheck.check_model(Attention(2 * 16**-0.5, True), [CHECK]).results[0]
    assert {f.code for f in r.findings} == {"FWD953"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_eager_scale_bug_warns(reference, dtype):
    report = run_checks(reference(attention="eager", bugs=["eager-scale-1-over-d"]), [CHECK], dtype=dtype)
    assert codes(report, "attention-stats") == {"FWD952"}
    assert report.exit_code == 0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_model_passes(reference, attention, dtype):
    r = result(run_checks(reference(attention=attention), [CHECK], dtype=dtype))
    assert r.status.value == "pass", r.findings
    assert r.data["at_initialisation"] is True
    assert len(r.data["calls"]) == 2 and all(0 < c["entropy_share"] <= 1 for c in r.data["calls"])


@pytest.mark.parametrize("name", ["GPT-2", "Llama (GQA)", "Mistral (sliding window 4)", "Qwen2", "Gemma (MQA)", "OPT"])
def test_hf_models_pass(name):
    from tests import compat

    r = result(run_checks(compat.CASES[name][0], [CHECK], code_paths={"enabled": False}))
    assert r.status.value == "pass", r.findings


def test_hf_eager_weights_reproduce_the_scale():
    from tests import compat

    spec = compat.hf("llama", num_key_value_heads=2, attn_implementation="eager", **compat.LLAMA_LIKE)
    r = result(run_checks(spec, [CHECK], code_paths={"enabled": False}))
    assert r.status.value == "pass", r.findings
    assert {c["measured_by"] for c in r.data["calls"]} == {"weights"}


def test_saturated_attention_at_initialisation_warns():
    """q and k initialised far too large: at initialisation most rows read one key (FWD954); the same module handed
    over as a python model may hold trained weights, and is measured, not judged."""
    import dataclasses

    from fwdcheck.config.registry import select
    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.model.sources import load_model
    from fwdcheck.run.runner import run_model
    from fwdcheck.run.settings import Settings

    config = config_from_dict(
        {
            "model": {"source": "reference", "vocab_size": 32, "d_model": 64, "n_heads": 4},
            "inputs": {"batch_size": 2, "seq_len": 16},
        }
    )
    model = load_model(config)
    with torch.no_grad():
        for block in model.module.layers:
            block.attn.q_proj.weight.mul_(30)
            block.attn.k_proj.weight.mul_(30)
    report = run_model(model, Settings.from_config(config), select([CHECK]))
    r = report.results[0]
    assert r.status.value == "warn" and {f.code for f in r.findings} == {"FWD954"}
    assert r.metrics["saturated_share"] > 0.5
    trained = run_model(
        dataclasses.replace(model, weights_at_init=False), Settings.from_config(config), select([CHECK])
    )
    assert trained.results[0].status.value == "pass"


def test_mha_only_model_skips():
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 32)

        def forward(self, input_ids):
            x = self.embed(input_ids)
            mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
            return self.head(self.attn(x, x, x, attn_mask=mask, need_weights=False)[0])

    r = fwdcheck.check_model(Encoder(), [CHECK]).results[0]
    assert r.status.value == "skip"
    assert "inside torch" in r.summary
