"""The model under test is left exactly as found: parameters bitwise, modes, dropout, hooks, RNG, dtype, device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fwdcheck.config import config_from_dict
from fwdcheck.model import ModelUnderTest, load_model
from fwdcheck.registry import select
from fwdcheck.runner import run_model
from fwdcheck.session import Settings


def snapshot(module: nn.Module) -> dict:
    return {
        "tensors": {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()},
        "storage": {k: v.data_ptr() for k, v in module.state_dict(keep_vars=True).items()},
        "dtypes": {k: v.dtype for k, v in module.state_dict().items()},
        "training": {n: m.training for n, m in module.named_modules()},
        "dropout": {n: m.p for n, m in module.named_modules() if isinstance(m, nn.Dropout)},
        "attention_dropout": {n: m.dropout for n, m in module.named_modules() if hasattr(m, "dropout")
                              and isinstance(m.dropout, float)},
        "requires_grad": {n: p.requires_grad for n, p in module.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()},
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules()),
    }


def assert_same(before: dict, after: dict) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    for name, tensor in before["tensors"].items():
        assert torch.equal(tensor, after["tensors"][name]), name  # bitwise for floats of equal dtype
    for key in ("storage", "dtypes", "training", "dropout", "attention_dropout", "requires_grad", "hooks"):
        assert before[key] == after[key], key
    for name, grad in before["grads"].items():
        assert (grad is None) == (after["grads"][name] is None), name
        if grad is not None:
            assert torch.equal(grad, after["grads"][name]), name


def reference_model(**fields) -> tuple[ModelUnderTest, Settings]:
    config = config_from_dict({"model": {"source": "reference", "dropout": 0.2, **fields},
                               "inputs": {"batch_size": 2, "seq_len": 8}})
    return load_model(config), Settings.from_config(config)


@pytest.mark.parametrize("bug", [None, "sdpa-dropout-in-eval", "batch-mix", "no-causal-mask"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_left_as_found(bug, dtype):
    model, settings = reference_model(bugs=[bug] if bug else [])
    settings.dtype = dtype
    module = model.module
    module.train()  # found in training mode: it must go back to training mode
    module.layers[0].attn.q_proj.weight.grad = torch.ones_like(module.layers[0].attn.q_proj.weight)
    module.lm_head.weight.requires_grad_(False)
    before = snapshot(module)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    default_dtype = torch.get_default_dtype()

    report = run_model(model, settings, select(None))

    assert report.exit_code in (0, 1)
    assert_same(before, snapshot(module))
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.get_default_dtype() == default_dtype
    assert not torch._C._is_torch_function_mode_enabled()


class RaisesOnThirdCall(nn.Module):
    """A model that breaks part-way through a run, from its third forward on: the guard must still restore
    everything."""

    def __init__(self):
        super().__init__()
        self.inner = load_model(config_from_dict({"model": {"source": "reference"}})).module
        self.calls = 0

    def forward(self, input_ids, position_ids=None):
        self.calls += 1
        if self.calls >= 3:
            raise RuntimeError("CUDA-like failure in the middle of a run")
        return self.inner(input_ids, position_ids)


def test_model_left_as_found_when_it_raises_midway():
    module = RaisesOnThirdCall().train()
    model = ModelUnderTest(module=module, label="raises", source="python", vocab_size=16, max_positions=64)
    before = snapshot(module)
    report = run_model(model, Settings(seq_len=8), select(None))
    assert any(r.status.value == "error" for r in report.results)
    assert report.exit_code == 1
    module.calls = 0
    assert_same(before, snapshot(module))
    assert not torch._C._is_torch_function_mode_enabled()


def test_every_check_reports_when_the_forward_always_raises():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)

        def forward(self, input_ids):
            raise ValueError("boom")

    model = ModelUnderTest(module=Broken(), label="broken", source="python", vocab_size=16)
    report = run_model(model, Settings(seq_len=4), select(None))
    assert [r.status.value for r in report.results] == ["error"] * 4
    assert all("ValueError: boom" in r.summary for r in report.results)
    assert report.results[0].findings[0].where.endswith("in forward")  # the model-code frame that raised
    assert report.exit_code == 1
