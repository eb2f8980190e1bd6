"""mask-audit's declared chunks (FWD214): the keys each query of a chunked-attention layer may read against the chunk
the model declares (query p reads exactly positions C * (p // C) .. p). transformers' Llama 4 passes as shipped and
fails with its chunked mask dropped (full causal), its chunk one token larger or smaller, or its boundaries shifted by
one, planted through the mask functions it uses; a hand-written model declares its chunk in the config."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from fwdcheck.config.schema import config_from_dict
from fwdcheck.errors import UsageError
from fwdcheck.model.capabilities import Chunks, Windows
from tests.conftest import codes, run_checks
from tests.models import AttentionLM

CHECK = "mask-audit"
DECLARED = "layer 0 declares chunked attention in chunks of 4 tokens"


def chunked(T: int, size: int | None, shift: int = 0) -> torch.Tensor:
    """(T, T) bool, True = may attend: causal, and within one chunk of `size` (counted from position -shift); None:
    plain causal."""
    i = torch.arange(T)
    mask = i[None, :] <= i[:, None]  # (T, T): key j for query i when j <= i
    if size is not None:
        mask &= (i[None, :] + shift) // size == (i[:, None] + shift) // size
    return mask


def band(T: int, width: int) -> torch.Tensor:
    """(T, T) bool: a sliding band of `width` keys, the query included."""
    ones = torch.ones(T, T, dtype=torch.bool)
    return ones.tril() & ~ones.tril(-width)


class MaskedAttention(nn.Module):
    """SDPA attention over the mask `build(T)` makes."""

    def __init__(self, build):
        super().__init__()
        self.build = build
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.build(T))  # (B, nh, T, hs)
        return out.transpose(1, 2).reshape(B, T, C)


class Layered(AttentionLM):
    """One attention layer per mask builder."""

    def __init__(self, *builds):
        torch.manual_seed(0)
        super().__init__(lambda: (MaskedAttention(b) for b in builds))


def chunks(size: int | None, shift: int = 0):
    return functools.partial(chunked, size=size, shift=shift)


def audit(model: nn.Module, seq_len: int = 12, **declared):
    return fwdcheck.check_model(model, [CHECK], seq_len=seq_len, min_seq_len=min(seq_len, 8), **declared).results[0]


def test_a_declared_chunk_kept_passes():
    r = audit(Layered(chunks(4), chunks(4)), chunk=4)
    assert r.status.value == "pass", r.findings
    records = [c["chunk"] for c in r.data["calls"] if "chunk" in c]
    assert records and all(c["judged"] and c["measured"] == "chunks of 4" for c in records)
    assert "chunks as declared at 2 call(s)" in r.summary


@pytest.mark.parametrize(
    ("size", "shift", "what", "query"),
    [
        (None, 0, "is full causal attention, across every chunk boundary", "position 4 reads positions 0-4"),
        (5, 0, "cuts chunks of 5 (boundaries at 5, 10, not 4, 8)", "position 4 reads positions 0-4"),
        (3, 0, "cuts chunks of 3 (boundaries at 3, 6, 9, not 4, 8)", "position 3 reads position 3 "),
        (4, 1, "puts the chunk boundaries at 3, 7, 11, not at 4, 8", "position 3 reads position 3 "),
        (4, -1, "puts the chunk boundaries at 1, 5, 9, not at 4, 8", "position 1 reads position 1 "),
    ],
)
def test_a_mask_other_than_the_declared_chunk_fails_saying_what_it_is(size, shift, what, query):
    r = audit(Layered(chunks(size, shift), chunks(4)), chunk=4)
    assert r.status.value == "fail"
    assert {f.code for f in r.findings} == {"FWD214"}
    (finding,) = r.findings
    assert finding.message.startswith(DECLARED), finding.message
    assert "declared in the config (model.chunk)" in finding.message
    assert f"but its mask {what}: the query at {query}" in finding.message
    assert finding.where.startswith("layers.0")


def test_a_sliding_band_on_a_chunked_layer_is_named():
    r = audit(Layered(functools.partial(band, width=4), chunks(4)), chunk=4)
    assert {f.code for f in r.findings} == {"FWD214"}
    assert "but its mask is a sliding band of 4 keys, not chunks" in r.findings[0].message


def test_chunks_per_layer_judge_the_full_layers_too():
    """Layer 1 declared full attention reads chunks: the chunked mask handed to every layer (FWD211). Declared as
    full, a full layer passes."""
    both = audit(Layered(chunks(4), chunks(4)), chunk=[4, None])
    assert [(f.code, f.message.split(" declares")[0]) for f in both.findings] == [("FWD211", "layer 1")]
    assert "a band or chunk where none is declared" in both.findings[0].message
    right = audit(Layered(chunks(4), chunks(None)), chunk=[4, None])
    assert right.status.value == "pass", right.findings
    assert "full attention as declared at 1 call(s); chunks as declared at 1 call(s)" in right.summary


def test_windows_and_chunks_on_different_layers_each_judged():
    model = Layered(chunks(4), functools.partial(band, width=3))
    right = audit(model, chunk=[4, None], window=[None, 3])
    assert right.status.value == "pass", right.findings
    assert [("chunk" in c, "window" in c) for c in right.data["calls"][:2]] == [(True, False), (False, True)]
    wrong = audit(model, chunk=[None, 4], window=[3, None])
    assert {f.code for f in wrong.findings} == {"FWD211", "FWD214"}


def test_a_run_within_one_chunk_says_not_judged():
    """At T = 4 a chunk of 4 reads like full causal attention: a chunk dropped, or one token larger, cannot show."""
    for size in (None, 5, 4):
        r = audit(Layered(chunks(size), chunks(size)), seq_len=4, chunk=4)
        assert r.status.value == "pass", r.findings
        assert not any(c["chunk"]["judged"] for c in r.data["calls"])
        assert "chunks not judged: every query here reads within its own chunk of 4" in r.summary
        assert "(a sequence of 5 tokens or more crosses one)" in r.summary


def test_a_boundary_inside_the_first_chunk_fails_even_when_none_is_crossed():
    """At T = 4 a chunk of 3 starts a chunk at position 3, where the declared chunk of 4 has none: that is seen."""
    r = audit(Layered(chunks(3), chunks(4)), seq_len=4, chunk=4)
    assert {f.code for f in r.findings} == {"FWD214"}


def test_no_chunk_declared_is_not_judged_on_chunks():
    r = audit(Layered(chunks(4), chunks(4)))
    assert r.status.value == "pass", r.findings
    assert all("chunk" not in c and "window" not in c for c in r.data["calls"])


def test_a_python_model_declares_its_chunk_in_the_config():
    """Through a config file's `chunk:`, as a python source reads it."""
    section = {"source": "python", "factory": "tests.test_mask_audit_chunks:chunked_model", "chunk": 4}
    assert codes(run_checks(section, [CHECK], inputs={"batch_size": 2, "seq_len": 12}), CHECK) == set()
    section["chunk"] = 5
    assert codes(run_checks(section, [CHECK], inputs={"batch_size": 2, "seq_len": 12}), CHECK) == {"FWD214"}


