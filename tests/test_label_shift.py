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
