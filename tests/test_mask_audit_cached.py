"""mask-audit and the observation pass on attention that is not one square [T, T] call: KV caches longer than the
prompt, chunked prefill, decode steps, einsum scores, cross-attention, and softmaxes that are not attention.

Each model here is small and written in the shape of widely copied code (gpt-fast's preallocated cache indexed by
input_pos, x-transformers' einsum attention over a growing cache, nn.TransformerDecoder's memory). Every correct one
passes with no warning; every planted bug fails with the code named.

Shapes: B (batch), T (sequence), C (width), nh (heads), hs (head size), S (key slots).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from fwdcheck.observe.frames import _PositionsSeen, _shared_positions
from fwdcheck.observe.observer import observing

VOCAB, WIDTH, HEADS, LAYERS, SLOTS = 32, 16, 2, 2, 32


def audit(model: nn.Module, **kw):
    """mask-audit alone on a module, through the Python API."""
    return fwdcheck.check_model(model, ["mask-audit"], vocab_size=VOCAB, **kw).result("mask-audit")


def clean_pass(result) -> None:
    assert result.status.value == "pass", (result.summary, result.findings)
    assert not [f for f in result.findings if f.status.value != "pass"], result.findings


def codes(result) -> set[str]:
    return {f.code for f in result.findings}


# =====================================================================================================================
# gpt-fast: a KV cache preallocated to SLOTS positions, written at input_pos; SDPA reads every slot, and a boolean
# mask sliced by input_pos (causal_mask[None, None, input_pos]) closes the future and the slots not yet written.


class CachedAttention(nn.Module):
    def __init__(self, positions_as: str):
        super().__init__()
        self.positions_as = positions_as  # the name under which the positions reach this forward
        self.wqkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.wo = nn.Linear(WIDTH, WIDTH)
        self.k_cache = self.v_cache = None

    def setup_cache(self, B: int) -> None:
        self.k_cache = torch.zeros(B, HEADS, SLOTS, WIDTH // HEADS)  # (B, nh, S, hs)
        self.v_cache = torch.zeros(B, HEADS, SLOTS, WIDTH // HEADS)

    def forward(self, x, mask, input_pos=None, cache_position=None):
        positions = input_pos if input_pos is not None else cache_position
        B, T, C = x.shape
        q, k, v = self.wqkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        self.k_cache[:, :, positions] = k  # written at the positions; later slots stay empty
        self.v_cache[:, :, positions] = v
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class GptFast(nn.Module):
    """bug: none | inverted (triu(ones, 1).bool(): nn.MultiheadAttention's convention handed to SDPA) |
    decode-unmasked (decode steps pass no mask: every slot is read, the unwritten ones too).
    prefill: tokens run in the first forward call; the rest follow one at a time through the cache (generate-style).
    chunk: prefill in chunks of this many tokens (chunked prefill)."""

    def __init__(
        self, bug: str = "none", prefill: int | None = None, chunk: int | None = None, positions_as: str = "input_pos"
    ):
        super().__init__()
        torch.manual_seed(0)
        self.bug, self.prefill, self.chunk, self.positions_as = bug, prefill, chunk, positions_as
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(CachedAttention(positions_as) for _ in range(LAYERS))
        self.output = nn.Linear(WIDTH, VOCAB)
        ones = torch.ones(SLOTS, SLOTS)
        causal = torch.triu(ones, 1).bool() if bug == "inverted" else torch.tril(ones).bool()
        self.register_buffer("causal_mask", causal, persistent=False)  # (S, S) SDPA: True = may attend

    def step(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal_mask[None, None, input_pos]  # (1, 1, T, S)
        if self.bug == "decode-unmasked" and len(input_pos) == 1:
            mask = None
        x = self.tok_embeddings(ids)  # (B, T, C)
        for layer in self.layers:
            x = x + layer(x, mask, **{self.positions_as: input_pos})
        return self.output(x)  # (B, T, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        for layer in self.layers:
            layer.setup_cache(B)
        first = self.prefill or T
        bounds = list(range(0, first, self.chunk or first)) + list(range(first, T))
        ends = bounds[1:] + [T]
        return torch.cat(
            [self.step(input_ids[:, s:e], torch.arange(s, e)) for s, e in zip(bounds, ends, strict=True)], dim=1
        )


def test_cache_longer_than_the_prompt_is_judged_by_input_pos():
    result = audit(GptFast())
    clean_pass(result)
    calls = result.data["calls"]
    assert {(c["queries"], c["keys"], c["positions_from"], c["pattern"]) for c in calls} == {
        (8, SLOTS, "input_pos", "causal")
    }
    assert calls[0]["query_positions"] == list(range(8))
    assert result.metrics["judged_calls"] == LAYERS


def test_cache_position_keyword_is_read_too():
    result = audit(GptFast(positions_as="cache_position"))
    clean_pass(result)
    assert {c["positions_from"] for c in result.data["calls"]} == {"cache_position"}


def test_inverted_bool_mask_over_the_cache_fails():
    result = audit(GptFast(bug="inverted"))
    assert result.status.value == "fail"
    assert "FWD202" in codes(result), result.findings
    assert {c["pattern"] for c in result.data["calls"]} == {"inverted: the future only"}


def test_generate_style_forward_is_observed_and_judged():
    """Prefill of 4 tokens, then 4 one-token decode steps through the cache: every call judged."""
    result = audit(GptFast(prefill=4))
    clean_pass(result)
    calls = result.data["calls"]
    assert len(calls) == LAYERS * 5 and all(c["judged"] for c in calls)
    assert sorted({(c["queries"], tuple(c["query_positions"])) for c in calls}) == [
        (1, (4,)),
        (1, (5,)),
        (1, (6,)),
        (1, (7,)),
        (4, (0, 1, 2, 3)),
    ]


def test_chunked_prefill_is_judged():
    result = audit(GptFast(chunk=4))
    clean_pass(result)
    assert {tuple(c["query_positions"]) for c in result.data["calls"]} == {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_decode_step_that_opens_unwritten_slots_fails():
    """Without a mask a decode step at position p reads slots p+1.. which hold nothing yet: a bug, named FWD201."""
    result = audit(GptFast(bug="decode-unmasked", prefill=4))
    assert result.status.value == "fail"
    assert codes(result) == {"FWD201"}, result.findings
    finding = next(f for f in result.findings if f.code == "FWD201")
    assert f"all {SLOTS} key slots" in finding.message
    prefill = [c for c in result.data["calls"] if c["queries"] == 4]
    assert {c["pattern"] for c in prefill} == {"causal"}  # the prefill itself is right


def test_observed_fields_of_a_cached_call():
    model = GptFast().eval()
    with torch.no_grad(), observing(model, seq_len=8) as seen:
        model(torch.randint(0, VOCAB, (2, 8)))
    call = seen.attention[0]
    assert call.allowed.shape == (8, SLOTS) and (call.query_len, call.key_len) == (8, SLOTS)
    assert call.query_positions.tolist() == list(range(8)) and call.positions_from == "input_pos"
    assert not call.cross and not call.self_attention
    assert torch.equal(call.allowed, torch.ones(SLOTS, SLOTS).tril().bool()[:8])


# =====================================================================================================================
# x-transformers' einsum attention over a cache that grows by concatenation; no positions are handed to any module
# (the positional embedding is looked up with a Python offset): S is the number of tokens written, queries last.


class EinsumAttention(nn.Module):
    def __init__(self, bug: str):
        super().__init__()
        self.bug = bug
        self.to_qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.to_out = nn.Linear(WIDTH, WIDTH)
        self.cache = None

    def forward(self, x, context=None):
        B, n, C = x.shape
        q, k, v = (t.view(B, n, HEADS, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))  # (B, nh, n, hs)
        if self.cache is not None:
            k, v = torch.cat([self.cache[0], k], dim=-2), torch.cat([self.cache[1], v], dim=-2)  # (B, nh, S, hs)
        self.cache = (k, v)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * q.shape[-1] ** -0.5  # (B, nh, i, j)
        i, j = sim.shape[-2:]
        # bottom-right causal: query i sits at j - i + i; "off-by-one" lets each query read the next key
        future = torch.ones(i, j).triu(j - i + (2 if self.bug == "off-by-one" else 1)).bool()
        if not (self.bug == "square-only" and i != j):  # a mask applied only when the call is square
            sim = sim.masked_fill(future, -torch.finfo(sim.dtype).max)
        attn = F.softmax(sim, dim=-1, dtype=torch.float32).type(sim.dtype)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)  # (B, nh, i, hs)
        return self.to_out(out.transpose(1, 2).reshape(B, n, C))


class EinsumChunked(nn.Module):
    """Runs the sequence in chunks of `chunk` tokens (1 = token by token after a prefill of `prefill`)."""

    def __init__(self, bug: str = "none", chunk: int = 4, prefill: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.chunk, self.prefill = chunk, prefill
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(64, WIDTH)
        self.layers = nn.ModuleList(EinsumAttention(bug) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        for layer in self.layers:
            layer.cache = None
        starts = [0, *range(self.prefill, T, self.chunk)] if self.prefill else list(range(0, T, self.chunk))
        logits = []
        for s, e in zip(starts, starts[1:] + [T], strict=True):
            x = self.emb(input_ids[:, s:e]) + self.pos.weight[s:e]  # (B, n, C)
            for layer in self.layers:
                x = x + layer(x)
            logits.append(self.head(x))
        return torch.cat(logits, dim=1)  # (B, T, V)


def test_growing_cache_is_judged_bottom_right():
    result = audit(EinsumChunked())
    clean_pass(result)
    calls = result.data["calls"]
    assert {(c["queries"], c["keys"], c["positions_from"]) for c in calls} == {(4, 4, "square"), (4, 8, "bottom-right")}
    assert {c["pattern"] for c in calls} == {"causal"}


def test_token_by_token_decode_over_a_growing_cache_is_judged():
    result = audit(EinsumChunked(chunk=1, prefill=3))
    clean_pass(result)
    assert all(c["judged"] for c in result.data["calls"])
    assert len(result.data["calls"]) == LAYERS * 6


@pytest.mark.parametrize(
    "bug, code, pattern",
    [("off-by-one", "FWD204", "leaky: some future keys"), ("square-only", "FWD201", "bidirectional: every key")],
)
def test_einsum_mask_bugs_over_the_cache_fail(bug, code, pattern):
    result = audit(EinsumChunked(bug=bug))
    assert result.status.value == "fail" and code in codes(result), result.findings
    chunked = [c for c in result.data["calls"] if c["keys"] == 8]
    assert {c["pattern"] for c in chunked} == {pattern}
    messages = [f.message for f in result.findings if f.code == code]
    assert messages and not [m for m in messages if "MayRead" in m], messages  # the shape in words, not an enum
    assert code != "FWD204" or f"({pattern})" in messages[0]


def test_einsum_products_are_recorded_in_matmul_layout():
    q, k, v = torch.randn(3, 2, 5, 4, 8).unbind(0)  # (B, L, nh, hs): the layout TransformerLens keeps
    with observing(nn.Identity(), seq_len=5, keep_tensors=True) as seen:
        weights = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)  # (B, nh, L, S)
        torch.einsum("bkhd,bhqk->bqhd", v, weights)
    scores, values = seen.matmuls
    assert (scores.kind, scores.op, scores.a_shape, scores.b_shape) == ("scores", "einsum", (2, 4, 5, 8), (2, 4, 8, 5))
    assert torch.equal(scores.a, q.transpose(1, 2)) and torch.equal(scores.b, k.permute(0, 2, 3, 1))
    assert (values.kind, values.a_shape, values.b_shape, values.call) == ("values", (2, 4, 5, 5), (2, 4, 5, 8), 0)
    assert seen.attention[0].matmul == 0


@pytest.mark.parametrize("form", ["ellipsis", "multi-query", "implicit", "list", "baddbmm", "bmm"])
def test_score_products_in_every_form_are_recognised(form):
    """Scores of 3 queries over 5 keys, whichever way the product is written, reach the softmax as attention."""
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8)  # (B, nh, L, hs), (B, nh, S, hs)
    with observing(nn.Identity(), seq_len=3) as seen:
        if form == "ellipsis":
            scores = torch.einsum("...id,...jd->...ij", q, k)
        elif form == "multi-query":
            scores = torch.einsum("b h i d, b j d -> b h i j", q, k[:, 0])
        elif form == "implicit":  # no output given: broadcast dimensions, then the labels seen once, i j
            scores = torch.einsum("...id,...jd", q, k)
        elif form == "list":
            scores = torch.einsum("bhid,bhjd->bhij", [q, k])
        elif form == "baddbmm":  # BLOOM: ALiBi bias + scale * q @ k^T in one call
            scores = torch.baddbmm(
                torch.zeros(8, 3, 5), q.reshape(8, 3, 8), k.reshape(8, 5, 8).transpose(1, 2), beta=1.0, alpha=0.5
            )
        else:
            scores = torch.bmm(q.reshape(8, 3, 8), k.reshape(8, 5, 8).transpose(1, 2))
        F.softmax(scores / 2, dim=-1)
    assert [(c.query_len, c.key_len) for c in seen.attention] == [(3, 5)]
    scores_call = seen.matmuls[0]
    assert scores_call.kind == "scores" and scores_call.a_shape[-2:] == (3, 8) and scores_call.b_shape[-2:] == (8, 5)


def test_square_calls_sit_at_0_to_T_minus_1_whatever_positions_are_handed():
    """A sequence against itself: query i sits at key slot i, also when forward gets positions offset by 16."""
    from fwdcheck.model.reference import ReferenceConfig, ReferenceTransformer

    model = ReferenceTransformer(ReferenceConfig(vocab_size=VOCAB, d_model=WIDTH, n_heads=HEADS, n_layers=1)).eval()
    with torch.no_grad(), observing(model, seq_len=8) as seen:
        model(torch.randint(0, VOCAB, (1, 8)), position_ids=torch.arange(16, 24)[None])
    call = seen.attention[0]
    assert call.positions_from == "square" and call.query_positions.tolist() == list(range(8))


# =====================================================================================================================
# A preallocated cache filled by a slice (cache[:, :, :T] = x) names the slots it wrote: judged. One built by
# concatenation (torch.cat of the keys and empty slots) names none: its query positions cannot be known, nothing is
# judged, so nothing passes.


class OffsetCacheAttention(nn.Module):
    def forward(self, q, k_cache, v_cache, T):
        mask = torch.ones(T, SLOTS // 2, dtype=torch.bool).tril()  # (T, S): right for this model's offset 0
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)


class OffsetCache(nn.Module):
    def __init__(self, fill: str = "cat"):
        super().__init__()
        torch.manual_seed(0)
        self.fill = fill  # slice: cache[:, :, :T] = x | cat: the keys, then empty slots, concatenated
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.attn = OffsetCacheAttention()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        x = self.emb(input_ids).view(B, T, HEADS, -1).transpose(1, 2)  # (B, nh, T, hs)
        if self.fill == "slice":
            cache = torch.zeros(B, HEADS, SLOTS // 2, WIDTH // HEADS)  # (B, nh, S, hs)
            cache[:, :, :T] = x
        else:
            cache = torch.cat([x, x.new_zeros(B, HEADS, SLOTS // 2 - T, WIDTH // HEADS)], dim=2)  # (B, nh, S, hs)
        y = self.attn(x, cache, cache, T)
        return self.head(y.transpose(1, 2).reshape(B, T, WIDTH))


def test_calls_that_cannot_be_judged_skip_with_the_reason():
    result = audit(OffsetCache())
    assert result.status.value == "skip"
    assert "not judged: query positions unknown (8 queries over 16 key slots" in result.summary


def test_a_cache_filled_by_a_slice_is_judged_by_the_slots_it_wrote():
    result = audit(OffsetCache(fill="slice"))
    clean_pass(result)
    call = result.data["calls"][0]
    assert (call["positions_from"], call["query_positions"]) == ("written slots", list(range(8)))


# =====================================================================================================================
# Cross-attention: keys from another sequence are not causal by nature; the decoder's self-attention still is.


class DecoderWithMemory(nn.Module):
    """nn.TransformerDecoder over a learned memory of `memory` tokens (a conditioning sequence)."""

    def __init__(self, memory: int = 8, causal_mask: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.causal_mask = causal_mask
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.memory = nn.Parameter(torch.randn(1, memory, WIDTH))
        layer = nn.TransformerDecoderLayer(WIDTH, HEADS, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, LAYERS)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        mask = nn.Transformer.generate_square_subsequent_mask(T) if self.causal_mask else None
        y = self.decoder(self.emb(input_ids), self.memory.expand(B, -1, -1), tgt_mask=mask)
        return self.head(y)


@pytest.mark.parametrize("memory", [8, 5])
def test_cross_attention_is_reported_not_judged(memory):
    """A memory as long as the prompt makes square cross-attention calls: still not read as a leak."""
    result = audit(DecoderWithMemory(memory))
    clean_pass(result)
    cross = [c for c in result.data["calls"] if not c["judged"]]
    assert len(cross) == LAYERS and {c["pattern"] for c in cross} == {
        "cross-attention: keys from another sequence, not judged for causality"
    }
    assert f"{LAYERS} not judged: cross-attention" in result.summary
    assert {c["pattern"] for c in result.data["calls"] if c["judged"]} == {"causal"}


class EncoderDecoder(nn.Module):
    """nn.Transformer: its encoder reads a fixed source (bidirectional, as an encoder should), its decoder the
    tokens."""

    def __init__(self, source: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("source", torch.arange(source) % VOCAB)
        self.transformer = nn.Transformer(WIDTH, HEADS, LAYERS, LAYERS, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        src = self.emb(self.source).expand(B, -1, -1)  # (B, S, C): the same for every input
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(T)
        return self.head(self.transformer(src, self.emb(input_ids), tgt_mask=tgt_mask))


def test_encoder_over_a_fixed_source_is_not_read_as_the_tokens_self_attention():
    result = audit(EncoderDecoder())
    clean_pass(result)
    assert f"{LAYERS} not judged: encoder over the source" in result.summary
    assert "cross-attention: every source position" in result.summary  # an encoder-decoder's: judged
    encoder = [c for c in result.data["calls"] if c["module"].startswith("transformer.encoder")]
    assert len(encoder) == LAYERS and not any(c["judged"] for c in encoder)


def test_decoder_without_its_causal_mask_fails():
    result = audit(DecoderWithMemory(causal_mask=False))
    assert result.status.value == "fail" and codes(result) == {"FWD201"}


class ContextAttention(EinsumAttention):
    """x-transformers' Attention: keys from `context` when one is given, else from x."""

    def forward(self, x, context=None):
        if context is None:
            return super().forward(x)
        B, n, C = x.shape
        q = self.to_qkv(x)[..., :C].view(B, n, HEADS, -1).transpose(1, 2)  # (B, nh, n, hs)
        k = self.to_qkv(context)[..., C : 2 * C].view(B, -1, HEADS, C // HEADS).transpose(1, 2)  # (B, nh, m, hs)
        y = F.scaled_dot_product_attention(q, k, k)  # every context token, by design
        return self.to_out(y.transpose(1, 2).reshape(B, n, C))


def test_sdpa_cross_attention_named_by_its_context_argument():
    model = EinsumChunked(chunk=8)
    model.cross = nn.ModuleList(ContextAttention("none") for _ in range(LAYERS))
    context = torch.randn(1, 8, WIDTH)

    def forward(input_ids):
        x = model.emb(input_ids) + model.pos.weight[: input_ids.shape[1]]
        for layer, cross in zip(model.layers, model.cross, strict=True):
            layer.cache = None
            x = x + layer(x)
            x = x + cross(x, context=context.expand(x.shape[0], -1, -1))
        return model.head(x)

    model.forward = forward
    result = audit(model)
    clean_pass(result)
    assert [c["judged"] for c in result.data["calls"]] == [True, False] * LAYERS


# =====================================================================================================================
# Batch size 1: a "single sequence" fast path is observed too, in the default run.


class SingleSequenceShortcut(EinsumChunked):
    """A correct causal mask, except that one sequence alone takes SDPA without it (a "fast path" bug)."""

    def __init__(self):
        super().__init__(chunk=8)

    def forward(self, input_ids):
        if input_ids.shape[0] > 1:
            return super().forward(input_ids)
        x = self.emb(input_ids) + self.pos.weight[: input_ids.shape[1]]
        for layer in self.layers:
            q, k, v = (t.view(1, -1, HEADS, WIDTH // HEADS).transpose(1, 2) for t in layer.to_qkv(x).chunk(3, -1))
            y = F.scaled_dot_product_attention(q, k, v)  # is_causal forgotten
            x = x + layer.to_out(y.transpose(1, 2).reshape(x.shape))
        return self.head(x)


def test_batch_size_one_fast_path_is_caught_by_default():
    result = audit(SingleSequenceShortcut())
    assert result.status.value == "fail" and codes(result) == {"FWD201"}
    assert result.findings[0].where.startswith("model (sdpa) at B=1 x2")  # both layers, called from the root's forward
    assert {c.get("batch_size") for c in result.data["calls"]} == {None, 1}  # the B=1 calls differ: listed


def test_the_batch_size_one_pass_runs_a_short_row_and_still_catches_the_shortcut():
    """A single-sequence shortcut shows at any length: the pass at B=1 observes the session's short length (16
    tokens), not the whole sequence."""
    result = audit(SingleSequenceShortcut(), seq_len=32)
    assert result.status.value == "fail" and codes(result) == {"FWD201"}
    assert result.data["batch1_length"] == 16
    assert result.findings[0].where.startswith("model (sdpa) at B=1 x2")
    clean = audit(EinsumChunked(), seq_len=32)
    assert "(alike at B=1)" in clean.summary, clean.summary  # a shorter row is no other kind of call


def test_the_batch_size_one_pass_adds_nothing_when_alike():
    result = audit(EinsumChunked())
    assert result.data["batch1"] == "observed" and "(alike at B=1)" in result.summary
    assert all("batch_size" not in c for c in result.data["calls"])


# =====================================================================================================================
# What is not attention, and the meta device.


def test_router_softmax_and_other_softmaxes_are_not_attention():
    """A router's [B, T, E] softmax with E = T, and a softmax over a tensor no q @ k^T made, are not attention."""
    x = torch.randn(2, 8, WIDTH)
    router = nn.Linear(WIDTH, 8)
    with torch.no_grad(), observing(nn.Identity(), seq_len=8) as seen:
        F.softmax(router(x), dim=-1)  # (B, T, E=8)
        torch.softmax(torch.randn(2, HEADS, 8, 8), dim=-1)  # square, but made by no product
        torch.bmm(torch.randn(2, 8, WIDTH), torch.randn(2, WIDTH, 8)).sigmoid()  # a product no softmax reads
    assert seen.attention == [] and seen.matmuls == []


def test_positions_count_only_when_every_row_shares_them():
    assert _shared_positions(torch.tensor([[0, 1, 2], [0, 1, 2]])).tolist() == [0, 1, 2]
    assert _shared_positions(torch.tensor([[1, 1, 0], [0, 1, 2]])) is None  # left padding: rows differ
    assert _shared_positions(torch.tensor([0.0, 1.0])) is None


def test_positions_are_read_again_once_the_tensor_is_written():
    """The reading is kept per tensor while it is unchanged: one written in place between two module calls (a cache's
    one row's positions advanced) is read again, and another tensor is its own."""
    seen = _PositionsSeen()
    positions = torch.tensor([[0, 1, 2], [0, 1, 2]])
    assert seen(positions).tolist() == [0, 1, 2]
    assert seen(positions).tolist() == [0, 1, 2]
    positions[1] += 3  # the rows no longer share their positions
    assert seen(positions) is None
    assert seen(torch.tensor([[1, 1, 0], [0, 1, 2]])) is None
    assert seen(None) is None
    with torch.inference_mode():  # no version counter: read each time
        frozen = torch.tensor([7, 8])
    assert seen(frozen).tolist() == [7, 8]


class MetaEager(nn.Module):
    """nanoGPT's eager attention with its registered tril buffer, and an SDPA layer with a boolean mask."""

    def __init__(self, T: int):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return F.scaled_dot_product_attention(q, k, y, attn_mask=self.bias[0, 0, :T, :T].bool())


def test_meta_inputs_allocate_nothing_of_size_T_squared():
    T = 8192  # a [T, T] bool on the CPU would be 64 MiB per call
    with torch.device("meta"):
        model = MetaEager(T)
        x = torch.randn(1, T, WIDTH)
    with torch.no_grad(), observing(model, seq_len=T) as seen:
        model(x)
    assert [c.api for c in seen.attention] == ["softmax", "sdpa"]
    for call in seen.attention:
        assert call.allowed.is_meta and call.allowed.shape == (T, T)
        assert call.query_positions.shape == (T,) and call.positions_from == "square"
    assert [m.kind for m in seen.matmuls] == ["scores", "values"]


# =====================================================================================================================
# Hugging Face (transformers 5): prefill, then decode steps through its cache, as generate() runs them.


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_hugging_face_decode_steps_are_judged(implementation):
    pytest.importorskip("transformers")
    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.model.sources import load_model
    from tests import compat

    model = load_model(config_from_dict({"model": compat.CASES["Llama (GQA)"][0]})).module.eval()
    model.set_attn_implementation(implementation)

    def generate_style(module, input_ids, **kwargs):
        out = module(input_ids[:, :4], use_cache=True)
        logits, cache = [out.logits], out.cache
        for t in range(4, input_ids.shape[1]):
            out = module(input_ids[:, t : t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.cache
        return torch.cat(logits, dim=1)  # (B, T, V)

    result = fwdcheck.check_model(model, ["mask-audit"], forward=generate_style, vocab_size=64).result("mask-audit")
    clean_pass(result)
    calls = result.data["calls"]
    assert len(calls) == 2 * 5 and all(c["judged"] for c in calls)
    assert {(c["queries"], c["keys"], c["positions_from"]) for c in calls if c["queries"] == 1} == {
        (1, S, "bottom-right") for S in range(5, 9)
    }