def chunked_model() -> nn.Module:
    """Two layers of chunked attention, chunks of 4 (the factory a config names)."""
    return Layered(chunks(4), chunks(4))


@pytest.mark.parametrize(
    ("declared", "refused"),
    [
        ({"chunk": 0}, "chunk"),
        ({"window": 4, "chunk": [4, None]}, "window: 4 is one window for every layer, and chunk: is given too"),
        ({"window": [4, None], "chunk": 8}, "chunk: 8 is one chunk for every layer"),
        ({"window": [4, None], "chunk": [None, 8, None]}, "window: has 2 entries and chunk: 3"),
        ({"window": [4, None], "chunk": [8, None]}, r"layer 0 is given both a window \(4\) and a chunk \(8\)"),
    ],
)
def test_a_config_declaring_a_layer_twice_is_refused_in_one_line(declared, refused):
    with pytest.raises(Exception, match=refused):
        config_from_dict({"model": {"source": "python", "factory": "x:y", **declared}})
    with pytest.raises(UsageError, match=refused):
        fwdcheck.check_model(Layered(chunks(4)), [CHECK], **declared)


def test_a_config_declares_chunks_per_layer():
    config = config_from_dict(
        {"model": {"source": "python", "factory": "x:y", "chunk": [4, None], "window": [None, 3]}}
    )
    assert (config.model.chunk, config.model.window) == ([4, None], [None, 3])
    windows = Windows.declared(config.model.window, "here", chunk=config.model.chunk)
    assert (windows.of(0), windows.of(1), windows.widest) == (Chunks(4), 3, 4)
    every = Windows.declared(None, "here", chunk=8)
    assert (every.of(0), every.of(5), every.widest, every.chunked) == (Chunks(8), Chunks(8), 8, True)
    assert not Windows.declared(4, "here").chunked


