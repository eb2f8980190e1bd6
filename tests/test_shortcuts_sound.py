"""The default run's checks run on fewer and shorter forwards than the session's (kv-cache's short decode, backends'
one row, grad-causality's cut rows, the observer's hooks with its mode off): each shortcut keeps the bug classes the
full procedure catches. Each model here carries a bug that only a shortcut too short, or too quiet, would miss."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fwdcheck.model.reference import KVCache, build
from tests.conftest import run_checks

NO_PATHS = {"enabled": False}


def failing(res) -> set[str]:
    return {f.code for f in res.findings if f.status.value == "fail"}


# -- kv-cache: a bug of the second one-token step, which the first does not show --------------------------------------


class StaleSlotCache(KVCache):
    """A decode path (one new token) that writes its k/v at the slot recorded by the last multi-token call, as a
    decode kernel's cache_seqlens that the decode path never advances: the first one-token step is right, the second
    overwrites the first's key. A chunk after one step reads a right cache."""

    def __init__(self):
        super().__init__()
        self.slot: dict[int, int] = {}

    def update(self, k, v, layer_idx):
        if k.shape[2] == 1 and layer_idx < len(self.keys):
            s = self.slot[layer_idx]
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx][:, :, :s], k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx][:, :, :s], v], dim=2)
            return self.keys[layer_idx], self.values[layer_idx]
        out = super().update(k, v, layer_idx)
        self.slot[layer_idx] = self.keys[layer_idx].shape[2]
        return out


class StaleSlotModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = build(vocab_size=32, d_model=16, n_heads=4)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = StaleSlotCache()
        return self.inner(input_ids, past_key_values=past_key_values, use_cache=use_cache)


def test_kv_cache_second_one_token_step_bug_is_caught():
    model = {"source": "python", "factory": "tests.test_shortcuts_sound:StaleSlotModel", "cache": {"style": "hf"}}
    res = run_checks(model, ["kv-cache"]).result("kv-cache")
    assert failing(res) == {"FWD501"}, (res.status, res.summary)


# -- kv-cache: a declared window's prefill is one litgpt takes --------------------------------------------------------


def litgpt_mistral():
    from tests.corpus import litgpt_models

    return litgpt_models.mistral()


def test_kv_cache_declared_window_on_litgpt_still_runs_and_catches_the_ring_buffer():
    """litgpt raises on a prefill longer than its sliding window: a prefill of the declared window (4) runs, and the
    ring buffer whose mask ignores the wrap fails FWD502, not FWD002 (an error)."""
    pytest.importorskip("litgpt")
    model = {
        "source": "python",
        "factory": "tests.test_shortcuts_sound:litgpt_mistral",
        "cache": {"style": "gpt-fast", "setup": "set_kv_cache"},
        "window": 4,
    }
    res = run_checks(model, ["kv-cache"]).result("kv-cache")
    assert res.status.value != "error", res.summary
    assert failing(res) == {"FWD502"}, res.summary


# -- backends: a non-default path that breaks only past 16 tokens -----------------------------------------------------


