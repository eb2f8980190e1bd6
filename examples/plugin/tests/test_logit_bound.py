"""The check both ways: a model it must pass, and one model per finding code it must flag.

The check is named by its class (`fwdcheck_logit_bound:LogitBound`), so these tests run whether or not the
distribution is installed; test_registered checks the entry point when it is.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import fwdcheck
from fwdcheck.model.reference import build

CHECK = "fwdcheck_logit_bound:LogitBound"


def small(**fields):
    torch.manual_seed(0)
    return build(vocab_size=256, d_model=64, n_heads=4, n_layers=2, **fields)


def verdict(model, **options):
    report = fwdcheck.check_model(model, [CHECK], **options)
    result = report.results[0]
    return report, result.status.value, {f.code for f in result.findings}


def test_default_initialisation_passes():
    report, status, codes = verdict(small())
    assert (status, codes) == ("pass", set()), report.results[0].summary
    metrics = report.results[0].metrics
    assert metrics["max_abs_logit"] < 30
    # PyTorch's default init: logits of order one, the loss on random targets near ln V
    assert abs(metrics["random_target_loss"] - metrics["ln_vocab"]) < 1.0
    report.raise_for_failures()


def test_tied_embedding_left_at_its_n01_init_fails():
    model = small()
    model.lm_head.weight = model.wte.weight  # tied, and nn.Embedding's default init is N(0, 1), not std 0.02
    report, status, codes = verdict(model)
    assert (status, codes) == ("fail", {"LOGIT102"})
    assert report.results[0].metrics["max_abs_logit"] > 30
    with pytest.raises(AssertionError, match="LOGIT102|exceeds the bound"):
        report.raise_for_failures()


def test_the_same_model_with_std_002_passes():
    model = small()
    model.lm_head.weight = model.wte.weight
    with torch.no_grad():
        model.wte.weight.normal_(0.0, 0.02)
    assert verdict(model)[1:] == ("pass", set())


def test_nonfinite_logits_fail():
    model = small()
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    report, status, codes = verdict(model)
    assert (status, codes) == ("fail", {"LOGIT101"})
    assert "NaN" in report.results[0].findings[0].message


def test_collapsed_final_norm_warns():
    """A final norm whose weight and bias are zero: every position reads out the same logits. (A zero read-out
    matrix, deliberate in some recipes, is not one: fwdcheck gives it small random values for the run.)"""
    model = small()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.zero_()
    report, status, codes = verdict(model)
    assert (status, codes) == ("warn", {"LOGIT103"})
    assert report.ok  # a warning passes ...
    assert not fwdcheck.check_model(model, [CHECK], fail_on="warn").ok  # ... unless warnings fail


def test_bound_from_the_environment(monkeypatch):
    monkeypatch.setenv("FWDCHECK_LOGIT_BOUND", "0.5")
    assert verdict(small())[1:] == ("fail", {"LOGIT102"})


def test_a_subclass_sets_the_bound():
    import fwdcheck_logit_bound

    class Loose(fwdcheck_logit_bound.LogitBound):
        bound = 1000.0

    fwdcheck_logit_bound.Loose = Loose  # importable as module:Class, as a config would name it
    try:
        model = small()
        model.lm_head.weight = model.wte.weight
        report = fwdcheck.check_model(model, ["fwdcheck_logit_bound:Loose"])
        assert report.results[0].status.value == "pass"
    finally:
        del fwdcheck_logit_bound.Loose


def test_registered():
    try:
        importlib.metadata.distribution("fwdcheck-logit-bound")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fwdcheck-logit-bound is not installed (pip install -e examples/plugin)")
    from fwdcheck.config.registry import available

    entry = available()["logit-bound"]
    assert entry.label == "fwdcheck-logit-bound[logit-bound]"
    assert entry.load().codes.keys() == {"LOGIT101", "LOGIT102", "LOGIT103"}
