"""The planted-bug matrix: every bug x every check, on both attention code paths.

Each bug must fail exactly the checks listed, with the finding codes listed, and every clean variant must pass
everything that applies. A check that cannot fail, or fails a clean model, breaks this file. A bug that keeps every
shape, mask and position (two heads swapped) fails no check here: only a numeric contract sees it
(tests/test_golden_contract.py).
"""

from __future__ import annotations

import pytest

from fwdcheck.config.bugs import BUGS
from fwdcheck.config.registry import select
from tests.conftest import codes, run_checks, statuses

# bug -> {check: codes that must be among its findings}; every check not named must pass.
# A mask lost everywhere shows in every check that reads the future some way: the cached decode, the gradients.
EXPECTED = {
    "no-causal-mask": {
        "future-token": {"FWD101", "FWD105"},
        "mask-audit": {"FWD201"},
        "kv-cache": {"FWD501", "FWD503"},
        "grad-causality": {"FWD121"},
    },
    "inverted-bool-mask": {"future-token": {"FWD101"}, "mask-audit": set()},
    "float-mask-01": {
        "future-token": {"FWD101"},
        "mask-audit": set(),
        "kv-cache": {"FWD501", "FWD503"},
        "grad-causality": {"FWD121"},
    },
    "sdpa-dropout-in-eval": {"future-token": {"FWD103"}, "mask-audit": {"FWD207"}},
    # heads reading another sample's queries: every check that runs rows side by side sees it
    "batch-mix": {
        "future-token": {"FWD102"},
        "packing": {"FWD601"},
        "label-shift": {"FWD703"},
        "grad-causality": {"FWD122"},
    },
    "rope-k-unrotated": {"rope": {"FWD301", "FWD304"}},
    "rope-pairing-mismatch": {"rope": {"FWD302", "FWD304"}},
    "rope-absolute-offset": {"rope": {"FWD304"}},
    "kv-cache-position-off-by-one": {"kv-cache": {"FWD501"}},
    "kv-cache-mask-top-left": {"kv-cache": {"FWD502"}},
    "kv-cache-rope-restart": {"kv-cache": {"FWD501"}},
    "eager-scale-1-over-d": {"backends": {"FWD801"}},
    "sdpa-scale-dropped": {"backends": {"FWD801"}},
    "heads-swapped": {},
    "rope-angles-in-model-dtype": {"rope-precision": {"FWD901"}},
    "label-no-shift": {"label-shift": {"FWD701"}},
    "label-double-shift": {"label-shift": {"FWD702", "FWD703"}},
    "packing-no-document-mask": {"packing": {"FWD601"}},
    "packing-positions-not-reset": {"packing": {"FWD602"}},
    "sliding-window-one-wider": {"mask-audit": {"FWD211"}},
    "scale-applied-twice": {"attention-stats": {"FWD955"}},
}
# Bugs that only show at long positions in low precision run there: (model fields, dtype). In float32, or at 64
# positions, rope angles computed in the activations' dtype are what correct code computes.
BUG_RUN = {
    "rope-angles-in-model-dtype": ({"max_seq_len": 4096}, "bfloat16"),
    # with rotary positions, isolated documents at continuing positions give the same logits: learned ones
    "packing-positions-not-reset": ({"positional": "learned"}, "float32"),
    # a band one key wider needs a band: a window of 4 under the run's 8 tokens
    "sliding-window-one-wider": ({"window": 4}, "float32"),
}
# How each mask mistake reads, by code path: SDPA's mask is seen in its own convention; eager code only leaves
# its scores, so an inverted mask is "future keys readable" and a 0/1 mask "no restriction".
MASK_CODES = {
    ("inverted-bool-mask", "sdpa"): {"FWD202", "FWD205"},
    ("inverted-bool-mask", "eager"): {"FWD204", "FWD205"},
    ("float-mask-01", "sdpa"): {"FWD203"},
    ("float-mask-01", "eager"): {"FWD201"},
}
# Eager softmax over a row whose every key is -inf gives NaN (SDPA gives zeros): the logits are NaN, never a pass.
FUTURE_CODES = {("inverted-bool-mask", "eager"): {"FWD104"}}
# What else fails, by code path: on SDPA an inverted mask reads the future (the cache and the gradients show it) and
# eager attention, handed the same mask in its own convention, disagrees (backends); on the eager path the NaN rows
# reach every forward (packed documents, the loss, the gradients), and the cached decode and backends have no finite
# full forward to compare with.
PATH_FAILS = {
    # a scale wrong on one path is attention-stats' too, on that path: 1/d_h is 1/sqrt(d_h) twice, none is none
    ("eager-scale-1-over-d", "eager"): {"attention-stats": {"FWD955"}},
    ("sdpa-scale-dropped", "sdpa"): {"attention-stats": {"FWD956"}},
    ("inverted-bool-mask", "sdpa"): {
        "kv-cache": {"FWD501", "FWD503"},
        "grad-causality": {"FWD121"},
        "backends": {"FWD801"},
    },
    ("inverted-bool-mask", "eager"): {
        "shape-ledger": {"FWD404"},
        "packing": {"FWD604"},
        "label-shift": {"FWD706"},
        "grad-causality": {"FWD123"},
    },
}


