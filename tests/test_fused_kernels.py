"""Attention kernels whose mask is declared by their arguments, judged by what the kernel computes from them.

torch's own causal masks for scaled_dot_product_attention (torch.nn.attention.bias.causal_upper_left and
causal_lower_right) are the real thing here: a model that prefills its sequence in two chunks, the second chunk's
queries over the first chunk's keys and values and their own, as chunked prefill and decoding through a cache do.
The causal diagonal must then be aligned to the bottom right (the queries are the last of the keys); aligned top
left, each query of the second chunk no longer reads itself or the tokens just before it: nothing of the future is
read, so mask-audit names it (FWD210) and future-token sees it only as logits that depend on the length (FWD105).

Shapes: B (batch), T (sequence), nh (heads), hs (head size), C (width).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck

bias = pytest.importorskip("torch.nn.attention.bias")

VOCAB, WIDTH, HEADS = 32, 16, 2


class ChunkedPrefill(nn.Module):
    """One attention layer run over the sequence in two chunks; the second attends over a cache holding the first
    chunk's keys and values, then its own. `causal` makes the second chunk's mask: lower_right | upper_left."""

    def __init__(self, causal: str = "lower_right"):
        super().__init__()
        torch.manual_seed(0)
        self.causal = getattr(bias, f"causal_{causal}")
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(64, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        x = self.embed(input_ids) + self.positions(torch.arange(T))  # (B, T, C)
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
        half = T // 2
        first = F.scaled_dot_product_attention(q[:, :, :half], k[:, :, :half], v[:, :, :half], is_causal=True)
        mask = self.causal(T - half, T)  # the second chunk's queries over every key so far
        second = F.scaled_dot_product_attention(q[:, :, half:], k, v, attn_mask=mask)
        y = torch.cat([first, second], dim=2)  # (B, nh, T, hs)
        return self.head(y.transpose(1, 2).reshape(B, T, WIDTH))


def results(model):
    return {r.name: r for r in fwdcheck.check_model(model, vocab_size=VOCAB, seq_len=12).results}


def test_causal_lower_right_over_a_cache_passes():
    found = results(ChunkedPrefill("lower_right"))
    audit = found["mask-audit"]
    assert audit.status.value == "pass", audit.summary
    rows = audit.data["calls"]
    chunk = next(r for r in rows if r["mask"] == "causal_lower_right")
    assert chunk["judged"] and (chunk["queries"], chunk["keys"]) == (6, 12)
    assert chunk["query_positions"] == list(range(6, 12))
    assert found["future-token"].status.value == "pass"


def test_causal_upper_left_over_a_cache_fails_mask_audit():
    found = results(ChunkedPrefill("upper_left"))
    audit = found["mask-audit"]
    assert audit.status.value == "fail"
    blind = next(f for f in audit.findings if f.code == "FWD210")
    assert "aligned top left over a cache" in blind.message
    assert blind.source.startswith("tests/test_fused_kernels.py:")
    # it reads nothing of the future, but what a token sees depends on where the chunks split: a prefix run alone
    # gives other logits (FWD105), no future-token leak (FWD101)
    codes = {f.code for f in found["future-token"].findings if f.status.value == "fail"}
    assert codes == {"FWD105"}


def test_a_square_causal_bias_reads_like_is_causal():
    for causal in ("lower_right", "upper_left"):  # at L == S the two alignments are one mask
        model = ChunkedPrefill(causal)
        model.forward = lambda ids, m=model: m.head(  # one chunk: the whole sequence at once
            F.scaled_dot_product_attention(*_qkv(m, ids), attn_mask=m.causal(ids.shape[1], ids.shape[1]))
            .transpose(1, 2)
            .reshape(ids.shape[0], ids.shape[1], WIDTH)
        )
        audit = results(model)["mask-audit"]
        assert audit.status.value == "pass", (causal, audit.summary)


def _qkv(model, ids):
    B, T = ids.shape
    x = model.embed(ids) + model.positions(torch.arange(T))
    return model.qkv(x).view(B, T, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)


# -- a kernel fwdcheck does not know -------------------------------------------------------------------------------


@torch.library.custom_op("fwdcheck_tests::fused_attention", mutates_args=())
def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """A library's own attention kernel, (B, nh, T, hs) in and out, its mask declared by `causal`."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class UnknownKernel(ChunkedPrefill):
    def __init__(self, causal: bool):
        super().__init__()
        self.is_causal = causal

    def forward(self, input_ids):
        B, T = input_ids.shape
        y = fused_attention(*_qkv(self, input_ids), self.is_causal)  # (B, nh, T, hs)
        return self.head(y.transpose(1, 2).reshape(B, T, WIDTH))


@pytest.mark.parametrize("causal", [True, False])
def test_an_unknown_kernel_is_not_judged_by_name_never_passed(causal):
    found = results(UnknownKernel(causal))
    audit = found["mask-audit"]
    assert audit.status.value == "skip"
    assert "fwdcheck_tests::fused_attention" in audit.summary and "not judged" in audit.summary
    # what the kernel does is still tested from the outside
    assert found["future-token"].status.value == ("pass" if causal else "fail")
