"""Weights that hide paths: an output projection initialised to zero (modded-nanogpt's c_proj, ReZero, adaLN-zero)
makes attention contribute nothing at initialisation, so a leak after the attention call (its output rolled one step
in time) moves no logit. fwdcheck gives such weights small random values for the run and puts the zeros back; a
checkpoint's weights are left as loaded.

Shapes: B (batch), T (sequence), C (width), nh (heads), hs (head size).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from tests.conftest import run_checks

VOCAB, WIDTH, HEADS, LAYERS = 32, 16, 2, 2


class Attention(nn.Module):
    def __init__(self, leak: bool):
        super().__init__()
        self.leak = leak
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.c_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        nn.init.zeros_(self.c_proj.weight)  # as modded-nanogpt initialises it

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1)
        )  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        if self.leak:  # each position takes the next one's attention output: outside any mask
            y = torch.roll(y, shifts=-1, dims=1)
        return self.c_proj(y)


class ZeroProjectionLM(nn.Module):
    def __init__(self, leak: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Attention(leak) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.emb(input_ids)  # (B, T, C)
        for block in self.blocks:
            x = x + block(self.norm(x))
        return self.head(self.norm(x))  # (B, T, V)


def build(leak: bool = False) -> nn.Module:
    return ZeroProjectionLM(leak)


def future_token(model: nn.Module):
    return fwdcheck.check_model(model, ["future-token"], vocab_size=VOCAB, seq_len=8)


def test_a_leak_behind_a_zero_initialised_projection_fails():
    model = build(leak=True)
    report = future_token(model)
    result = report.result("future-token")
    assert result.status.value == "fail" and "FWD101" in {f.code for f in result.findings}, result.summary
    assert any("identically zero at initialisation" in note for note in report.notes), report.notes


def test_the_same_model_without_the_leak_passes_and_is_left_as_found():
    model = build(leak=False)
    report = future_token(model)
    assert report.result("future-token").status.value == "pass"
    note = next(note for note in report.notes if "identically zero" in note)
    assert "blocks.0.c_proj.weight" in note and "2 weight(s)" in note
    assert all(not block.c_proj.weight.any() for block in model.blocks)  # zero again, bit for bit
    assert all(torch.equal(b.c_proj.weight, torch.zeros(WIDTH, WIDTH)) for b in model.blocks)


def test_a_checkpoints_zeros_are_left_as_loaded(tmp_path):
    """Loaded weights are the model's own numbers: nothing is woken, and the hidden leak stays hidden."""
    path = tmp_path / "zero.pt"
    torch.save(build(leak=True).state_dict(), path)
    spec = {"source": "checkpoint", "factory": "tests.test_zero_weights:build", "kwargs": {"leak": True}}
    report = run_checks({**spec, "path": str(path), "vocab_size": VOCAB}, ["future-token"])
    assert not any("identically zero" in note for note in report.notes), report.notes
    assert report.result("future-token").status.value == "pass"  # what the zeros hide, as loaded
