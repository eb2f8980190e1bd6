"""future-token on models that refuse some of its passes, and on leaks that only one row shows.

Real training code asserts `T > 1`, sizes its caches for the batch it trains with, or takes a shortcut for a single
sequence. A pass the model cannot run at some size is a note, the findings made elsewhere stand, and only a check
that measured nothing at all is an error. Batch size 1 is covered in every default run by one short row run alone.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

from fwdcheck.api import check_model
from fwdcheck.checks.future_token import FutureToken, prefix_lengths
from fwdcheck.config.schema import FactoryModel, Inputs, RunConfig
from fwdcheck.model.sources.factory import FactoryParts, model_from_module
from fwdcheck.result import Status
from fwdcheck.run.session import Session
from fwdcheck.run.settings import Settings
from tests.conftest import run_checks

V = 32


class Block(nn.Module):
    """nanoGPT's attention (eager, masked_fill on a registered tril buffer) and MLP, pre-norm."""

    def __init__(self, d: int, n_heads: int, block_size: int, leak: str):
        super().__init__()
        self.n_heads, self.leak = n_heads, leak
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        masked = self.leak != "no-mask" and not (self.leak == "batch1-no-mask" and B == 1)
        if masked:  # the planted bugs: no mask at all, or a "single sequence" shortcut that forgets it
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A small GPT with the guards real training code has: `needs_two` asserts T > 1 (a loss over shifted targets
    needs two tokens), `max_batch` sizes a cache for the batch it trains with, `no_single` refuses one row."""

    def __init__(
        self,
        leak: str = "none",
        needs_two: bool = False,
        max_batch: int | None = None,
        no_single: bool = False,
        mix_batch: bool = False,
        d: int = 16,
        n_heads: int = 2,
        n_layers: int = 2,
        block_size: int = 64,
    ):
        super().__init__()
        self.needs_two, self.max_batch, self.no_single, self.mix_batch = needs_two, max_batch, no_single, mix_batch
        self.wte = nn.Embedding(V, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList(Block(d, n_heads, block_size, leak) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if self.needs_two:
            assert T > 1, f"sequence of length {T}: a shifted target needs at least 2 tokens"
        if self.max_batch is not None and B > self.max_batch:
            raise RuntimeError(f"KV cache holds {self.max_batch} rows, got {B}")
        if self.no_single and B == 1:
            raise ValueError("batch of one: use generate() for a single sequence")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, d)
        if self.mix_batch:  # each sample adds a little of the next one's embeddings
            x = x + 0.5 * x.roll(1, dims=0)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def gpt(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return GPT(**kwargs)


def future_token(module: nn.Module, **settings):
    report = check_model(module, checks=["future-token"], **settings)
    return report.result("future-token")


def problems(result) -> set[str]:
    return {f.code for f in result.findings if f.status in (Status.FAIL, Status.WARN, Status.ERROR)}


# ---------------------------------------------------------------------------------------------------------------------
# A forward that asserts T > 1: the prefix pass at k = 1 is a note, never the check's verdict


def test_gpt_that_asserts_two_tokens_passes_with_a_note():
    result = future_token(gpt(needs_two=True))
    assert result.status == Status.PASS and not problems(result), result.findings
    assert result.metrics["prefix_lengths"] == [2]
    (note,) = result.data["notes"]
    assert note.startswith("prefix pass at k=1 skipped: the model raised AssertionError at T=1"), note
    assert "a shifted target needs at least 2 tokens" in note
    assert note in result.summary


def test_leak_in_a_gpt_that_asserts_two_tokens_is_reported_not_lost():
    """The leak found at the cuts stands; the refused length is a note beside it, not an error instead of it."""
    result = future_token(gpt(needs_two=True, leak="no-mask"))
    assert result.status == Status.FAIL
    assert {"FWD101", "FWD105"} <= problems(result) and "FWD002" not in problems(result)
    assert any("prefix pass at k=1 skipped" in n for n in result.data["notes"])


def test_declared_min_seq_len_skips_the_short_prefixes_without_a_note():
    result = future_token(gpt(needs_two=True), min_seq_len=2)
    assert result.status == Status.PASS and not problems(result)
    assert result.metrics["prefix_lengths"] == [2]
    assert "notes" not in result.data


def test_min_seq_len_from_a_config():
    report = run_checks(
        {"source": "python", "factory": "tests.test_future_token_robust:gpt", "kwargs": {"needs_two": True}},
        ["future-token"],
        inputs={"batch_size": 2, "seq_len": 16, "min_seq_len": 4},
    )
    result = report.result("future-token")
    assert result.status == Status.PASS and "notes" not in result.data
    assert result.metrics["prefix_lengths"] == [4]


def test_the_session_learns_the_refused_length_for_the_checks_after():
    """Other checks that run shorter forwards (a probe at another T) start at session.min_seq_len."""
    module = gpt(needs_two=True)
    spec = FactoryModel(factory="tests.test_future_token_robust:gpt", vocab_size=V)
    under_test = model_from_module(
        module, spec, FactoryParts(factory=lambda: module, forward=None, rotary=None), source="python"
    )
    session = Session(under_test, Settings(RunConfig(inputs=Inputs(batch_size=2, seq_len=8))))
    assert session.min_seq_len == 1
    with session.active():
        FutureToken().run(under_test, session)
    assert session.min_seq_len == 2
    declared = Session(under_test, Settings(RunConfig(inputs=Inputs(batch_size=2, seq_len=8, min_seq_len=4))))
    assert declared.min_seq_len == 4


@pytest.mark.parametrize(
    "T, shortest, expected",
    [
        (8, 1, [1, 2]),
        (8, 2, [2]),
        (8, 4, [4]),
        (8, 8, []),
        (2, 1, [1]),
        (3, 2, [2]),
        (256, 1, [1, 2, 16]),
        (256, 3, [3, 16]),
        (64, 2, [2, 16]),
        (32, 1, [1, 2]),
        (256, 20, [20]),
    ],
)
def test_prefix_ladder_starts_at_the_shortest_accepted_length(T, shortest, expected):
    assert prefix_lengths(T, shortest) == expected


# ---------------------------------------------------------------------------------------------------------------------
# Row counts the model refuses


def test_cache_sized_for_the_batch_is_never_asked_for_more_rows():
    """The cut rows run in forwards of the baseline's row count: a cache sized for the batch takes them all."""
    clean = future_token(gpt(max_batch=2))
    assert clean.status == Status.PASS and not problems(clean) and "notes" not in clean.data
    leak = future_token(gpt(max_batch=2, leak="no-mask"))
    assert leak.status == Status.FAIL and "FWD101" in problems(leak)


