"""What fwdcheck reads off a Hugging Face model rather than assumes: the text model's settings in a composite config,
sizes that are sentinels or per-layer lists, whether forward really reads position_ids and counts them from 0, the
model's own cache class, 2-D-only masks, and the layers that carry state across packed documents.

Each is tested both ways: on the architecture that needs it (taken from the sweep's tiny configs, tests/arch_sweep.py)
and on one where the old reading was right and must stay so.
"""

from __future__ import annotations

import pytest
import torch

from fwdcheck.model.sources.hf import config_size, hf_model_under_test, text_config
from tests.arch_sweep import SEQ_LEN, tiny
from tests.conftest import codes, run_checks, statuses

INPUTS = {"batch_size": 2, "seq_len": SEQ_LEN}


def _hf(model_type: str) -> dict:
    built = tiny(model_type)
    assert built.config is not None, built.left_out
    return {"source": "hf", "config": built.config}


def _load(model_type: str):
    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.model.sources import load_model

    return load_model(config_from_dict({"model": _hf(model_type)}))


# ----------------------------------------------------------------------------------------------------------------
# 1. composite configs


def test_a_composite_config_is_read_through_its_text_config():
    """Gemma 3 keeps vocab_size, sizes and rope in text_config: the model loads and its dims are the text model's
    (before, reading vocab_size off the top-level config was an exit 3 before any check)."""
    model = _load("gemma3")
    text = model.module.config.text_config
    assert not hasattr(model.module.config, "vocab_size") or model.module.config.vocab_size is None
    assert model.vocab_size == text.vocab_size
    assert model.dims["d"] == text.hidden_size and model.dims["h"] == text.num_attention_heads
    assert model.max_positions == text.max_position_embeddings


def test_a_text_only_config_is_its_own_text_config():
    model = _load("llama")
    assert text_config(model.module.config) is model.module.config


# ----------------------------------------------------------------------------------------------------------------
# 2. sentinels, per-layer lists, absent fields


class _Config:
    max_position_embeddings = -1
    intermediate_size = [64, 128]
    hidden_size = 32
    flag = True
    ratio = 0.5


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("max_position_embeddings",), None),  # XLNet's -1: no limit
        (("intermediate_size",), None),  # a list per layer: no single d_ff
        (("absent",), None),
        (("absent", "hidden_size"), 32),  # the first given one
        (("flag",), None),
        (("ratio",), None),
    ],
)
def test_config_size_reads_only_one_positive_whole_number(names, expected):
    assert config_size(_Config(), *names) == expected


@pytest.mark.slow
def test_a_sentinel_limit_and_a_per_layer_width_are_left_unnamed_not_refused():
    """A -1 position limit is no limit (before: refused as a limit of -1), a per-layer intermediate_size is no d_ff
    (before: an internal error in the ledger), and the ledger still runs on the model."""
    from fwdcheck.config.schema import HFModel

    model = _load("llama")
    # as a config class without validation holds them (transformers' Llama validates; XLNet and Gemma 3n hold these)
    object.__setattr__(model.module.config, "max_position_embeddings", -1)
    object.__setattr__(model.module.config, "intermediate_size", [64, 64])
    read = hf_model_under_test(model.module, HFModel(source="hf", config={"model_type": "llama"}), notes=[])
    assert read.max_positions is None
    assert "d_ff" not in read.dims
    from fwdcheck import check_model

    report = check_model(model.module, ["shape-ledger", "future-token"])
    assert statuses(report) == {"shape-ledger": "pass", "future-token": "pass"}


# ----------------------------------------------------------------------------------------------------------------
# 3 and 4. positions: read from the signature and the observed effect, in the model's own convention


