"""Where a leak enters (fwdcheck/checks/leak_entry.py): future-token's FWD101 names the first module whose output at an
earlier position moves, and which side of it the leak is on. Leaks outside any mask are located, not only detected:
attention's output rolled one step in time, a norm over the sequence axis; and a mask dropped inside a module."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

import fwdcheck
from tests.conftest import run_checks
from tests.test_zero_weights import VOCAB, WIDTH, Attention, build


def leak(model: nn.Module):
    result = fwdcheck.check_model(model, ["future-token"], vocab_size=VOCAB, seq_len=8).result("future-token")
    (finding,) = [f for f in result.findings if f.code == "FWD101"]
    return finding


def line_of(cls) -> str:
    return f"{inspect.getsourcelines(cls.forward)[1]}"


class SequenceCentred(nn.Module):
    """Subtracts the mean over the sequence: every position reads every other, later ones too."""

    def forward(self, x):
        return x - x.mean(dim=1, keepdim=True)  # (B, T, C)


class CentredLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.centre = SequenceCentred()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        return self.head(self.centre(self.emb(input_ids)))


class UnmaskedMHA(nn.Module):
    """torch's nn.MultiheadAttention called without a mask: the leak is inside a module of torch's own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)  # (B, T, C)
        return self.head(x + self.attn(x, x, x, need_weights=False)[0])


def test_a_roll_after_the_attention_call_is_located_in_the_code_before_the_projection():
    finding = leak(build(leak=True))
    assert finding.module == "blocks.0.c_proj"
    assert "the leak enters before blocks.0.c_proj" in finding.message and "so does its input" in finding.message
    assert finding.source.endswith(f"test_zero_weights.py:{line_of(Attention)}")  # Attention.forward, the roll's


def test_a_norm_over_the_sequence_is_located_at_its_module():
    finding = leak(CentredLM())
    assert finding.module == "centre" and "the leak enters at centre" in finding.message
    assert "its input does not" in finding.message
    assert finding.source.endswith(f"test_leak_entry.py:{line_of(SequenceCentred)}")


def test_a_mask_missing_inside_a_torch_module_names_that_module():
    finding = leak(UnmaskedMHA())
    assert finding.module == "attn" and "its input does not" in finding.message


def test_the_reference_models_dropped_mask_points_at_its_attention():
    result = run_checks({"source": "reference", "bugs": ["no-causal-mask"]}, ["future-token"]).result("future-token")
    (finding,) = [f for f in result.findings if f.code == "FWD101"]
    assert finding.module.startswith("layers.0.attn") and "look at the code of layers.0.attn" in finding.message
    assert "fwdcheck/model/reference.py:" in finding.source


def test_an_off_by_one_mask_leads_to_the_line_mask_audit_names():
    """nanoGPT with its mask buffer built one diagonal too high: the first module whose output moves is the innocent
    attn_dropout, but the leak comes through the attention call whose mask reads ahead. FWD101 names that call's
    line, the one mask-audit's FWD204 names, not the attention module's `def forward`."""
    from tests.corpus.nanogpt import every_position, gpt_with

    report = fwdcheck.check_model(gpt_with("block-leak"), ["future-token", "mask-audit"], forward=every_position)
    (leaked,) = [f for f in report.result("future-token").findings if f.code == "FWD101"]
    audited = [f for f in report.result("mask-audit").findings if f.code == "FWD204"]
    assert audited and leaked.source == audited[0].source and leaked.module == audited[0].module
    assert leaked.source.endswith("nanogpt.py:54")  # att = F.softmax(att, dim=-1), over the masked scores
    assert "comes through transformer.h.0.attn's attention, whose mask lets queries read later keys" in leaked.message
