"""Encoder-decoders from `source: hf` with no adapter: the decoder's tokens are under test, the source held fixed.

The obvious config ({source: hf, config: {model_type: t5, ...tiny}}) builds AutoModelForSeq2SeqLM; fwdcheck draws one
source row (seeded, no special tokens), hands it to every forward beside the decoder's tokens, and says so in the
report's notes. The clean architectures pass; a dropped decoder mask, a causal cross-attention mask and a dead
cross-attention are each caught, each bug shown to be real in plain torch first.

Builds transformers models: the slow tier.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fwdcheck import check_model
from tests.conftest import run_checks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

V = 64
BART_LIKE = dict(
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_position_embeddings=64,
)
T5_LIKE = dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
CONFIGS = {
    "t5": T5_LIKE,
    "mt5": T5_LIKE,
    "bart": BART_LIKE,
    "mbart": BART_LIKE,
    "plbart": BART_LIKE,
    "marian": {**BART_LIKE, "pad_token_id": 0, "decoder_start_token_id": 0},  # its defaults name token 58100
    "pegasus": BART_LIKE,
    "m2m_100": BART_LIKE,
    "blenderbot": BART_LIKE,
    "blenderbot-small": BART_LIKE,
    "fsmt": {**BART_LIKE, "src_vocab_size": V, "tgt_vocab_size": V, "langs": ["en", "de"]},
    "led": {
        **{k: v for k, v in BART_LIKE.items() if k != "max_position_embeddings"},
        "max_encoder_position_embeddings": 64,
        "max_decoder_position_embeddings": 64,
        "attention_window": [4, 4],
    },
}


def spec(model_type: str) -> dict:
    """T5, mT5, M2M100, FSMT and LED have no causal LM class: the obvious config builds the encoder-decoder; the
    others name it (their default is the decoder alone, XForCausalLM)."""
    seq2seq_by_default = model_type in ("t5", "mt5", "m2m_100", "fsmt", "led")
    named = {} if seq2seq_by_default else {"class": "AutoModelForSeq2SeqLM"}
    return {"source": "hf", **named, "config": {"model_type": model_type, "vocab_size": V, **CONFIGS[model_type]}}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_obvious_config_passes_with_the_source_held_fixed(model_type):
    four = ["shape-ledger", "future-token", "mask-audit", "rope"]  # what the decoder's forward is judged on here
    report = run_checks(spec(model_type), four, code_paths={"enabled": False})
    statuses = {r.name: r.status.value for r in report.results}
    assert statuses == {"shape-ledger": "pass", "future-token": "pass", "mask-audit": "pass", "rope": "skip"}, [
        (r.name, r.summary) for r in report.results
    ]
    assert any(n.startswith("held fixed: the encoder's input_ids") for n in report.notes)
    assert report.model["attention_pattern"].startswith("encoder-decoder")
    audit = report.result("mask-audit")
    assert "cross-attention: every source position" in audit.summary
    read = audit.data["source"]
    assert read["change_with_another_source"] > read["noise_floor"]  # the decoder reads its source


def bart() -> nn.Module:
    config = transformers.AutoConfig.for_model("bart", vocab_size=V, **BART_LIKE)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config).eval()


def logits(model: nn.Module, source: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=source, decoder_input_ids=ids, use_cache=False).logits


IDS = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(2))
SOURCES = torch.randint(3, V, (2, 1, 8), generator=torch.Generator().manual_seed(3)).expand(2, 2, 8)


def run(model: nn.Module):
    return check_model(model, ["future-token", "mask-audit"], code_paths={"enabled": False})


def codes(report, check: str) -> set[str]:
    return {f.code for f in report.result(check).findings}


def test_a_dropped_decoder_mask_is_caught_without_an_adapter():
    def drop(model):
        for name, module in model.named_modules():
            if name.startswith("model.decoder.") and name.endswith("self_attn"):
                module.is_causal = False
                module.register_forward_pre_hook(lambda m, a, kw: (a, {**kw, "attention_mask": None}), with_kwargs=True)
        return model

    changed = IDS.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    planted = drop(bart())
    moved = (logits(planted, SOURCES[0], IDS) - logits(planted, SOURCES[0], changed))[:, 0].abs().max()
    assert moved > 1e-4  # plain torch: the first position reads the last token
    report = run(drop(bart()))
    assert "FWD101" in codes(report, "future-token")
    assert codes(report, "mask-audit") & {"FWD201", "FWD204"}


def test_a_causal_cross_attention_mask_is_caught_without_an_adapter():
    def causal_cross(model):
        def hook(module, args, kwargs):
            L, S = args[0].shape[1], kwargs["key_value_states"].shape[1]
            keep = torch.ones(L, S, dtype=torch.bool).tril()
            mask = torch.zeros(L, S).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]  # (1, 1, L, S)
            return args, {**kwargs, "attention_mask": mask}

        for name, module in model.named_modules():
            if name.endswith("encoder_attn"):
                module.register_forward_pre_hook(hook, with_kwargs=True)
        return model

    assert (logits(bart(), SOURCES[0], IDS) - logits(causal_cross(bart()), SOURCES[0], IDS)).abs().max() > 1e-4
    report = run(causal_cross(bart()))
    assert "FWD212" in codes(report, "mask-audit")
    assert report.result("future-token").status.value == "pass"


def test_a_dead_cross_attention_is_caught():
    """The cross-attention's output dropped: the decoder's logits no longer depend on the source."""

    def dead(model):
        for name, module in model.named_modules():
            if name.endswith("encoder_attn"):
                module.register_forward_hook(lambda m, a, out: (torch.zeros_like(out[0]), *out[1:]))
        return model

    other = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(4))
    assert (logits(bart(), SOURCES[0], IDS) - logits(bart(), other, IDS)).abs().max() > 1e-4  # clean: reads it
    assert (logits(dead(bart()), SOURCES[0], IDS) - logits(dead(bart()), other, IDS)).abs().max() == 0  # planted
    clean = run(bart())
    assert "FWD213" not in codes(clean, "mask-audit")
    report = run(dead(bart()))
    assert "FWD213" in codes(report, "mask-audit")


def test_prophetnet_n_gram_self_attention_is_not_taken_for_cross_attention():
    """ProphetNet's decoder attends over its main and predicting streams with einsum: the keys are the tokens' own
    (followed through the einsum's own operands, not a re-laid copy), so those calls are self-attention, judged
    causal, and only its cross_attn reads the source. Before, the decoder layer's encoder_hidden_states made every
    call cross-attention, and its causal main stream a false FWD212."""
    config = {
        "model_type": "prophetnet",
        "vocab_size": V,
        "hidden_size": 16,
        "encoder_ffn_dim": 32,
        "decoder_ffn_dim": 32,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "num_encoder_attention_heads": 2,
        "num_decoder_attention_heads": 2,
        "ngram": 2,
        "max_position_embeddings": 64,
    }
    report = run_checks(
        {"source": "hf", "class": "AutoModelForSeq2SeqLM", "config": config},
        ["mask-audit"],
        code_paths={"enabled": False},
    )
    audit = report.result("mask-audit")
    assert audit.status.value == "pass", [f.message for f in audit.findings]
    rows = audit.data["calls"]
    own = [r for r in rows if r["module"].startswith("prophetnet.decoder.") and r["module"].endswith("self_attn")]
    cross = [r for r in rows if r["module"].endswith("cross_attn")]
    assert own and all(r["judged"] and r["pattern"].startswith("causal") for r in own)
    assert cross and all(r["pattern"] == "cross-attention: every source position" for r in cross)