def test_every_bug_is_in_the_matrix():
    assert set(EXPECTED) == set(BUGS)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_fails_exactly_its_checks(reference, bug, attention):
    expected = EXPECTED[bug]
    # the default checks, and the checks the bug must fail that do not run by default
    fields, dtype = BUG_RUN.get(bug, ({}, "float32"))
    report = run_checks(
        reference(bugs=[bug], attention=attention, dropout=0.1, **fields), ["default", *expected], dtype=dtype
    )
    got = statuses(report)
    failing = {name for name, status in got.items() if status == "fail"}
    expected = {**expected, **PATH_FAILS.get((bug, attention), {})}
    assert failing == set(expected), got
    for check, wanted in expected.items():
        if check == "mask-audit":
            wanted = wanted | MASK_CODES.get((bug, attention), set())
        if check == "future-token":
            wanted = FUTURE_CODES.get((bug, attention), wanted)
        assert wanted <= codes(report, check), (check, codes(report, check))
    assert report.exit_code == (1 if expected else 0)


ROTARY = ("rope", "rope-precision")
CLEAN = {
    "rope-half": {},
    "rope-interleaved": {"rope": {"pairing": "interleaved", "base": 500000.0}},
    "rope-partial": {"rope": {"rotary_dim": 2}},
    "gqa": {"n_kv_heads": 1},
    "float-mask": {"mask": "float"},
    "is-causal": {"mask": "is_causal"},
    "post-norm": {"norm": "post"},
    "learned": {"positional": "learned"},
    "no-positions": {"positional": "none"},
    "dropout-train-only": {"dropout": 0.3},
    "sliding-window": {"window": 4},
    "sliding-window-is-causal": {"window": 4, "mask": "is_causal"},
}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("variant", sorted(CLEAN))
def test_clean_variants_pass(reference, variant, attention):
    report = run_checks(reference(attention=attention, **CLEAN[variant]))
    got = statuses(report)
    rotary = variant not in ("learned", "no-positions")  # without one, rope and rope-precision do not apply
    expected = {entry.name: "pass" for entry in select(None)} | ({} if rotary else dict.fromkeys(ROTARY, "skip"))
    assert got == expected, [(r.name, r.findings) for r in report.results if r.status.value not in ("pass", "skip")]
    assert report.exit_code == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bug", [None, "no-causal-mask", "batch-mix", "rope-k-unrotated", "sdpa-dropout-in-eval"])
def test_low_precision_tolerances_follow_the_dtype(reference, dtype, bug):
    """bfloat16 rounding is ~1e-2 relative: no false alarm on the clean model, and the bugs still show."""
    report = run_checks(
        reference(bugs=[bug] if bug else [], dropout=0.1), dtype=dtype, inputs={"batch_size": 2, "seq_len": 16}
    )
    failing = {name for name, status in statuses(report).items() if status == "fail"}
    # In bfloat16, rows mixed by batch-mix move the loss (by 0.006 on label-shift's 8-token rows, as in float32) by
    # less than the dtype's bar: label-shift's FWD703 is a float32 and float16 finding (future-token, packing and
    # grad-causality see the mixing in every dtype)
    missed = {"label-shift"} if bug == "batch-mix" and dtype == "bfloat16" else set()
    assert failing == (set(EXPECTED[bug]) - missed if bug else set())


def test_rope_reports_measured_pairing_and_base(reference):
    report = run_checks(reference(rope={"pairing": "interleaved", "base": 500000.0}), ["rope"])
    metrics = report.result("rope").metrics
    assert metrics["pairing"] == "interleaved"
    assert metrics["rotary_dim"] == 4
    assert metrics["base"] == pytest.approx(500000.0, rel=0.01)


def test_exhaustive_leak_map_names_every_pair(reference):
    """With every position perturbed alone, the leak map of a maskless model is the full upper triangle."""
    report = run_checks(
        reference(bugs=["no-causal-mask"]), ["future-token"], exhaustive=True, inputs={"batch_size": 2, "seq_len": 6}
    )
    columns = report.result("future-token").data["leak_map"]["columns"]
    threshold = report.result("future-token").data["leak_map"]["threshold"]
    moved = {(q, c["k"]) for c in columns for q, change in enumerate(c["change"]) if change > threshold}
    assert moved == {(q, k) for k in range(1, 6) for q in range(k)}


def test_exhaustive_clean_model_has_an_empty_map(reference):
    report = run_checks(reference(), ["future-token"], exhaustive=True, inputs={"batch_size": 2, "seq_len": 6})
    result = report.result("future-token")
    assert result.status.value == "pass"
    assert [c["k"] for c in result.data["leak_map"]["columns"]] == [1, 2, 3, 4, 5]
