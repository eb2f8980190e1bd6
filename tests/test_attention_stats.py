"""attention-stats: the effective scale of q . k, measured from the projections' outputs to the softmax (SDPA's
argument or eager weights reproduced by softmax(c q.k), times the factor q and k were multiplied by after their
projections): applied twice or not at all fails, another than declared fails, the statistics only warn."""

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
def test_missing_scale_fails(eager):
    report = fwdcheck.check_model(Attention(1.0, eager), [CHECK])
    r = report.results[0]
    assert r.status.value == "fail"
    assert {f.code for f in r.findings} == {"FWD956"}
    assert r.metrics["scale_ratio"] == pytest.approx(4.0, rel=1e-2)  # sqrt(16)
    assert "no scale applied at all" in r.findings[0].message
    assert report.exit_code == 1


@pytest.mark.parametrize("eager", [False, True])
def test_doubled_scale_fails(eager):
    r = fwdcheck.check_model(Attention(1 / 16, eager), [CHECK]).results[0]
    assert {f.code for f in r.findings} == {"FWD955"}
    assert r.status.value == "fail"


@pytest.mark.parametrize("eager", [False, True])
def test_q_scaled_before_a_call_that_scales_again_fails(eager):
    """OPT's shipped bug: q_proj(x) * scaling handed to SDPA's default scale (or an eager 1/sqrt(hs)): the kernel's
    own scale is right, and the scores are q . k / hs."""
    r = fwdcheck.check_model(Attention(16**-0.5 if eager else None, eager, prescale=16**-0.5), [CHECK]).results[0]
    assert {f.code for f in r.findings} == {"FWD955"}
    call = r.data["calls"][0]
    assert call["q_factor"] == pytest.approx(0.25, rel=1e-3) and call["k_factor"] == pytest.approx(1.0, rel=1e-3)
    assert call["effective_scale"] == pytest.approx(1 / 16, rel=1e-3)
    assert "q multiplied by 0.25 after its projection" in r.findings[0].message


def test_q_scaled_before_the_call_is_the_scale():
    """OPT and BART multiply q by 1/sqrt(hs) and call attention with scale 1: correct, not a missing scale."""
    r = fwdcheck.check_model(Attention(1.0, False, prescale=16**-0.5), [CHECK]).results[0]
    assert r.status.value == "pass", r.findings
    assert r.data["calls"][0]["q_factor"] == pytest.approx(0.25, rel=1e-3)
    assert r.metrics["scale_ratio"] == pytest.approx(1.0, rel=1e-3)


def test_other_scale_warns():
    r = fwdcheck.check_model(Attention(2 * 16**-0.5, True), [CHECK]).results[0]
    assert {f.code for f in r.findings} == {"FWD953"}
    assert r.status.value == "warn"


def test_a_declared_scale_is_the_one_judged():
    """A model declaring its scale (muP's 1/d_h, T5's 1) passes with it; one declaring another fails (FWD957)."""
    for eager in (False, True):
        r = fwdcheck.check_model(Attention(1 / 16, eager), [CHECK], scale=1 / 16).results[0]
        assert r.status.value == "pass", r.findings
        r = fwdcheck.check_model(Attention(1.0, eager), [CHECK], scale=1.0).results[0]
        assert r.status.value == "pass", r.findings
        r = fwdcheck.check_model(Attention(2 * 16**-0.5, eager), [CHECK], scale=16**-0.5).results[0]
        assert {f.code for f in r.findings} == {"FWD957"}, r.findings
        r = fwdcheck.check_model(Attention(1 / 16, eager), [CHECK], scale=0.3).results[0]
        assert {f.code for f in r.findings} == {"FWD957"}, r.findings


def test_an_architecture_that_folds_the_scale_declares_1():
    """T5's family folds 1/sqrt(d_h) into the initialisation of q and applies none, by design: a config naming that
    architecture declares the scale 1; the same attention without it has no scale at all (FWD956)."""
    import types

    model = Attention(1.0, True)
    model.config = types.SimpleNamespace(model_type="t5")
    r = fwdcheck.check_model(model, [CHECK]).results[0]
    assert r.status.value == "pass", r.findings
    assert r.data["calls"][0]["declared"] == {"t5's scale folded into its initialisation": 1.0}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_eager_scale_bug_fails(reference, dtype):
    report = run_checks(reference(attention="eager", bugs=["eager-scale-1-over-d"]), [CHECK], dtype=dtype)
    assert codes(report, "attention-stats") == {"FWD955"}
    assert report.exit_code == 1


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_scale_applied_twice_fails(reference, attention, dtype):
    report = run_checks(reference(attention=attention, bugs=["scale-applied-twice"]), [CHECK], dtype=dtype)
    assert codes(report, "attention-stats") == {"FWD955"}
    (call, *_) = report.result("attention-stats").data["calls"]
    assert call["q_factor"] == pytest.approx(0.5, rel=2e-2)  # head size 4