def test_cache_sized_for_one_row_gets_the_cut_rows_one_at_a_time():
    """Batch size 1: the rows run two at a time (a row beside another shows samples reading each other); a cache
    sized for one row refuses that, and gets them in forwards of one row, the baseline's count."""
    clean = future_token(gpt(max_batch=1), batch_size=1)
    assert clean.status == Status.PASS and not problems(clean)
    assert any("they ran in forwards of 1 row, the baseline's count" in n for n in clean.data["notes"])
    leak = future_token(gpt(max_batch=1, leak="no-mask"), batch_size=1)
    assert leak.status == Status.FAIL and "FWD101" in problems(leak)


def test_model_that_refuses_one_row_is_judged_on_the_cuts():
    clean = future_token(gpt(no_single=True))
    assert clean.status == Status.PASS and not problems(clean)
    notes = " | ".join(clean.data["notes"])
    assert "prefix pass at k=1, 2 skipped: the model raised ValueError at T=1, 2" in notes
    assert "single-row pass skipped: the model raised ValueError at B=1, T=8" in notes
    leak = future_token(gpt(no_single=True, leak="no-mask"))
    assert leak.status == Status.FAIL and problems(leak) == {"FWD101"}


def test_samples_that_read_each_other_and_refuse_one_row_keep_the_batch_finding():
    result = future_token(gpt(no_single=True, mix_batch=True))
    assert result.status == Status.FAIL and problems(result) == {"FWD102"}
    assert any(n.startswith("causal comparisons skipped: samples read each other") for n in result.data["notes"])


