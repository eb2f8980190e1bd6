"""shape-ledger on models that pool the sequence by design: an axis that is T / k (rounded up) in both passes, at
two lengths, is the sequence pooled by k, named T/k where queries or keys go (Funnel Transformer's pooled queries:
its attention weights are [B, h, T/2, T] between blocks). A pooled sequence is never a head count or a width, so a
pooled model that forgets its transpose(1, 2) still fails; before it was named, the pooled length sat in the heads'
place unnoticed.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from fwdcheck import check_model  # noqa: E402
from fwdcheck.checks.shape_ledger import _pooled  # noqa: E402

V, D, H = 32, 32, 2


class PooledAttention(nn.Module):
    """Funnel's pooling in a few lines: the sequence mean-pooled by 2 (rounded up), then attention over the pooled
    sequence with SDPA. `transposed=False` is the bug: q, k, v handed over as [B, T/2, h, d_h]."""

    def __init__(self, transposed: bool = True):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, V)
        self.transposed = transposed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, D)
        B = x.shape[0]
        pooled = F.avg_pool1d(x.transpose(1, 2), 2, ceil_mode=True).transpose(1, 2)  # (B, ceil(T/2), D)
        q, k, v = self.qkv(pooled).view(B, pooled.shape[1], 3, H, D // H).unbind(2)  # each (B, T/2, h, d_h)
        if self.transposed:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T/2, d_h)
        y = F.scaled_dot_product_attention(q, k, v)
        y = y.transpose(1, 2) if self.transposed else y  # (B, T/2, h, d_h)
        y = y.reshape(B, pooled.shape[1], D).repeat_interleave(2, dim=1)[:, : ids.shape[1]]  # (B, T, D)
        return self.out(y)


def ledger(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_model(model, ["shape-ledger"], causal=False, code_paths={"enabled": False})
    return report.result("shape-ledger")


def dims_of(result, name: str) -> list[str]:
    return next(e["dims"] for e in result.data["entries"] if name in e["name"])


def test_pooled_lengths_are_told_by_both_passes():
    assert _pooled(4, 3, 8, 5) == 2  # ceil(8/2), ceil(5/2)
    assert _pooled(2, 2, 8, 5) is None  # stayed put: a constant
    assert _pooled(4, 4, 8, 5) is None
    assert _pooled(3, 3, 8, 5) is None
    assert _pooled(2, 1, 8, 3) == 4  # ceil(8/4), ceil(3/4)
    assert _pooled(5, 3, 8, 5) is None  # changed, but by no common factor


def test_a_pooled_sequence_is_named_and_passes():
    result = ledger(PooledAttention().eval())
    assert result.status.value == "pass", (result.summary, [f.message for f in result.findings])
    assert dims_of(result, "q") == ["B", "h", "T/2", "d_h"]


def test_a_pooled_model_missing_its_transpose_fails():
    result = ledger(PooledAttention(transposed=False).eval())
    assert result.status.value == "fail", result.summary
    failed = [f for f in result.findings if f.status.value == "fail"]
    assert {f.code for f in failed} == {"FWD401"}, failed
    assert any("T/2" in f.message for f in failed), failed  # the pooled sequence, where the heads belong


@pytest.mark.slow
def test_funnel_names_its_pooled_queries():
    """transformers' Funnel Transformer (pool_q_only): its second block's queries are the sequence pooled by 2, read
    against the unpooled keys; the ledger names them T/2 and passes."""
    pytest.importorskip("transformers")
    from tests.arch_sweep import plain

    result = ledger(plain("funnel", "masked-lm"))
    assert result.status.value == "pass", (result.summary, [f.message for f in result.findings])
    weights = dims_of(result, "blocks.1.0.attention attention weights")
    assert weights == ["B", "h", "T/2", "T"], weights
