"""mask-audit on attention whose query positions arrive under names of the model's own: a model in the shape of
gemma_pytorch (google/gemma_pytorch, not on the package index), whose forward takes `input_positions` and
`kv_write_indices`, writes keys and values into a cache preallocated to every position
(k_cache.index_copy_(1, kv_write_indices, xk)) and always attends over the whole cache, with a sliding-window mask in
every other layer. The query positions are the slots the call wrote, whatever the argument is called.

Both ways: the model as gemma_pytorch writes it passes; a sliding-window mask that lets position i read i+1 fails
(future-token sees it too). A ring-buffer cache whose slots are written twice in one forward says nothing of positions
and is not judged by them; one written a chunk at a time (Mistral's reference) is judged past its wrap, by mask-audit
and by rope.

Shapes: B (batch), T (sequence), S (cache slots), nh (heads), nkv (key/value heads), hs (head size).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck

VOCAB, WIDTH, HEADS, KV_HEADS, LAYERS, SLOTS, WINDOW = 32, 16, 2, 1, 2, 32, 3
MIN = -2.3819763e38  # gemma_pytorch's mask value


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))  # (hs/2,)
    t = torch.arange(end)  # (S,)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())  # (S, hs/2) complex


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x (B, T, nh, hs) turned as gemma_pytorch turns it: the two halves as the real and imaginary parts."""
    pairs = torch.view_as_complex(torch.stack(torch.chunk(x.transpose(1, 2).float(), 2, dim=-1), dim=-1))
    out = torch.view_as_real(pairs * freqs_cis).type_as(x)  # (B, nh, T, hs/2, 2)
    out = torch.cat(torch.chunk(out, 2, dim=-1), dim=-2).reshape(out.shape[0], out.shape[1], out.shape[2], -1)
    return out.transpose(1, 2)  # (B, T, nh, hs)


