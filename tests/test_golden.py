"""The seed notes' hand calculations and toy shapes, as golden tests of what fwdcheck computes and reads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fwdcheck.checks.rotation import analyze, toeplitz_error
from fwdcheck.model.reference import ReferenceConfig, ReferenceTransformer, apply_rope
from fwdcheck.observe.masks import _read_mask
from fwdcheck.observe.observer import observing
from tests.conftest import run_checks

SCORES = torch.tensor([math.log(2), 0.0, 0.0])
VALUES = torch.tensor([[2.0, 0.0], [0.0, 4.0], [2.0, 2.0]])


def test_seed_weights_are_half_quarter_quarter():
    assert torch.softmax(SCORES, -1).tolist() == pytest.approx([0.5, 0.25, 0.25])


def test_seed_output_through_sdpa_and_the_reference_eager_path():
    """Scores log 2, 0, 0 over values (2,0), (0,4), (2,2) give (1.5, 1.5), by either code path."""
    q = torch.tensor([[[[math.log(2)]]]])  # (B=1, h=1, T=1, d_h=1)
    k = torch.tensor([[[[1.0], [0.0], [0.0]]]])  # (1, 1, S=3, 1): q.k = log 2, 0, 0
    v = VALUES[None, None]  # (1, 1, 3, 2)
    out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert out.flatten().tolist() == pytest.approx([1.5, 1.5])
    model = ReferenceTransformer(ReferenceConfig(d_model=1, n_heads=1, n_layers=1, positional="none"))
    attention = model.layers[0].attn
    eager = attention.eager_attention(q, k, v, mask=None, is_causal=False, dropout_p=0.0)  # scale 1/sqrt(1)
    assert eager.flatten().tolist() == pytest.approx([1.5, 1.5])


def test_observer_reads_the_seed_weights_off_eager_softmax():
    q = torch.full((1, 1, 3, 1), math.log(2))  # (B=1, h=1, L=3, d_h=1): three queries alike
    k = torch.tensor([[[[1.0], [0.0], [0.0]]]])  # (1, 1, S=3, 1): each query scores its keys log 2, 0, 0
    with observing(torch.nn.Identity(), seq_len=3) as seen:
        weights = F.softmax(q @ k.transpose(-2, -1), dim=-1)  # eager attention: scores made by q @ k^T
    call = seen.attention[0]
    assert weights[0, 0, 0].tolist() == pytest.approx([0.5, 0.25, 0.25])
    assert call.api == "softmax" and call.softmax_dim == -1 and call.row_sum_error < 1e-6
    assert call.allowed.all()


def test_toy_shapes_are_named_although_T_equals_d_h():
    """[2,4] ids, [2,4,8] hidden, [2,2,4,4] per head, [2,4,16] logits; T = d_h = 4 named apart."""
    report = run_checks({"source": "reference"}, ["shape-ledger"], inputs={"batch_size": 2, "seq_len": 4})
    entries = {e["name"]: e for e in report.result("shape-ledger").data["entries"]}
    assert entries["input_ids"]["shape"] == [2, 4] and entries["input_ids"]["dims"] == ["B", "T"]
    assert entries["token embedding (wte)"]["dims"] == ["B", "T", "d"]
    assert entries["token embedding (wte)"]["shape"] == [2, 4, 8]
    assert entries["layers.0.attn q"]["shape"] == [2, 2, 4, 4]
    assert entries["layers.0.attn q"]["dims"] == ["B", "h", "T", "d_h"]
    assert entries["layers.0.attn attention weights"]["dims"] == ["B", "h", "T", "T"]
    assert entries["logits"]["shape"] == [2, 4, 16] and entries["logits"]["dims"] == ["B", "T", "V"]
    assert report.result("shape-ledger").status.value == "pass"


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 200), n=st.integers(0, 200), seed=st.integers(0, 2**16))
def test_rope_2d_identity(m, n, seed):
    """<R(m)q, R(n)k> = <q, R(n-m)k> in two dimensions (RoFormer section 3), for both pairings."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 1, 2, generator=g, dtype=torch.float64)
    for pairing in ("half", "interleaved"):

        def rotate(x, p):
            return apply_rope(x, torch.tensor([p]), 10000.0, pairing, 2).double()  # noqa: B023 -- this iteration's

        lhs = (rotate(q, m) * rotate(k, n)).sum()
        rhs = (q * rotate(k, n - m)).sum() if n >= m else (rotate(q, m - n) * k).sum()
        assert float(lhs) == pytest.approx(float(rhs), abs=1e-4)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_analyze_recovers_pairing_and_base(pairing, base):
    x = torch.randn(1, 1, 1, 16, generator=torch.Generator().manual_seed(0)).expand(1, 1, 32, 16)
    rotated = apply_rope(x.contiguous(), torch.arange(32), base, pairing, 16)[0, 0]  # (32, 16)
    found = analyze(rotated, tol=1e-4)
    assert (found.pairing, found.rotary_dim) == (pairing, 16)
    assert found.base == pytest.approx(base, rel=0.01)
    assert found.thetas[0] == pytest.approx(1.0, rel=1e-3)
    assert toeplitz_error(rotated.double() @ rotated.double().T) < 1e-5


def test_analyze_sees_partial_rotary_and_no_rotation():
    x = torch.randn(1, 1, 1, 8, generator=torch.Generator().manual_seed(1)).expand(1, 1, 16, 8).contiguous()
    partial = analyze(apply_rope(x, torch.arange(16), 10000.0, "half", 4)[0, 0], tol=1e-4)
    assert (partial.pairing, partial.rotary_dim) == ("half", 4)
    assert not analyze(x[0, 0], tol=1e-4).rotates


def test_mask_conventions():
    """One causal intent, four encodings: the may-read set is the same lower triangle every time."""
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(_read_mask(causal, true_means_masked=False).allowed, causal)  # SDPA bool: True = may attend
    assert torch.equal(_read_mask(~causal, true_means_masked=True).allowed, causal)  # MHA bool: True = masked out
    additive = _read_mask(torch.zeros(3, 3).masked_fill(~causal, float("-inf")), true_means_masked=True)
    assert (additive.kind, additive.values, additive.float_01) == ("float", "{0, -inf}", False)
    assert torch.equal(additive.allowed, causal)
    zero_one = _read_mask(causal.float(), true_means_masked=False)
    assert zero_one.float_01 and zero_one.allowed.all()  # 0/1 floats are added to the scores: nothing is masked
    finfo_min = torch.zeros(3, 3).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert torch.equal(_read_mask(finfo_min, true_means_masked=False).allowed, causal)
