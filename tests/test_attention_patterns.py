"""The attention pattern by design, judged on real models both ways.

A bidirectional encoder (BertForMaskedLM) reads the future by design: it passes, said so, never a bare leak. An
encoder-decoder (BART, T5, torch's nn.Transformer) driven with its source held fixed passes, its cross-attention
judged as reading all of the source; with its decoder's causal mask dropped it fails future-token and mask-audit, and
with a causal or truncated cross-attention mask mask-audit fails FWD212. Each planted bug is shown to move the logits
in plain torch first: the bug is real, not a pattern only fwdcheck objects to.

Building transformers models costs seconds: the file is in the slow tier.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fwdcheck import check_model
from fwdcheck.model.sources.pattern import read_pattern

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

V, B, T, S = 64, 2, 8, 8
SOURCE = torch.randint(3, V, (B, S), generator=torch.Generator().manual_seed(1))  # the source, held fixed
CHECKS = ["future-token", "mask-audit"]


def tiny(model_type: str, cls: str, **fields) -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type, vocab_size=V, **fields)
    torch.manual_seed(0)
    return getattr(transformers, cls)(config).eval()


def bart() -> nn.Module:
    return tiny(
        "bart",
        "BartForConditionalGeneration",
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
    )


def t5() -> nn.Module:
    return tiny(
        "t5",
        "T5ForConditionalGeneration",
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
    )


def decoder_reads(model: nn.Module, ids: torch.Tensor, **_) -> torch.Tensor:
    """The decoder's logits for ids [b, T], the source held fixed."""
    return model(input_ids=SOURCE[: ids.shape[0]], decoder_input_ids=ids).logits


def run(model: nn.Module, **kwargs):
    return check_model(model, CHECKS, forward=decoder_reads, vocab_size=V, code_paths={"enabled": False}, **kwargs)


def codes(report, check: str) -> set[str]:
    return {f.code for f in report.result(check).findings}


# -- planted bugs, as hooks on the real attention modules -------------------------------------------------------------


def self_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's self-attention modules (BART's self_attn, T5's SelfAttention)."""
    return [
        m
        for n, m in model.named_modules()
        if n.startswith(("model.decoder.", "decoder.")) and n.endswith(("self_attn", "SelfAttention"))
    ]


def cross_attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(("encoder_attn", "EncDecAttention"))]


def mask_key(module: nn.Module) -> str:
    return "mask" if type(module).__name__.startswith("T5") else "attention_mask"


def drop_decoder_mask(model: nn.Module) -> nn.Module:
    """The decoder's self-attention handed no mask and is_causal off: every decoder position reads every other."""
    for module in self_attention_modules(model):
        module.is_causal = False
        module.register_forward_pre_hook(lambda m, a, kw: (a, {**kw, mask_key(m): None}), with_kwargs=True)
    return model


def restrict_cross_attention(model: nn.Module, how: str) -> nn.Module:
    """Cross-attention handed a mask that closes part of the source: `causal` (decoder position i reads source
    positions <= i, the decoder's own causal mask handed on), or `truncated` (the last 3 source positions closed)."""

    def hook(module, args, kwargs):
        L = args[0].shape[1]
        keep = (
            torch.ones(L, S, dtype=torch.bool).tril()
            if how == "causal"
            else torch.arange(S)[None, :].expand(L, S) < S - 3
        )
        additive = torch.zeros(L, S).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]  # (1, 1, L, S)
        return args, {**kwargs, mask_key(module): additive}

    for module in cross_attention_modules(model):
        module.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def logits_move(clean: nn.Module, planted: nn.Module) -> float:
    """How far the planted bug moves the decoder's logits, in plain torch."""
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return float((decoder_reads(clean, ids) - decoder_reads(planted, ids)).abs().max())


# -- reading the pattern off the model ---------------------------------------------------------------------------------


