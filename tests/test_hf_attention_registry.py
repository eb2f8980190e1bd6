"""Attention functions registered with transformers (AttentionInterface.register("name", fn)) and chosen by
attn_implementation="name": one that computes through a call fwdcheck reads is judged by that call; one that
computes where fwdcheck cannot see (its own kernel) is "not judged: name", never a pass. The registry is left as
found."""

from __future__ import annotations

import warnings

import pytest
import torch

import fwdcheck

transformers = pytest.importorskip("transformers")
try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError:  # transformers < 4.48 (pyproject's [hf] extra allows 4.46): no registry of attention functions
    pytest.skip(
        f"transformers {transformers.__version__} has no AttentionInterface registry to register functions in",
        allow_module_level=True,
    )

from tests import test_flex_attention as flex_tests  # noqa: E402


def through_sdpa(module, query, key, value, attention_mask, **kwargs):
    """A function of one's own that hands over to transformers' SDPA path: judged by its SDPA call."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def mask_dropped(module, query, key, value, attention_mask, **kwargs):
    """The same, with the mask dropped and is_causal off: every key read."""
    kwargs["is_causal"] = False
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def own_kernel(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention computed where no torch function is seen, as an extension's kernel is: (B, h, T, d) in,
    (B, T, h, d) out, as transformers' attention functions return it."""
    with torch._C.DisableTorchFunction():
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        T = query.shape[-2]
        scores = (query @ key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)  # (B, h, T, T)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


FUNCTIONS = {"fwdcheck_through_sdpa": through_sdpa, "fwdcheck_mask_dropped": mask_dropped, "fwdcheck_own": own_kernel}


@pytest.fixture(autouse=True)
def registered():
    for name, function in FUNCTIONS.items():
        AttentionInterface.register(name, function)
    yield
    for name in FUNCTIONS:
        AttentionInterface._global_mapping.pop(name, None)


def tiny_llama(attn_implementation: str):
    model = flex_tests.tiny_llama()
    model.config._attn_implementation = attn_implementation  # read at every call, as from_pretrained would set it
    return model


def audit(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = fwdcheck.check_model(tiny_llama(name), ["future-token", "mask-audit"], code_paths={"enabled": False})
    return report


def test_a_registered_function_through_sdpa_is_judged_by_its_call():
    report = audit("fwdcheck_through_sdpa")
    result = report.result("mask-audit")
    assert result.status.value == "pass", result.summary
    assert {c["api"] for c in result.data["calls"]} == {"sdpa"} and all(c["judged"] for c in result.data["calls"])


def test_a_registered_function_that_drops_the_mask_fails():
    report = audit("fwdcheck_mask_dropped")
    assert report.result("mask-audit").status.value == "fail"
    assert "FWD201" in {f.code for f in report.result("mask-audit").findings}
    assert report.result("future-token").status.value == "fail"


def test_a_registered_function_computing_out_of_sight_is_not_judged_never_passed():
    report = audit("fwdcheck_own")
    result = report.result("mask-audit")
    assert result.status.value == "skip", result.summary
    assert "not judged: fwdcheck_own" in result.summary
    assert report.result("future-token").status.value == "pass"  # what it computes is still tested from outside
    assert AttentionInterface._global_mapping["fwdcheck_own"] is own_kernel  # the registry as found
