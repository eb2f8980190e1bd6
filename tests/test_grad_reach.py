"""grad-reach: on the train path (train() mode, dropout zeroed, gradients on), every parameter that requires grad gets
a finite gradient from the logits. Correct models pass (the reference model, transformers' architectures built tiny,
x-transformers, litgpt, torch.nn); a layer built and never called and a detached branch warn by name, telling the
two apart; a NaN gradient fails; tied and frozen weights give no false warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from tests import arch_sweep
from tests.conftest import codes, run_checks
from tests.test_bug_matrix import BUG_RUN
from tests.test_grad_causality import HF_CORRECT, THIRD_PARTY_CORRECT, ForwardOnly, TinyCausalLM, gate

CHECK = "grad-reach"


def reach(model: nn.Module, **kw):
    return gate(model, checks=(CHECK,), **kw).result(CHECK)


# =====================================================================================================================
# Correct models pass


def test_tiny_correct_model_passes():
    r = reach(TinyCausalLM())
    assert r.status.value == "pass", r.findings
    assert r.metrics["parameters"] == sum(1 for p in TinyCausalLM().parameters() if p.requires_grad)
    assert r.metrics["parameters_without_gradient"] == 0


def test_reference_model_passes(reference):
    r = run_checks(reference(dropout=0.1), [CHECK]).result(CHECK)
    assert r.status.value == "pass", r.findings
    assert r.metrics["parameters"] > 0 and r.metrics["parameters_without_gradient"] == 0


@pytest.mark.parametrize("name", list(HF_CORRECT))
def test_transformers_architectures_pass(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_checks(HF_CORRECT[name], [CHECK], inputs={"batch_size": 2, "seq_len": 12}).result(CHECK)
    assert r.status.value == "pass", (r.summary, r.findings)


@pytest.mark.slow  # importing litgpt and x-transformers takes seconds
@pytest.mark.parametrize("name", list(THIRD_PARTY_CORRECT))
def test_third_party_models_pass(name):
    spec = {"source": "python", "factory": THIRD_PARTY_CORRECT[name], "path": ["."]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_checks(spec, [CHECK]).result(CHECK)
    assert r.status.value == "pass", (r.summary, r.findings)


def test_a_bidirectional_model_is_judged_too():
    r = reach(TinyCausalLM("unused-layer"), causal=False)  # training reaches weights whatever the attention
    assert {f.code for f in r.findings} == {"FWD124"}


@pytest.mark.parametrize("bug", ["no-causal-mask", "batch-mix", "rope-pairing-mismatch"])
def test_leaks_are_not_this_checks_to_find(reference, bug):
    fields, dtype = BUG_RUN.get(bug, ({}, "float32"))
    r = run_checks(reference(bugs=[bug], **fields), [CHECK], dtype=dtype).result(CHECK)
    assert r.status.value == "pass", r.findings


# =====================================================================================================================
# Parameters the gradient does not reach


@pytest.mark.parametrize("leak, name", [("unused-layer", "never_called"), ("detached", "gate")])
def test_parameters_without_gradient_warn_by_name(leak, name):
    report = gate(TinyCausalLM(leak), checks=(CHECK,))
    r = report.result(CHECK)
    assert r.status.value == "warn"
    (warned,) = [f for f in r.findings if f.code == "FWD124"]
    assert f"{name}.weight" in warned.message and f"{name}.bias" in warned.message
    assert r.metrics["parameters_without_gradient"] == 2
    assert r.metrics["parameters_never_called"] == (2 if leak == "unused-layer" else 0)
    assert ("never called" in warned.message) == (leak == "unused-layer")
    assert ("passed no gradient back" in warned.message) == (leak == "detached")
    assert report.exit_code == 0  # a warning, not a failure (unless --fail-on warn)


def test_tied_and_frozen_embeddings_get_no_false_warning():
    tied = TinyCausalLM()
    tied.head.weight = tied.embed.weight  # the output head tied to the embedding (GPT-2's layout)
    r = reach(tied)
    assert r.status.value == "pass", r.findings
    frozen = TinyCausalLM()
    frozen.embed.weight.requires_grad_(False)  # a frozen parameter is not asked for
    r = reach(frozen)
    assert r.status.value == "pass", r.findings
    assert r.metrics["parameters"] == sum(1 for p in frozen.parameters() if p.requires_grad)


def test_nonfinite_parameter_gradient_fails():
    class Overflow(TinyCausalLM):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.zeros(()))

        def forward(self, input_ids):
            # the value is the logits (sqrt(0) = 0); the scale's gradient is the upstream sum x 1/(2 sqrt(0)): Inf
            return super().forward(input_ids) + torch.sqrt(self.scale)

    report = gate(Overflow(), checks=(CHECK,))
    r = report.result(CHECK)
    assert r.status.value == "fail" and report.exit_code == 1
    (finding,) = [f for f in r.findings if f.code == "FWD125"]
    assert "scale" in finding.message and "head" not in finding.message  # only the parameter whose gradient is Inf


# =====================================================================================================================
# Skips say why


def test_logits_without_gradient_skip():
    class Detached(TinyCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids).detach()

    r = reach(Detached())
    assert r.status.value == "skip"
    assert "carry no gradient" in r.summary


def test_a_model_with_nothing_to_train_skips():
    frozen = TinyCausalLM().requires_grad_(False)
    r = reach(frozen)
    assert r.status.value == "skip"
    assert "no parameter requires grad" in r.summary


def test_model_without_a_backward_skips_with_torchs_reason():
    r = reach(ForwardOnly())
    assert r.status.value == "skip"
    assert r.summary.startswith("the backward cannot run: ")


# =====================================================================================================================
# The model is left as found


def test_model_left_as_found():
    model = TinyCausalLM("unused-layer")
    model.eval()
    model.head.train()  # a mixed mode, to be put back module by module
    kept = torch.ones_like(model.head.weight)
    model.head.weight.grad = kept  # a gradient the caller accumulated: untouched
    frozen = model.proj.bias.requires_grad_(False)
    before_training = {name: m.training for name, m in model.named_modules()}
    before_hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    before_values = {name: p.detach().clone() for name, p in model.named_parameters()}
    report = gate(model, checks=(CHECK, "future-token"))
    assert report.result("future-token").status.value == "pass"  # ran after it, on the model as found
    assert {name: m.training for name, m in model.named_modules()} == before_training
    assert model.head.weight.grad is kept and bool((kept == 1).all())
    assert all(p.grad is None for name, p in model.named_parameters() if name != "head.weight")
    assert frozen.requires_grad is False and model.qkv.weight.requires_grad is True
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == before_hooks
    assert all(torch.equal(p, before_values[name]) for name, p in model.named_parameters())
    assert model.dropout.p == 0.5
    assert torch.is_grad_enabled()


def test_explain_lists_its_codes():
    from typer.testing import CliRunner

    from fwdcheck.cli import app

    explained = CliRunner().invoke(app, ["explain", CHECK], catch_exceptions=False)
    assert explained.exit_code == 0, explained.output
    assert "FWD124" in explained.stdout and "FWD125" in explained.stdout


# =====================================================================================================================
# Every causal-LM architecture transformers ships: no NaN gradient, no error; parameters not reached are named


@pytest.mark.slow
@pytest.mark.parametrize("model_type", arch_sweep.architectures())
def test_transformers_architectures_train_every_weight_or_say_which_not(model_type):
    report = arch_sweep.one_check_report(model_type, CHECK)
    r = report.result(CHECK)
    if r.status.value == "skip":  # a model that refuses train mode at this length (Reformer's axial positions)
        assert r.summary.startswith("the model cannot run in train mode"), r.summary
        return
    assert r.status.value in ("pass", "warn"), (r.status, r.summary)  # nothing fails: no NaN gradient, no error
    assert codes(report, CHECK) <= {"FWD124"}
    if r.status.value == "warn":  # the parameters named, and whether their module ran
        assert r.metrics["parameters_without_gradient"] > 0 and "get no gradient from the logits" in r.summary
