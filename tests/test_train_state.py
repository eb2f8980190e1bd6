"""What ordinary models do on the train path, and with their logits, that is no bug: every dropout form zeroed
(nn.RNN/LSTM/GRU's `dropout`, alpha and feature dropout, dropout1d/2d/3d, functional, ATen and in-place forms),
state a train-mode forward updates (spectral norm's power-iteration vectors, BatchNorm's running statistics, a step
counter) put back between forwards, a kernel without a backward on this device (a skip, not the model's error), and
a masked vocabulary (-inf logits where both sides hold -inf are equal). Each tested both ways: the correct model
passes the default run, the planted bug (randomness the model draws itself, a leak behind a masked vocabulary, NaN)
still fails it.

Shapes: B (batch), T (sequence), d (width), V (vocabulary).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from fwdcheck.checks.future_token import FutureToken
from fwdcheck.run.compare import logit_scale, nonfinite_positions, position_change, relative_error

V, WIDTH, HEADS = 48, 16, 2


def gate(module: nn.Module, checks: list[str] | None = None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwdcheck.check_model(module, checks, **kw)


def failing(report) -> set[str]:
    return {f.code for r in report.results for f in r.findings if f.status.value in ("fail", "error")}


class Causal(nn.Module):
    """Causal self-attention through SDPA."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, h, T, d_h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, d))  # (B, T, d)


class LM(nn.Module):
    """embedding -> causal attention -> `between` -> head; `between` is where the case under test sits."""

    def __init__(self, between: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, WIDTH)
        self.attn = Causal()
        self.between = between or nn.Identity()
        self.head = nn.Linear(WIDTH, V)

    def forward(self, input_ids):
        x = self.embed(input_ids)  # (B, T, d)
        return self.head(self.between(x + self.attn(x)))  # (B, T, V)


# =====================================================================================================================
# 1. Every dropout form zeroed on the train path


class RecurrentLM(nn.Module):
    """A recurrent language model as torch builds them: dropout between the layers, from the module's float."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, WIDTH)
        self.rnn = getattr(nn, kind)(WIDTH, WIDTH, num_layers=2, batch_first=True, dropout=0.3)
        self.head = nn.Linear(WIDTH, V)

    def forward(self, input_ids):
        hidden, _ = self.rnn(self.embed(input_ids))  # (B, T, d)
        return self.head(hidden)


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
@pytest.mark.ordinary
def test_recurrent_dropout_is_zeroed_on_the_train_path_and_put_back(kind):
    model = RecurrentLM(kind)
    report = gate(model)
    assert report.exit_code == 0, failing(report)
    assert "FWD103" not in {c for row in report.result("future-token").paths.rows for c in row.codes}
    assert model.rnn.dropout == 0.3 and model.training  # as found: nn.Module starts in training mode


class FunctionalDropout(nn.Module):
    """Dropout called as a function, in each of the forms model code writes."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, x):  # x: (B, T, d)
        p, training = 0.3, self.training
        form = self.form
        if form == "alpha_dropout":
            return F.alpha_dropout(x, p, training)
        if form == "feature_alpha_dropout":
            return F.feature_alpha_dropout(x, p, training=training)
        if form == "dropout1d":
            return F.dropout1d(x.transpose(1, 2), p, training).transpose(1, 2)  # over (B, d, T)
        if form == "dropout2d":
            return F.dropout2d(x[..., None], p, training)[..., 0]  # (B, T, d, 1)
        if form == "dropout3d":
            return F.dropout3d(x[..., None, None], p, training)[..., 0, 0]  # (B, T, d, 1, 1)
        if form == "torch.dropout":
            return torch.dropout(x, p, training)
        if form == "in-place":
            return F.dropout(x.clone(), p, training, inplace=True)
        if form == "rrelu":
            return F.rrelu(x, training=training)
        raise ValueError(form)


MODULE_FORMS = {
    "AlphaDropout": lambda: nn.AlphaDropout(0.3),
    "FeatureAlphaDropout": lambda: nn.FeatureAlphaDropout(0.3),
    "Dropout1d": lambda: nn.Sequential(Transposed(nn.Dropout1d(0.3))),
    "RReLU": lambda: nn.RReLU(),
}
FUNCTIONAL_FORMS = [
    "alpha_dropout",
    "feature_alpha_dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "torch.dropout",
    "in-place",
    "rrelu",
]


class Transposed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.transpose(1, 2)).transpose(1, 2)  # (B, d, T) inside