class GemmaAttention(nn.Module):
    def __init__(self, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.head_dim = WIDTH // HEADS
        self.qkv_proj = nn.Linear(WIDTH, (HEADS + 2 * KV_HEADS) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, WIDTH, bias=False)
        self.scaling = self.head_dim**-0.5

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask):
        B, T, _ = hidden_states.shape
        xq, xk, xv = self.qkv_proj(hidden_states).split(
            [HEADS * self.head_dim, KV_HEADS * self.head_dim, KV_HEADS * self.head_dim], dim=-1
        )
        xq = xq.view(B, -1, HEADS, self.head_dim)  # (B, T, nh, hs)
        xk = xk.view(B, -1, KV_HEADS, self.head_dim)  # (B, T, nkv, hs)
        xv = xv.view(B, -1, KV_HEADS, self.head_dim)
        xq, xk = apply_rotary_emb(xq, freqs_cis), apply_rotary_emb(xk, freqs_cis)
        k_cache, v_cache = kv_cache  # (B, S, nkv, hs) each
        k_cache.index_copy_(1, kv_write_indices, xk)
        v_cache.index_copy_(1, kv_write_indices, xv)
        key = torch.repeat_interleave(k_cache, HEADS // KV_HEADS, dim=2)  # (B, S, nh, hs): a copy
        value = torch.repeat_interleave(v_cache, HEADS // KV_HEADS, dim=2)
        q, k, v = xq.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, nh, T or S, hs)
        scores = torch.matmul(q * self.scaling, k.transpose(2, 3))  # (B, nh, T, S)
        scores = scores + (local_mask if self.sliding else mask)
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        output = torch.matmul(scores, v)  # (B, nh, T, hs)
        return self.o_proj(output.transpose(1, 2).contiguous().view(B, T, -1))  # (B, T, C)


class GemmaShaped(nn.Module):
    """bug: none | window-both-ways (the sliding mask built from the band alone, without the causal mask: position i
    reads i+1 .. i+WINDOW-1)."""

    def __init__(self, bug: str = "none"):
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.embedder = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(GemmaAttention(sliding=i % 2 == 0) for i in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.register_buffer("freqs_cis", precompute_freqs_cis(WIDTH // HEADS, SLOTS), persistent=False)

    def masks(self, input_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(global, local) float masks [1, 1, T, S] of the queries at input_positions, as gemma_pytorch's generate
        builds them."""
        causal = torch.triu(torch.full((1, 1, SLOTS, SLOTS), MIN), diagonal=1)  # (1, 1, S, S)
        ones = torch.ones_like(causal)
        band = torch.triu(ones, -WINDOW + 1) * torch.tril(ones, WINDOW - 1)
        inside = torch.zeros_like(causal) if self.bug == "window-both-ways" else causal
        local = torch.where(band == 1, inside, MIN)
        return causal.index_select(2, input_positions), local.index_select(2, input_positions)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        input_positions = torch.arange(T)
        kv_write_indices = input_positions
        mask, local_mask = self.masks(input_positions)
        freqs_cis = self.freqs_cis.index_select(0, input_positions)  # (T, hs/2)
        x = self.embedder(input_ids) * WIDTH**0.5  # (B, T, C)
        for layer in self.layers:
            kv_cache = (
                torch.zeros(B, SLOTS, KV_HEADS, WIDTH // HEADS),
                torch.zeros(B, SLOTS, KV_HEADS, WIDTH // HEADS),
            )
            x = x + layer(x, freqs_cis, kv_write_indices, kv_cache, mask, local_mask)
        return self.norm(x) @ self.embedder.weight.t()  # (B, T, V)


def run(model: nn.Module, checks: list[str]):
    return fwdcheck.check_model(model, checks, vocab_size=VOCAB, seq_len=8)


def test_gemma_shaped_attention_is_judged_by_the_slots_it_wrote():
    result = run(GemmaShaped(), ["mask-audit"]).result("mask-audit")
    assert result.status.value == "pass", (result.summary, result.findings)
    calls = result.data["calls"]
    assert {(c["queries"], c["keys"], c["positions_from"]) for c in calls} == {(8, SLOTS, "written slots")}
    assert all(c["query_positions"] == list(range(8)) for c in calls)
    assert [c["pattern"] for c in calls] == ["causal, restricted (window or sparse)", "causal"]
    assert result.metrics["judged_calls"] == LAYERS


def test_a_sliding_window_that_reads_the_next_position_fails():
    report = run(GemmaShaped("window-both-ways"), ["mask-audit", "future-token"])
    audit = report.result("mask-audit")
    assert audit.status.value == "fail", audit.summary
    leaking = [c for c in audit.data["calls"] if c["pattern"] != "causal"]
    assert len(leaking) == 1 and leaking[0]["positions_from"] == "written slots"
    assert report.result("future-token").status.value == "fail"  # the behaviour agrees: the logits leak


class RingAttention(nn.Module):
    """A cache of WINDOW slots written at position % WINDOW, one token at a time: past the wrap a slot holds a later
    position than its index, so the slots written are not the queries' positions."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x, step_index):
        B, T, C = x.shape
        k_cache = torch.zeros(B, HEADS, WINDOW, C // HEADS)  # (B, nh, W, hs)
        v_cache = torch.zeros(B, HEADS, WINDOW, C // HEADS)
        outputs = []
        for t in range(T):
            q, k, v = self.qkv(x[:, t : t + 1]).split(C, dim=-1)
            q, k, v = (a.view(B, 1, HEADS, C // HEADS).transpose(1, 2) for a in (q, k, v))  # (B, nh, 1, hs)
            k_cache[:, :, step_index[t : t + 1] % WINDOW] = k
            v_cache[:, :, step_index[t : t + 1] % WINDOW] = v
            filled = min(t + 1, WINDOW)
            y = F.scaled_dot_product_attention(q, k_cache[:, :, :filled], v_cache[:, :, :filled])  # (B, nh, 1, hs)
            outputs.append(y.transpose(1, 2).reshape(B, 1, C))
        return torch.cat(outputs, dim=1)  # (B, T, C)


class RingModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.attn = RingAttention()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        return self.head(self.emb(input_ids) + self.attn(self.emb(input_ids), torch.arange(input_ids.shape[1])))


def test_a_ring_buffer_written_twice_is_not_read_as_positions():
    """Past the wrap, slot 0 holds position 3: taken for a position, the call would seem to read the future. Slots
    written twice in one forward say nothing of positions: the calls past the wrap are not judged by them, and
    nothing fails (future-token passes: the model is causal)."""
    report = run(RingModel(), ["mask-audit", "future-token"])
    audit = report.result("mask-audit")
    assert audit.status.value == "pass", audit.summary
    judged_by = [c["positions_from"] for c in audit.data["calls"]]
    assert judged_by == ["square", "bottom-right", "written slots", *[None] * 5]  # the wrap comes at the 4th token
    assert "5 not judged: query positions unknown" in audit.summary
    assert report.result("future-token").status.value == "pass"


# =====================================================================================================================
# A ring buffer, as Mistral's reference implementation keeps one: WINDOW slots written at positions % WINDOW by
# scatter_, read whole. Past the wrap a slot holds a later position than its index; the positions handed to the
# attention module say which (the slots are those positions modulo the window), so every call is judged.

RING = 4


class RingBufferAttention(nn.Module):
    """rotary: none | qk (q and k turned at their positions before the cache, as Mistral's reference) | q (q only)
    | slot (k turned by the slot it lands in, not its position: right until the wrap)."""

    def __init__(self, rotary: str = "none"):
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.rotary = rotary
        self.wq, self.wk, self.wv = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.wo = nn.Linear(WIDTH, WIDTH, bias=False)
        self.cache_k = self.cache_v = torch.empty(0)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, 64), persistent=False)

    def forward(self, x, positions, mask):
        B, T, C = x.shape
        xq, xk, xv = (w(x).view(B, T, HEADS, self.head_dim) for w in (self.wq, self.wk, self.wv))  # (B, T, nh, hs)
        if self.rotary != "none":
            xq = apply_rotary_emb(xq, self.freqs_cis[positions])
        if self.rotary == "qk":
            xk = apply_rotary_emb(xk, self.freqs_cis[positions])
        if self.rotary == "slot":
            xk = apply_rotary_emb(xk, self.freqs_cis[positions % RING])
        # The cache is a rotating buffer
        scatter_pos = (positions[-RING:] % RING)[None, :, None, None].repeat(B, 1, HEADS, self.head_dim)
        self.cache_k[:B].scatter_(dim=1, index=scatter_pos, src=xk[:, -RING:])
        self.cache_v[:B].scatter_(dim=1, index=scatter_pos, src=xv[:, -RING:])
        q = xq.transpose(1, 2)  # (B, nh, T, hs)
        k, v = self.cache_k[:B].transpose(1, 2), self.cache_v[:B].transpose(1, 2)  # (B, nh, RING, hs)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim**-0.5 + mask  # (B, nh, T, RING)
        weights = F.softmax(scores.float(), dim=-1).type_as(q)
        return self.wo(torch.matmul(weights, v).transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class RingBufferModel(nn.Module):
    """Chunks of 2 tokens through a ring buffer of RING slots; the mask is built from the position each slot holds.
    bug: none | written-slots (the mask opens every slot written so far: a chunk's first query reads its second)."""

    def __init__(self, bug: str = "none", rotary: str = "none"):
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(RingBufferAttention(rotary) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        for layer in self.layers:
            layer.cache_k = torch.zeros(B, RING, HEADS, WIDTH // HEADS)  # (B, RING, nh, hs)
            layer.cache_v = torch.zeros(B, RING, HEADS, WIDTH // HEADS)
        held = torch.full((RING,), -1)  # the position each slot holds
        out = []
        for start in range(0, T, 2):
            positions = torch.arange(start, min(start + 2, T))
            held[positions % RING] = positions
            if self.bug == "written-slots":
                may = (held >= 0)[None, :].expand(len(positions), RING)
            else:
                may = (held >= 0) & (held <= positions[:, None]) & (held > positions[:, None] - RING)  # (T, RING)
            mask = torch.zeros(len(positions), RING).masked_fill(~may, float("-inf"))
            x = self.emb(input_ids[:, start : start + 2])  # (B, 2, C)
            for layer in self.layers:
                x = x + layer(x, positions, mask)
            out.append(self.head(x))
        return torch.cat(out, dim=1)  # (B, T, V)


def test_a_ring_buffer_past_its_wrap_is_judged_by_the_positions_its_slots_hold():
    result = run(RingBufferModel(), ["mask-audit"]).result("mask-audit")
    assert result.status.value == "pass", (result.summary, result.findings)
    calls = result.data["calls"]
    assert result.metrics["judged_calls"] == len(calls) == LAYERS * 4  # every chunk, past the wrap too
    assert {c["positions_from"] for c in calls} == {"written slots"}
    past_wrap = [c for c in calls if c["key_positions"] is not None]
    assert [(c["query_positions"], c["key_positions"]) for c in past_wrap[::LAYERS]] == [
        ([4, 5], [4, 5, 2, 3]),
        ([6, 7], [4, 5, 6, 7]),  # the wrap's second round: slot j holds 4 + j
    ]
    assert {c["pattern"] for c in calls} == {"causal"}


def test_a_ring_buffer_mask_that_reads_a_later_slot_fails_past_the_wrap_too():
    report = run(RingBufferModel("written-slots"), ["mask-audit", "future-token"])
    audit = report.result("mask-audit")
    assert audit.status.value == "fail" and "FWD204" in {f.code for f in audit.findings}
    leaking = [c for c in audit.data["calls"] if c["reads_future"]]
    assert len(leaking) == len(audit.data["calls"]) == LAYERS * 4
    assert report.result("future-token").status.value == "fail"


# rope over the same ring: each position's key is read from a step whose slots held it, so the probe's positions are
# all judged though the cache never holds more than RING of them at once.


def test_rope_over_a_ring_buffer_is_judged_past_its_wrap():
    result = run(RingBufferModel(rotary="qk"), ["rope"]).result("rope")
    assert result.status.value == "pass", (result.summary, result.findings)
    assert result.metrics["judged_calls"] == LAYERS
    assert "pairing half" in result.summary


def test_rope_on_q_only_over_a_ring_buffer_fails():
    result = run(RingBufferModel(rotary="q"), ["rope"]).result("rope")
    assert "FWD301" in {f.code for f in result.findings if f.status.value == "fail"}, result.summary


def test_keys_turned_by_their_slot_not_their_position_fail_rope_alone():
    """Right until the wrap, then a key's angle is its slot's: no future token is read, only rope can tell."""
    report = run(RingBufferModel(rotary="slot"), ["rope", "future-token"])
    assert report.result("future-token").status.value == "pass"
    assert report.result("rope").status.value == "fail", report.result("rope").summary
