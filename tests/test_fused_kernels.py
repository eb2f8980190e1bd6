"""Attention kernels whose mask is declared by their arguments, judged by what the kernel computes from them.

torch's own causal masks for scaled_dot_product_attention (torch.nn.attention.bias.causal_upper_left and
causal_lower_right) are the real thing here: a model that prefills its sequence in two chunks, the second chunk's
queries over the first chunk's keys and values and their own, as chunked prefill and decoding through a cache do.
The causal diagonal must then be aligned to the bottom right (the queries are the last of the keys); aligned top
left, each query of the second chunk no longer reads itself or the tokens just before it: nothing of the future is
read, so mask-audit names it (FWD210) and future-token sees it only as logits that depend on the length (FWD105).

flash-attn and xformers need CUDA to install: here they are stand-ins (tests/standins) with their real signatures and
op names and a reference computation inside, judged both ways (causal=False, a window off by one, documents that
read the next, a causal bias aligned top left over a cache); the CUDA tests run the real libraries where they exist.

Shapes: B (batch), T (sequence), nh (heads), hs (head size), C (width).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

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


# -- flash-attn, by its stand-in (tests/standins/flash_attn: its real signatures and op names, a reference inside) ----

STANDINS = str(Path(__file__).with_name("standins"))


def _standin(package: str, module: str, test: str):
    """A stand-in package from tests/standins, imported; where the real package is installed these tests leave it
    alone (both would register the same ops), and `test` checks the real one instead."""
    spec = importlib.util.find_spec(package)
    if spec is not None and STANDINS not in str(spec.origin):
        pytest.skip(f"the real {package} is installed: {test} checks it")
    sys.path.insert(0, STANDINS)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(STANDINS)


@pytest.fixture(scope="module")
def flash_attn():
    return _standin("flash_attn", "flash_attn", "test_real_flash_attn_on_cuda")


class FlashModel(ChunkedPrefill):
    """One attention layer through flash_attn_func, q, k, v as flash-attn takes them: (B, T, nh, hs)."""

    def __init__(self, flash, causal=True, window=(-1, -1)):
        super().__init__()
        self.flash, self.flash_causal, self.window = flash, causal, window

    def forward(self, input_ids):
        B, T = input_ids.shape
        q, k, v = (t.transpose(1, 2) for t in _qkv(self, input_ids))  # 3 x (B, T, nh, hs)
        y = self.flash.flash_attn_func(q, k, v, causal=self.flash_causal, window_size=self.window)  # (B, T, nh, hs)
        return self.head(y.reshape(B, T, WIDTH))


class PackedFlashModel(ChunkedPrefill):
    """Documents of 5 tokens packed in each row, run through flash_attn_varlen_func: every row's documents are
    sequences of their own, (B * T, nh, hs) packed. `shifted_keys`: cu_seqlens_k one token later than cu_seqlens_q
    at every inner boundary, so each document's keys take in the next document's first token."""

    def __init__(self, flash, shifted_keys=False):
        super().__init__()
        self.flash, self.shifted_keys = flash, shifted_keys

    def forward(self, input_ids):
        B, T = input_ids.shape
        q, k, v = (t.transpose(1, 2).reshape(B * T, HEADS, WIDTH // HEADS) for t in _qkv(self, input_ids))
        starts = [b * T + s for b in range(B) for s in range(0, T, 5)] + [B * T]
        cu_q = torch.tensor(starts, dtype=torch.int32)
        inner = torch.tensor([s % T != 0 for s in starts[:-1]] + [False])
        cu_k = cu_q + (inner.int() if self.shifted_keys else 0)
        y = self.flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True)  # (B * T, nh, hs)
        return self.head(y.reshape(B, T, WIDTH))


@pytest.mark.parametrize(
    ("causal", "window", "audit_codes"),
    [
        (True, (-1, -1), set()),
        (True, (3, 0), set()),  # a sliding window of 3 tokens before each query, and itself
        (False, (-1, -1), {"FWD201"}),  # causal=False: every key
        (False, (3, 1), {"FWD204"}),  # the window's right edge off by one: the next token too
    ],
)
def test_flash_attn_judged_by_its_arguments(flash_attn, causal, window, audit_codes):
    found = results(FlashModel(flash_attn, causal, window))
    audit = found["mask-audit"]
    assert {f.code for f in audit.findings if f.status.value == "fail"} == audit_codes, audit.summary
    assert audit.status.value == ("fail" if audit_codes else "pass")
    row = audit.data["calls"][0]
    assert row["api"] == "flash" and row["judged"] and f"window_size={window}" in row["values"]
    assert found["future-token"].status.value == ("fail" if audit_codes else "pass")


@pytest.mark.parametrize("shifted_keys", [False, True])
def test_flash_attn_varlen_documents(flash_attn, shifted_keys):
    found = results(PackedFlashModel(flash_attn, shifted_keys))
    audit = found["mask-audit"]
    if shifted_keys:  # each document reads the next one's first token
        assert {f.code for f in audit.findings if f.status.value == "fail"} == {"FWD204"}
        assert found["future-token"].status.value == "fail"
    else:
        assert audit.status.value == "pass", audit.summary
        assert "restricted" in audit.summary  # documents: causal within each, nothing across
        assert found["future-token"].status.value == "pass"


class KVCacheFlashModel(ChunkedPrefill):
    """Prefill in two chunks through flash_attn_with_kvcache, the second chunk over the first's keys and its own.
    `appended`: the kernel writes each chunk's k and v into the cache at cache_seqlens; else the model writes them
    itself and hands cache_seqlens counting the keys held. `bug`:
    top-left:   (written by the model) cache_seqlens = the chunk's length: the second chunk's queries read the cache
                from slot 0, aligned top left over it, and no longer their own keys
    window:     causal=False, window_size (2, 1): each query reads the next token too
    not-causal: causal=False: every key held, the chunk's later tokens among them"""

    def __init__(self, flash, appended=True, bug=None):
        super().__init__()
        self.flash, self.appended, self.bug = flash, appended, bug

    def forward(self, input_ids):
        B, T = input_ids.shape
        q, k, v = (t.transpose(1, 2) for t in _qkv(self, input_ids))  # 3 x (B, T, nh, hs)
        cache_k, cache_v = torch.zeros_like(k), torch.zeros_like(v)  # (B, T, nh, hs): a slot per position
        causal, window = self.bug not in ("not-causal", "window"), (2, 1) if self.bug == "window" else (-1, -1)
        chunks = []
        for start, end in ((0, T // 2), (T // 2, T)):
            if self.appended:
                kwargs = dict(k=k[:, start:end], v=v[:, start:end], cache_seqlens=start)
            else:
                cache_k[:, start:end], cache_v[:, start:end] = k[:, start:end], v[:, start:end]
                kwargs = dict(cache_seqlens=end - start if self.bug == "top-left" else end)
            chunks.append(
                self.flash.flash_attn_with_kvcache(
                    q[:, start:end], cache_k, cache_v, causal=causal, window_size=window, **kwargs
                )
            )
        y = torch.cat(chunks, dim=1)  # (B, T, nh, hs)
        return self.head(y.reshape(B, T, WIDTH))


@pytest.mark.parametrize(
    ("appended", "bug", "audit_codes", "leaks"),
    [
        (True, None, set(), False),
        (False, None, set(), False),
        (False, "top-left", {"FWD210"}, False),
        (True, "window", {"FWD204"}, True),
        (True, "not-causal", {"FWD201", "FWD204"}, True),  # the first chunk square, the second over the cache
    ],
)
def test_flash_attn_with_kvcache_judged_over_its_cache(flash_attn, appended, bug, audit_codes, leaks):
    """flash_attn_with_kvcache calls its CUDA extension directly (no torch op): the observer sees it through its
    extension's fwd_kvcache, and judges causal, the window and cache_seqlens (query i of the chunk reads the keys up
    to cache_seqlens + i) against where the chunk's queries sit."""
    found = results(KVCacheFlashModel(flash_attn, appended, bug))
    audit = found["mask-audit"]
    assert {f.code for f in audit.findings if f.status.value == "fail"} == audit_codes, audit.summary
    calls = [r for r in audit.data["calls"] if r["api"] == "flash"]
    assert calls and all(r["judged"] and "fwd_kvcache" in r["values"] for r in calls), calls
    future = found["future-token"]
    assert ("FWD101" in {f.code for f in future.findings}) == leaks, future.summary
    if bug == "top-left":  # nothing of the future read: the second chunk's logits depend on the length (FWD105)
        assert {f.code for f in future.findings if f.status.value == "fail"} == {"FWD105"}
    else:
        assert future.status.value == ("fail" if leaks else "pass"), future.summary
    # the extension's fwd_kvcache is its own again after the run
    assert sys.modules["flash_attn_2_cuda"].fwd_kvcache.__module__ == "flash_attn_2_cuda"


# -- xformers, by its stand-in (tests/standins/xformers: memory_efficient_attention and its bias objects lowered to
# the arguments of xformers' CUTLASS op, as xformers lowers them; a reference inside) ---------------------------------


@pytest.fixture(scope="module")
def xformers():
    return _standin("xformers", "xformers.ops", "test_real_xformers_on_cuda")


class XformersModel(ChunkedPrefill):
    """One attention layer through memory_efficient_attention, q, k, v as xformers takes them: (B, T, nh, hs).
    `bias(xops, T)` makes the attn_bias for the whole sequence, or with `chunked` for the second chunk of a two-chunk
    prefill, whose queries are the last T - T // 2 of the T keys."""

    def __init__(self, xops, bias, chunked=False):
        super().__init__()
        self.xops, self.bias, self.chunked = xops, bias, chunked

    def forward(self, input_ids):
        B, T = input_ids.shape
        q, k, v = (t.transpose(1, 2) for t in _qkv(self, input_ids))  # 3 x (B, T, nh, hs)
        attention = self.xops.memory_efficient_attention
        if not self.chunked:
            y = attention(q, k, v, attn_bias=self.bias(self.xops, T))  # (B, T, nh, hs)
        else:
            half = T // 2
            first = attention(q[:, :half], k[:, :half], v[:, :half], attn_bias=self.xops.LowerTriangularMask())
            second = attention(q[:, half:], k, v, attn_bias=self.bias(self.xops, T))  # over every key so far
            y = torch.cat([first, second], dim=1)  # (B, T, nh, hs)
        return self.head(y.reshape(B, T, WIDTH))


class PackedXformersModel(ChunkedPrefill):
    """Documents of 5 tokens packed in each row, all rows' documents one block-diagonal batch (1, B * T, nh, hs).
    `bias(xops, q_seqlens, kv_seqlens)`; `shifted_keys`: every document but a row's last gets one key more, taken
    from the start of the next document."""

    def __init__(self, xops, bias, shifted_keys=False):
        super().__init__()
        self.xops, self.bias, self.shifted_keys = xops, bias, shifted_keys

    def forward(self, input_ids):
        B, T = input_ids.shape
        q, k, v = (t.transpose(1, 2).reshape(1, B * T, HEADS, WIDTH // HEADS) for t in _qkv(self, input_ids))
        lengths = [min(5, T - s) for s in range(0, T, 5)] * B
        kv_lengths = list(lengths)
        if self.shifted_keys:  # document i takes the next one's first key, which the next one then lacks
            for i in range(len(lengths) - 1):
                if (i + 1) % (len(lengths) // B):  # not across rows
                    kv_lengths[i] += 1
                    kv_lengths[i + 1] -= 1
        y = self.xops.memory_efficient_attention(q, k, v, attn_bias=self.bias(self.xops, lengths, kv_lengths))
        return self.head(y.reshape(B, T, WIDTH))


def _causal_tensor(xops, T):  # an additive bias tensor: 0 on and below the diagonal, -inf above
    return torch.full((T, T), float("-inf")).triu(1)


@pytest.mark.parametrize(
    ("bias", "chunked", "audit_codes"),
    [
        (lambda xops, T: xops.LowerTriangularMask(), False, set()),
        (lambda xops, T: xops.LowerTriangularFromBottomRightLocalAttentionMask(3), False, set()),  # a window of 3
        (_causal_tensor, False, set()),
        (lambda xops, T: None, False, {"FWD201"}),  # no bias: every key
        (lambda xops, T: xops.LowerTriangularFromBottomRightMask(), True, set()),  # over a cache, bottom right
        (lambda xops, T: xops.LowerTriangularMask(), True, {"FWD210"}),  # over a cache, top left
    ],
    ids=["causal", "local-window", "additive-tensor", "no-bias", "bottom-right-over-cache", "top-left-over-cache"],
)
def test_xformers_judged_by_its_bias(xformers, bias, chunked, audit_codes):
    found = results(XformersModel(xformers, bias, chunked))
    audit = found["mask-audit"]
    assert {f.code for f in audit.findings if f.status.value == "fail"} == audit_codes, audit.summary
    assert audit.status.value == ("fail" if audit_codes else "pass")
    rows = audit.data["calls"]
    assert {r["api"] for r in rows} == {"xformers"} and all(r["judged"] for r in rows)
    assert all(r["values"].startswith("efficient_attention_forward_cutlass: custom_mask_type=") for r in rows)
    # future-token: every key read is a leak (FWD101); top left over a cache reads nothing of the future, but what a
    # token sees then depends on where the chunks split, and a prefix run alone gives other logits (FWD105)
    future = {"FWD201": {"FWD101", "FWD105"}, "FWD210": {"FWD105"}}.get(next(iter(audit_codes), ""), set())
    assert {f.code for f in found["future-token"].findings if f.status.value == "fail"} == future


@pytest.mark.parametrize("shifted_keys", [False, True])
def test_xformers_block_diagonal_documents(xformers, shifted_keys):
    def causal_from_bottom_right(xops, lengths, kv_lengths):
        return xops.BlockDiagonalCausalFromBottomRightMask.from_seqlens(lengths, kv_lengths)

    found = results(PackedXformersModel(xformers, causal_from_bottom_right, shifted_keys))
    audit = found["mask-audit"]
    if shifted_keys:  # each document but a row's last reads the next one's first token
        assert {f.code for f in audit.findings if f.status.value == "fail"} == {"FWD204"}, audit.summary
        assert found["future-token"].status.value == "fail"
    else:
        assert audit.status.value == "pass", audit.summary
        assert "restricted" in audit.summary  # documents: causal within each, nothing across
        assert found["future-token"].status.value == "pass"


def test_xformers_block_diagonal_without_causal_fails(xformers):
    def bidirectional(xops, lengths, kv_lengths):
        return xops.BlockDiagonalMask.from_seqlens(lengths, kv_lengths)

    found = results(PackedXformersModel(xformers, bidirectional))
    assert {f.code for f in found["mask-audit"].findings if f.status.value == "fail"} == {"FWD204"}
    assert found["future-token"].status.value == "fail"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn needs a CUDA GPU")
def test_real_flash_attn_on_cuda():
    flash = pytest.importorskip("flash_attn")
    if STANDINS in str(getattr(flash, "__file__", "")):
        pytest.skip("the stand-in was imported in this process, not the real flash-attn")
    for causal, window, fails in ((True, (-1, -1), False), (False, (-1, -1), True), (True, (3, 0), False)):
        model = FlashModel(flash, causal, window).to("cuda", torch.float16)
        report = fwdcheck.check_model(model, vocab_size=VOCAB, seq_len=12)
        audit = report.result("mask-audit")
        assert audit.status.value == ("fail" if fails else "pass"), (causal, window, audit.summary)
        assert {r["api"] for r in audit.data["calls"]} == {"flash"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn needs a CUDA GPU")
def test_real_flash_attn_with_kvcache_on_cuda():
    flash = pytest.importorskip("flash_attn")
    if STANDINS in str(getattr(flash, "__file__", "")):
        pytest.skip("the stand-in was imported in this process, not the real flash-attn")
    for appended, bug, fails in (
        (True, None, False),
        (False, None, False),
        (False, "top-left", True),
        (True, "window", True),
    ):
        model = KVCacheFlashModel(flash, appended, bug).to("cuda", torch.float16)
        audit = fwdcheck.check_model(model, vocab_size=VOCAB, seq_len=12).result("mask-audit")
        assert audit.status.value == ("fail" if fails else "pass"), (appended, bug, audit.summary)
        assert any("fwd_kvcache" in r["values"] for r in audit.data["calls"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="xformers needs a CUDA GPU")
def test_real_xformers_on_cuda():
    xops = pytest.importorskip("xformers.ops")
    if STANDINS in str(getattr(xops, "__file__", "")):
        pytest.skip("the stand-in was imported in this process, not the real xformers")
    cases = [
        (lambda xops, T: xops.LowerTriangularMask(), False, False),
        (lambda xops, T: None, False, True),
        (lambda xops, T: xops.LowerTriangularMask(), True, True),
        (lambda xops, T: xops.LowerTriangularFromBottomRightMask(), True, False),
    ]
    for bias, chunked, fails in cases:
        model = XformersModel(xops, bias, chunked).to("cuda", torch.float16)
        audit = fwdcheck.check_model(model, vocab_size=VOCAB, seq_len=16).result("mask-audit")
        # the real library may pick a kernel other than CUTLASS's (flash on recent GPUs): then it is named, unjudged
        judged = [r for r in audit.data["calls"] if r["api"] == "xformers"]
        if not judged:
            assert "not judged" in audit.summary and "xformers" in audit.summary, audit.summary
            continue
        assert audit.status.value == ("fail" if fails else "pass"), (chunked, audit.summary)
