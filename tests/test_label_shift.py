"""label-shift: the loss forward computes from labels is the next-token cross-entropy of its own logits, on the
reference model (planted bugs), Hugging Face causal LMs (transformers shifts inside its loss) and a nanoGPT-style
model whose data loader shifts the targets."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fwdcheck.config.registry import CheckEntry
from tests.conftest import run_checks
from tests.models import GPT, Block, CausalSelfAttention, GPTConfig

CHECK = "fwdcheck.checks.label_shift:LabelShift"
NANOGPT_LOSS = {"argument": "targets", "shifted_by": "caller", "output": 1, "ignore_index": -1}


class NanoGPT(GPT):
    """nanoGPT's forward(idx, targets): the data loader shifts (y = data[i+1:i+1+T]), the model does not; with
    targets, (logits of every position, loss); without, the last position's logits only."""

    def __init__(self, double_shift: bool = False):
        super().__init__(GPTConfig(), CausalSelfAttention, block=Block)
        self.double_shift = double_shift

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # (B, 1, V): inference only needs the last position
        logits = self.lm_head(x)  # (B, T, V)
        if self.double_shift:  # the HF habit kept on targets the data loader already shifted
            logits, targets = logits[:, :-1], targets[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return self.lm_head(x), loss


def nanogpt(double_shift: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT(double_shift)


def every_position(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor | None = None, **extras):
    """The `forward:` adapter nanoGPT needs for logits of every position: targets given (any), loss ignored; with
    the targets label-shift hands it (the adapter contract's extra), the (logits, loss) forward returns for them."""
    logits, loss = model(input_ids, targets if targets is not None else torch.zeros_like(input_ids))
    return logits if targets is None else (logits, loss)


def nanogpt_spec(factory: str = "nanogpt", **kwargs) -> dict:
    return {
        "source": "python",
        "factory": f"tests.test_label_shift:{factory}",
        "kwargs": kwargs,
        "forward": "tests.test_label_shift:every_position",
        "loss": NANOGPT_LOSS,
    }


def result(model: dict, **top):
    return run_checks(model, [CHECK], **top).results[0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_loss_passes(reference, attention, dtype):
    got = result(reference(attention=attention), dtype=dtype)
    assert got.status.value == "pass", got.summary
    assert got.metrics["matched"] == "shift 1"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_label_no_shift_is_named_shift_0(reference, dtype):
    got = result(reference(bugs=["label-no-shift"]), dtype=dtype)
    assert got.status.value == "fail"
    assert codes_of(got) == {"FWD701"}
    assert "shift 0" in got.summary


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_label_double_shift_crosses_rows(reference, dtype):
    got = result(reference(bugs=["label-double-shift"]), dtype=dtype)
    assert got.status.value == "fail"
    assert codes_of(got) == {"FWD702", "FWD703"}
    assert got.metrics["loss"] != got.metrics["rolled_rows_loss"]  # the row order moves it


def test_loss_checks_leave_the_logits_path_alone(reference):
    """No labels: the planted loss bugs change nothing the other checks see."""
    report = run_checks(reference(bugs=["label-no-shift"]))
    assert {r.name for r in report.results if r.status.value not in ("pass", "skip")} == {"label-shift"}


@pytest.mark.parametrize("name", ["GPT-2", "Llama (GQA)", "Mistral (sliding window 4)", "Qwen2", "Gemma (MQA)", "OPT"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hugging_face_causal_lms_pass(name, dtype):
    pytest.importorskip("transformers")
    from tests import compat

    got = result(compat.CASES[name][0], dtype=dtype, code_paths={"enabled": False})
    assert got.status.value == "pass", (got.summary, got.findings)
    assert got.data["convention"].startswith("transformers")


def test_hugging_face_masked_lm_skips():
    pytest.importorskip("transformers")
    from tests import compat

    got = result(compat.CASES["BERT (BertForMaskedLM)"][0], code_paths={"enabled": False})
    assert got.status.value == "skip"
    assert "bidirectional by design" in got.summary  # read off BertSelfAttention.is_causal


def test_nanogpt_with_shifted_targets_passes():
    got = result(nanogpt_spec())
    assert got.status.value == "pass", got.summary
    assert got.data["shifted_by"] == "caller"


def test_nanogpt_shifting_shifted_targets_again_fails():
    got = result(nanogpt_spec(double_shift=True))
    assert got.status.value == "fail"
    assert codes_of(got) == {"FWD702"}
    assert "shift 2" in got.summary


def test_python_model_without_a_declared_loss_skips():
    got = result({**nanogpt_spec(), "loss": None})
    assert got.status.value == "skip"
    assert "declares no loss" in got.summary


def test_loss_declared_at_the_wrong_place_skips():
    got = result({**nanogpt_spec(), "loss": {**NANOGPT_LOSS, "output": "loss"}})
    assert got.status.value == "skip"
    assert "returned no loss at 'loss'" in got.summary


def test_ignored_labels_counted_in_the_mean_fail():
    got = result(nanogpt_spec("mean_over_all"))
    assert codes_of(got) == {"FWD705"}


class MeanOverAll(NanoGPT):
    """Bug: the per-token losses summed over the counted targets but divided by every position."""

    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx, targets)
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction="none"
        )
        return logits, per_token.sum() / targets.numel()  # should be / (targets != -1).sum()


def mean_over_all() -> nn.Module:
    torch.manual_seed(0)
    return MeanOverAll()


def test_registered_in_pyproject():
    entries = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["entry-points"]
    value = entries["fwdcheck.checks"]["label-shift"]
    check = CheckEntry("label-shift", value, "fwdcheck 0.1.0").load()
    assert check.name == "label-shift" and check.default is True and "loss from labels" in check.applies_when
    assert set(check.codes) == {f"FWD70{i}" for i in range(1, 7)}


def codes_of(got) -> set[str]:
    return {f.code for f in got.findings}


# =====================================================================================================================
# What runs: one call where the session's logits stand in for the rows in another order


def test_one_call_on_the_session_rows_with_the_other_order_predicted(reference):
    """A correct loss on the session's rows: the rows in another order are the session's own forward of them, and
    forward is called once."""
    report = run_checks(reference(), [CHECK], inputs={"batch_size": 2, "seq_len": 32})
    got = report.results[0]
    assert got.status.value == "pass", got.summary
    assert got.data["row_source"] == "the session's first rows, rolled by one" and got.data["seq_len"] == 8
    assert got.data["other_order"].startswith("predicted from the session's logits")
    assert got.metrics["rolled_rows_loss"] == pytest.approx(got.metrics["loss"], abs=got.metrics["threshold"])


def test_rows_that_read_each_other_move_the_predicted_loss_and_a_call_confirms_it(reference):
    """Heads taking another sample's queries (batch-mix): the call's logits of a row beside another neighbour are not
    the session's, the predicted loss moves, and the call with the rows in another order shows the loss moving."""
    got = result(reference(bugs=["batch-mix"]))
    assert codes_of(got) == {"FWD703"}, got.findings
    assert got.data["other_order"] == "a call with the rows rolled by one"


def test_a_session_of_one_row_draws_its_rows_and_runs_the_other_order(reference):
    clean = result(reference(), inputs={"batch_size": 1, "seq_len": 8})
    assert clean.status.value == "pass", clean.summary
    assert clean.data["row_source"] == "drawn" and clean.data["other_order"] == "a call with the rows rolled by one"
    broken = result(reference(bugs=["label-double-shift"]), inputs={"batch_size": 1, "seq_len": 8})
    assert codes_of(broken) == {"FWD702", "FWD703"}


class SoftCappedLoss(nn.Module):
    """The reference transformer whose forward with labels soft-caps the logits it scores and returns them
    (cap * tanh(logits / cap), as Gemma 2 caps its final logits), while the plain forward does not: the loss call's
    logits are not the session's. The loss itself is right."""

    def __init__(self):
        super().__init__()
        from fwdcheck.model.reference import build

        torch.manual_seed(0)
        self.inner = build(vocab_size=32, d_model=16, n_heads=4)

    def forward(self, input_ids, labels=None):
        logits = self.inner(input_ids)  # (B, T, V)
        if labels is None:
            return logits
        cap = float(logits.abs().max())  # a cap the logits reach: tanh bends them visibly
        capped = cap * torch.tanh(logits / cap)
        loss = F.cross_entropy(capped[:, :-1].reshape(-1, capped.size(-1)), labels[:, 1:].reshape(-1))
        return capped, loss


def soft_capped_loss() -> nn.Module:
    return SoftCappedLoss()


def test_a_loss_call_with_logits_of_its_own_is_judged_by_a_call_not_by_the_prediction():
    """The prediction from the session's logits parts from the loss by the cap's change: not a finding, but a reason
    to run the rows in another order, whose loss agrees (no false FWD703)."""
    got = result({"source": "python", "factory": "tests.test_label_shift:soft_capped_loss", "loss": {"output": 1}})
    assert got.status.value == "pass", (got.summary, got.findings)
    assert got.data["other_order"] == "a call with the rows rolled by one"
