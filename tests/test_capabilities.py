"""Capabilities: what a model can do is read off the model, whichever source built it.

A transformers model built by a Python factory is driven as the `hf` source drives it (the kv-cache, label-shift and
packing checks run instead of asking for declarations), the reference transformer built by a factory as the
reference, and what a config declares wins over what was detected.
"""

from __future__ import annotations

import pytest
import torch

from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from tests.conftest import run_checks, statuses

transformers = pytest.importorskip("transformers")

TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_llama(causal_lm: bool = True, rope_restarts_in_decode: bool = False) -> torch.nn.Module:
    """A factory as a user writes one: transformers' Llama from a config, random weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA)
    if not causal_lm:
        return transformers.LlamaForSequenceClassification(config)
    model = transformers.LlamaForCausalLM(config)
    if rope_restarts_in_decode:  # decoded tokens rotated at positions counted from the first new token
        rotary = model.model.rotary_emb
        original = rotary.forward
        rotary.forward = lambda x, position_ids: original(x, position_ids - position_ids[:, :1])
    return model


def factory(name: str, **kwargs) -> dict:
    return {"source": "python", "factory": f"tests.test_capabilities:{name}", "kwargs": kwargs}


def loaded(model: dict):
    return load_model(config_from_dict({"model": model}))


def test_a_transformers_model_from_a_factory_has_the_hf_sources_capabilities():
    from_factory, from_hf = (
        loaded(factory("tiny_llama")),
        loaded({"source": "hf", "config": {"model_type": "llama", **TINY_LLAMA}}),
    )
    for model in (from_factory, from_hf):
        assert model.attention is not None and model.attention.ordered()[0] in ("eager", "sdpa")
        assert model.cache.style == "past_key_values" and model.cache.new_cache is not None
        assert (model.loss.argument, model.loss.output) == ("labels", "loss")
        assert model.packing.form == "positions"  # transformers 5's mask builder reads position_ids
        assert model.matrix_by_default and model.library_loggers == ("transformers",)
        assert model.tensor_parallel is not None
    assert not from_factory.weights_at_init  # a factory may hold trained weights
    assert from_hf.weights_at_init and from_hf.origins["rope"].startswith("read off")


def test_the_factory_built_transformers_model_is_checked_through_its_cache_and_loss():
    report = run_checks(factory("tiny_llama"), ["kv-cache", "label-shift", "packing"], code_paths={"enabled": False})
    assert statuses(report) == {"kv-cache": "pass", "label-shift": "pass", "packing": "pass"}
    broken = run_checks(
        factory("tiny_llama", rope_restarts_in_decode=True), ["kv-cache"], code_paths={"enabled": False}
    )
    assert {f.code for f in broken.result("kv-cache").findings if f.status.value == "fail"} == {"FWD501"}


def test_a_transformers_model_that_is_not_a_causal_lm_says_why_it_has_no_loss():
    model = loaded(factory("tiny_llama", causal_lm=False))
    assert model.loss is None and model.packing is None
    assert "not one of transformers' causal language models" in model.unavailable["loss"]


def test_a_declared_interface_wins_over_the_detected_one():
    model = loaded(
        {**factory("tiny_llama"), "cache": {"style": "hf"}, "loss": {"argument": "labels", "output": "loss"}}
    )
    assert model.cache.new_cache is None and model.cache.origin == "declared in the config (model.cache)"
    assert model.loss.origin == "declared in the config (model.loss)"


def test_the_reference_transformer_from_a_factory_is_driven_as_the_reference():
    model = loaded(
        {
            "source": "python",
            "factory": "fwdcheck.model.reference:build",
            "kwargs": {"vocab_size": 32, "d_model": 16, "n_heads": 4},
        }
    )
    assert model.packing.argument == "document_ids" and model.loss.output == 1
    assert model.rotary_in_layers is not None and model.attention.implementations == ("eager", "sdpa")
    assert not model.matrix_by_default and not model.weights_at_init


def test_a_forward_adapter_keeps_detection_to_the_attention_switch():
    """An adapter drives forward its own way: fwdcheck cannot call forward with labels or a cache behind its back."""
    model = loaded({**factory("tiny_llama"), "forward": "tests.test_capabilities:logits_only"})
    assert model.loss is None and model.cache is None and model.packing is None and not model.matrix_by_default
    assert model.attention is not None


def logits_only(module, input_ids, **kwargs):
    return module(input_ids, **kwargs).logits


def test_a_model_with_no_interfaces_skips_saying_what_to_declare():
    report = run_checks({"source": "python", "factory": "tests.models:path_bug"}, ["kv-cache", "label-shift"])
    assert statuses(report) == {"kv-cache": "skip", "label-shift": "skip"}
    assert "declare" in report.result("label-shift").summary