@pytest.mark.parametrize(
    ("model_type", "form"),
    [
        ("llama", "given"),  # names position_ids and counts from 0
        ("gpt2", "given"),  # learned positions from 0
        ("roberta", "own"),  # counts from padding_idx + 1
        ("xlm-roberta", "own"),
        ("bart", "own"),  # swallows position_ids in **kwargs
        ("blenderbot-small", "own"),
        ("mamba", "own"),  # takes none
    ],
)
@pytest.mark.slow
def test_positions_are_read_off_the_model(model_type, form):
    model = _load(model_type)
    assert model.positions is not None and model.positions.form == form, model.positions
    assert model.accepts_position_ids == (form == "given")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["roberta", "camembert", "bart", "blenderbot-small"])
def test_models_counting_their_own_positions_pass_future_token_and_kv_cache(model_type):
    """Before: false FWD107 on the left-padding cells (0-based position_ids the model misreads or never reads) and,
    for the RoBERTa family, false FWD501/FWD503 in cached decoding."""
    report = run_checks(_hf(model_type), ["future-token", "kv-cache"], inputs=INPUTS)
    assert statuses(report) == {"future-token": "pass", "kv-cache": "pass"}, [r.summary for r in report.results]


@pytest.mark.slow
def test_a_model_counting_its_own_positions_still_fails_on_a_dropped_mask():
    """The other way: letting RoBERTa count its positions must not blind future-token to a real leak."""
    from tests.test_arch_planted import SDPA_ONLY, mask_dropped

    with mask_dropped():
        report = run_checks(_hf("roberta"), ["future-token"], inputs=INPUTS, code_paths=SDPA_ONLY)
    assert report.result("future-token").status.value == "fail"
    assert "FWD101" in codes(report, "future-token")


def test_the_positions_probe_leaves_the_model_as_found():
    from fwdcheck.model.sources.hf import positions_of

    model = _load("roberta")
    model.module.train()
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    positions_of(model.module)
    assert model.module.training
    assert all(torch.equal(before[k], v) for k, v in model.module.state_dict().items())


# ----------------------------------------------------------------------------------------------------------------
# 9. the model's own cache class, 2-D-only masks


def test_a_model_with_its_own_cache_class_gets_no_dynamic_cache():
    assert _load("minimax").cache.new_cache is None
    assert _load("llama").cache.new_cache is not None


@pytest.mark.slow
def test_a_model_with_its_own_cache_class_decodes_through_it():
    """MiniMax refuses a DynamicCache (before: an error); decoding through its own cache matches the full forward."""
    report = run_checks(_hf("minimax"), ["kv-cache"], inputs=INPUTS)
    assert report.result("kv-cache").status.value == "pass", report.result("kv-cache").summary


@pytest.mark.parametrize("model_type", ["openai-gpt", "xlm"])
@pytest.mark.slow
def test_a_model_taking_only_2d_masks_skips_packing_saying_why(model_type):
    """Before: a 4-D block-diagonal mask forced on them, an error."""
    model = _load(model_type)
    assert model.packing is None
    assert "takes only 2-D attention masks" in model.unavailable["packing"]
    report = run_checks(_hf(model_type), ["packing"], inputs=INPUTS)
    assert report.result("packing").status.value == "skip"
    assert "2-D attention masks" in report.result("packing").summary


# ----------------------------------------------------------------------------------------------------------------
# 10. packing on recurrent hybrids names the layers that carry state


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["minimax", "qwen3_next", "jamba"])
def test_packing_on_a_recurrent_hybrid_names_the_layers_carrying_state(model_type):
    """The leak is true (the recurrent state runs across the documents); the finding says which layers carry it
    rather than only that transformers finds documents from positions."""
    report = run_checks(_hf(model_type), ["packing"], inputs=INPUTS)
    result = report.result("packing")
    assert result.status.value == "fail" and "FWD601" in codes(report, "packing")
    message = next(f.message for f in result.findings if f.code == "FWD601")
    assert "layers" in message and "runs along the whole row" in message, message


def test_an_attention_only_model_carries_no_state():
    from fwdcheck.model.sources.hf import stateful_layers

    assert stateful_layers(_load("llama").module) is None
    assert stateful_layers(_load("gemma2").module) is None  # sliding and full attention are both attention
    assert "linear_attention" in (stateful_layers(_load("qwen3_next").module) or "")
