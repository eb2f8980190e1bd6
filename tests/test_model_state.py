"""The model under test is left exactly as found: parameters bitwise, modes, dropout, hooks, RNG, dtype, device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fwdcheck.config.registry import select
from fwdcheck.config.schema import Inputs, RunConfig, config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings


def snapshot(module: nn.Module) -> dict:
    return {
        "tensors": {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()},
        "storage": {k: v.data_ptr() for k, v in module.state_dict(keep_vars=True).items()},
        "dtypes": {k: v.dtype for k, v in module.state_dict().items()},
        "training": {n: m.training for n, m in module.named_modules()},
        "dropout": {n: m.p for n, m in module.named_modules() if isinstance(m, nn.Dropout)},
        "attention_dropout": {
            n: m.dropout for n, m in module.named_modules() if hasattr(m, "dropout") and isinstance(m.dropout, float)
        },
        "requires_grad": {n: p.requires_grad for n, p in module.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()},
        "hooks": {
            (n, kind): list(hooks)
            for n, m in module.named_modules()
            for kind, hooks in vars(m).items()
            if "_hooks" in kind and isinstance(hooks, dict)
        },
        "attributes": {n: set(vars(m)) for n, m in module.named_modules()},
    }


def assert_same(before: dict, after: dict) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    for name, tensor in before["tensors"].items():
        assert torch.equal(tensor, after["tensors"][name]), name  # bitwise for floats of equal dtype
    for key in (
        "storage",
        "dtypes",
        "training",
        "dropout",
        "attention_dropout",
        "requires_grad",
        "hooks",
        "attributes",
    ):
        assert before[key] == after[key], key
    for name, grad in before["grads"].items():
        assert (grad is None) == (after["grads"][name] is None), name
        if grad is not None:
            assert torch.equal(grad, after["grads"][name]), name


def reference_model(**fields) -> tuple[ModelUnderTest, Settings]:
    config = config_from_dict(
        {"model": {"source": "reference", "dropout": 0.2, **fields}, "inputs": {"batch_size": 2, "seq_len": 8}}
    )
    return load_model(config), Settings.from_config(config)


@pytest.mark.parametrize("bug", [None, "sdpa-dropout-in-eval", "batch-mix", "no-causal-mask"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_left_as_found(bug, dtype):
    model, settings = reference_model(bugs=[bug] if bug else [])
    settings = settings.with_config(dtype=dtype)
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
    report = run_model(model, Settings(RunConfig(inputs=Inputs(seq_len=8))), select(None))
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
    report = run_model(model, Settings(RunConfig(inputs=Inputs(seq_len=4))), select(None))
    # every check that applies errors; those that do not apply (no cache, loss, packing, rotary) say so first
    applies = [r for r in report.results if not r.summary.startswith("does not apply: ")]
    assert len(applies) >= 4 and {r.status.value for r in applies} == {"error"}
    assert all("ValueError: boom" in r.summary for r in applies)
    assert report.results[0].findings[0].where.endswith("in forward")  # the model-code frame that raised
    assert report.exit_code == 1


# ---------------------------------------------------------------------------------------------------------------------
# What a forward writes in place


class WritesInPlace(nn.Module):
    """A forward that writes its own tensors in place: a step counter and a cache of what it saw, kept in buffers as
    gpt-fast keeps its KV cache; with `drift`, a weight too (`self.head.bias.data.add_`), which no forward should."""

    def __init__(self, drift: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(8, 64, 8))
        self.drift = drift

    def forward(self, input_ids):
        x = self.embed(input_ids)  # (B, T, d): every position reads only its own token
        self.steps += 1
        self.cache[: x.shape[0], : x.shape[1]] = x
        if self.drift:
            self.head.bias.data.add_(1e-3)
        return self.head(x)


def writes_in_place(drift: bool = False) -> tuple[nn.Module, ModelUnderTest]:
    module = WritesInPlace(drift)
    return module, ModelUnderTest(module=module, label="writes", source="python", vocab_size=16, max_positions=64)


def test_buffers_written_in_place_come_back_as_found():
    module, model = writes_in_place()
    module.cache.normal_()  # found holding something: it must hold exactly that again
    before = snapshot(module)
    report = run_model(model, Settings(RunConfig(inputs=Inputs(seq_len=8))), select(["shape-ledger", "future-token"]))
    assert report.exit_code == 0, [r.summary for r in report.results]
    assert_same(before, snapshot(module))  # contents bitwise, in their own storage
    assert int(module.steps) == 0
    assert any("the forward wrote buffers steps, cache in place" in note for note in report.notes), report.notes


def test_a_forward_that_writes_its_weights_fails_the_run():
    """Found by a fingerprint after the default path's checks: FWD006 on the first check that ran, naming the
    parameter, its module and that its values stay as written."""
    module, model = writes_in_place(drift=True)
    bias = module.head.bias.detach().clone()
    report = run_model(model, Settings(RunConfig(inputs=Inputs(seq_len=8))), select(["shape-ledger", "future-token"]))
    first = report.results[0]
    (finding,) = [f for f in first.findings if f.code == "FWD006"]
    assert first.status.value == "fail" and finding.status.value == "fail"
    assert finding.message.startswith("the forward wrote parameter head.bias in place"), finding.message
    assert finding.where == "head"
    assert "they stay as written" in finding.message  # fingerprints, not copies: said, not hidden
    assert report.exit_code == 1
    assert not torch.equal(module.head.bias, bias)


def test_weights_written_in_a_cast_copy_are_intact():
    module, model = writes_in_place(drift=True)
    before = snapshot(module)
    report = run_model(model, Settings(RunConfig(inputs=Inputs(seq_len=8), dtype="bfloat16")), select(["shape-ledger"]))
    (finding,) = [f for f in report.results[0].findings if f.code == "FWD006"]
    assert "the model's own values are intact: the run worked on a copy" in finding.message
    assert_same(before, snapshot(module))


def test_a_clean_model_has_its_weights_watched_without_a_finding():
    model, settings = reference_model()
    report = run_model(model, settings, select(None))
    assert not [f for r in report.results for f in r.findings if f.code == "FWD006"]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7, 11),  # 77 float32: not a whole number of 64-bit words, read byte by byte
        torch.randn(600, 8),  # words in blocks and a rest
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.randint(0, 9, (7,)),
        torch.rand(4, 4) > 0.5,
        torch.randn(64, 64).t(),  # not contiguous
        torch.tensor([float("nan"), float("inf"), 1.0, 2.0]),
    ],
    ids=["odd-size", "blocks", "bfloat16", "int64", "bool", "transposed", "nan"],
)
def test_fingerprint_changes_with_any_write(tensor):
    from fwdcheck.run.model_state import fingerprint

    before = fingerprint(tensor)
    assert torch.equal(fingerprint(tensor.clone()), before)  # a function of the contents alone, NaN included
    for index in (0, tensor.numel() // 2, tensor.numel() - 1):
        changed = tensor.clone()
        at = torch.unravel_index(torch.tensor(index), tensor.shape)
        changed[at] = ~changed[at] if changed.dtype == torch.bool else (0 if changed[at] != 0 else 1)  # NaN too
        assert not torch.equal(fingerprint(changed), before), index


def test_fingerprint_sees_values_moved_between_blocks():
    from fwdcheck.run.model_state import FINGERPRINT_BLOCK, fingerprint

    tensor = torch.randn(4 * FINGERPRINT_BLOCK * 2)  # float32: two per 64-bit word, four blocks
    moved = tensor.clone()
    moved[[0, 3 * FINGERPRINT_BLOCK * 2]] = tensor[[3 * FINGERPRINT_BLOCK * 2, 0]]  # same sum, other places
    assert not torch.equal(fingerprint(moved), fingerprint(tensor))


# ---------------------------------------------------------------------------------------------------------------------
# A rotary function that fails in ways `except Exception` does not expect


class ModelAbort(BaseException):
    """A model's own BaseException: not Ctrl-C, not a time limit."""


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("__str__ of Unprintable")


