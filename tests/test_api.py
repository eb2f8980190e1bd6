"""The Python API, as a model repository's own tests use it: fwdcheck.check_model(module) -> Report.

A clean reference model passes, a planted bug fails with the findings the CLI gives, the Report's helpers behave as
documented, and the module handed over is left exactly as it was found.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import fwdcheck
from fwdcheck.errors import UsageError
from fwdcheck.model.reference import build
from fwdcheck.report import ChecksFailed, Report

# The default selection: every check applies to the reference model (it decodes through a cache, computes a loss,
# packs documents, switches attention and turns q and k)
CHECKS = [
    *("shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "packing", "label-shift", "grad-causality"),
    *("backends", "rope-precision", "attention-stats"),
]


def small(**fields) -> nn.Module:
    torch.manual_seed(0)
    return build(vocab_size=32, d_model=16, n_heads=4, n_layers=2, **fields)


def test_clean_reference_model_passes():
    report = fwdcheck.check_model(small())
    assert isinstance(report, Report)
    assert report.ok and report.exit_code == 0
    assert report.failures == []
    assert [r.name for r in report.results] == CHECKS
    assert {r.status.value for r in report.results} == {"pass"}
    report.raise_for_failures()  # does not raise

    document = json.loads(report.to_json())
    assert document["status"] == "pass" and document["exit_code"] == 0
    assert [c["name"] for c in document["checks"]] == CHECKS
    assert document["environment"]["batch_size"] == 2 and document["environment"]["seq_len"] == 8
    assert document["model"]["vocab_size"] == 32


def test_planted_bug_fails_with_its_findings():
    report = fwdcheck.check_model(small(bugs=["no-causal-mask"]))
    assert not report.ok and report.exit_code == 1
    # no mask anywhere: the cached decode and the train path's gradients read the future too
    assert [r.name for r in report.failures] == ["future-token", "mask-audit", "kv-cache", "grad-causality"]
    assert "FWD101" in {f.code for f in report.result("future-token").findings}
    assert "FWD201" in {f.code for f in report.result("mask-audit").findings}

    with pytest.raises(ChecksFailed) as raised:
        report.raise_for_failures()
    assert isinstance(raised.value, AssertionError)  # test runners show it as a failed assertion
    assert raised.value.report is report
    message = str(raised.value)
    assert message.startswith("fwdcheck: failed (exit 1)\n")
    assert "\nfuture-token FWD101: " in message and "\nmask-audit FWD201: " in message
    # the model code's file:line, to open in an editor
    assert "(at layers.0.attn fwdcheck/model/reference.py:" in message

    document = json.loads(report.to_json(indent=2))
    assert document["status"] == "fail" and document["exit_code"] == 1
    by_name = {c["name"]: c for c in document["checks"]}
    assert "FWD201" in {f["code"] for f in by_name["mask-audit"]["findings"]}
    assert by_name["shape-ledger"]["status"] == "pass"


def test_checks_subset_and_options():
    report = fwdcheck.check_model(small(), ["future-token"], batch_size=3, seq_len=6, seed=5)
    assert [r.name for r in report.results] == ["future-token"]
    assert report.environment["batch_size"] == 3 and report.environment["seq_len"] == 6
    assert report.environment["seed"] == 5
    with pytest.raises(UsageError, match="did you mean 'future-token'"):
        fwdcheck.check_model(small(), ["future-tokens"])


def test_the_checks_options_are_a_config_s_options_section():
    def leak_map_kind(**kwargs) -> str:
        report = fwdcheck.check_model(small(), ["future-token"], seq_len=6, **kwargs)
        return report.result("future-token").data["leak_map"]["kind"]

    # exhaustive: one token changed at a time; by default, every token from a cut on
    assert leak_map_kind(options={"future-token": {"exhaustive": True}}) == leak_map_kind(exhaustive=True) == "token"
    assert leak_map_kind() == "cut"
    with pytest.raises(UsageError, match="options.future-token.exhaustiv: unknown key; did you mean 'exhaustive'"):
        fwdcheck.check_model(small(), ["future-token"], options={"future-token": {"exhaustiv": True}})


@pytest.mark.parametrize("not_a_module", [lambda ids: ids, object(), "gpt2", None])
def test_non_module_is_a_usage_error(not_a_module):
    with pytest.raises(UsageError, match="needs a torch.nn.Module"):
        fwdcheck.check_model(not_a_module)


def test_module_class_instead_of_instance_is_a_usage_error():
    with pytest.raises(UsageError, match="needs a torch.nn.Module"):
        fwdcheck.check_model(nn.Linear)


# ---------------------------------------------------------------------------------------------------------------------
# Left as found


HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)
GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def snapshot(module: nn.Module) -> dict:
    named = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    return {
        "params": {n: p.detach().clone() for n, p in named.items()},
        "buffers": {n: b.detach().clone() for n, b in buffers.items()},
        "identity": {n: id(p) for n, p in named.items()},  # the same Parameter objects (optimizers hold them)
        "storage": {n: p.data_ptr() for n, p in named.items()},
        "device": {n: p.device for n, p in [*named.items(), *buffers.items()]},
        "dtype": {n: p.dtype for n, p in [*named.items(), *buffers.items()]},
        "requires_grad": {n: p.requires_grad for n, p in named.items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in named.items()},
        "grad_identity": {n: None if p.grad is None else id(p.grad) for n, p in named.items()},
        "training": {n: m.training for n, m in module.named_modules()},
        "dropout_p": {n: m.p for n, m in module.named_modules() if isinstance(m, nn.Dropout)},
        "hooks": {(n, kind): len(getattr(m, kind, {}) or {}) for n, m in module.named_modules() for kind in HOOK_DICTS},
        "global_hooks": {kind: len(getattr(nn.modules.module, kind, {})) for kind in GLOBAL_HOOKS},
    }


def global_state() -> dict:
    return {
        "rng": torch.get_rng_state(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "function_mode": torch._C._is_torch_function_mode_enabled(),
    }


def assert_bitwise_same(before: dict, after: dict, name: str) -> None:
    assert before.keys() == after.keys(), name
    for key, tensor in before.items():
        other = after[key]
        assert tensor.dtype == other.dtype and tensor.shape == other.shape, f"{name} {key}"
        # bitwise: compare the raw bytes, so NaN payloads and -0.0 count too
        assert torch.equal(
            tensor.view(torch.uint8) if tensor.is_floating_point() else tensor,
            other.view(torch.uint8) if other.is_floating_point() else other,
        ), f"{name} {key}"


@pytest.mark.parametrize(
    "bug, dtype", [(None, "float32"), ("no-causal-mask", "bfloat16"), ("sdpa-dropout-in-eval", "float32")]
)
def test_model_left_as_found(bug, dtype):
    module = small(
        dropout=0.2, positional="learned" if bug == "sdpa-dropout-in-eval" else "rope", bugs=[bug] if bug else []
    )
    module.train()  # found in training mode: it must go back to training mode
    module.layers[1].attn.eval()  # and a submodule in eval mode stays in eval mode
    q = module.layers[0].attn.q_proj.weight
    q.grad = torch.full_like(q, 0.5)  # a gradient from a previous step
    module.lm_head.weight.requires_grad_(False)  # frozen by the user
    assert any(isinstance(m, nn.Dropout) and m.p == 0.2 for m in module.modules())

    before = snapshot(module)
    assert all(count == 0 for count in before["hooks"].values())
    torch.manual_seed(1234)
    state = global_state()

    report = fwdcheck.check_model(module, dtype=dtype)
    assert report.exit_code in (0, 1)
    if bug:
        assert not report.ok

    after = snapshot(module)
    assert_bitwise_same(before["params"], after["params"], "parameter")
    assert_bitwise_same(before["buffers"], after["buffers"], "buffer")
    for name, grad in before["grads"].items():
        assert (grad is None) == (after["grads"][name] is None), name
        if grad is not None:
            assert_bitwise_same({name: grad}, {name: after["grads"][name]}, "grad")
    for key in (
        "identity",
        "storage",
        "device",
        "dtype",
        "requires_grad",
        "grad_identity",
        "training",
        "dropout_p",
        "hooks",
        "global_hooks",
    ):
        assert before[key] == after[key], key
    assert all(count == 0 for count in after["hooks"].values())
    assert module.training and not module.layers[1].attn.training
    now = global_state()
    assert torch.equal(state.pop("rng"), now.pop("rng")), "torch RNG state advanced"
    assert state == now
    assert not torch._C._is_torch_function_mode_enabled()


def test_default_dtype_left_as_found():
    module = small()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        report = fwdcheck.check_model(module, ["future-token", "mask-audit"])
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert report.ok, [r.summary for r in report.failures]


def test_user_hooks_survive_and_none_are_added():
    module = small()
    calls = []
    handle = module.layers[0].register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    pre = module.register_forward_pre_hook(lambda mod, args: None)
    try:
        fwdcheck.check_model(module, ["shape-ledger", "mask-audit"])
        assert list(module.layers[0]._forward_hooks) == [handle.id]
        assert list(module._forward_pre_hooks) == [pre.id]
        assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules()) == 2
        calls.clear()
        module(torch.zeros(1, 3, dtype=torch.long))
        assert calls == [torch.Size([1, 3, 16])]  # still attached and called
    finally:
        handle.remove()
        pre.remove()


def test_fixture_style_usage_in_a_model_repo():
    """What the README and the pytest plugin's `fwdcheck` fixture promise: one line in a model repo's tests."""
    fwdcheck.check_model(small(), seq_len=8).raise_for_failures()
    with pytest.raises(AssertionError, match="future-token"):
        fwdcheck.check_model(small(bugs=["batch-mix"])).raise_for_failures()


def test_the_api_pages_example_reads_codes_off_the_failures():
    """docs/api.md's example: `report.failures` holds check results, whose findings have the codes (a user once
    wrote `{f.code for f in report.failures}` and met AttributeError)."""
    from fwdcheck.result import CheckResult

    report = fwdcheck.check_model(build(vocab_size=16, d_model=8, n_heads=2, n_layers=1, bugs=["no-causal-mask"]))
    codes = {f.code for r in report.failures for f in r.findings}
    assert "FWD101" in codes and "FWD201" in codes
    assert all(isinstance(r, CheckResult) for r in report.failures)
    assert not report.ok and "codes = {f.code for r in report.failures for f in r.findings}" in (
        fwdcheck_docs_page("api.md")
    )


def fwdcheck_docs_page(name: str) -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "docs" / name).read_text(encoding="utf-8")
