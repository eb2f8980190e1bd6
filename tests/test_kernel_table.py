"""The kernel table is the one seam a new attention kernel needs. A kernel fwdcheck has never heard of, defined here as
a torch.library custom op, is recorded as not judged until its reader is registered in the table (one function, one
row); from then on mask-audit judges its calls both ways, like a built-in kernel's, and points at the model line
that made them. Nothing else is edited, and the rows registered here are taken out again.

Shapes: B (batch), T (sequence), nh (heads), hs (head size), C (width).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from fwdcheck.observe.dispatcher import Observer
from fwdcheck.observe.masks import MaskRead
from fwdcheck.observe.table import KERNELS

VOCAB, WIDTH, HEADS, T = 32, 16, 2, 12
OP = "fwdcheck_table_tests::banded_attention"


@torch.library.custom_op(OP, mutates_args=())
def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ahead: int) -> torch.Tensor:
    """A library's own attention kernel, (B, nh, T, hs) in and out: query i reads the keys up to i + ahead (0: causal,
    1: the next token too, T or more: every key)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[-2], k.shape[-2], ahead, q.device))


def _band(L: int, S: int, ahead: int, device: torch.device) -> torch.Tensor:
    """(L, S) bool, True where query i may read key j: j <= i + ahead."""
    return torch.arange(S, device=device)[None, :] <= torch.arange(L, device=device)[:, None] + ahead


def read_banded(observer: Observer, func, args, kwargs):
    """The kernel's reader: its mask is declared by `ahead`, as flash-attn's is by causal and the window."""
    q, k, v, ahead = (*args, *kwargs.values())[:4]
    allowed = _band(q.shape[-2], k.shape[-2], int(ahead), q.device)
    mask = MaskRead(allowed, "declared", f"banded_attention: ahead={ahead}")
    observer.record.attention.append(
        observer.attention_call(
            "banded",
            observer.module(),
            q,
            k,
            v,
            batch_heads=tuple(q.shape[:-2]),
            mask=mask,
            is_causal=ahead == 0,
            dropout=0.0,
            cross=observer.cross(q, k),
            reads_input=observer.reads_input(q),
        )
    )
    return observer.plain(func, args, kwargs)


class Banded(nn.Module):
    """One attention layer through banded_attention."""

    def __init__(self, ahead: int):
        super().__init__()
        torch.manual_seed(0)
        self.ahead = ahead
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(64, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        x = self.embed(input_ids) + self.positions(torch.arange(T))  # (B, T, C)
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
        y = banded_attention(q, k, v, self.ahead)  # (B, nh, T, hs)
        return self.head(y.transpose(1, 2).reshape(B, T, WIDTH))


CALL_LINE = next(
    i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "y = banded_attention(q, k, v" in line
)


@pytest.fixture
def registered():
    """The reader's row in the table for the test, and the table as found after it."""
    readers, wrappers = dict(KERNELS.readers), dict(KERNELS.wrappers)
    KERNELS.reader(OP)(read_banded)
    try:
        yield
    finally:
        KERNELS.remove(OP)
        assert KERNELS.readers == readers and KERNELS.wrappers == wrappers


def audit(ahead: int):
    report = fwdcheck.check_model(Banded(ahead), ["mask-audit"], vocab_size=VOCAB, seq_len=T)
    return report.result("mask-audit")


def test_without_its_reader_the_kernel_is_not_judged():
    assert OP not in KERNELS.readers
    result = audit(ahead=0)
    assert result.status.value == "skip"
    assert OP in result.summary and "not judged" in result.summary


@pytest.mark.parametrize(("ahead", "codes"), [(0, set()), (1, {"FWD204"}), (T, {"FWD201"})])
def test_a_registered_reader_is_judged_both_ways(registered, ahead, codes):
    result = audit(ahead)
    rows = result.data["calls"]
    assert rows and all(r["api"] == "banded" and r["judged"] for r in rows)
    assert result.status.value == ("pass" if not codes else "fail"), result.summary
    assert {f.code for f in result.findings if f.status.value == "fail"} == codes
    # the reader lives outside fwdcheck/observe/ and is still passed over: the call is the model's line
    assert {r["source"].rsplit(":", 1)[1] for r in rows} == {str(CALL_LINE)}
    assert all(f.source.endswith(f"test_kernel_table.py:{CALL_LINE}") for f in result.findings)


def test_a_key_has_one_reader():
    KERNELS.reader(OP, None)(read_banded)  # None: a function this torch does not have, passed over
    try:
        assert None not in KERNELS.readers
        with pytest.raises(ValueError, match="already has a reader: .*read_banded"):
            KERNELS.reader(OP)(lambda observer, func, args, kwargs: None)
    finally:
        KERNELS.remove(OP)
    assert OP not in KERNELS.readers
