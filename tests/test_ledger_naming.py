"""shape-ledger names an axis by the role of its tensor, never by a size that two dimensions happen to share.

Each case builds the reference model with two dimensions of one size (V = d_ff, d = d_ff, d = V, h = d_h, T = d_h,
B = h, h_kv = d_h, and h = h_kv against grouped-query h_kv < h) and reads the ledger on both attention paths: the
logits' last axis is V because they are the logits, the feed-forward state is the up projection's output (the down
projection and the lm head are no feed-forward state, however wide), and the operands of an eager q @ k^T and
weights @ v carry the query heads once the kv heads are repeated. A ledger saved before one of the two sizes changes
must then differ from the new one only in that size.
"""

from __future__ import annotations

import pytest

from fwdcheck.checks.ledger_file import ledger_from_dict
from fwdcheck.config.registry import select
from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings

REFERENCE = {"source": "reference", "vocab_size": 40, "d_model": 24, "n_heads": 4, "n_layers": 2, "d_ff": 56}
INPUTS = {"batch_size": 3, "seq_len": 10}  # no size the reference above uses (d_h = 6)


def ledger(model: dict, inputs: dict | None = None, expect: dict | None = None):
    """The shape-ledger result of the reference model with these fields changed, compared with `expect` if given."""
    config = config_from_dict({"model": {**REFERENCE, **model}, "inputs": {**INPUTS, **(inputs or {})}})
    expected = {"--expect-ledger": ledger_from_dict(expect, "the saved ledger")} if expect is not None else {}
    settings = Settings.from_config(config, Overrides(expected=expected))
    return run_model(load_model(config), settings, select(["shape-ledger"])).result("shape-ledger")


def saved(result) -> dict:
    """The ledger as --save-ledger writes it."""
    return {
        "fwdcheck_ledger": 1,
        "dims": result.data["dims"],
        "entries": [{k: e[k] for k in ("name", "shape", "dims", "dtype")} for e in result.data["entries"]],
    }


def dims_of(result) -> dict[str, list[str]]:
    return {e["name"]: e["dims"] for e in result.data["entries"]}


def assert_clean(result):
    problems = [f"{f.code}: {f.message}" for f in result.findings if f.status.value != "pass"]
    assert result.status.value == "pass" and not problems, problems


# Two dimensions of one size each; the inputs change where B or T is one of them.
COLLISIONS = {
    "V=d_ff": ({"vocab_size": 56}, {}),
    "d=d_ff": ({"d_ff": 24}, {}),
    "d=V": ({"vocab_size": 24}, {}),
    "h=d_h": ({"d_model": 16}, {}),  # 4 heads of 4
    "T=d_h": ({}, {"seq_len": 6}),
    "B=h": ({}, {"batch_size": 4}),
    "h_kv=d_h": ({"d_model": 16, "n_heads": 8, "n_kv_heads": 2}, {}),  # 8 heads of 2, 2 kv heads
    "gqa": ({"n_kv_heads": 2}, {}),
}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("collision", COLLISIONS)
def test_shared_sizes_are_named_by_role(collision, attention):
    model, inputs = COLLISIONS[collision]
    result = ledger({**model, "attention": attention}, inputs)
    assert_clean(result)
    names = dims_of(result)
    assert names["logits"] == ["B", "T", "V"]
    assert names["layers.0.mlp.up output"] == ["B", "T", "d_ff"]
    assert "layers.0.mlp.down output" not in names  # the MLP's output is the residual width, not a hidden state
    assert not any(name.startswith("lm_head") for name in names)
    assert names["token embedding (wte)"] == names["layers.0 output"] == ["B", "T", "d"]
    if attention == "sdpa":
        assert names["layers.0.attn q"] == ["B", "h", "T", "d_h"]
        assert names["layers.0.attn k"] == names["layers.0.attn v"] == ["B", "h_kv", "T", "d_h"]
    else:  # k and v repeated to the query heads before the products
        assert names["layers.0.attn q (q @ k^T)"] == ["B", "h", "T", "d_h"]
        assert names["layers.0.attn k^T (q @ k^T)"] == ["B", "h", "d_h", "T"]
        assert names["layers.0.attn v (weights @ v)"] == ["B", "h", "T", "d_h"]
    assert names["layers.0.attn attention weights"] == ["B", "h", "T", "T"]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_row_is_shown_against_the_layout_it_fits(attention):
    """A repeated v [B,h,T,d_h] is right, and shown against [B,h,S,d_h], not against the kv heads' [B,h_kv,S,d_h]."""
    result = ledger({"n_kv_heads": 2, "attention": attention})
    for row in result.data["entries"]:
        assert row["ok"], row
        assert ["T" if symbol == "S" else symbol for symbol in row["expected"]] == row["dims"], row  # S: the keys


# One size of a colliding pair changed, and the one difference a saved ledger may then report.
CHANGES = {
    "V=d_ff, d_ff changes": ({"vocab_size": 56}, {"vocab_size": 56, "d_ff": 72}, {"dimension d_ff: 56 -> 72"}),
    "V=d_ff, V changes": ({"vocab_size": 56}, {"vocab_size": 72}, {"dimension V: 56 -> 72"}),
    "d=d_ff, d_ff changes": ({"d_ff": 24}, {"d_ff": 72}, {"dimension d_ff: 24 -> 72"}),
    "d=V, V changes": ({"vocab_size": 24}, {"vocab_size": 72}, {"dimension V: 24 -> 72"}),
    "h=h_kv, grouped-query after": ({}, {"n_kv_heads": 2}, {"dimension h_kv: 4 -> 2"}),
    "h=d_h, heads change": (
        {"d_model": 16, "n_kv_heads": 1},
        {"d_model": 16, "n_heads": 2, "n_kv_heads": 1},
        {"dimension h: 4 -> 2", "dimension d_h: 4 -> 8"},
    ),
}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("change", CHANGES)
def test_saved_ledger_reports_only_the_size_that_changed(change, attention):
    before, after, differences = CHANGES[change]
    expected = saved(ledger({**before, "attention": attention}))
    result = ledger({**after, "attention": attention}, expect=expected)
    assert set(result.data["ledger_diff"]) == differences
    assert {f.code for f in result.findings if f.status.value != "pass"} == {"FWD406"}


def test_sequence_length_equal_to_the_head_size_changes_nothing_saved():
    """B and T follow the inputs: a ledger saved at T = d_h holds at another length."""
    expected = saved(ledger({}, {"seq_len": 6}))
    result = ledger({}, {"seq_len": 10}, expect=expected)
    assert result.data["ledger_diff"] == [] and result.status.value == "pass"


def test_hugging_face_llama_with_the_vocabulary_as_wide_as_the_mlp():
    pytest.importorskip("transformers")
    config = config_from_dict(
        {
            "model": {
                "source": "hf",
                "config": {
                    "model_type": "llama",
                    "vocab_size": 64,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 128,
                },
            },
            "inputs": {"batch_size": 3, "seq_len": 12},
        }
    )
    result = run_model(load_model(config), Settings.from_config(config), select(["shape-ledger"]))
    names = dims_of(result.result("shape-ledger"))
    assert names["logits"] == ["B", "T", "V"]
    feed_forward = {name: dims for name, dims in names.items() if dims[-1] == "d_ff"}
    assert feed_forward == {
        "model.layers.0.mlp.gate_proj output": ["B", "T", "d_ff"],
        "model.layers.0.mlp.up_proj output": ["B", "T", "d_ff"],
    }