def test_transformers_llama4_config_declares_its_chunked_layers():
    """Llama 4's config: chunked_attention on the layers without rope (three of every four), attention_chunk_size."""
    from transformers import Llama4TextConfig

    from fwdcheck.model.sources.attention_declared import transformers_windows

    windows = transformers_windows(Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=16), "Llama 4")
    assert windows is not None
    assert [windows.of(i) for i in range(4)] == [Chunks(16), Chunks(16), Chunks(16), None]
    assert windows.widest == 16 and "attention_chunk_size 16 on its chunked_attention layers" in windows.origin
    assert transformers_windows(Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=None), "Llama 4") is None


# -- transformers' Llama 4: as shipped, and with its chunked mask planted otherwise -----------------------------------

LLAMA4 = dict(
    model_type="llama4_text",
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size_mlp=64,
    num_local_experts=2,
    no_rope_layer_interval=2,  # layer 0 chunked, layer 1 full attention
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def _llama4(chunk: int | None = 4) -> dict:
    from tests import compat

    fields = dict(LLAMA4)
    return compat.hf(fields.pop("model_type"), attention_chunk_size=chunk, **fields)


@pytest.fixture
def planted(monkeypatch):
    """Llama 4's chunked mask as transformers builds it (masking_utils.chunked_overlay, which create_chunked_causal_mask
    goes through), planted otherwise: dropped for the plain causal mask, one token larger or smaller, or its
    boundaries shifted by one."""
    import transformers.masking_utils as masking
    import transformers.models.llama4.modeling_llama4 as llama4

    shipped = masking.chunked_overlay

    def plant(bug: str) -> None:
        if bug == "full causal":
            monkeypatch.setattr(llama4, "create_chunked_causal_mask", masking.create_causal_mask)
        elif bug == "chunked on every layer":
            monkeypatch.setattr(llama4, "create_causal_mask", masking.create_chunked_causal_mask)
        elif bug.startswith("size"):
            by = int(bug.removeprefix("size "))
            monkeypatch.setattr(masking, "chunked_overlay", lambda size, left: shipped(size + by, left))
        else:
            by = int(bug.removeprefix("shift "))

            def overlay(size, left):
                def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
                    return (kv_idx - left[batch_idx] + by) // size == (q_idx - left[batch_idx] + by) // size

                return inner_mask

            monkeypatch.setattr(masking, "chunked_overlay", overlay)

    return plant


@pytest.mark.slow
def test_transformers_llama4_passes_as_shipped():
    """On every cell of the code-path matrix too (eager and sdpa, every attention mask, left padding)."""
    report = run_checks(_llama4(), [CHECK], inputs={"batch_size": 2, "seq_len": 12})
    r = report.result(CHECK)
    assert r.status.value == "pass", r.findings
    records = [c["chunk"] for c in r.data["calls"] if c.get("chunk")]
    assert records and all(c["judged"] and c["layer"] == 0 and c["declared"] == 4 for c in records)
    full = [c["window"] for c in r.data["calls"] if c.get("window")]
    assert full and all(c["judged"] and c["layer"] == 1 and c["declared"] is None for c in full)
    assert r.paths is not None and len(r.paths.rows) > 4 and r.paths.failing == 0
    assert all("chunks as declared at 1 call(s)" in row.summary for row in r.paths.rows), r.paths.rows


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bug", "what"),
    [
        ("full causal", "is full causal attention"),
        ("size 1", "cuts chunks of 5"),
        ("size -1", "cuts chunks of 3"),
        ("shift 1", "puts the chunk boundaries at 3, 7, 11, not at 4, 8"),
        ("shift -1", "puts the chunk boundaries at 1, 5, 9, not at 4, 8"),
    ],
)
def test_transformers_llama4_chunk_planted_otherwise_fails_naming_the_layer(bug, what, planted):
    planted(bug)
    report = run_checks(_llama4(), [CHECK], inputs={"batch_size": 2, "seq_len": 12}, code_paths={"enabled": False})
    assert codes(report, CHECK) == {"FWD214"}
    messages = [f.message for f in report.result(CHECK).findings]
    assert all(m.startswith(DECLARED) for m in messages), messages  # the full-attention layer is not named
    assert any(f"but its mask {what}" in m for m in messages), messages
    assert all("transformers' Llama4TextConfig: attention_chunk_size 4" in m for m in messages)