def test_nothing_measured_is_an_error_with_the_model_refusal():
    """Only the session's own inputs run: every cut, prefix and single row is refused, and nothing is compared."""
    module = gpt()
    original = module.forward
    calls = []

    def forward(idx):  # runs the observation pass, whose logits are the reference; then nothing more
        calls.append(idx.shape)
        if len(calls) > 1:
            raise RuntimeError("KV cache full")
        return original(idx)

    module.forward = forward
    result = future_token(module)
    assert result.status == Status.ERROR
    assert [f.code for f in result.findings] == ["FWD002"] and "KV cache full" in result.summary


# ---------------------------------------------------------------------------------------------------------------------
# Batch size 1, in every default run


def test_mask_dropped_only_for_one_row_fails_by_default():
    result = future_token(gpt(leak="batch1-no-mask"))
    assert result.status == Status.FAIL
    leak = next(f for f in result.findings if f.code == "FWD101")
    assert "one row run alone (batch size 1)" in leak.message and "run alone" in leak.where
    assert result.data["single_row"]["against"] == "prefix"


def test_mask_dropped_only_for_one_row_fails_when_no_prefix_of_two_tokens_runs():
    """seq_len 3: the prefix pass runs k = 1 only, so the row alone is the full sequence, against the baseline."""
    result = future_token(gpt(leak="batch1-no-mask"), seq_len=3)
    assert result.status == Status.FAIL and "FWD101" in problems(result)
    assert result.data["single_row"]["against"] == "baseline"


def test_mask_dropped_for_one_row_in_a_gpt_that_asserts_two_tokens():
    result = future_token(gpt(leak="batch1-no-mask", needs_two=True))
    assert result.status == Status.FAIL and "FWD101" in problems(result)


def test_leak_on_every_path_is_one_finding_that_also_names_one_row():
    result = future_token(gpt(leak="no-mask"))
    (leak,) = [f for f in result.findings if f.code == "FWD101"]
    # the default path's comparisons, then the train path's cell, which fails alike
    assert re.search(
        r"also with one row run alone \(batch size 1, by up to [0-9.e+-]+\); also on 1 of 1 code paths: "
        r"train mode",
        leak.where,
    ), leak.where


@pytest.mark.parametrize("guard", [None, "needs_two", "max_batch"])
@pytest.mark.parametrize("batch_size, seq_len", [(2, 8), (3, 16), (2, 2)])
def test_correct_models_pass_with_no_warning(guard, batch_size, seq_len):
    kwargs = {"needs_two": {"needs_two": True}, "max_batch": {"max_batch": batch_size}}.get(guard, {})
    result = future_token(gpt(**kwargs), batch_size=batch_size, seq_len=seq_len)
    assert result.status == Status.PASS and not problems(result), result.findings


def test_single_row_pass_is_skipped_where_one_row_is_already_covered():
    one = future_token(gpt(leak="batch1-no-mask"), batch_size=1)
    assert "not needed" in one.data["single_row"]
    assert one.status == Status.FAIL and "FWD101" in problems(one)  # the baseline itself is the single row
    matrix = future_token(gpt(), code_paths={"enabled": True})
    assert "code-path matrix" in matrix.data["single_row"]


def test_single_row_pass_costs_one_short_row(reference):
    """The extra forward is the length of the longest prefix (T/4): an eighth of a baseline forward at B = 2."""
    report = run_checks(reference(), ["future-token"], inputs={"batch_size": 2, "seq_len": 64})
    single = report.result("future-token").data["single_row"]
    assert single["length"] == 16 and single["cut"] == 8


# ---------------------------------------------------------------------------------------------------------------------
# What a default run costs, and why its shortcuts hold: the observation pass's logits stand in for the baseline and
# the noise floor is not measured, until a comparison moves beyond the tolerance.