def test_backends_sees_an_eager_path_that_breaks_past_16_tokens(monkeypatch):
    import transformers.models.llama.modeling_llama as llama

    from tests import compat

    original = llama.eager_attention_forward

    def blockwise(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """Eager attention in query blocks of 16, each block masked with the first block's rows."""
        L = query.shape[-2]
        if L <= 16:
            return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        outs, weights = [], []
        for s in range(0, L, 16):
            q = query[..., s : s + 16, :]
            m = attention_mask[:, :, : q.shape[-2], :] if attention_mask is not None else None
            o, w = original(module, q, key, value, m, scaling, dropout, **kwargs)
            outs.append(o)
            weights.append(w)
        return torch.cat(outs, dim=1), torch.cat(weights, dim=-2)

    monkeypatch.setattr(llama, "eager_attention_forward", blockwise)
    spec = compat.hf("llama", **{**compat.LLAMA_LIKE, "num_key_value_heads": 2})
    res = run_checks(spec, ["backends"], inputs={"batch_size": 2, "seq_len": 32}, code_paths=NO_PATHS).result(
        "backends"
    )
    assert "FWD801" in failing(res), res.summary


# -- grad-causality: a train-path leak past 16 tokens -----------------------------------------------------------------


class LongTrainAttention(nn.Module):
    """Causal attention whose train path, on rows longer than 16 tokens, forgets is_causal."""

    def __init__(self, d=16, h=4):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=not (self.training and T > 16))
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(128, d)
        self.blocks = nn.ModuleList([LongTrainAttention(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def hidden(self, input_ids):
        T = input_ids.shape[1]
        x = self.emb(input_ids) + self.pos(torch.arange(T, device=input_ids.device))
        for b in self.blocks:
            x = x + b(x)
        return x

    def forward(self, input_ids):
        return self.head(self.hidden(input_ids))


def test_grad_causality_sees_a_train_path_leak_past_16_tokens():
    """Rows cut to a quarter of the session's 128 tokens reach past the 16 where the train path's mask goes; the eval
    path is causal at every length, so nothing else fails."""
    model = {"source": "python", "factory": "tests.test_shortcuts_sound:TinyLM"}
    report = run_checks(model, ["grad-causality", "future-token"], inputs={"batch_size": 2, "seq_len": 128})
    assert "FWD121" in failing(report.result("grad-causality")), report.result("grad-causality").summary


# -- grad-causality: rows no shorter than the declared min_seq_len ----------------------------------------------------


class NeedsLongRows(TinyLM):
    def forward(self, input_ids):
        assert input_ids.shape[1] >= 32, f"sequence length {input_ids.shape[1]} is shorter than the block of 32"
        x = self.emb(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for b in self.blocks:
            y = b.qkv(x)  # a correct causal block: always is_causal
            B, T, C = x.shape
            q, k, v = y.view(B, T, 3, b.h, C // b.h).permute(2, 0, 3, 1, 4)
            x = x + b.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return self.head(x)


def test_grad_causality_respects_the_declared_min_seq_len():
    model = {"source": "python", "factory": "tests.test_shortcuts_sound:NeedsLongRows"}
    res = run_checks(
        model, ["grad-causality"], inputs={"batch_size": 2, "seq_len": 64, "min_seq_len": 32}, code_paths=NO_PATHS
    ).result("grad-causality")
    assert res.status.value == "pass", res.summary


# -- observer: model code in an output's property is observed ---------------------------------------------------------


class LazyOutput:
    def __init__(self, hidden, head):
        self.hidden, self.head = hidden, head

    @functools.cached_property
    def logits(self):  # lazy logits through a final dropout left training=True: dropout live in eval
        return self.head(F.dropout(self.hidden, p=0.1, training=True))


class LazyLM(TinyLM):
    def forward(self, input_ids):
        return LazyOutput(self.hidden(input_ids), self.head)


def test_dropout_in_a_lazy_logits_property_is_observed():
    model = {"source": "python", "factory": "tests.test_shortcuts_sound:LazyLM"}
    res = run_checks(model, ["mask-audit"], code_paths=NO_PATHS).result("mask-audit")
    assert "FWD207" in failing(res), res.summary


# -- one observed short row for mask-audit, attention-stats and backends' kernels -------------------------------------


def test_one_observed_short_row_serves_mask_audit_attention_stats_and_backends():
    """The three checks that look at the first row's short length alone read one observed forward of it (short_row.py)
    instead of one each, and each still finds its own bug there: the scale applied twice (attention-stats), q and k
    as SDPA was handed them (backends' kernels), the batch-size-1 pass of mask-audit."""
    from fwdcheck.config.registry import select
    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.model.sources import load_model
    from fwdcheck.run.runner import run_model
    from fwdcheck.run.settings import Settings

    fields = {"source": "reference", "vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2}
    config = config_from_dict(
        {
            "model": {**fields, "bugs": ["scale-applied-twice"]},
            "inputs": {"batch_size": 2, "seq_len": 64},
            "code_paths": NO_PATHS,
        }
    )
    model = load_model(config)
    shapes: list[tuple[int, ...]] = []
    model.module.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    report = run_model(model, Settings.from_config(config), select(["mask-audit", "attention-stats", "backends"]))
    assert shapes.count((1, 16)) == 1, shapes  # the short row, observed once
    assert report.result("mask-audit").data["batch1"] == "observed"
    assert "FWD955" in failing(report.result("attention-stats"))
    backends = report.result("backends")
    assert backends.data["kernels_ran"]["math"] == 2, backends.data  # both layers' SDPA calls replayed


# -- rope: a model that claims no rotary embedding is screened at 16 positions first -----------------------------------


class Undeclared(nn.Module):
    """The reference transformer behind a plain module: nothing tells fwdcheck whether it has a rotary embedding."""

    def __init__(self, positional: str):
        super().__init__()
        torch.manual_seed(0)
        self.inner = build(vocab_size=32, d_model=32, n_heads=2, n_layers=2, positional=positional)

    def forward(self, input_ids, position_ids=None):
        return self.inner(input_ids, position_ids=position_ids)


@pytest.mark.parametrize("positional", ["rope", "learned"])
def test_rope_screens_a_model_that_claims_nothing_at_16_positions(positional):
    """A model with learned positions is probed once, at 16 positions, and said to have no rotary embedding; one
    whose rotary embedding nobody declared is probed again at the full 32 and judged as a declared one is: the
    screen finds the rotation, it does not judge it."""
    import fwdcheck

    module = Undeclared(positional)
    probes: list[int] = []
    module.register_forward_pre_hook(
        lambda m, args, kwargs: probes.append((args[0] if args else kwargs["input_ids"]).shape[1]), with_kwargs=True
    )
    rope = fwdcheck.check_model(module, ["rope"], vocab_size=32, seq_len=64, code_paths={"enabled": False})
    result = rope.results[0]
    if positional == "learned":
        assert result.status.value == "skip" and "no rotary embedding" in result.summary, result.summary
        assert 32 not in probes and 16 in probes, probes
    else:
        assert result.status.value == "pass", result.summary
        assert result.data["probe"]["q"]["pairing"] == "half", result.data["probe"]
        assert probes.count(32) >= 2, probes  # the probe and its shift, at the full length
