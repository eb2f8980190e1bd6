"""rope on attention that is unusual by design, from transformers' own architectures built tiny: a short causal
convolution over the keys and no rotary embedding (Inkling), a convolution-mixed projection (Zaya), NoPE layers whose
queries are scaled by position beside rotary ones (Beam). Where the probe cannot tell, the call is not judged and
says why; FWD301 and FWD304 need a rotation on one side and a visible absence on the other. Planted rope-on-q-only
still fails."""

from __future__ import annotations

import pytest
import torch

from fwdcheck.checks.rope import one_side_unjudgeable
from fwdcheck.checks.rotation import analyze

pytest.importorskip("transformers")

from tests.test_hf_rope_declared import failed, rope_result, tiny  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["inkling_text", "zaya"])
def test_position_that_reaches_one_side_without_rotating_it_is_not_judged(model_type):
    result = rope_result(tiny(model_type))
    assert result.status.value == "skip", result.findings
    assert "in a way no rotation does" in result.summary


@pytest.mark.slow
def test_nope_layers_scaled_by_position_beside_rotary_ones_pass():
    """Beam's full-attention layers scale q by position and rotate nothing; its sliding layers rotate both."""
    result = rope_result(tiny("beam"))
    assert result.status.value == "pass", result.findings
    unjudged = [c for c in result.data["probe_calls"] if not c["judged"]]
    assert unjudged and all("no rotation" in c["note"] for c in unjudged)
    assert result.data["logits_shift"].startswith("skipped: positions also enter absolutely")


@pytest.mark.slow
def test_rope_on_q_only_in_the_rotary_layers_still_fails(rope_on_q_only):
    rope_on_q_only("beam")
    assert "FWD301" in failed(rope_result(tiny("beam")))


def rotated(x: torch.Tensor, positions: int = 16) -> torch.Tensor:
    """x (D,) rotated in half pairing over all its dims to positions 0..P-1: (P, D)."""
    half = x.shape[0] // 2
    theta = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * theta  # (P, D/2)
    a, b = x[:half], x[half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1)


def test_one_side_rotated_is_evidence_only_when_the_other_could_show_it():
    g = torch.Generator().manual_seed(0)
    q_row, k_row = torch.randn(2, 8, generator=g, dtype=torch.float64)
    q_seen, still = rotated(q_row), k_row.expand(16, -1)
    q, k = analyze(q_seen, 1e-6), analyze(still, 1e-6)
    assert q.pairing == "half" and not k.rotates
    assert one_side_unjudgeable(q, k, q_seen, still, 1e-9) == (None, False)  # FWD301's evidence

    zero = torch.zeros_like(still)
    note, absolute = one_side_unjudgeable(q, analyze(zero, 1e-6), q_seen, zero, 1e-9)
    assert "zero in the dims q rotates" in note and not absolute

    scaled = q_row * torch.linspace(1, 2, 16, dtype=torch.float64)[:, None]  # (P, D): a scale growing with position
    q_scaled = analyze(scaled, 1e-6)
    assert q_scaled.rotates and q_scaled.pairing is None
    note, absolute = one_side_unjudgeable(q_scaled, k, scaled, still, 1e-9)
    assert "in a way no rotation does" in note and absolute