@pytest.mark.slow
def test_transformers_llama4_chunked_mask_on_its_full_layer_fails():
    """The chunked mask handed to the full-attention layer too: FWD211 names layer 1."""
    import transformers.masking_utils as masking
    import transformers.models.llama4.modeling_llama4 as llama4

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama4, "create_causal_mask", masking.create_chunked_causal_mask)
        report = run_checks(_llama4(), [CHECK], inputs={"batch_size": 2, "seq_len": 12}, code_paths={"enabled": False})
    assert codes(report, CHECK) == {"FWD211"}
    assert all(f.message.startswith("layer 1 declares full causal attention") for f in report.result(CHECK).findings)


@pytest.mark.slow
def test_transformers_llama4_declaring_no_chunk_is_not_judged_on_chunks():
    r = run_checks(_llama4(chunk=None), [CHECK], code_paths={"enabled": False}).result(CHECK)
    assert r.status.value == "pass", r.findings
    assert all("chunk" not in c and "window" not in c for c in r.data["calls"])


@pytest.mark.slow
def test_backends_compares_rows_that_cross_the_declared_chunk(monkeypatch):
    """backends compares the implementations on a whole row, which crosses the declared chunk: an SDPA path that
    drops the chunk (transformers' is_causal shortcut planted to ignore the chunk size, as a window was once ignored)
    parts from eager, where a row of 16 tokens would sit inside one chunk and agree."""
    import transformers.masking_utils as masking

    shipped = masking._ignore_causal_mask_sdpa

    def ignoring_the_chunk(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return shipped(padding_mask, q_length, kv_length, q_offset, kv_offset, None)

    inputs = {"batch_size": 2, "seq_len": 32}
    shipped_run = run_checks(_llama4(16), ["backends"], inputs=inputs, code_paths={"enabled": False})
    assert shipped_run.results[0].status.value == "pass", shipped_run.results[0].findings
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", ignoring_the_chunk)
    r = run_checks(_llama4(16), ["backends"], inputs=inputs, code_paths={"enabled": False}).results[0]
    assert r.data["implementations"]["tokens"] == [1, 32]
    assert "FWD801" in {f.code for f in r.findings}, r.summary
