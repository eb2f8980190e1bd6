"""grad-causality: on the train path (train() mode, dropout zeroed, gradients on), earlier logits get exactly 0.0
gradient from later tokens' embeddings and from other samples'. Correct models pass: the reference model,
transformers' architectures built tiny, x-transformers, litgpt, torch.nn with a causal mask. Leaks future-token
cannot see fail: below its tolerance, only with gradients enabled, only in train mode; samples mixed."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from fwdcheck.checks.grad_causality import cuts_for
from fwdcheck.config.bugs import BUGS
from tests import arch_sweep, compat
from tests.conftest import codes, run_checks
from tests.test_bug_matrix import BUG_RUN, CLEAN

CHECK = "grad-causality"
VOCAB, WIDTH, HEADS = 32, 16, 4


def result(report):
    return report.result(CHECK)


class TinyCausalLM(nn.Module):
    """One attention block over an embedding, causal through SDPA's is_causal. `leak` plants a bug:
    whisper:      1e-7 x the next position's hidden state added to each position (below future-token's tolerance)
    grad-only:    is_causal only under torch.no_grad() (what eval-time checks run)
    train-only:   is_causal dropped when self.training
    unused-layer: a projection built and never called (grad-reach's to find)
    detached:     a gated branch whose output is detached (grad-reach's to find)
    """

    def __init__(self, leak: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.leak = leak
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.5)  # zeroed by the check in train mode: its dice never reach the verdict
        self.head = nn.Linear(WIDTH, VOCAB)
        if leak == "unused-layer":
            self.never_called = nn.Linear(WIDTH, WIDTH)
        if leak == "detached":
            self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        x = self.embed(input_ids)  # (B, T, d)
        q, k, v = self.qkv(x).split(WIDTH, dim=-1)
        q, k, v = (t.view(B, T, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))  # (B, h, T, d_h)
        causal = True
        if self.leak == "grad-only":
            causal = not torch.is_grad_enabled()
        if self.leak == "train-only":
            causal = not self.training
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=0.5 if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, WIDTH)  # (B, T, d)
        x = x + self.dropout(self.proj(y))
        if self.leak == "whisper":
            x = x + 1e-7 * x.roll(-1, dims=1)  # position t reads t + 1 (and the last reads the first)
        if self.leak == "detached":
            x = x + self.gate(x).detach()
        return self.head(x)


class NoBackward(torch.autograd.Function):  # a forward-only kernel: torch's own error when asked for gradients
    @staticmethod
    def forward(ctx, x):
        return x * 1.0


class ForwardOnly(TinyCausalLM):
    """Logits through a kernel without a backward."""

    def forward(self, input_ids):
        return NoBackward.apply(super().forward(input_ids))


def gate(module: nn.Module, checks=(CHECK,), **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwdcheck.check_model(module, list(checks), **kw)


# =====================================================================================================================
# Correct models pass


def test_cuts_cover_last_first_and_middle():
    assert cuts_for(2, 8) == [7, 1]
    assert cuts_for(4, 8) == [7, 1, 4, 7]
    assert cuts_for(1, 2) == [1]


def test_tiny_correct_model_passes_with_exact_zeros():
    report = gate(TinyCausalLM())
    r = result(report)
    assert r.status.value == "pass", r.findings
    assert r.metrics["max_gradient_after_cut"] == 0.0
    assert r.metrics["max_gradient_before_cut"] > 0  # the gradient reached what it should: something was measured
    assert report.exit_code == 0


def test_reference_model_passes(reference):
    r = result(run_checks(reference(), [CHECK]))
    assert r.status.value == "pass", r.findings
    assert r.metrics["max_gradient_after_cut"] == 0.0 and r.metrics["max_gradient_before_cut"] > 0


@pytest.mark.parametrize("batch_size, seq_len", [(1, 8), (3, 16)])
def test_reference_model_passes_at_other_sizes(reference, batch_size, seq_len):
    r = result(run_checks(reference(), [CHECK], inputs={"batch_size": batch_size, "seq_len": seq_len}))
    assert r.status.value == "pass", r.findings
    assert r.metrics["cuts"] == cuts_for(batch_size, seq_len)


HF_CORRECT = {
    "llama": compat.hf("llama", num_key_value_heads=2, **compat.LLAMA_LIKE),
    "gpt2": compat.hf("gpt2", n_embd=32, n_layer=2, n_head=4),
    "mistral-sliding-window": compat.hf("mistral", num_key_value_heads=2, sliding_window=4, **compat.LLAMA_LIKE),
    "qwen2": compat.hf("qwen2", num_key_value_heads=2, **compat.LLAMA_LIKE),
    "gemma2": compat.hf("gemma2", num_key_value_heads=2, head_dim=8, sliding_window=4, **compat.LLAMA_LIKE),
}


@pytest.mark.parametrize("name", list(HF_CORRECT))
def test_transformers_architectures_pass(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = result(run_checks(HF_CORRECT[name], [CHECK], inputs={"batch_size": 2, "seq_len": 12}))
    assert r.status.value == "pass", (r.summary, r.findings)
    assert r.metrics["max_gradient_after_cut"] == 0.0


THIRD_PARTY_CORRECT = {
    "x-transformers": "tests.corpus.xtransformers_models:rotary",
    "litgpt-llama": "tests.corpus.litgpt_models:llama",
    "nn.TransformerEncoder causal": "tests.models:torch_encoder",
    "nn.TransformerDecoder causal": "tests.corpus.torch_models:decoder",
}


@pytest.mark.slow  # importing litgpt and x-transformers takes seconds
@pytest.mark.parametrize("name", list(THIRD_PARTY_CORRECT))
def test_third_party_models_pass(name):
    spec = {"source": "python", "factory": THIRD_PARTY_CORRECT[name], "path": ["."]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = result(run_checks(spec, [CHECK]))
    assert r.status.value == "pass", (r.summary, r.findings)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("variant", sorted(CLEAN))
def test_reference_clean_variants_pass(reference, variant, attention):
    fields = {"dropout": 0.1, **CLEAN[variant]}  # dropout live in train mode: the check must zero it
    r = result(run_checks(reference(attention=attention, **fields), [CHECK]))
    assert r.status.value == "pass", r.findings


# =====================================================================================================================
# Leaks fail

# The reference model's planted bugs that make a later token, or another sample, reach an earlier logit; every
# other bug (rope, kv-cache, scale, labels, packing, dropout in eval) must pass here: it is not this check's to find.
PLANTED = {
    "no-causal-mask": {"FWD121"},
    "inverted-bool-mask": {"FWD121"},
    "float-mask-01": {"FWD121"},
    "batch-mix": {"FWD122"},
}
# Eager softmax over a row whose every key is -inf gives NaN: NaN gradients, never a pass, and no evidence of a path
PLANTED_ON = {("inverted-bool-mask", "eager"): {"FWD123"}}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bugs_fail_exactly_the_causal_ones(reference, bug, attention):
    fields, dtype = BUG_RUN.get(bug, ({}, "float32"))
    report = run_checks(reference(bugs=[bug], attention=attention, dropout=0.1, **fields), [CHECK], dtype=dtype)
    expected = PLANTED_ON.get((bug, attention), PLANTED.get(bug, set()))
    assert codes(report, CHECK) == expected, result(report).findings
    assert result(report).status.value == ("fail" if expected else "pass")


def test_leak_below_future_tokens_tolerance_fails_here_only():
    report = gate(TinyCausalLM("whisper"), checks=["future-token", CHECK])
    assert report.result("future-token").status.value == "pass"  # 1e-7 of a hidden state: within its tolerance
    r = result(report)
    assert r.status.value == "fail"
    assert codes(report, CHECK) == {"FWD121"}
    # position q reads q + 1 and nothing else later: the map holds exactly the pairs (q, q + 1)
    assert r.metrics["leaked_pairs"] == 7
    leak = r.data["gradient_map"]
    assert leak["row"] == 0 and leak["length"] == 8
    moved = {(q, k) for q, per_key in enumerate(leak["gradient"]) for k, v in enumerate(per_key) if k > q and v > 0}
    assert moved == {(q, q + 1) for q in range(7)}
    leak_finding = next(f for f in r.findings if f.code == "FWD121")
    assert leak_finding.module == "head"  # the roll sits between the block and the head: first seen at its output
    assert report.exit_code == 1


@pytest.mark.parametrize("leak", ["grad-only", "train-only"])
def test_mask_dropped_on_the_train_path_fails_here_only(leak):
    report = gate(TinyCausalLM(leak), checks=["future-token", CHECK], code_paths={"train": False})
    assert report.result("future-token").status.value == "pass"  # eval, no_grad: the mask is there
    r = result(report)
    assert r.status.value == "fail"
    assert "FWD121" in codes(report, CHECK)
    assert r.metrics["leaked_pairs"] == 28  # every (earlier, later) pair of T = 8
    assert next(f for f in r.findings if f.code == "FWD121").module == "proj"  # the first module after the SDPA call


def test_reference_model_without_mask_fails(reference):
    report = run_checks(reference(bugs=["no-causal-mask"]), [CHECK])
    assert codes(report, CHECK) == {"FWD121"}
    # the attention's output projection, inside the first block: the first module whose output carries the leak
    assert result(report).findings[0].module == "layers.0.attn.o_proj"


@pytest.mark.parametrize("factory", ["tests.models:batch_mean_leak"])
def test_samples_reading_each_other_fail(factory):
    report = run_checks({"source": "python", "factory": factory, "path": ["."]}, [CHECK])
    r = result(report)
    assert r.status.value == "fail"
    assert "FWD122" in codes(report, CHECK)
    assert "FWD121" not in codes(report, CHECK)  # a mean over the batch reads no later position of its own row


def test_nan_gradient_is_never_a_pass():
    class SqrtAtZero(TinyCausalLM):
        def forward(self, input_ids):
            logits = super().forward(input_ids)
            return logits + torch.sqrt(logits - logits)  # the value is logits; the gradient of sqrt at 0 is inf

    r = result(gate(SqrtAtZero()))
    assert r.status.value == "fail"
    assert "FWD123" in {f.code for f in r.findings}


# =====================================================================================================================
# The embedding's every call


def test_embedding_called_twice_is_hooked_at_each_call():
    class TwiceEmbedded(TinyCausalLM):
        def __init__(self, leak: bool):
            super().__init__()
            self.leaky = leak

        def forward(self, input_ids):
            logits = super().forward(input_ids)
            again = self.embed(input_ids)  # (B, T, d): a second call, e.g. a skip from the inputs to the head
            if self.leaky:
                again = again.flip(1)  # position t reads position T-1-t
            return logits + self.head(again)

    clean = result(gate(TwiceEmbedded(leak=False)))
    assert clean.status.value == "pass", clean.findings
    assert "2 calls" in clean.data["notes"][0]
    leaky = result(gate(TwiceEmbedded(leak=True)))
    assert {f.code for f in leaky.findings} == {"FWD121"}


# =====================================================================================================================
# Skips say why


def test_bidirectional_model_skips():
    r = result(gate(TinyCausalLM(), causal=False))
    assert r.status.value == "skip"
    assert "bidirectional" in r.summary


def test_model_without_embedding_skips():
    class OneHot(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(VOCAB, VOCAB)

        def forward(self, input_ids):
            return self.inner(F.one_hot(input_ids, VOCAB).float())

    r = result(gate(OneHot(), vocab_size=VOCAB))
    assert r.status.value == "skip"
    assert "no token embedding" in r.summary


def test_model_without_a_backward_skips_with_torchs_reason():
    r = result(gate(ForwardOnly()))
    assert r.status.value == "skip"
    assert r.summary.startswith("the backward cannot run: ")
    assert "backward" in r.summary.removeprefix("the backward cannot run: ")  # torch's message, not ours


def test_logits_without_gradient_skip():
    class Detached(TinyCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids).detach()

    r = result(gate(Detached()))
    assert r.status.value == "skip"
    assert "carry no gradient" in r.summary


# =====================================================================================================================
# The model is left as found


def test_model_left_as_found():
    model = TinyCausalLM("unused-layer")
    model.eval()
    model.head.train()  # a mixed mode, to be put back module by module
    kept = torch.ones_like(model.head.weight)
    model.head.weight.grad = kept  # a gradient the caller accumulated: untouched
    frozen = model.proj.bias.requires_grad_(False)
    before_training = {name: m.training for name, m in model.named_modules()}
    before_hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    before_values = {name: p.detach().clone() for name, p in model.named_parameters()}
    gate(model)
    assert {name: m.training for name, m in model.named_modules()} == before_training
    assert model.head.weight.grad is kept and bool((kept == 1).all())
    assert all(p.grad is None for name, p in model.named_parameters() if name != "head.weight")
    assert frozen.requires_grad is False and model.qkv.weight.requires_grad is True
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == before_hooks
    assert all(torch.equal(p, before_values[name]) for name, p in model.named_parameters())
    assert model.dropout.p == 0.5
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_model_left_as_found_for_the_checks_after(dtype):
    from fwdcheck.config.registry import select
    from fwdcheck.run.runner import run_model
    from tests.test_model_state import assert_same, reference_model, snapshot

    model, settings = reference_model()  # dropout 0.2
    settings = settings.with_config(dtype=dtype)
    module = model.module
    module.train()  # found in training mode: it must go back to training mode
    module.layers[0].attn.q_proj.weight.grad = torch.ones_like(module.layers[0].attn.q_proj.weight)
    module.lm_head.weight.requires_grad_(False)
    before = snapshot(module)
    report = run_model(model, settings, select([CHECK, "future-token"]))
    assert report.result(CHECK).status.value == "pass", report.result(CHECK).findings
    assert report.result("future-token").status.value == "pass"  # ran after it, on the model as the session holds it
    assert_same(before, snapshot(module))
    assert not torch._C._is_torch_function_mode_enabled()


def test_buffers_a_train_mode_forward_writes_are_put_back_before_the_next_check():
    class CountsSteps(TinyCausalLM):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, input_ids):
            if self.training:
                self.steps += 1  # a training-step counter, as schedulers inside models keep
            return super().forward(input_ids) + self.steps.float()  # later forwards would see another model

    model = CountsSteps()
    report = gate(model, checks=[CHECK, "future-token"])
    # the train path adds the counter to its logits: what eval never computes (FWD126), and causal all the same
    assert {f.code for f in report.result(CHECK).findings if f.status.value != "pass"} == {"FWD126"}
    # future-token's train cell puts the counter back after every forward: each one starts from the model as found,
    # so identical forwards agree (no FWD103: that is for randomness), and the counter added is the train path's own
    (train,) = report.result("future-token").paths.rows
    assert train.codes == ("FWD108",)
    assert int(model.steps) == 0
    assert any("steps" in note and "put back" in note for note in report.notes)


# =====================================================================================================================
# The command line: explain, and the leak map drawn in the terminal report


def test_explain_and_terminal_report(tmp_path):
    import re

    from typer.testing import CliRunner

    from fwdcheck.cli import app

    runner = CliRunner()
    explained = runner.invoke(app, ["explain", CHECK], catch_exceptions=False)
    assert explained.exit_code == 0, explained.output
    for code in ("FWD121", "FWD122", "FWD123", "FWD126"):
        assert code in explained.stdout
    config = tmp_path / "leaky.yaml"
    config.write_text(
        "model:\n  source: reference\n  vocab_size: 32\n  d_model: 16\n  n_heads: 4\n  n_layers: 2\n"
        "  bugs: [no-causal-mask]\ninputs: {batch_size: 2, seq_len: 8}\n"
    )
    ran = runner.invoke(app, ["run", str(config), "--check", CHECK, "--in-process"], catch_exceptions=False)
    out = re.sub(r"\x1b\[[0-9;]*m", "", ran.stdout)
    assert ran.exit_code == 1, out
    assert "FWD121" in out
    assert "query\\key 0..7" in out and "nonzero gradient" in out  # the gradient leak map
    assert "Traceback" not in ran.output


def test_gradient_map_view_bins_long_rows_and_shows_nonfinite():
    from rich.console import Console

    from fwdcheck.checks.grad_causality_view import gradient_map
    from fwdcheck.result import CheckResult, Status

    T = 130  # wider than 64 positions: 3 per character
    gradient = [[0.0] * T for _ in range(3)]
    gradient[0][1] = 0.5  # query 0 reads position 1
    gradient[1][T - 1] = float("inf")  # NaN or Inf at query 1's last position
    result = CheckResult(
        "grad-causality", Status.FAIL, "", data={"gradient_map": {"row": 0, "length": T, "gradient": gradient}}
    )
    console = Console(width=120, record=True, color_system=None)
    console.print(gradient_map(result))
    lines = console.export_text().splitlines()
    assert "3 positions per char" in lines[0]
    assert lines[1].split()[1].startswith("#")  # query 0: its first bin holds position 1
    assert lines[2].rstrip().endswith("N") and "#" not in lines[2]
    assert set(lines[3].split()[1]) == {"."}  # query 2: exactly 0.0 everywhere after it


# =====================================================================================================================
# Every causal-LM architecture transformers ships: no failure without a leak shown in plain torch


@pytest.mark.slow
@pytest.mark.parametrize("model_type", arch_sweep.architectures())
def test_transformers_architectures_fail_only_with_a_leak_shown_in_plain_torch(model_type):
    report = arch_sweep.one_check_report(model_type, CHECK)
    r = result(report)
    assert "FWD122" not in codes(report, CHECK)  # no architecture mixes the samples of a batch
    assert "FWD123" not in codes(report, CHECK), r.findings  # nor has NaN gradients at these sizes
    if r.status.value == "fail":
        assert codes(report, CHECK) <= {"FWD121"}
        # prophetnet's n-gram stream: a leak by design, of any size (the gradient test is exact, and so is this)
        assert arch_sweep.future_leak(model_type, relative=0.0), r.summary


# =====================================================================================================================
# CUDA: SDPA's fused kernels (flash, memory-efficient) and their own backward. Skipped without a GPU.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", ["reference", "llama"])
def test_fused_kernels_backward_on_cuda_is_exactly_causal(reference, spec, dtype):
    model = reference(vocab_size=64, d_model=32) if spec == "reference" else HF_CORRECT["llama"]
    r = result(run_checks(model, [CHECK], device="cuda", dtype=dtype, inputs={"batch_size": 2, "seq_len": 64}))
    assert r.status.value == "pass", r.findings
    assert r.metrics["max_gradient_after_cut"] == 0.0


@needs_cuda
@pytest.mark.parametrize("bug, code", [("no-causal-mask", "FWD121"), ("batch-mix", "FWD122")])
def test_leaks_fail_on_cuda(reference, bug, code):
    report = run_checks(
        reference(vocab_size=64, d_model=32, bugs=[bug]),
        [CHECK],
        device="cuda",
        dtype="bfloat16",
        inputs={"seq_len": 64},
    )
    assert code in codes(report, CHECK)


# =====================================================================================================================
# The train path against eval (FWD126)


class TrainScaled(nn.Module):
    """A block whose output is scaled only in train mode: causal both ways, another model when it trains."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.inner(x) * (1.5 if self.training else 1.0)


class TrainScaledLM(TinyCausalLM):
    def __init__(self):
        super().__init__()
        self.block = TrainScaled()

    def forward(self, input_ids):
        return self.head(self.block(self.embed(input_ids)))  # (B, T, V)


class BatchNormLM(TinyCausalLM):
    """Normalised per feature over the batch and positions: by design another model in training (and samples mix)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, input_ids):
        x = self.embed(input_ids)  # (B, T, d)
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))  # BatchNorm1d over (B, d, T)


def test_a_branch_only_the_train_path_takes_fails_naming_its_module():
    result = gate(TrainScaledLM()).result(CHECK)
    (finding,) = [f for f in result.findings if f.code == "FWD126"]
    assert finding.status.value == "fail" and finding.module == "block"
    assert "first seen at the output of block" in finding.message


def test_a_mask_dropped_in_train_mode_is_both_a_leak_and_another_path():
    codes = {f.code for f in gate(TinyCausalLM("train-only")).result(CHECK).findings if f.status.value == "fail"}
    assert {"FWD121", "FWD126"} <= codes


def test_batch_statistics_in_train_mode_are_a_warning_by_design():
    result = gate(BatchNormLM()).result(CHECK)
    (finding,) = [f for f in result.findings if f.code == "FWD126"]
    assert finding.status.value == "warn" and finding.module == "norm" and "by design" in finding.message


def test_a_correct_model_trains_the_model_it_evaluates():
    result = gate(TinyCausalLM()).result(CHECK)
    assert "FWD126" not in {f.code for f in result.findings}
    assert result.metrics["train_eval_change"] <= 1e-5