@pytest.mark.parametrize("form", [*MODULE_FORMS, *FUNCTIONAL_FORMS])
@pytest.mark.ordinary
def test_every_dropout_form_is_zeroed_on_the_train_path(form):
    between = MODULE_FORMS[form]() if form in MODULE_FORMS else FunctionalDropout(form)
    report = gate(LM(between), ["future-token"])
    assert report.exit_code == 0, report.result("future-token").findings


class DrawsNoise(nn.Module):
    """Noise the model draws itself in training (router jitter, noisy embeddings): no dropout to zero."""

    def forward(self, x):
        return x * (1 + 0.1 * torch.rand_like(x)) if self.training else x


def test_randomness_the_model_draws_itself_is_fwd103_naming_the_draw():
    report = gate(LM(DrawsNoise()), ["future-token"])
    assert report.exit_code == 1
    (train,) = report.result("future-token").paths.rows
    assert "FWD103" in train.codes
    found = next(f for f in report.result("future-token").findings if f.code == "FWD103")
    assert "draws random numbers itself (rand_like)" in found.message and "train mode" in found.message
    assert found.source is not None and found.source.endswith(f"test_train_state.py:{_line_of('torch.rand_like')}")


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "def " not in line and "_line_of" not in line)


class AlphaDropoutInEval(nn.Module):
    """F.alpha_dropout with training=True whatever the mode: dropout live in eval."""

    def forward(self, x):
        return F.alpha_dropout(x, 0.3, True)


def test_functional_dropout_of_any_form_live_in_eval_is_named():
    report = gate(LM(AlphaDropoutInEval()), ["future-token", "mask-audit"], code_paths={"train": False})
    assert report.result("future-token").status.value == "fail"
    live = next(f for f in report.result("future-token").findings if f.code == "FWD103")
    assert "F.alpha_dropout p=0.3, training=True" in live.where
    assert any(f.code == "FWD207" and "F.alpha_dropout" in f.message for f in report.result("mask-audit").findings)


def test_fwd103_reads_as_what_it_means_on_each_path():
    meaning = FutureToken.codes["FWD103"]
    assert "live in eval mode (on the train path" not in meaning
    assert "eval mode" in meaning and "train path" in meaning and "draws random numbers itself" in meaning


# =====================================================================================================================
# 2. State a train-mode forward updates is put back between forwards


@pytest.mark.parametrize(
    "spectral_norm", [nn.utils.spectral_norm, nn.utils.parametrizations.spectral_norm], ids=["hook", "parametrization"]
)
@pytest.mark.ordinary
def test_spectral_norm_is_neither_random_nor_a_shape_bug(spectral_norm):
    model = LM()
    spectral_norm(model.head)
    before = {name: b.clone() for name, b in model.named_buffers()}
    report = gate(model)
    assert report.exit_code == 0, failing(report)
    codes = {f.code for r in report.results for f in r.findings if f.status.value != "pass"}
    assert not {"FWD103", "FWD106", "FWD401"} & codes, codes
    # the power iteration moves u (and v) at every train forward: by design, said as a warning where it shows
    for finding in (f for r in report.results for f in r.findings if f.code in ("FWD108", "FWD126")):
        assert finding.status.value == "warn" and "state the train-mode forward updates" in finding.message
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())


class Normed(nn.Module):
    """BatchNorm over the features, each row and position: statistics of the batch in train mode, running ones in
    eval."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        return self.norm(x.transpose(1, 2)).transpose(1, 2)  # over (B, d, T)


@pytest.mark.ordinary
def test_batchnorm_running_statistics_are_put_back_after_every_train_forward():
    model = LM(Normed())
    found = {name: b.clone() for name, b in model.named_buffers()}
    seen: list[dict[str, torch.Tensor]] = []
    model.register_forward_pre_hook(lambda m, a: seen.append({n: b.clone() for n, b in m.named_buffers()}))
    report = gate(model, ["future-token"])
    assert len(seen) > 3
    # every forward, train and eval, starts from the statistics as found: the eval logits the train path is held to
    # are the default path's, and no forward sees another model
    assert all(torch.equal(state[name], found[name]) for state in seen for name in found)
    assert all(torch.equal(b, found[name]) for name, b in model.named_buffers())
    # batch statistics over the positions read the future in training: a true finding, and by design at FWD108
    (train,) = report.result("future-token").paths.rows
    assert "FWD101" in train.codes and "FWD103" not in train.codes
    apart = next(f for f in report.result("future-token").findings if f.code == "FWD108")
    assert apart.status.value == "warn" and "batch's statistics" in apart.message


class CountsAndScales(nn.Module):
    """A step counter the forward writes, and a warm-up it reads: every train forward from the model as found
    computes the same, so identical forwards agree."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.steps += 1
        return x * torch.clamp(self.steps.float() / 1000, max=1.0) + x


