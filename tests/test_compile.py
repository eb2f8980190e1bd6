"""compile: the model under torch.compile (inductor) gives its eager logits. Both ways on the CPU: the reference
model and a transformers model pass; a model whose compiled path differs (a branch taken only while compiling, as a
"fast path for compile" would be) fails FWD811; a model torch cannot compile skips with torch's reason. Compiling
takes seconds: the slow tier."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fwdcheck
from tests.test_zero_weights import VOCAB, build

pytestmark = pytest.mark.slow


def compiled(model: nn.Module, **kw):
    return fwdcheck.check_model(model, ["compile"], vocab_size=VOCAB, seq_len=8, **kw).result("compile")


class CompileOnlyScale(nn.Module):
    """Correct eagerly; compiled, its logits are scaled by 1.01 (a branch only the traced graph takes)."""

    def __init__(self):
        super().__init__()
        self.inner = build()

    def forward(self, input_ids):
        logits = self.inner(input_ids)
        if torch.compiler.is_compiling():
            logits = logits * 1.01
        return logits


def test_a_model_that_compiles_to_its_eager_logits_passes():
    result = compiled(build())
    assert result.status.value == "pass", result.summary
    assert result.metrics["max_change"] <= result.metrics["bar"]


def test_a_branch_only_the_compiled_graph_takes_fails():
    result = compiled(CompileOnlyScale())
    assert result.status.value == "fail", result.summary
    assert {f.code for f in result.findings} == {"FWD811"}


def test_the_model_is_left_as_found():
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert compiled(model).status.value == "pass"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_compile_that_cannot_run_skips_with_torchs_reason(monkeypatch):
    """A backend that fails on the model's graph (an operator it cannot lower): the eager model ran, so the skip
    says torch's reason and judges nothing."""
    from fwdcheck.checks import compile as compile_check

    def cannot_lower(graph, example_inputs):
        raise NotImplementedError("no lowering for aten.roll")

    monkeypatch.setattr(compile_check, "BACKEND", cannot_lower)
    result = compiled(build())
    assert result.status.value == "skip", result.summary
    assert result.summary.startswith("torch.compile could not run the model") and "no lowering" in result.summary


def test_no_cpu_compiler_is_a_skip_saying_so(monkeypatch):
    monkeypatch.setenv("PATH", "")
    result = compiled(build())
    assert result.status.value == "skip" and "C++ compiler" in result.summary


def test_a_transformers_model_passes():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    result = compiled(model)
    assert result.status.value == "pass", result.summary
