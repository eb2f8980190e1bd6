"""The default selection is every check that applies: each check says which models it applies to, a model with the
capability gets the check, one without gets a skip reading "does not apply: <reason>", and the command line says
which checks run by default and when each applies."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

import fwdcheck
from fwdcheck.cli import app
from fwdcheck.config.registry import _is_builtin, available, info, select
from fwdcheck.result import DOES_NOT_APPLY, does_not_apply
from tests.conftest import run_checks

runner = CliRunner()
CAPABILITY_CHECKS = ("kv-cache", "packing", "label-shift", "rope-precision")  # each needs a capability a model offers


class PlainCausal(nn.Module):
    """An embedding, one causal SDPA block and a head: logits and nothing else (no cache, loss, packing, rotary or
    attention switch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        x = self.embed(input_ids)  # (B, T, d)
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))  # (B, h, T, d_h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, 16)  # (B, T, d)
        return self.head(x + y)


class NoAttention(nn.Module):
    """Logits from each token alone: no attention call to observe, no switch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def gate(module: nn.Module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwdcheck.check_model(module)


def test_the_default_is_every_check_but_those_that_say_why_not():
    builtins = {name: info(entry) for name, entry in available().items() if _is_builtin(entry)}
    default = {name for name, about in builtins.items() if about.default}
    assert default == {
        *("shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "packing", "label-shift"),
        *("grad-causality", "backends", "rope-precision", "attention-stats"),
    }
    for name, about in builtins.items():
        if not about.default:  # left out: the reason is declared, and says when it runs
            assert about.applies_when.startswith("runs asked for") or "distributed" in about.applies_when, name
    for name in CAPABILITY_CHECKS:
        assert builtins[name].applies_when, name
    assert [e.name for e in select(["default"])] == [e.name for e in select(None)]


def test_a_model_with_each_capability_gets_each_check():
    report = run_checks({"source": "reference", "vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2})
    assert {r.name: r.status.value for r in report.results} == {e.name: "pass" for e in select(None)}


def test_a_model_without_them_gets_a_skip_saying_it_does_not_apply():
    report = gate(PlainCausal())
    for name in (*CAPABILITY_CHECKS, "rope"):
        result = report.result(name)
        assert does_not_apply(result), (name, result.summary)
        assert len(result.summary) > len(DOES_NOT_APPLY) + 10, result.summary  # and the reason follows
    assert "declare one" in report.result("kv-cache").summary  # how to give the model the capability
    # what it has, it gets: SDPA calls to compare kernels on, gradients to record, attention calls to measure
    for name in ("shape-ledger", "future-token", "mask-audit", "grad-causality", "backends", "attention-stats"):
        assert report.result(name).status.value == "pass", (name, report.result(name).summary)
    assert report.exit_code == 0


def test_without_attention_calls_the_attention_checks_do_not_apply():
    report = gate(NoAttention())
    for name in ("backends", "attention-stats"):
        assert does_not_apply(report.result(name)), report.result(name).summary
    assert report.result("grad-causality").status.value == "pass"  # each token alone: no gradient crosses


def test_a_skip_for_want_of_inputs_is_not_a_check_that_does_not_apply():
    report = run_checks({"source": "reference"}, ["kv-cache", "packing"], inputs={"batch_size": 2, "seq_len": 3})
    for name in ("kv-cache", "packing"):
        result = report.result(name)
        assert result.status.value == "skip" and not does_not_apply(result) and "too short" in result.summary


def plain() -> nn.Module:
    return PlainCausal()


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves paired, angles in float32: x [..., T, d_h] at positions [T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32) / half)  # (d_h/2,)
    angles = positions.float()[:, None] * inv_freq  # (T, d_h/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def test_rope_precision_needs_a_declared_context_length():
    model = {
        "source": "python",
        "factory": "tests.test_default_set:plain",
        "rotary_function": "tests.test_default_set:rotate",
        "dims": {"h": 2, "d_h": 8},
    }
    undeclared = run_checks(model, ["rope-precision"]).result("rope-precision")
    assert does_not_apply(undeclared) and "context length" in undeclared.summary, undeclared.summary
    declared = run_checks({**model, "max_positions": 4096}, ["rope-precision"]).result("rope-precision")
    assert declared.status.value == "pass" and "4095" in declared.summary, declared.summary


def test_list_and_run_help_say_when_each_check_applies():
    listed = runner.invoke(app, ["list"], catch_exceptions=False)
    assert listed.exit_code == 0
    text = " ".join(listed.stdout.split())
    assert text.count("applies to:") == len(available())
    assert "applies to: every model" in text and "does not apply" in text
    helped = runner.invoke(app, ["run", "--help"], catch_exceptions=False, env={"COLUMNS": "200"})
    assert helped.exit_code == 0
    help_text = "".join(helped.stdout.split())  # wrapped at spaces and hyphens: compared without either break
    assert "Checks(default:everycheckthatapplies" in help_text
    for name, entry in available().items():
        applies = info(entry).applies_when or "every model"
        said = f"{name}{'' if info(entry).default else 'not in the default: '}{applies}"
        assert "".join(said.split()) in help_text, name
