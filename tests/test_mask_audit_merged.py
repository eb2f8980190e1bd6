"""mask-audit on a decoder that attends over its own tokens and its source in one call (T5Gemma 2's merged self- and
cross-attention: keys [T + S], the source's S keys after the tokens' own), driven with no adapter, its source held
fixed. The call is judged as two blocks: the tokens' own keys as the decoder's self-attention (causal), the source's
as a cross-attention (every source position readable). The source's keys were read as future positions (a false
FWD204) until the blocks were told apart; a causal or truncated mask over the source block is still FWD212, and a
self block opened to the future still fails.

The bugs are planted in transformers' own T5Gemma 2 (tiny, random weights) by a pre-hook on its merged attention that
rewrites the mask the model built, each first shown in plain torch to move the logits.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # builds a Hugging Face model for every case


def t5gemma2(kind: str, plant: str | None = None):
    """The tiny T5Gemma 2 the family sweeps build, with `plant` rewriting every merged attention's mask: "causal
    source" (decoder position i reads source positions <= i), "truncated source" (the last 3 source positions closed
    to every decoder position) or "open self" (every decoder position reads every decoder key)."""
    from tests.arch_sweep import plain

    model = plain("t5gemma2", kind)

    def rewrite(module, args, kwargs):
        mask = kwargs.get("merged_attention_mask")
        if mask is None:
            return None
        L = kwargs["hidden_states"].shape[1]
        S = mask.shape[-1] - L  # (B, 1, L, L + S): the tokens' keys, then the source's
        keep = torch.ones(L, L + S, dtype=torch.bool)
        if plant == "causal source":
            keep[:, L:] = torch.ones(L, S, dtype=torch.bool).tril()
        elif plant == "truncated source":
            keep[:, L + S - 3 :] = False
        opened = mask.clone()
        if mask.dtype == torch.bool:
            opened &= keep
            if plant == "open self":
                opened[..., :L] = True
        else:
            opened = opened.masked_fill(~keep, torch.finfo(mask.dtype).min)
            if plant == "open self":
                opened[..., :L] = 0.0
        return args, {**kwargs, "merged_attention_mask": opened}

    if plant is not None:
        hooked = [
            m.register_forward_pre_hook(rewrite, with_kwargs=True)
            for m in model.modules()
            if type(m).__name__ == "T5Gemma2MergedAttention"
        ]
        assert hooked, "T5Gemma 2 has no merged attention to plant the bug in"
    return model


def logits(model) -> torch.Tensor:
    """The decoder's logits beside a fixed source, transformers alone."""
    from tests.family_sweep import logits as decoder_logits

    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return decoder_logits(model, ids)


def audit(model):
    from fwdcheck import check_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_model(model, ["mask-audit", "future-token"], code_paths={"enabled": False})


@pytest.mark.parametrize("kind", ["seq2seq", "image-text-to-text"])
def test_the_merged_call_passes_as_a_causal_self_block_and_a_fully_read_source_block(kind):
    report = audit(t5gemma2(kind))
    result = report.result("mask-audit")
    assert result.status.value == "pass", (result.summary, [f.message for f in result.findings])
    merged = [row for row in result.data["calls"] if row.get("merged")]
    own = [row for row in merged if row["merged"].startswith("self block")]
    source = [row for row in merged if row["merged"].startswith("source block")]
    assert own and len(own) == len(source)  # each merged call judged as its two blocks
    assert all(row["judged"] and not row["reads_future"] for row in own)
    assert {row["pattern"] for row in source} == {"cross-attention: every source position"}
    assert all(row["keys"] == 8 for row in source)  # the source held fixed: 8 tokens
    assert report.result("future-token").status.value == "pass"


@pytest.mark.parametrize("plant", ["causal source", "truncated source"])
def test_a_source_block_read_in_part_is_fwd212(plant):
    clean, planted = t5gemma2("seq2seq"), t5gemma2("seq2seq", plant)
    with torch.no_grad():  # the planted mask moves the logits in plain torch
        assert (logits(planted) - logits(clean)).abs().max() > 1e-4 * logits(clean).abs().max()
    result = audit(planted).result("mask-audit")
    assert result.status.value == "fail"
    assert {f.code for f in result.findings if f.status.value == "fail"} == {"FWD212"}, result.findings


def test_a_self_block_that_reads_the_future_still_fails():
    report = audit(t5gemma2("seq2seq", "open self"))
    failed = {f.code for f in report.result("mask-audit").findings if f.status.value == "fail"}
    assert failed & {"FWD201", "FWD204"}, failed
    assert "FWD212" not in failed  # the source block is still read whole
    assert report.result("future-token").status.value == "fail"
