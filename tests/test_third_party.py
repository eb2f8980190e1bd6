"""fwdcheck's verdicts on models that are not its own reference model (tests/models.py).

Each case names a model, what is true of it (checked here independently with plain torch, so a wrong expectation
cannot hide behind a wrong check), and the verdict each check must give: its status and the exact set of non-pass
finding codes.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from fwdcheck.config.callables import resolve_callable
from fwdcheck.config.registry import select
from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings

REPO = Path(__file__).resolve().parent.parent
CHECKS = ("shape-ledger", "future-token", "mask-audit", "rope")
PASS, SKIP = ("pass", set()), ("skip", set())


@dataclass
class Case:
    id: str
    factory: str  # attribute of tests.models
    kwargs: dict = field(default_factory=dict)
    expect: dict = field(default_factory=dict)  # check -> (status, exact set of non-pass finding codes)
    truth: str = "causal"  # causal | leaks | nan | mixes-batch | bidirectional: what the model really does
    model: dict = field(default_factory=dict)  # extra keys of the config's model section (causal, rope)


def correct(**overrides) -> dict:
    """A correct decoder without rotary embedding: everything passes, rope skips."""
    return {"shape-ledger": PASS, "future-token": PASS, "mask-audit": PASS, "rope": SKIP, **overrides}


CASES = [
    # 1. nn.TransformerEncoder as a decoder; both with the nested-tensor fast path allowed (default) and disabled.
    *[
        Case(
            f"encoder-{mask}-{'nested' if nested else 'nonested'}",
            "torch_encoder",
            {"mask": mask, "enable_nested_tensor": nested},
            correct(),
        )
        for mask in ("float", "bool", "is_causal")
        for nested in (True, False)
    ],
    *[
        Case(
            f"encoder-none-{'nested' if nested else 'nonested'}",
            "torch_encoder",
            {"mask": "none", "enable_nested_tensor": nested},
            correct(**{"future-token": ("fail", {"FWD101", "FWD105"}), "mask-audit": ("fail", {"FWD201"})}),
            truth="leaks",
        )
        for nested in (True, False)
    ],
    # SDPA's convention handed to MultiheadAttention: the last query has no key left -> NaN, which future-token
    # reports (FWD104) before it compares anything. On the train path's cell, where torch's attention takes its slow
    # path, the logits of queries that have keys are finite, and there the inverted mask reads the future (FWD101).
    *[
        Case(
            f"encoder-tril_bool-{'nested' if nested else 'nonested'}",
            "torch_encoder",
            {"mask": "tril_bool", "enable_nested_tensor": nested},
            correct(**{"future-token": ("fail", {"FWD104", "FWD101"}), "mask-audit": ("fail", {"FWD202", "FWD205"})}),
            truth="nan",
        )
        for nested in (True, False)
    ],
    # nn.MultiheadAttention called directly: same conventions, same conversion to float.
    Case("mha-bool", "torch_mha", {"mask": "bool"}, correct()),
    Case(
        "mha-tril_bool",
        "torch_mha",
        {"mask": "tril_bool"},
        correct(**{"future-token": ("fail", {"FWD104", "FWD101"}), "mask-audit": ("fail", {"FWD202", "FWD205"})}),
        truth="nan",
    ),
    # The mirror image, MultiheadAttention's mask handed to SDPA: SDPA sees the bool itself, FWD202 fires.
    Case(
        "nanogpt-mha-mask-to-sdpa",
        "nanogpt_mha_mask_to_sdpa",
        {},
        correct(**{"future-token": ("fail", {"FWD101", "FWD105"}), "mask-audit": ("fail", {"FWD202", "FWD205"})}),
        truth="leaks",
    ),
    # 2. nanoGPT.
    Case("nanogpt", "nanogpt", {}, correct()),
    # 3. Missing transpose(1, 2): SDPA attends over the heads of one position; no position reads another, so
    #    future-token rightly passes; only the ledger sees it.
    Case(
        "nanogpt-missing-transpose",
        "nanogpt_missing_transpose",
        {},
        correct(**{"shape-ledger": ("fail", {"FWD402", "FWD401"})}),
        truth="causal",
    ),
    # 4. softmax(dim=-2) with a correct masked_fill.
    Case(
        "eager-softmax-dim-2",
        "eager_softmax_over_queries",
        {},
        correct(**{"shape-ledger": ("fail", {"FWD403"}), "future-token": ("fail", {"FWD101", "FWD105"})}),
        truth="leaks",
    ),
    # 5. Llama by hand (rotate_half, base 5e5, GQA) and GPT-J style interleaved rotary.
    Case("llama-half-5e5", "llama", {"pairing": "half", "rope_theta": 500000.0}, correct(rope=PASS)),
    Case(
        "llama-half-5e5-declared",
        "llama",
        {"pairing": "half", "rope_theta": 500000.0},
        correct(rope=PASS),
        model={"rope": {"base": 500000.0, "pairing": "half"}},
    ),
    Case(
        "llama-half-declared-interleaved",
        "llama",
        {"pairing": "half", "rope_theta": 500000.0},
        correct(rope=("fail", {"FWD305"})),
        model={"rope": {"base": 500000.0, "pairing": "interleaved"}},
    ),
    Case("gptj-interleaved-1e4", "llama", {"pairing": "interleaved", "rope_theta": 10000.0}, correct(rope=PASS)),
    Case(
        "gptj-interleaved-1e4-declared",
        "llama",
        {"pairing": "interleaved", "rope_theta": 10000.0},
        correct(rope=PASS),
        model={"rope": {"base": 10000.0, "pairing": "interleaved"}},
    ),
    Case("gptj-interleaved-5e5", "llama", {"pairing": "interleaved", "rope_theta": 500000.0}, correct(rope=PASS)),
    Case(
        "gptj-interleaved-5e5-d_h16-declared",
        "llama",
        {"pairing": "interleaved", "rope_theta": 500000.0, "num_attention_heads": 2, "num_key_value_heads": 1},
        correct(rope=PASS),
        model={"rope": {"base": 500000.0, "pairing": "interleaved"}},
    ),
    # 6. Sliding window (Mistral), bool mask for SDPA.
    Case("sliding-window-3", "sliding_window", {}, correct()),
    # 7. ALiBi bias with -inf on the future, as SDPA's float mask.
    Case("alibi", "alibi", {}, correct()),
    # 8. Bidirectional encoders declared `causal: false`.
    *[
        Case(
            f"encoder-bidirectional-{'nested' if nested else 'nonested'}",
            "torch_encoder",
            {"mask": "none", "enable_nested_tensor": nested, "key_padding": True},
            correct(),
            truth="bidirectional",
            model={"causal": False},
        )
        for nested in (True, False)
    ],
    Case("bert-bidirectional", "bert", {}, correct(), truth="bidirectional", model={"causal": False}),
    # 9. Hugging Face 4-D mask with finfo.min, into SDPA and added by hand (eager).
    Case("hf-finfo-min-sdpa", "hf_finfo_mask", {"eager": False}, correct()),
    Case("hf-finfo-min-eager", "hf_finfo_mask", {"eager": True}, correct()),
    # 10. Batch statistic inside a block.
    Case(
        "batch-mean-leak", "batch_mean_leak", {}, correct(**{"future-token": ("fail", {"FWD102"})}), truth="mixes-batch"
    ),
]
BY_ID = {c.id: c for c in CASES}


def config(case: Case, **inputs):
    return config_from_dict(
        {
            "model": {
                "source": "python",
                "factory": f"tests.models:{case.factory}",
                "kwargs": case.kwargs,
                "path": [str(REPO)],
                **case.model,
            },
            "inputs": {"batch_size": 2, "seq_len": 8, "seed": 0, **inputs},
        }
    )


@functools.cache
def report(case_id: str):
    cfg = config(BY_ID[case_id])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.TransformerEncoder's nested-tensor notices
        return run_model(load_model(cfg), Settings.from_config(cfg), select(None))


def result(case_id: str, check: str):
    return next(r for r in report(case_id).results if r.name == check)


def problems(r) -> set[str]:
    return {f.code for f in r.findings if f.status.value != "pass"}


def verdict_params():
    for case in CASES:
        for check in CHECKS:
            yield pytest.param(case.id, check, id=f"{case.id}-{check}")


@pytest.mark.parametrize("case_id, check", verdict_params())
def test_verdict(case_id, check):
    status, codes = BY_ID[case_id].expect[check]
    r = result(case_id, check)
    assert (r.status.value, problems(r)) == (status, codes), f"{r.summary}\n" + "\n".join(
        f"  {f.code} {f.status.value}: {f.message} [{f.where}]" for f in r.findings
    )


# -- the ground truth, measured with plain torch (no fwdcheck) ---------------------------------------------------------


def _load(case: Case):
    sys.path.insert(0, str(REPO))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return resolve_callable(f"tests.models:{case.factory}", "factory")(**case.kwargs).eval()
    finally:
        sys.path.remove(str(REPO))


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_ground_truth(case_id):
    """What each model really does, so every expectation above rests on a fact, not on fwdcheck."""
    case = BY_ID[case_id]
    model = _load(case)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (2, 8), generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = model(ids)
        if case.truth == "nan":
            assert not torch.isfinite(base).all()
            return
        assert torch.isfinite(base).all()
        other = ids.clone()
        other[1] = torch.randint(0, 32, (8,), generator=g)
        mixes = float((model(other)[0] - base[0]).abs().max()) > 1e-4  # sample 0 unchanged, sample 1 changed
        leaks = False  # one row at a time, so that a batch leak does not pass for a future leak
        for k in range(1, 8):
            for row in ids:
                cut = row.clone()[None]  # (1, T)
                cut[:, k:] = (cut[:, k:] + torch.randint(1, 32, (8 - k,), generator=g)) % 32  # every token differs
                leaks |= float((model(cut)[:, :k] - model(row[None])[:, :k]).abs().max()) > 1e-4
    assert mixes == (case.truth == "mixes-batch")
    assert leaks == (case.truth in ("leaks", "bidirectional"))


# -- what the checks report beyond the status --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case_id, pairing, base",
    [
        ("llama-half-5e5", "half", 500000.0),
        ("gptj-interleaved-1e4", "interleaved", 10000.0),
        ("gptj-interleaved-5e5", "interleaved", 500000.0),
    ],
)
def test_rope_measures_pairing_and_base(case_id, pairing, base):
    r = result(case_id, "rope")
    assert r.metrics["pairing"] == pairing
    assert r.metrics["rotary_dim"] == 8
    assert abs(math.log(r.metrics["base"] / base)) < 0.02, r.metrics


def test_rope_interleaved_head16_base5e5_metrics():
    """Slow pairs of an interleaved layout barely turn within the probe; they still count toward the rotary dim."""
    case = Case(
        "gptj-interleaved-5e5-d_h16",
        "llama",
        {"pairing": "interleaved", "rope_theta": 500000.0, "num_attention_heads": 2, "num_key_value_heads": 1},
    )
    cfg = config(case)
    r = run_model(load_model(cfg), Settings.from_config(cfg), select(["rope"])).results[0]
    assert r.status.value == "pass"
    assert r.metrics["pairing"] == "interleaved"
    assert r.metrics["rotary_dim"] == 16 and abs(math.log(r.metrics["base"] / 500000.0)) < 0.02, r.metrics


def test_sliding_window_is_causal_restricted():
    calls = result("sliding-window-3", "mask-audit").data["calls"]
    assert {c["pattern"] for c in calls} == {"causal, restricted (window or sparse)"}
    may = torch.tensor(calls[0]["may_read"], dtype=torch.bool)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None]
    assert torch.equal(may, (j <= i) & (i - j < 3))


@pytest.mark.parametrize("case_id", ["alibi", "hf-finfo-min-sdpa", "hf-finfo-min-eager"])
def test_additive_masks_read_as_causal(case_id):
    calls = result(case_id, "mask-audit").data["calls"]
    assert {c["pattern"] for c in calls} == {"causal"}


@pytest.mark.parametrize(
    "case_id", ["encoder-bidirectional-nested", "encoder-bidirectional-nonested", "bert-bidirectional"]
)
def test_bidirectional_skips_causal_part(case_id):
    r = result(case_id, "future-token")
    assert r.data.get("note", "").startswith("part (a) not judged: bidirectional by design")
    assert "max_change_before_cut" not in r.metrics and "prefix_max_change" not in r.metrics
    assert {c["pattern"] for c in result(case_id, "mask-audit").data["calls"]} == {"bidirectional by design: every key"}


@pytest.mark.parametrize(
    "case_id, kind",
    [
        ("encoder-float-nested", "float"),
        ("encoder-bool-nested", "float"),
        ("encoder-is_causal-nested", "is_causal"),
        ("encoder-tril_bool-nested", "float"),
        ("mha-tril_bool", "float"),
    ],
)
def test_multihead_attention_masks_arrive_as_float(case_id, kind):
    """Documents the cause of the FWD202 miss: whatever the model passes, the observer sees the canonical mask."""
    calls = result(case_id, "mask-audit").data["calls"]
    assert {c["api"] for c in calls} == {"mha"} and {c["mask"] for c in calls} == {kind}
