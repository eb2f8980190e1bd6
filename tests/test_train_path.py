"""The train path as a cell of the default run's code-path matrix, for every source: train() mode, every dropout
zeroed, gradients on. future-token and mask-audit judge it like any other cell, and its logits must be the eval
path's (FWD108, naming the first module where they part). A mask dropped only with gradients or only in train mode
fails the default run; correct models pass; a model that cannot record gradients runs the cell without them, one
that cannot train at all skips it; the model is left as found."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from fwdcheck.result import PathRow, Shared
from fwdcheck.run import code_paths
from tests import compat
from tests.conftest import run_checks
from tests.test_flex_attention import FlexModel
from tests.test_grad_causality import THIRD_PARTY_CORRECT, VOCAB, TinyCausalLM

TRAIN_ROW = "train mode, default attention, mask absent, B=2"


def gate(module: nn.Module, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwdcheck.check_model(module, **kw)  # the default checks, as `fwdcheck run` with no check list


def train_row(report, check: str) -> PathRow:
    return next(row for row in report.result(check).paths.rows if row.path.startswith("train mode"))


# =====================================================================================================================
# Masks dropped on the train path fail the default run


@pytest.mark.parametrize("leak", ["grad-only", "train-only"])
def test_mask_dropped_only_on_the_train_path_fails_the_default_run(leak):
    report = gate(TinyCausalLM(leak))
    assert report.exit_code == 1
    future, audit = train_row(report, "future-token"), train_row(report, "mask-audit")
    assert future.path == TRAIN_ROW
    assert {"FWD101", "FWD108"} <= set(future.codes), future
    assert audit.codes == ("FWD201",), audit  # no causal restriction in the call the train path makes
    # the default path, eval without gradients, has its mask: only the train cell fails
    for check in ("future-token", "mask-audit"):
        result = report.result(check)
        assert [row.status.value for row in result.paths.rows] == ["fail"]
        assert all("1 of 1 code paths" in f.where for f in result.findings if f.status.value == "fail")
    apart = next(f for f in report.result("future-token").findings if f.code == "FWD108")
    assert apart.module == "proj"  # the first module after the attention call that reads the future


class TrainOnlyScaling(TinyCausalLM):
    """Causal on every path, but its head is scaled only in training: the train path computes other logits."""

    def __init__(self):
        super().__init__()
        self.head.register_forward_hook(lambda module, args, out: out * 1.5 if module.training else out)


def test_a_train_only_branch_that_reads_no_future_is_named_by_its_module():
    report = gate(TrainOnlyScaling())
    future = report.result("future-token")
    assert future.status.value == "fail"
    assert train_row(report, "future-token").codes == ("FWD108",)  # no leak: the cuts and the batch pass
    apart = next(f for f in future.findings if f.code == "FWD108")
    assert apart.module == "head" and "first seen at the output of head" in apart.message
    assert report.result("mask-audit").status.value == "pass"


# =====================================================================================================================
# Correct models pass the train cell


def test_correct_tiny_model_passes_with_train_and_eval_logits_equal():
    report = gate(TinyCausalLM())  # nn.Dropout(0.5) and SDPA's dropout_p=0.5 in training: zeroed on the train path
    assert report.exit_code == 0
    row = train_row(report, "future-token")
    assert row.status.value == "pass" and "train vs eval" in row.summary, row
    assert "the train path passes" in report.result("future-token").summary
    assert train_row(report, "mask-audit").status.value == "pass"


CORRECT = {
    "reference": {"source": "reference", "vocab_size": 64, "d_model": 32, "n_heads": 4, "n_layers": 2, "dropout": 0.1},
    "hf-llama": compat.hf("llama", num_key_value_heads=2, attention_dropout=0.1, **compat.LLAMA_LIKE),
    "hf-gpt2": compat.hf("gpt2", n_embd=32, n_layer=2, n_head=4),
    "nn.TransformerEncoder causal": {"source": "python", "factory": "tests.models:torch_encoder", "path": ["."]},
}


@pytest.mark.parametrize("name", list(CORRECT))
@pytest.mark.slow
def test_correct_models_pass_the_default_run_with_its_train_cell(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_checks(CORRECT[name], None, inputs={"batch_size": 2, "seq_len": 12})
    assert report.exit_code == 0, [(r.name, r.summary) for r in report.results]
    for check in ("future-token", "mask-audit"):
        row = train_row(report, check)
        assert row.status.value == "pass", (check, row)


THIRD_PARTY = {name: THIRD_PARTY_CORRECT[name] for name in ("x-transformers", "litgpt-llama")}


@pytest.mark.slow  # importing litgpt and x-transformers takes seconds
@pytest.mark.parametrize("name", list(THIRD_PARTY))
def test_third_party_models_pass_the_train_cell(name):
    spec = {"source": "python", "factory": THIRD_PARTY[name], "path": ["."]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_checks(spec, None)
    assert report.exit_code == 0, [(r.name, r.summary) for r in report.results]
    assert train_row(report, "future-token").status.value == "pass"


# =====================================================================================================================
# At the default length the cell runs on rows the eval path ran alone, and is held to their logits


LONG = 128  # inputs.seq_len at which the prefix ladder runs the short length (16 tokens) alone, and the single row


def test_at_the_default_length_the_cell_runs_on_the_eval_paths_rows_and_takes_its_pass():
    report = gate(TinyCausalLM(), seq_len=LONG)
    assert report.exit_code == 0
    row = train_row(report, "future-token")
    assert row.seq_len == 16 and row.shares == Shared(code_paths.RAN_ALONE, "logits"), row
    assert row.summary.startswith("train vs eval: the same logits as"), row
    assert train_row(report, "mask-audit").status.value == "pass"


@pytest.mark.parametrize("leak", ["grad-only", "train-only"])
def test_at_the_default_length_a_mask_dropped_on_the_train_path_still_fails_in_full(leak):
    """The train path's logits are not the eval path's on those rows: the cell runs its own comparisons on them."""
    report = gate(TinyCausalLM(leak), seq_len=LONG)
    assert report.exit_code == 1
    future = train_row(report, "future-token")
    assert {"FWD101", "FWD108"} <= set(future.codes) and future.shares is None, future
    assert train_row(report, "mask-audit").codes == ("FWD201",)


def test_at_the_default_length_a_train_only_branch_is_named_by_its_module():
    report = gate(TrainOnlyScaling(), seq_len=LONG)
    assert train_row(report, "future-token").codes == ("FWD108",)
    apart = next(f for f in report.result("future-token").findings if f.code == "FWD108")
    assert apart.module == "head"


class BatchStatistics(TinyCausalLM):
    """Causal per sample, but in train mode each position is centred by the mean over the batch (a norm over the batch
    axis): samples read each other on the train path only."""

    def forward(self, input_ids):
        logits = super().forward(input_ids)
        return logits - logits.mean(0, keepdim=True) if self.training else logits


def test_at_the_default_length_samples_read_each_other_on_the_train_path_fails():
    report = gate(BatchStatistics(), seq_len=LONG)
    future = train_row(report, "future-token")
    assert future.status.value == "fail" and "FWD108" in future.codes, future


# =====================================================================================================================
# What cannot run with gradients, or in train mode at all


@pytest.mark.slow
def test_flex_attention_on_cpu_runs_the_train_cell_without_gradients_and_says_so():
    report = gate(FlexModel("causal"), vocab_size=VOCAB, seq_len=12)
    assert report.exit_code == 0
    for check in ("future-token", "mask-audit"):
        row = train_row(report, check)
        assert row.status.value == "pass", row
        assert "run without gradients" in row.note and "backward" in row.note, row


@pytest.mark.slow
def test_a_wrong_flex_mask_still_fails_on_the_train_cell_without_gradients():
    report = gate(FlexModel("window-one-ahead"), vocab_size=VOCAB, seq_len=12)
    row = train_row(report, "mask-audit")
    assert row.status.value == "fail" and "FWD204" in row.codes


class NeedsLabelsToTrain(TinyCausalLM):
    def forward(self, input_ids):
        if self.training:
            raise ValueError("labels are required in training")
        return super().forward(input_ids)


def test_a_model_that_cannot_run_in_train_mode_skips_the_cell_with_its_reason():
    report = gate(NeedsLabelsToTrain())
    assert report.exit_code == 0
    grad = report.result("grad-causality")  # its train-mode forward cannot run either: no verdict, its reason said
    assert grad.status.value == "skip" and "labels are required in training" in grad.summary
    for check in ("future-token", "mask-audit"):
        row = train_row(report, check)
        assert row.status.value == "skip"
        assert "cannot run in train mode" in row.summary and "labels are required in training" in row.summary
        assert report.result(check).status.value == "pass"  # the default path's verdict stands


def test_train_false_leaves_the_train_cell_out():
    report = gate(TinyCausalLM("train-only"), code_paths={"train": False})
    assert report.result("future-token").paths is None  # the eval path alone cannot see the train-only branch
    assert report.result("future-token").status.value == "pass"
    # grad-causality runs its own train-mode forward, cell or no cell
    assert [r.name for r in report.failures] == ["grad-causality"]


# =====================================================================================================================
# The model is left as found


class Frozen(TinyCausalLM):
    def __init__(self):
        super().__init__()
        self.embed.weight.requires_grad_(False)
        self.qkv.weight.grad = torch.full_like(self.qkv.weight, 0.25)  # a gradient the caller accumulated
        self.dropout.eval()  # a submodule kept in eval on purpose, its parent in train mode


def test_the_model_is_left_exactly_as_found():
    model = Frozen().train()
    modes = {name: m.training for name, m in model.named_modules()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    report = gate(model)
    assert report.exit_code == 0
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert torch.equal(model.qkv.weight.grad, torch.full_like(model.qkv.weight, 0.25))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "qkv.weight")
    assert model.dropout.p == 0.5
    assert torch.is_grad_enabled()  # the caller's autograd mode is its own again


def test_a_functional_dropout_in_training_is_zeroed_on_the_train_path():
    class FunctionalDropout(TinyCausalLM):
        def forward(self, input_ids):
            return F.dropout(super().forward(input_ids), p=0.5, training=self.training)

    report = gate(FunctionalDropout())
    assert report.exit_code == 0
    assert train_row(report, "future-token").status.value == "pass"