def test_the_pattern_is_read_off_each_kind_of_model():
    bert = tiny(
        "bert", "BertForMaskedLM", hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    llama = tiny(
        "llama", "LlamaForCausalLM", hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    assert read_pattern(bert).kind == "bidirectional"
    assert "BertSelfAttention.is_causal is False" in read_pattern(bert).origin
    assert read_pattern(llama).kind == "causal"
    assert read_pattern(bart()).kind == "encoder-decoder"
    assert read_pattern(nn.Transformer(16, 2, 1, 1, 32, batch_first=True)).kind == "encoder-decoder"
    assert read_pattern(nn.Linear(2, 2)) is None


# -- a bidirectional encoder -------------------------------------------------------------------------------------------


def test_bert_is_bidirectional_by_design_and_passes_saying_so():
    """BertForMaskedLM reads every token both ways, as designed: no FWD101 or FWD201, and the summary says why the
    causal comparisons did not run; what must still hold (samples apart, determinism) is judged."""
    bert = tiny(
        "bert", "BertForMaskedLM", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    report = check_model(bert, CHECKS, code_paths={"enabled": False})
    future = report.result("future-token")
    assert future.status.value == "pass", future.summary
    assert "bidirectional by design" in future.summary
    assert "batch" in future.summary  # samples independent: judged
    assert report.result("mask-audit").status.value == "pass"
    assert "bidirectional by design" in report.result("mask-audit").summary
    assert report.model["attention_pattern"].startswith("bidirectional by design")


def test_bert_declared_causal_still_fails_as_a_leak():
    """Declaring the pattern wins over what the model shows: a BERT declared causal reads the future."""
    bert = tiny(
        "bert", "BertForMaskedLM", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    report = check_model(bert, CHECKS, attention={"pattern": "causal"}, code_paths={"enabled": False})
    assert "FWD101" in codes(report, "future-token")
    assert "FWD201" in codes(report, "mask-audit")


# -- encoder-decoders --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [bart, t5], ids=["bart", "t5"])
def test_an_encoder_decoder_passes_its_cross_attention_judged(build):
    report = run(build())
    assert report.result("future-token").status.value == "pass"
    audit = report.result("mask-audit")
    assert audit.status.value == "pass", [f.message for f in audit.findings]
    judged_cross = [r for r in audit.data["calls"] if r["judged"] and r["pattern"].startswith("cross-attention")]
    assert judged_cross, audit.summary
    assert not any(r["module"].startswith("encoder.") and r["judged"] for r in audit.data["calls"])


@pytest.mark.parametrize("build", [bart, t5], ids=["bart", "t5"])
def test_a_dropped_decoder_mask_is_caught(build):
    ids = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    planted = drop_decoder_mask(build())
    with torch.no_grad():  # plain torch: the first position moves when the last token changes
        moved = (decoder_reads(planted, ids) - decoder_reads(planted, changed))[:, 0].abs().max()
    assert moved > 1e-4
    report = run(drop_decoder_mask(build()))
    assert "FWD101" in codes(report, "future-token")
    assert codes(report, "mask-audit") & {"FWD201", "FWD204"}


@pytest.mark.parametrize("how", ["causal", "truncated"])
@pytest.mark.parametrize("build", [bart, t5], ids=["bart", "t5"])
def test_a_restricted_cross_attention_is_caught(build, how):
    assert logits_move(build(), restrict_cross_attention(build(), how)) > 1e-4  # plain torch: the bug is real
    report = run(restrict_cross_attention(build(), how))
    audit = report.result("mask-audit")
    assert "FWD212" in codes(report, "mask-audit"), audit.summary
    finding = next(f for f in audit.findings if f.code == "FWD212")
    assert ("causal mask handed to cross-attention" in finding.message) == (how == "causal")
    assert report.result("future-token").status.value == "pass"  # still causal: only mask-audit sees it


class TorchSeq2Seq(nn.Module):
    """torch's nn.Transformer with embeddings and a head; memory_mask optionally causal (the bug)."""

    def __init__(self, causal_memory: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(V, 16), nn.Linear(16, V)
        self.transformer = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.causal_memory = causal_memory

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        L = target.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(L)
        memory_mask = (
            nn.Transformer.generate_square_subsequent_mask(L)[:, : source.shape[1]] if self.causal_memory else None
        )
        y = self.transformer(self.embed(source), self.embed(target), tgt_mask=mask, memory_mask=memory_mask)
        return self.head(y)


def torch_reads(model: nn.Module, ids: torch.Tensor, **_) -> torch.Tensor:
    return model(SOURCE[: ids.shape[0]], ids)


def test_nn_transformer_passes_and_its_causal_memory_mask_is_caught():
    clean = check_model(TorchSeq2Seq().eval(), CHECKS, forward=torch_reads, vocab_size=V)
    assert {r.status.value for r in clean.results} == {"pass"}, [r.summary for r in clean.results]
    assert clean.model["attention_pattern"].startswith("encoder-decoder")
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # plain torch: the causal memory mask moves the logits
        assert (
            float((torch_reads(TorchSeq2Seq().eval(), ids) - torch_reads(TorchSeq2Seq(True).eval(), ids)).abs().max())
            > 1e-4
        )
    planted = check_model(TorchSeq2Seq(True).eval(), CHECKS, forward=torch_reads, vocab_size=V)
    assert "FWD212" in codes(planted, "mask-audit")


# -- a prefix-LM (x-transformers' PrefixDecoder) -----------------------------------------------------------------------

PREFIX = 4


def prefix_lm(bug: str | None = None) -> nn.Module:
    """x-transformers' PrefixDecoder: the first prefix_attn_len tokens read each other, the rest is causal. Planted:
    `prefix-reads-suffix` builds the prefix mask over the queries instead of the keys (a prefix query reads the whole
    row); `suffix-not-causal` forgets the causal part (every token reads every token)."""
    from x_transformers import TransformerWrapper
    from x_transformers.x_transformers import AttentionLayers, PrefixDecoder

    class Planted(PrefixDecoder):
        def forward(self, x, *args, attn_mask=None, prefix_attn_len=None, **kwargs):
            n = x.shape[1]
            if bug == "prefix-reads-suffix":
                causal = torch.ones((n, n), dtype=torch.bool, device=x.device).tril()
                prefix = (torch.arange(n, device=x.device) < prefix_attn_len)[:, None]  # (n, 1): the queries' axis
                mask = causal | prefix
            else:
                mask = torch.ones((n, n), dtype=torch.bool, device=x.device)
            return AttentionLayers.forward(self, x, *args, attn_mask=mask, **kwargs)

    torch.manual_seed(0)
    layers = (Planted if bug else PrefixDecoder)(dim=16, depth=2, heads=2)
    return TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=layers).eval()


def with_prefix(model: nn.Module, ids: torch.Tensor, **_) -> torch.Tensor:
    return model(ids, prefix_attn_len=PREFIX)


def run_prefix_lm(model: nn.Module):
    declared = {"pattern": "prefix", "prefix_length": PREFIX}
    return check_model(
        model, CHECKS, forward=with_prefix, vocab_size=V, attention=declared, code_paths={"enabled": False}
    )


def test_a_prefix_lm_passes_with_its_prefix_read_both_ways():
    ids = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, PREFIX - 1] = (changed[:, PREFIX - 1] + 1) % V
    with torch.no_grad():  # plain torch: position 0 reads position PREFIX - 1 by design, so a causal judge would fail
        assert float((with_prefix(prefix_lm(), ids) - with_prefix(prefix_lm(), changed))[:, 0].abs().max()) > 1e-4
    report = run_prefix_lm(prefix_lm())
    assert {r.status.value for r in report.results} == {"pass"}, [r.summary for r in report.results]
    assert f"cuts from {PREFIX} on" in report.result("future-token").summary
    assert "prefix-LM" in report.result("mask-audit").summary


@pytest.mark.parametrize("bug", ["prefix-reads-suffix", "suffix-not-causal"])
def test_a_prefix_lm_reading_past_its_design_is_caught(bug):
    ids = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    with torch.no_grad():  # plain torch: a prefix (or earlier suffix) position moves when the last token changes
        moved = (with_prefix(prefix_lm(bug), ids) - with_prefix(prefix_lm(bug), changed))[:, : T - 1].abs().max()
    assert float(moved) > 1e-4
    report = run_prefix_lm(prefix_lm(bug))
    assert "FWD101" in codes(report, "future-token")
    assert codes(report, "mask-audit") & {"FWD201", "FWD204"}


def test_a_declared_pattern_contradicting_causal_is_refused():
    from fwdcheck.errors import UsageError

    with pytest.raises(UsageError, match="contradicts"):
        check_model(nn.Linear(2, 2), causal=False, attention={"pattern": "causal"})
    with pytest.raises(UsageError, match="prefix_length"):
        check_model(nn.Linear(2, 2), attention={"pattern": "prefix"})


# -- PaliGemma: the prefix from token_type_ids ------------------------------------------------------------------------


def paligemma(inverted: bool = False) -> nn.Module:
    """A tiny PaliGemma run on text: token_type_ids 0 mark the prompt (read both ways), 1 the suffix (causal).
    `inverted` reads the convention the other way round (1 = prefix): the suffix reads its future."""
    config = transformers.PaliGemmaConfig(
        text_config=dict(
            model_type="gemma",
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=128,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
        image_token_index=V - 1,
        projection_dim=32,
        hidden_size=32,
        vocab_size=V,
    )
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    if inverted:
        model.register_forward_pre_hook(
            lambda m, a, kw: (a, {**kw, "token_type_ids": 1 - kw["token_type_ids"]}), with_kwargs=True
        )
    return model


def with_token_types(model: nn.Module, ids: torch.Tensor, **kw) -> torch.Tensor:
    token_types = torch.ones_like(ids)
    token_types[:, :PREFIX] = 0  # the prompt
    return model(input_ids=ids, token_type_ids=token_types, **kw).logits


def run_paligemma(model: nn.Module):
    declared = {"pattern": "prefix", "prefix_length": PREFIX}
    # ids drawn below the image token: a text-only run
    return check_model(
        model, CHECKS, forward=with_token_types, vocab_size=V - 1, attention=declared, code_paths={"enabled": False}
    )


def test_paligemma_with_its_prompt_as_prefix_passes():
    ids = torch.randint(0, V - 1, (1, T), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, PREFIX - 1] = (changed[:, PREFIX - 1] + 1) % (V - 1)
    with torch.no_grad():  # plain torch: the prompt reads itself both ways, by design
        moved = (with_token_types(paligemma(), ids) - with_token_types(paligemma(), changed))[:, 0].abs().max()
    assert float(moved) > 1e-4
    report = run_paligemma(paligemma())
    assert {r.status.value for r in report.results} == {"pass"}, [r.summary for r in report.results]
    assert "prefix-LM" in report.result("mask-audit").summary


def test_paligemma_reading_its_token_types_inverted_is_caught():
    ids = torch.randint(0, V - 1, (1, T), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % (V - 1)
    with torch.no_grad():  # plain torch: the suffix, read both ways, moves when its last token changes
        moved = (with_token_types(paligemma(True), ids) - with_token_types(paligemma(True), changed))[:, PREFIX:-1]
    assert float(moved.abs().max()) > 1e-4
    report = run_paligemma(paligemma(inverted=True))
    assert "FWD101" in codes(report, "future-token")
    assert codes(report, "mask-audit") & {"FWD201", "FWD204"}