@pytest.mark.ordinary
def test_a_step_counter_is_put_back_and_no_randomness():
    model = LM(CountsAndScales())
    report = gate(model, ["future-token"])
    (train,) = report.result("future-token").paths.rows
    assert "FWD103" not in train.codes and "FWD106" not in train.codes
    assert int(model.between.steps) == 0


# =====================================================================================================================
# 3. A kernel without a backward on this device: the environment, not the model


class NoBackwardHere(LM):
    """Raises as flex_attention does on the CPU when its inputs require grad; `always` raises in any case (the
    model's own error)."""

    def __init__(self, always: bool = False):
        super().__init__()
        self.always = always

    def forward(self, input_ids):
        x = self.embed(input_ids)
        if self.always or x.requires_grad:
            raise NotImplementedError(
                "FlexAttention does not support backward on CPU. Please set the input requires_grad to False"
            )
        return self.head(x + self.attn(x))


@pytest.mark.ordinary
def test_gradient_checks_skip_a_kernel_without_a_backward_here_saying_why():
    report = gate(NoBackwardHere(), ["grad-causality", "grad-reach", "future-token"])
    for check in ("grad-causality", "grad-reach"):
        result = report.result(check)
        assert result.status.value == "skip", result.findings
        assert "cannot record gradients here" in result.summary and "does not support backward on CPU" in (
            result.summary
        )
        assert "environment" in result.summary
    assert report.result("future-token").status.value == "pass"  # the train path runs on without gradients


def test_a_model_that_raises_without_gradients_too_is_its_own_error():
    report = gate(NoBackwardHere(always=True), ["grad-causality"])
    assert report.result("grad-causality").status.value == "error"


# =====================================================================================================================
# 4. Masked vocabularies


class MaskedVocabulary(nn.Module):
    """Logits -inf on the vocabulary entries never emitted (a vocabulary padded past the tokenizer's), as models
    that mask them do. `bug`: "leak" reads the next token; "nan" one NaN logit; "all-masked" a position with every
    entry masked; "+inf" a +inf logit."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.inner, self.bug = LM(), bug
        self.register_buffer("never_emitted", torch.arange(V) >= V - 8)

    def forward(self, input_ids):
        if self.bug == "leak":
            input_ids = input_ids.roll(-1, 1)  # position t reads t + 1
        logits = self.inner(input_ids).masked_fill(self.never_emitted, float("-inf"))  # (B, T, V)
        if self.bug == "nan":
            logits[:, -1, 0] = float("nan")
        if self.bug == "all-masked":
            logits[:, -1] = float("-inf")
        if self.bug == "+inf":
            logits[:, -1, 0] = float("inf")
        return logits


@pytest.mark.ordinary
def test_a_masked_vocabulary_is_compared_on_its_finite_entries():
    report = gate(MaskedVocabulary())
    assert report.exit_code == 0, failing(report)
    assert report.result("future-token").status.value == "pass"


def test_a_leak_behind_a_masked_vocabulary_is_still_caught():
    report = gate(MaskedVocabulary("leak"), ["future-token"])
    assert "FWD101" in failing(report) and "FWD104" not in failing(report)


@pytest.mark.parametrize("bug", ["nan", "all-masked", "+inf"])
def test_nan_inf_and_a_position_with_nothing_left_are_still_refused(bug):
    report = gate(MaskedVocabulary(bug), ["future-token"])
    assert "FWD104" in failing(report)


def test_comparisons_treat_minus_inf_on_both_sides_as_equal():
    inf = float("inf")
    masked = torch.tensor([[[1.0, -inf, 2.0]]])  # (1, 1, V)
    assert float(position_change(masked, masked.clone())) == 0.0
    assert not float(position_change(torch.tensor([[[1.0, 0.5, 2.0]]]), masked)) < 1e38  # a masked entry opened
    assert float(position_change(torch.tensor([[[1.0, -inf, 2.5]]]), masked)) == 0.5  # finite entries compared
    assert not float(position_change(torch.tensor([[[1.0, -inf, float("nan")]]]), masked)) < 1e38
    assert nonfinite_positions(masked) == []
    assert nonfinite_positions(torch.full((1, 2, 3), -inf)) == [(0, 0), (0, 1)]
    assert logit_scale(masked) == 2.0
    assert relative_error(masked, masked.clone()) == 0.0
