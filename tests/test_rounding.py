"""The model's own rounding (fwdcheck/run/rounding.py), measured against a float64 twin, on transformers' Mamba.

A tiny Mamba's residual stream runs near 200 while its logits stay near 13: its first two tokens run alone differ from
the full run by 7.5e-5, over twice the float32 tolerance, and in float64 they agree exactly. That is rounding, and
future-token passes it; a leak in the same model, ten times smaller than the logits' rounding allowance would need to
hide it, still fails; a model that cannot run in float64 keeps the tolerance alone and says so.
"""

from __future__ import annotations

import pytest
import torch

import fwdcheck
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.run.rounding import ROUNDING_FACTOR, float64_twin


def mamba() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=512, hidden_size=768, num_hidden_layers=2, state_size=16)
    return transformers.MambaForCausalLM(config).eval()


def future_token(model: torch.nn.Module):
    report = fwdcheck.check_model(model, ["future-token"], code_paths={"enabled": False})
    return report, report.results[0]


def test_a_prefix_that_differs_by_rounding_alone_passes():
    model = mamba()
    _, result = future_token(model)
    metrics = result.metrics
    assert result.status.value == "pass", result.summary
    # The tolerance alone would have failed it: the rounding floor decided.
    assert metrics["max_change"] > metrics["tolerance"]
    assert metrics["rounding"] > 0
    assert metrics["threshold"] == pytest.approx(ROUNDING_FACTOR * metrics["rounding"])
    assert metrics["max_change"] <= metrics["threshold"]
    # The twin was a copy: the model is float32, in eval mode, as it was handed over.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not model.training


def test_a_leak_in_the_same_model_still_fails():
    """Each position's embedding gets 1e-3 of the next one's: a leak whose float64 twin leaks alike, so the rounding
    measured stays the model's rounding and excuses nothing of it."""
    model = mamba()
    model.backbone.embeddings.register_forward_hook(lambda module, args, out: out + 1e-3 * out.roll(-1, dims=1))
    _, result = future_token(model)
    assert result.status.value == "fail"
    assert "FWD101" in {f.code for f in result.findings}
    assert result.metrics["max_change"] > 10 * result.metrics["threshold"]
    assert 0 < result.metrics["rounding"] < result.metrics["max_change"] / 10


def test_a_model_that_cannot_run_in_float64_keeps_the_tolerance_and_says_why():
    model = mamba()

    def float32_only(module, args):
        if module.embeddings.weight.dtype != torch.float32:
            raise TypeError("this backbone runs in float32 only")

    model.backbone.register_forward_pre_hook(float32_only)
    report, result = future_token(model)
    assert "rounding" not in result.metrics
    assert result.metrics["threshold"] == result.metrics["tolerance"]
    notes = " ".join(report.notes)
    assert "rounding not measured: the model does not run in float64" in notes
    assert "this backbone runs in float32 only" in notes


def test_no_twin_when_the_copy_would_not_fit(monkeypatch):
    module = mamba()
    model = ModelUnderTest(module=module, label="mamba", source="factory", vocab_size=512)
    monkeypatch.setattr("fwdcheck.run.rounding._free_memory", lambda device: 1024)
    why = float64_twin(model, torch.device("cpu"))
    assert isinstance(why, str) and "a float64 copy of the model needs" in why and "free on cpu" in why
    monkeypatch.undo()
    twin = float64_twin(model, torch.device("cpu"))
    assert isinstance(twin, ModelUnderTest) and twin.module is not module
    assert {p.dtype for p in twin.module.parameters()} == {torch.float64}
    assert {p.dtype for p in module.parameters()} == {torch.float32}


class ImagePrefixLM(torch.nn.Module):
    """A vision-language model in miniature: 4 image embeddings before the text, a causal encoder layer over both,
    the text's logits out. `leak` gives each text embedding that much of the next one's: a real leak."""

    def __init__(self, leak: float = 0.0, vocab: int = 32, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.layer = torch.nn.TransformerEncoderLayer(width, 2, 64, dropout=0.0, batch_first=True)
        self.leak = leak

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        text = self.embed(ids)  # (B, T, D)
        text = text + self.leak * text.roll(-1, dims=1)
        x = torch.cat([image.to(text.dtype), text], dim=1)  # (B, 4 + T, D)
        n = x.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, dtype=x.dtype)
        return self.head(self.layer(x, src_mask=mask, is_causal=True))[:, image.shape[1] :]


def draws_its_image(model: torch.nn.Module, ids: torch.Tensor, **_) -> torch.Tensor:
    """The adapter the issue met: a seeded image drawn with torch.randn in the default dtype, which the float64 twin
    ran with the default dtype at float64, drawing other values."""
    torch.manual_seed(1)
    return model(ids, torch.randn(ids.shape[0], 4, 32))


def draws_in_the_models_dtype(model: torch.nn.Module, ids: torch.Tensor, **_) -> torch.Tensor:
    """A seeded image drawn in the dtype of the model's parameters: the float64 twin draws another one, whatever the
    default dtype."""
    torch.manual_seed(1)
    return model(ids, torch.randn(ids.shape[0], 4, 32, dtype=next(model.parameters()).dtype))


def twin_gap(adapter) -> float:
    """How far a float64 twin's logits lie from the run's when it runs as the session first runs it (default dtype
    float64): taken for rounding, ROUNDING_FACTOR times that would be the threshold."""
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        run = adapter(ImagePrefixLM(leak=0.02).eval(), ids)
        twin = ImagePrefixLM(leak=0.02).double().eval()
        torch.set_default_dtype(torch.float64)
        try:
            exact = adapter(twin, ids)
        finally:
            torch.set_default_dtype(torch.float32)
    return float((run.double() - exact).abs().max())


def test_the_twin_draws_the_runs_random_tensors_and_the_leak_fails():
    """The twin runs again with the default dtype as the run has it, draws the run's image, and measures rounding
    alone: the threshold stays far below the leak."""
    gap = twin_gap(draws_its_image)
    report = fwdcheck.check_model(
        ImagePrefixLM(leak=0.02).eval(), ["future-token"], forward=draws_its_image, vocab_size=32
    )
    result = report.result("future-token")
    assert result.metrics["max_change"] < ROUNDING_FACTOR * gap  # the gap would have excused the leak
    assert "FWD101" in {f.code for f in result.findings}, result.summary
    assert 0 < result.metrics["rounding"] < gap / 1000
    assert any(n.startswith("rounding measured with torch's default dtype left as the run's") for n in report.notes)


def test_a_twin_that_computed_something_else_excuses_no_leak():
    gap = twin_gap(draws_in_the_models_dtype)
    model = ImagePrefixLM(leak=0.02).eval()
    report = fwdcheck.check_model(model, ["future-token"], forward=draws_in_the_models_dtype, vocab_size=32)
    result = report.result("future-token")
    assert result.metrics["max_change"] < ROUNDING_FACTOR * gap  # the gap would have excused the leak
    assert "FWD101" in {f.code for f in result.findings}, result.summary
    assert "rounding" not in result.metrics
    assert any(n.startswith("rounding not used: the float64 twin's logits differ") for n in report.notes)


def test_the_same_model_without_the_leak_passes():
    report = fwdcheck.check_model(ImagePrefixLM().eval(), ["future-token"], forward=draws_its_image, vocab_size=32)
    assert report.result("future-token").status.value == "pass", report.result("future-token").summary