@pytest.mark.parametrize("eager", [False, True], ids=["flash", "eager"])
@pytest.mark.parametrize(("scaling", "code"), [("once", None), ("twice", "FWD955"), ("none", "FWD956")])
def test_nanogpt_scaled_once_twice_and_not_at_all(scaling, code, eager):
    """nanoGPT's fused c_attn split into q, k, v: each head of q is found in its chunk of the projection's output."""
    from tests.models import nanogpt_scaled

    r = fwdcheck.check_model(nanogpt_scaled(scaling, eager), [CHECK]).results[0]
    assert {f.code for f in r.findings} == ({code} if code else set()), r.findings
    assert r.status.value == ("fail" if code else "pass")
    assert all(
        c["chain"] == f"q from h.{i}.attn.c_attn, k from h.{i}.attn.c_attn" for i, c in enumerate(r.data["calls"])
    )
    if code:
        assert r.findings[0].where.startswith("h.0.attn")


def test_a_norm_between_projection_and_call_is_not_judged_whole():
    """q normalised after its projection (a q/k norm): no constant factor ties it to the projection, so only the
    kernel's scale is judged (a warning at most), never a failure on a guess."""

    class Normed(Attention):
        def forward(self, input_ids):
            B, T = input_ids.shape
            x = self.embed(input_ids)  # (B, T, C)
            q = F.normalize(self.q_proj(x).view(B, T, 4, 16), dim=-1).transpose(1, 2)  # (B, nh, T, hs)
            k = F.normalize(self.k_proj(x).view(B, T, 4, 16), dim=-1).transpose(1, 2)
            v = self.v_proj(x).view(B, T, 4, 16).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
            return self.head(y.transpose(1, 2).reshape(B, T, 64))

    r = fwdcheck.check_model(Normed(1.0, False), [CHECK]).results[0]
    assert r.status.value == "warn" and {f.code for f in r.findings} == {"FWD951"}
    assert r.data["calls"][0]["chain"].startswith("not measured: q a head of it is no constant multiple")


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


def _tiny(model_type: str, **fields) -> dict:
    from tests import compat

    if model_type in ("gpt2", "falcon", "opt"):
        sizes = {
            "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0),
            "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
            "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
        }[model_type]
        return compat.hf(model_type, **sizes, **fields)
    return compat.hf(model_type, **compat.LLAMA_LIKE, **fields)


SWEEP = {
    "gpt2": {},
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "gemma2": dict(num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=32),  # 1/sqrt(32), not 1/sqrt(8)
    "falcon": {},  # fused query_key_value, multi-query
    "gpt_neox": dict(rotary_pct=0.5),  # fused query_key_value, interleaved per head
    "phi": dict(partial_rotary_factor=0.5),
    "mistral": dict(num_key_value_heads=2, sliding_window=4),
    "opt": {},  # q_proj(x) * scaling, then the kernel's scale 1
    "granite": dict(num_key_value_heads=2, attention_multiplier=0.3),  # muP-style: a declared scale
}


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", sorted(SWEEP))
def test_transformers_effective_scale_passes_measured_whole(model_type, implementation):
    """The correct sweep sample: every call's chain from the projections is measured, and matches what the model
    declares (its attention module's `scaling`, Gemma 2's query_pre_attn_scalar, Granite's attention_multiplier)."""
    if model_type == "gemma2" and implementation == "sdpa":
        pytest.skip("transformers builds Gemma 2 eager only")
    spec = _tiny(model_type, attn_implementation=implementation, **SWEEP[model_type])
    r = result(run_checks(spec, [CHECK], code_paths={"enabled": False}))
    assert r.status.value == "pass", r.findings
    assert r.data["calls"] and all(c.get("effective_scale") for c in r.data["calls"]), r.data["calls"]
    if model_type == "gemma2":
        assert r.data["calls"][0]["effective_scale"] == pytest.approx(32**-0.5, rel=1e-3)


@pytest.fixture
def opt_scaled_twice(monkeypatch):
    """OPT as it shipped broken: q_proj(x) * self.scaling, then handed to an attention that scales again (SDPA's
    default scale; the eager path's `* scaling` with the module's own scaling), not scaling=1.0."""
    import transformers.models.opt.modeling_opt as opt

    real = opt.ALL_ATTENTION_FUNCTIONS

    class DefaultScale:
        def get_interface(self, implementation, default):
            function = real.get_interface(implementation, default)

            def attention(module, *args, scaling=None, **kwargs):
                again = None if implementation == "sdpa" else module.scaling  # None: SDPA's default 1/sqrt(hs)
                return function(module, *args, scaling=again, **kwargs)

            return attention

    monkeypatch.setattr(opt, "ALL_ATTENTION_FUNCTIONS", DefaultScale())


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_transformers_opt_scaled_twice_fails(opt_scaled_twice, implementation):
    r = result(run_checks(_tiny("opt", attn_implementation=implementation), [CHECK], code_paths={"enabled": False}))
    assert r.status.value == "fail" and {f.code for f in r.findings} == {"FWD955"}, r.findings
    assert "OPTAttention.scaling = 0.3536 is meant" in r.findings[0].message
    assert r.data["calls"][0]["q_factor"] == pytest.approx(8**-0.5, rel=1e-3)


@pytest.mark.slow
def test_transformers_q_norm_is_not_judged_whole():
    """Qwen3 normalises q and k per head after their projections: the chain is not measured, the kernel's scale is
    judged alone (right here), and nothing fails on a guess."""
    r = result(run_checks(_tiny("qwen3", num_key_value_heads=2, head_dim=8), [CHECK], code_paths={"enabled": False}))
    assert r.status.value == "pass", r.findings
    assert all(c["chain"].startswith("not measured") for c in r.data["calls"])


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