@pytest.mark.parametrize(
    "exc, shown",
    [
        (ModelAbort("rotary cache exhausted"), "ModelAbort: rotary cache exhausted"),
        (Unprintable(), "Unprintable: <its message cannot be shown"),
    ],
)
def test_rotary_function_failures_are_the_models_error(exc, shown):
    from dataclasses import replace

    def rotary(x, positions):
        raise exc

    model, settings = reference_model()
    model = replace(model, rotary=rotary, rotary_discovered=False)
    before = snapshot(model.module)
    report = run_model(model, settings, select(["rope"]))
    (finding,) = report.results[0].findings
    assert finding.code == "FWD002" and f"the rotary function raised {shown}" in finding.message, finding
    assert report.exit_code == 1
    assert_same(before, snapshot(model.module))


# ---------------------------------------------------------------------------------------------------------------------
# Hooks a Hugging Face model installs on itself


@pytest.mark.slow
def test_hf_model_comes_back_without_the_hooks_it_installed(capfd):
    """transformers installs output-capturing hooks on its own modules the first time output_attentions is asked
    for (the code-path matrix does), and marks the model as hooked. Both are gone afterwards, and a second check
    finds the model as the first did."""
    pytest.importorskip("transformers")
    import transformers

    import fwdcheck
    from tests.compat import CASES

    module = load_model(config_from_dict({"model": CASES["Llama (GQA)"][0]})).module
    before = snapshot(module)
    transformers.utils.logging.warning_once.cache_clear()  # the sdpa line is logged once per process
    capfd.readouterr()
    first = fwdcheck.check_model(module)
    assert_same(before, snapshot(module))
    assert not hasattr(module, "_output_capturing_hooks_installed")
    second = fwdcheck.check_model(module)
    assert_same(before, snapshot(module))
    assert [(r.name, r.status, r.summary) for r in first.results] == [
        (r.name, r.status, r.summary) for r in second.results
    ]
    assert {r.status.value for r in first.results} == {"pass"}
    # transformers' line about the output_attentions the code-path matrix passed is neither on stderr nor a note
    # (tests/test_hf_quiet.py: the library's other lines are notes)
    assert "[transformers]" not in capfd.readouterr().err
    assert not [n for n in first.notes if "output_attentions" in n], first.notes