class Observed(nn.Module):
    """A causal GPT that computes something else while a torch function mode is on, as torch's TransformerEncoder
    takes another path under one: `shift` adds to its logits there, `leak` drops its mask everywhere else."""

    def __init__(self, shift: float = 0.0, leak: bool = False):
        super().__init__()
        self.masked, self.leaky = gpt(), gpt(leak="no-mask")
        self.leaky.load_state_dict(self.masked.state_dict())
        self.shift, self.leak = shift, leak

    def forward(self, idx):
        observed = torch._C._is_torch_function_mode_enabled()
        logits = (self.leaky if self.leak and not observed else self.masked)(idx)
        return logits + self.shift if observed else logits


def session_for(module: nn.Module) -> tuple:
    spec = FactoryModel(factory="tests.test_future_token_robust:gpt", vocab_size=V)
    under_test = model_from_module(
        module, spec, FactoryParts(factory=lambda: module, forward=None, rotary=None), source="python"
    )
    return under_test, Session(under_test, Settings(RunConfig(inputs=Inputs(batch_size=2, seq_len=8))))


def test_a_clean_run_compares_with_the_observed_logits_and_measures_no_noise_floor():
    """The observation pass (16 tokens), the first forward of cut rows (cuts 7 and 1, 2 rows: 16), which vouches
    alone, the prefix ladder k = 1, 2 (3) and the single row of 2 tokens (2): no baseline forward, no repeat, and
    neither cut 4 nor the control row."""
    model, session = session_for(gpt())
    with session.active():
        result = FutureToken().run(model, session)
        assert not session.reference_untouched
    assert result.status == Status.PASS and not problems(result)
    assert session.forward_tokens == 16 + 16 + 3 + 2
    assert result.metrics["cuts"] == [1, 7] and "batch_max_change" in result.metrics
    assert "noise_floor" not in result.metrics and result.data["noise_floor"].startswith("not measured")


@pytest.mark.parametrize("bug", [{"leak": "no-mask"}, {"mix_batch": True}])
def test_anything_moving_in_the_first_forward_runs_every_row(bug):
    """A leak or samples reading each other move the first forward's rows: cut 4 and the control row run too, and
    the findings name which comparison moved."""
    model, session = session_for(gpt(**bug))
    with session.active():
        result = FutureToken().run(model, session)
    assert result.metrics["cuts"] == [1, 4, 7]
    assert ("FWD102" if bug.get("mix_batch") else "FWD101") in problems(result)


def test_a_leak_is_judged_against_the_untouched_baseline_with_the_noise_floor():
    model, session = session_for(gpt(leak="no-mask"))
    with session.active():
        result = FutureToken().run(model, session)
        assert session.reference_untouched
    assert {"FWD101", "FWD105"} <= problems(result)
    assert result.metrics["noise_floor"] == 0.0 and "reference" not in result.data  # observed == untouched, bitwise


def test_observed_logits_that_differ_give_way_to_the_untouched_baseline():
    """A model that computes other logits under the observer: compared against them, every row moves; the
    comparisons are made again against the untouched baseline, and the model passes."""
    result = future_token(Observed(shift=1e-3))
    assert result.status == Status.PASS and not problems(result), result.findings
    assert "made again against the baseline" in result.data["reference"]


def test_a_leak_only_off_the_observer_is_found():
    result = future_token(Observed(leak=True))
    assert result.status == Status.FAIL and "FWD101" in problems(result)


def test_randomness_in_eval_the_observer_cannot_see_still_fails():
    """Noise added in eval mode, invisible to the observation pass: the control row moves, so the noise floor is
    measured, FWD103 fails, FWD106 warns, and the threshold rises above the noise (no leak is reported)."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = gpt()

        def forward(self, idx):
            logits = self.inner(idx)
            return logits + 1e-3 * torch.rand_like(logits)

    result = future_token(Noisy())
    assert result.status == Status.FAIL and problems(result) == {"FWD103", "FWD106"}, result.findings
    assert result.metrics["noise_floor"] > result.metrics["tolerance"]
