"""Bugs planted in transformers' own architectures from outside the library, each caught by the check made for it.

Three bugs, planted while a test runs and never by editing installed files:
  mask dropped          the sdpa attention function registered in transformers' AttentionInterface is replaced by
                        one that calls it with no mask and is_causal=False: every query reads every key
  rope on q only        the modeling module's apply_rotary_pos_emb returns the keys unrotated
  decode off by one     the modeling module's rotary embedding adds 1 to the position of a one-token call, the way
                        a cached decode miscounting the cache's length would
Each plant is first shown to change the model in plain torch (the bug is there), then fwdcheck must fail the right
check with the right code. The architectures come from the sweep (tests/arch_sweep.py) and differ in their modeling
files: another attention class, norm, rotary layout or mask builder each.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests.arch_sweep import SEQ_LEN, future_leak, tiny
from tests.conftest import codes, run_checks

# Rotary architectures whose attention goes through transformers' registry and apply_rotary_pos_emb.
ROTARY = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "mixtral",
    "phi3",
    "olmo2",
    "granite",
    "stablelm",
    "starcoder2",
    "exaone4",
    "smollm3",
    "seed_oss",
    "arcee",
    "gpt_neox",
)
# Architectures with learned or no positions, for the dropped mask beside the rotary ones.
ABSOLUTE = ("gpt2", "opt", "gpt_bigcode", "biogpt")


def _config(model_type: str) -> dict:
    built = tiny(model_type)
    assert built.config is not None, built.left_out
    return {"source": "hf", "config": built.config}


def _meta_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in _config(model_type)["config"].items() if k != "model_type"}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))


def _modeling(model_type: str):
    """The modeling module of the tiny model's attention."""
    return sys.modules[type(_meta_model(model_type)).__module__]


@contextmanager
def mask_dropped() -> Iterator[None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registry = ALL_ATTENTION_FUNCTIONS._global_mapping
    sdpa = registry["sdpa"]

    def no_mask(module, query, key, value, attention_mask, **kwargs):
        kwargs["is_causal"] = False
        return sdpa(module, query, key, value, None, **kwargs)

    registry["sdpa"] = no_mask
    try:
        yield
    finally:
        registry["sdpa"] = sdpa


@contextmanager
def rope_on_q_only(model_type: str) -> Iterator[None]:
    modeling = _modeling(model_type)
    apply = modeling.apply_rotary_pos_emb

    def q_only(q, k, *args, **kwargs):
        return apply(q, k, *args, **kwargs)[0], k

    modeling.apply_rotary_pos_emb = q_only
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = apply


@contextmanager
def decode_off_by_one(model_type: str) -> Iterator[None]:
    # the class of the rotary embedding the model holds (a modeling module may import others)
    rotary = next(type(m) for m in _meta_model(model_type).modules() if type(m).__name__.endswith("RotaryEmbedding"))
    forward = rotary.forward

    def miscounted(self, x, position_ids, *args, **kwargs):
        if position_ids.shape[-1] == 1:  # one new token: the position of a cached decode step
            position_ids = position_ids + 1
        return forward(self, x, position_ids, *args, **kwargs)

    rotary.forward = miscounted
    try:
        yield
    finally:
        rotary.forward = forward


SDPA_ONLY = {"attn_implementation": ["sdpa"], "output_attentions": [False], "batch_size": [2]}
INPUTS = {"batch_size": 2, "seq_len": SEQ_LEN}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ROTARY + ABSOLUTE)
def test_a_dropped_mask_fails_future_token_and_mask_audit(model_type):
    assert not future_leak(model_type)
    with mask_dropped():
        assert future_leak(model_type), "the plant did not reach the model"
        report = run_checks(_config(model_type), ["future-token", "mask-audit"], inputs=INPUTS, code_paths=SDPA_ONLY)
    assert report.result("future-token").status.value == "fail"
    assert "FWD101" in codes(report, "future-token")
    assert report.result("mask-audit").status.value == "fail"
    assert "FWD201" in codes(report, "mask-audit")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ROTARY)
def test_rope_on_q_only_fails_rope(model_type):
    clean = run_checks(_config(model_type), ["rope"], inputs=INPUTS)
    assert clean.result("rope").status.value == "pass", clean.result("rope").summary
    with rope_on_q_only(model_type):
        report = run_checks(_config(model_type), ["rope"], inputs=INPUTS)
    assert report.result("rope").status.value == "fail", report.result("rope").summary
    assert "FWD301" in codes(report, "rope")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ROTARY)
def test_a_decode_position_off_by_one_fails_kv_cache(model_type):
    clean = run_checks(_config(model_type), ["kv-cache"], inputs=INPUTS)
    assert clean.result("kv-cache").status.value == "pass", clean.result("kv-cache").summary
    with decode_off_by_one(model_type):
        report = run_checks(_config(model_type), ["kv-cache"], inputs=INPUTS)
    assert report.result("kv-cache").status.value == "fail", report.result("kv-cache").summary
    assert "FWD501" in codes(report, "kv-cache")
