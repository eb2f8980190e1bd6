"""mask-audit's declared windows (FWD211): the band each call's mask allows against the sliding window the model
declares, per layer. transformers' Mistral (every layer), Qwen2 (layer_types from use_sliding_window and
max_window_layers) and Gemma 2 (alternating) pass as shipped, and fail with their band planted one key wider or
narrower through the mask function they use; a hand-written model declares its window in the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from tests.conftest import codes, run_checks
from tests.models import AttentionLM

CHECK = "mask-audit"


class BandedAttention(nn.Module):
    """Causal SDPA attention over a band of `window + wider` keys (the query included)."""

    def __init__(self, window: int, wider: int):
        super().__init__()
        self.window, self.wider = window, wider
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        B, T, C = x.shape
        ones = torch.ones(T, T, dtype=torch.bool)
        band = ones.tril() & ~ones.tril(-(self.window + self.wider))  # key j for query i when i - W < j <= i
        q, k, v = self.qkv(x).view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band).transpose(1, 2).reshape(B, T, C)


class Banded(AttentionLM):
    """Two layers of banded attention."""

    def __init__(self, window: int, wider: int = 0):
        super().__init__(lambda: (BandedAttention(window, wider) for _ in range(2)))


def test_a_declared_window_kept_passes():
    r = fwdcheck.check_model(Banded(4), [CHECK], window=4, seq_len=8).results[0]
    assert r.status.value == "pass", r.findings
    assert [c["window"]["measured"] for c in r.data["calls"][:2]] == [4, 4]
    assert "sliding windows as declared at 2 call(s)" in r.summary


@pytest.mark.parametrize(("wider", "measured", "how"), [(1, 5, "one key wider"), (-1, 3, "one key narrower")])
def test_a_band_one_key_off_the_declared_window_fails(wider, measured, how):
    r = fwdcheck.check_model(Banded(4, wider), [CHECK], window=4, seq_len=8).results[0]
    assert r.status.value == "fail"
    assert {f.code for f in r.findings} == {"FWD211"}
    messages = sorted(f.message for f in r.findings)
    assert len(messages) == 2 and messages[0].startswith("layer 0 declares a sliding window of 4 keys")
    assert f"lets a query read {measured}: {how}" in messages[0]
    assert "declared in the config (model.window)" in messages[0]


def test_a_window_per_layer_judges_each_layer():
    """Layer 1 declared full attention reads a band: the sliding mask handed to every layer."""
    r = fwdcheck.check_model(Banded(4), [CHECK], window=[4, None], seq_len=8).results[0]
    assert {f.code for f in r.findings} == {"FWD211"}
    (finding,) = r.findings
    assert finding.message.startswith("layer 1 declares full causal attention")
    assert "read only 4" in finding.message


class NumberedBlocks(Banded):
    """The layers in an nn.ModuleDict keyed by layer number, as OLMo-core and torchtitan keep them; layer 0 slides over
    4 keys, layer 1 over `second` (64: full causal attention at these lengths)."""

    def __init__(self, second: int):
        super().__init__(4)
        self.layers = nn.ModuleDict({"0": BandedAttention(4, 0), "1": BandedAttention(second, 0)})  # type: ignore[assignment]

    def forward(self, input_ids):
        x = self.embed(input_ids)  # (B, T, C)
        for attention in self.layers.values():
            x = x + attention(x)
        return self.head(x)


@pytest.mark.parametrize(("second", "code"), [(64, None), (4, "FWD211")])
def test_layers_kept_in_a_dict_by_number_are_judged_per_layer(second, code):
    """Each call finds its layer in a ModuleDict of numbered blocks too: judged, not "layer index is None"."""
    r = fwdcheck.check_model(NumberedBlocks(second), [CHECK], window=[4, None], seq_len=8).results[0]
    assert [c["window"]["layer"] for c in r.data["calls"][:2]] == [0, 1]
    if code is None:
        assert r.status.value == "pass" and "sliding windows as declared at 2 call(s)" in r.summary, r.findings
    else:
        assert [(f.code, f.message.split(" declares")[0]) for f in r.findings] == [(code, "layer 1")]


def test_no_window_declared_is_not_judged_on_width():
    r = fwdcheck.check_model(Banded(4, 1), [CHECK], seq_len=8).results[0]
    assert r.status.value == "pass", r.findings
    assert all("window" not in c for c in r.data["calls"])


def test_a_run_too_short_to_show_the_band_says_not_judged():
    """At T = 4 a window of 4 reads like full causal attention, and a band one key wider cannot show."""
    r = fwdcheck.check_model(Banded(4, 1), [CHECK], window=4, seq_len=4, min_seq_len=4).results[0]
    assert r.status.value == "pass", r.findings
    assert not any(c["window"]["judged"] for c in r.data["calls"])
    assert "width not judged: the longest query here reads 4 keys at most" in r.summary


def test_a_config_declares_the_window():
    from fwdcheck.config.schema import config_from_dict

    config = config_from_dict({"model": {"source": "python", "factory": "x:y", "window": [4, None]}})
    assert config.model.window == [4, None]
    with pytest.raises(Exception, match="window"):
        config_from_dict({"model": {"source": "python", "factory": "x:y", "window": 0}})


# -- transformers: as shipped, and with the band planted a key off through the mask function the model uses -------

WINDOWED = {
    "Mistral": dict(model_type="mistral", sliding_window=4),
    "Qwen2": dict(model_type="qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=1),
    "Gemma 2": dict(model_type="gemma2", sliding_window=4, head_dim=8),
}
SLIDING_LAYER = {"Mistral": 0, "Qwen2": 1, "Gemma 2": 0}  # Qwen2's first layer is below max_window_layers


def _spec(name: str) -> dict:
    from tests import compat

    fields = dict(WINDOWED[name])
    return compat.hf(fields.pop("model_type"), num_key_value_heads=2, **fields, **compat.LLAMA_LIKE)


@pytest.fixture
def band_off_by(monkeypatch):
    """transformers' sliding_window_overlay (masking_utils), which every sliding mask it builds goes through, keeping
    `by` keys more (or fewer) than `kv_idx > q_idx - sliding_window`."""
    import transformers.masking_utils as masking

    def plant(by: int) -> None:
        def overlay(sliding_window: int):
            def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
                return kv_idx > q_idx - sliding_window - by

            return inner_mask

        monkeypatch.setattr(masking, "sliding_window_overlay", overlay)

    return plant


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WINDOWED))
def test_transformers_windows_pass_as_shipped(name):
    r = run_checks(_spec(name), [CHECK]).results[0]
    assert r.status.value == "pass", r.findings
    bands = [c["window"] for c in r.data["calls"] if "window" in c]
    assert bands and all(b["judged"] for b in bands)
    assert {b["declared"] for b in bands if b["layer"] == SLIDING_LAYER[name]} == {4}
    assert None in {b["declared"] for b in bands} or name == "Mistral"  # full layers beside the sliding ones


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WINDOWED))
@pytest.mark.parametrize(("by", "measured"), [(1, 5), (-1, 3)])
def test_transformers_window_one_key_off_fails_naming_the_layer(name, by, measured, band_off_by):
    band_off_by(by)
    report = run_checks(_spec(name), [CHECK])
    assert codes(report, CHECK) == {"FWD211"}
    messages = [f.message for f in report.result(CHECK).findings]
    layer = SLIDING_LAYER[name]
    assert any(
        m.startswith(f"layer {layer} declares a sliding window of 4 keys") and f"read {measured}:" in m
        for m in messages
    ), messages
    if name != "Mistral":  # the full-attention layers stay full: only the sliding ones are named
        assert all(m.startswith(f"layer {layer} ") for m in messages), messages


@pytest.mark.parametrize(("declared", "code"), [(3, None), (4, "FWD211"), (2, "FWD211")])
def test_a_python_model_declares_its_window_in_the_config(declared, code):
    """tests/models.py's nanoGPT with Mistral-style local attention (each query reads itself and 2 keys before it),
    declared through the python source's `window:`."""
    report = run_checks({"source": "python", "factory": "tests.models:sliding_window", "window": declared}, [CHECK])
    assert codes(report, CHECK) == ({code} if code else set())
    bands = [c["window"] for c in report.result(CHECK).data["calls"] if c.get("window")]
    assert bands and all(b["judged"] and b["measured"] == 3 for b in bands)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["gemma3_text", "cohere2", "phi3", "gpt_neo", "starcoder2", "mixtral"],
)
def test_other_windowed_transformers_pass(name):
    """More of transformers' windowed models, correct as shipped: none reads another band than it declares."""
    from tests import compat

    fields = {
        "gemma3_text": dict(num_key_value_heads=2, head_dim=8, sliding_window=4),
        "cohere2": dict(num_key_value_heads=2, sliding_window=4),
        "phi3": dict(num_key_value_heads=2, sliding_window=4, pad_token_id=0),
        "starcoder2": dict(num_key_value_heads=2, sliding_window=4),
        "mixtral": dict(num_key_value_heads=2, sliding_window=4, num_local_experts=4),
    }
    if name == "gpt_neo":
        spec = compat.hf(
            "gpt_neo",
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=128,
        )
    else:
        spec = compat.hf(name, **compat.LLAMA_LIKE, **fields[name])
    r = run_checks(spec, [CHECK]).results[0]
    assert r.status.value == "pass", r.findings
    bands = [c["window"] for c in r.data["calls"] if c.get("window")]
    assert bands and all(b["judged"] for b in bands) and 4 in {b["declared"] for b in bands}
