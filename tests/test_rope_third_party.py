"""rope on transformer code written the ways real code writes it, not only on fwdcheck's own reference model.

One small decoder (`TinyLM`) takes its rotary embedding from each layout and library people use: rotate_half
(Llama, GPT-NeoX), rotate_every_two (GPT-J), complex numbers (`torch.polar` / `view_as_complex`, Meta's Llama and
gpt-fast), partial rotary, rotary-embedding-torch, x-transformers, torchtune and litgpt. Around it the shapes that
broke the probe before: grouped-query attention, a gpt-fast KV cache longer than the input (keys [B, h, 32, d_h] for
T queries, the mask sliced by `input_pos`), learned and sinusoidal absolute positions added to the residual, token
smearing (each token mixed with its predecessor before the blocks), eager attention.

Correct models pass with no warning, or skip with the reason when they have no rotary embedding; each planted bug
fails the code that names it: FWD301 (k not rotated), FWD302 (pairing or frequency mismatch, q and k turned in
opposite directions), FWD303 (angles not linear in the position), FWD304 (an offset that reaches q only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fwdcheck.api import check_model

# -- rotary embeddings, each as its source writes it: (x (B, h, T, d_h), positions (T,)) -> rotated x ---------------


def angles(positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """m * theta_i with theta_i = base^(-2i/dim): (T, dim/2)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=positions.device).float() / dim)
    return positions.float()[:, None] * inv_freq


def rope_half(x: torch.Tensor, positions: torch.Tensor, base: float, dim: int) -> torch.Tensor:
    """Llama / GPT-NeoX rotate_half: dim i turns with dim i + dim/2; dims past `dim` stay (partial rotary)."""
    a = angles(positions, dim, base)
    cos, sin = torch.cat([a.cos(), a.cos()], -1).to(x.dtype), torch.cat([a.sin(), a.sin()], -1).to(x.dtype)
    rot, rest = x[..., :dim], x[..., dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat([rot * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float, dim: int) -> torch.Tensor:
    """GPT-J rotate_every_two: dim 2i turns with 2i + 1."""
    a = angles(positions, dim, base)
    cos, sin = a.cos().repeat_interleave(2, -1).to(x.dtype), a.sin().repeat_interleave(2, -1).to(x.dtype)
    rot, rest = x[..., :dim], x[..., dim:]
    turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], -1).flatten(-2)
    return torch.cat([rot * cos + turned * sin, rest], -1)


def rope_complex(x: torch.Tensor, positions: torch.Tensor, base: float, dim: int) -> torch.Tensor:
    """Meta's Llama and gpt-fast: pairs (2i, 2i + 1) read as complex numbers, multiplied by e^(i m theta)."""
    freqs_cis = torch.polar(torch.ones(len(positions), dim // 2, device=x.device), angles(positions, dim, base))
    xc = torch.view_as_complex(x[..., :dim].float().reshape(*x.shape[:-1], -1, 2))  # (B, h, T, dim/2)
    rotated = torch.view_as_real(xc * freqs_cis).flatten(-2)
    return torch.cat([rotated.type_as(x), x[..., dim:]], -1)


HALF_FAMILY = {"half", "partial", "litgpt"}  # the layouts that pair i with i + r/2; the rest pair 2i with 2i + 1


class Rotary(nn.Module):
    """One rotary embedding for the whole model, in the layout `kind` names."""

    def __init__(self, kind: str, head_dim: int, base: float, table: int):
        super().__init__()
        self.kind, self.base = kind, base
        self.dim = head_dim // 2 if kind == "partial" else head_dim
        if kind == "rotary-embedding-torch":
            from rotary_embedding_torch import RotaryEmbedding

            self.library = RotaryEmbedding(dim=head_dim, theta=base)
        elif kind == "x-transformers":
            from x_transformers.x_transformers import RotaryEmbedding

            self.library = RotaryEmbedding(head_dim, base=base)
        elif kind == "torchtune":
            from torchtune.modules import RotaryPositionalEmbeddings

            self.library = RotaryPositionalEmbeddings(head_dim, max_seq_len=table, base=base)
        elif kind == "litgpt":
            from litgpt.model import build_rope_cache

            cos, sin = build_rope_cache(table, head_dim, base=base)
            self.register_buffer("cos", cos, persistent=False)  # (table, d_h)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.kind in ("half", "partial"):
            return rope_half(x, positions, self.base, self.dim)
        if self.kind == "interleaved":
            return rope_interleaved(x, positions, self.base, self.dim)
        if self.kind == "complex":
            return rope_complex(x, positions, self.base, self.dim)
        if self.kind == "rotary-embedding-torch":
            from rotary_embedding_torch import apply_rotary_emb

            return apply_rotary_emb(self.library(positions), x)
        if self.kind == "x-transformers":
            from x_transformers.x_transformers import apply_rotary_pos_emb

            freqs, scale = self.library(positions)
            return apply_rotary_pos_emb(x, freqs, scale)
        if self.kind == "torchtune":
            return self.library(x.transpose(1, 2), input_pos=positions).transpose(1, 2)  # it wants (B, T, h, d_h)
        from litgpt.model import apply_rope

        return apply_rope(x, self.cos[positions][None], self.sin[positions][None])

    def other_pairing(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The same frequencies in the other pairing: what a copy-pasted rotate function for k gets wrong."""
        other = rope_interleaved if self.kind in HALF_FAMILY else rope_half
        return other(x, positions, self.base, self.dim)


# -- the model ------------------------------------------------------------------------------------------------------


@dataclass
class TinyConfig:
    vocab_size: int = 32
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 4
    n_layers: int = 2
    max_seq_len: int = 32
    rotary: str | None = "half"  # a Rotary kind, or None: no rotary embedding
    base: float = 10000.0
    absolute: str | None = None  # learned | sinusoidal: a position encoding added to the residual
    smear: bool = False  # each token mixed with its predecessor before the blocks (as modded-nanoGPT's smear)
    cache: bool = False  # gpt-fast's KV cache: slots for max_seq_len rounded up to a multiple of 8
    attention: str = "sdpa"  # sdpa | eager
    bug: str | None = None  # q-only | pairing | opposite | frequency | wrap | offset

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def cache_len(self) -> int:
        return -(-self.max_seq_len // 8) * 8


class KVCache(nn.Module):
    """gpt-fast's cache: written at input_pos, read whole; slots not written yet hold zeros."""

    def __init__(self, cfg: TinyConfig, max_batch_size: int = 4):
        super().__init__()
        shape = (max_batch_size, cfg.n_kv_heads, cfg.cache_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        B = k.shape[0]
        self.k_cache[:B, :, input_pos] = k
        self.v_cache[:B, :, input_pos] = v
        return self.k_cache[:B], self.v_cache[:B]  # (B, h_kv, cache_len, d_h): every slot, written or not


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig, rotary: Rotary | None):
        super().__init__()
        self.cfg, self.rotary = cfg, rotary
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.kv_cache = KVCache(cfg) if cfg.cache else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, given: bool) -> torch.Tensor:
        cfg = self.cfg
        B, T, C = x.shape
        h, h_kv, d_h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = self.wqkv(x).split([h * d_h, h_kv * d_h, h_kv * d_h], dim=-1)
        q = q.view(B, T, h, d_h).transpose(1, 2)  # (B, h, T, d_h)
        k = k.view(B, T, h_kv, d_h).transpose(1, 2)  # (B, h_kv, T, d_h)
        v = v.view(B, T, h_kv, d_h).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotate(q, k, positions, given)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(positions, k, v)  # (B, h_kv, S, d_h), S = cache_len
        k = k.repeat_interleave(h // h_kv, dim=1)  # grouped-query attention: each kv head serves h / h_kv heads
        v = v.repeat_interleave(h // h_kv, dim=1)
        if cfg.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d_h)  # (B, h, T, S)
            y = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(B, T, C))

    def rotate(self, q, k, positions, given):
        bug, rotary = self.cfg.bug, self.rotary
        q_pos = k_pos = positions
        if bug == "wrap":
            q_pos = k_pos = positions % 5  # positions that restart: angles no longer linear in the position
        if bug == "offset" and given:
            k_pos = torch.arange(len(positions), device=positions.device)  # the caller's offset never reaches k
        q = rotary(q, q_pos)
        if bug == "q-only":
            return q, k
        if bug == "pairing":
            return q, rotary.other_pairing(k, k_pos)
        if bug == "opposite":
            k_pos = -k_pos  # q turned by +m theta, k by -m theta
        if bug == "frequency":
            k_pos = 2 * k_pos  # k turns twice as fast: as if built with another base
        return q, rotary(k, k_pos)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, rotary: Rotary | None):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, rotary)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x, positions, mask, given):
        x = x + self.attn(self.norm_1(x), positions, mask, given)
        return x + self.mlp(self.norm_2(x))


def sinusoids(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Attention Is All You Need, section 3.5: (T, dim)."""
    a = angles(positions, dim, 10000.0)
    return torch.stack([a.sin(), a.cos()], -1).flatten(-2)


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.absolute == "learned" else None
        # A projection, not a scaled copy: a scaled copy of the same token is undone by the LayerNorm
        self.smear = nn.Linear(cfg.d_model, cfg.d_model, bias=False) if cfg.smear else None
        table = 4 * cfg.max_seq_len  # the table-based rotaries are read at twice the positions by the frequency bug
        self.rotary = Rotary(cfg.rotary, cfg.head_dim, cfg.base, table) if cfg.rotary else None
        self.layers = nn.ModuleList(Block(cfg, self.rotary) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        slots = cfg.cache_len if cfg.cache else cfg.max_seq_len
        self.register_buffer("causal_mask", torch.ones(slots, slots, dtype=torch.bool).tril(), persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        given = position_ids is not None
        positions = position_ids.reshape(-1, T)[0] if given else torch.arange(T, device=input_ids.device)  # (T,)
        x = self.wte(input_ids)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        if self.config.absolute == "sinusoidal":
            x = x + sinusoids(positions, self.config.d_model).to(x.dtype)
        if self.smear is not None:
            x = torch.cat([x[:, :1], x[:, 1:] + self.smear(x[:, :-1])], dim=1)  # token t also carries token t - 1
        # (1, 1, T, S) when cached: query rows by input_pos, gpt-fast style
        mask = self.causal_mask[None, None, positions] if self.config.cache else self.causal_mask[:T, :T]
        for block in self.layers:
            x = block(x, positions, mask, given)
        return self.lm_head(self.norm(x))


class GptFastLM(TinyLM):
    """gpt-fast's call convention: forward(idx, input_pos); no position_ids, so no logits shift is possible."""

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx, input_pos)


def build(cls=TinyLM, **fields) -> TinyLM:
    torch.manual_seed(0)
    return cls(TinyConfig(**fields))


def rope_result(model: nn.Module, **kw):
    report = check_model(model, ["rope"], **kw)
    return report.results[0]


def summary(result) -> str:
    return f"{result.status.value}: {result.summary} {[(f.code, f.message) for f in result.findings]}"


# -- Karpathy's "Let's build GPT" gpt.py, as widely copied: one module per head, blocks in nn.Sequential ---------------


class Attend(nn.Module):
    """The score-softmax-values step as a module of its own, handed one head's rotated q, k, v (B, T, hs)."""

    def __init__(self, block_size: int):
        super().__init__()
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, q, k, v):
        T = q.shape[1]
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ v


class Head(nn.Module):
    def __init__(self, n_embd: int, head_size: int, block_size: int, rotary: bool):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.rotary, self.bug = rotary, None
        self.attend: Attend | None = None  # set: the attention step runs in a module of its own

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)  # (B, T, hs)
        q = self.query(x)  # (B, T, hs)
        if self.rotary:
            positions = torch.arange(T, device=x.device)
            q = rope_half(q, positions, 10000.0, q.shape[-1])
            if self.bug != "q-only":
                k = rope_half(k, positions, 10000.0, k.shape[-1])
        if self.attend is not None:
            return self.attend(q, k, self.value(x))
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        return wei @ self.value(x)  # (B, T, hs)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, n_embd: int, block_size: int, rotary: bool):
        super().__init__()
        self.heads = nn.ModuleList([Head(n_embd, head_size, block_size, rotary) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class TextbookBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, rotary: bool):
        super().__init__()
        self.sa = MultiHeadAttention(n_head, n_embd // n_head, n_embd, block_size, rotary)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class GPTLanguageModel(nn.Module):
    def __init__(
        self, vocab_size=32, n_embd=32, n_head=4, n_layer=2, block_size=32, rotary=False, bug=None, attend_module=False
    ):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = None if rotary else nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[TextbookBlock(n_embd, n_head, block_size, rotary) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)
        for head in self.modules():
            if isinstance(head, Head):
                head.bug = bug
                head.attend = Attend(block_size) if attend_module else None

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.token_embedding_table(idx)  # (B, T, C)
        if self.position_embedding_table is not None:
            x = x + self.position_embedding_table(torch.arange(T, device=idx.device))  # (T, C)
        logits = self.lm_head(self.ln_f(self.blocks(x)))  # (B, T, vocab_size)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def textbook(**kw) -> GPTLanguageModel:
    torch.manual_seed(0)
    return GPTLanguageModel(**kw)


# -- a model written inline: attention in the root's forward, no module to hold --------------------------------------


class Inline(nn.Module):
    """Everything in one forward: no module around the attention call takes the hidden state, so its input cannot be
    held. Clean rotations in q and k are still told apart from content; with a learned table added to the tokens,
    q and k change with position in no rotation's way and nothing can be judged."""

    def __init__(self, learned: bool = False, bug: str | None = None):
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(32, 16), nn.Linear(16, 48), nn.Linear(16, 32)
        self.wpe = nn.Embedding(32, 16) if learned else None
        self.bug = bug

    def forward(self, input_ids, position_ids=None):
        B, T = input_ids.shape
        here = torch.arange(T, device=input_ids.device)
        positions = here if position_ids is None else position_ids.reshape(-1, T)[0]
        x = self.embed(input_ids) + (self.wpe(here) if self.wpe is not None else 0)
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        q = rope_half(q, positions, 10000.0, 8)
        k = rope_half(k, -positions if self.bug == "opposite" else positions, 10000.0, 8)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(B, T, 16))


class InlineNoPositionIds(Inline):
    def forward(self, input_ids):
        return super().forward(input_ids)


def inline(cls=Inline, **kw) -> Inline:
    torch.manual_seed(0)
    return cls(**kw)


# -- the verdicts ---------------------------------------------------------------------------------------------------

KINDS = ["half", "interleaved", "complex", "partial", "rotary-embedding-torch", "x-transformers", "torchtune", "litgpt"]
PAIRING = {kind: "half" if kind in HALF_FAMILY else "interleaved" for kind in KINDS}
CACHE = dict(cache=True, max_seq_len=28)  # 28 positions: the cache holds 32 slots, as gpt-fast rounds up to 8
SHAPES = {  # name -> (model class, TinyConfig fields)
    "plain": (TinyLM, {}),
    "gqa": (TinyLM, {"n_kv_heads": 2}),
    "cache-gqa": (TinyLM, {**CACHE, "n_kv_heads": 2}),
    "gpt-fast": (GptFastLM, CACHE),
    "smear": (GptFastLM, {"smear": True}),
    "learned+rotary": (TinyLM, {"absolute": "learned"}),
}


def assert_pass(result, pairing: str, rotary_dim: int, calls: int = 2):
    assert result.status.value == "pass" and not result.findings, summary(result)
    assert result.metrics["pairing"] == pairing and result.metrics["rotary_dim"] == rotary_dim, result.metrics
    assert abs(math.log(result.metrics["base"] / 10000.0)) < 0.02, result.metrics
    assert result.metrics["judged_calls"] >= calls, result.metrics  # measured in every layer, not on faith


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.slow
def test_correct_rotary_passes_in_every_layout(kind, shape):
    cls, fields = SHAPES[shape]
    result = rope_result(build(cls, rotary=kind, **fields))
    assert_pass(result, PAIRING[kind], 4 if kind == "partial" else 8)


@pytest.mark.parametrize("kind", ["complex", "half"])
def test_declared_rope_on_a_long_cache_passes(kind):
    """gpt-fast: SDPA gets keys [1, h, 32, d_h] for 16 queries; the empty slots 28..31 and whatever earlier forwards
    left in the cache are not read as positions."""
    model = build(GptFastLM, rotary=kind, **CACHE)
    result = rope_result(model, rope={"base": 10000.0, "pairing": PAIRING[kind]})
    assert_pass(result, PAIRING[kind], 8)
    assert all(c["cached"] and c["judged"] for c in result.data["probe_calls"]), result.data["probe_calls"]


def test_cache_skips_the_logits_shift_it_cannot_trust():
    """Shifted positions in a cache kept between calls would also read what the probe left below them."""
    result = rope_result(build(TinyLM, rotary="complex", **CACHE))
    assert result.status.value == "pass", summary(result)
    assert "cache" in result.data["logits_shift"]
    assert result.data["probe_shift"]["calls"] >= 1  # the probe's own shift still compares q . k


def test_a_cache_exactly_as_long_as_the_probe_still_skips_the_logits_shift():
    """16 slots for a probe of 16: every call is square, but forward writes its cache buffers, and the shifted
    logits (positions 8..15) would read the slots below them that an earlier forward left."""
    result = rope_result(build(rotary="complex", cache=True, max_seq_len=16))
    assert result.status.value == "pass", summary(result)
    assert not any(c["cached"] for c in result.data["probe_calls"])
    assert "writes its buffers" in result.data["logits_shift"], result.data["logits_shift"]


def test_learned_positions_beside_rotary_skip_only_the_logits_shift():
    """A learned table as well as rotary: the logits rightly change with a shift, so they are not compared; the
    probe's shift, from the same held input, still is."""
    result = rope_result(build(rotary="half", absolute="learned"))
    assert result.status.value == "pass", summary(result)
    assert "positions also enter absolutely" in result.data["logits_shift"], result.data["logits_shift"]
    assert result.data["probe_shift"]["calls"] == 2 and result.data["probe_shift"]["score_change"] < 1e-4


BUGS = [  # (bug, rotary kind, shape, the code it must fail with)
    ("q-only", "half", "plain", "FWD301"),
    ("q-only", "complex", "gpt-fast", "FWD301"),
    ("q-only", "torchtune", "smear", "FWD301"),
    ("q-only", "x-transformers", "cache-gqa", "FWD301"),
    ("pairing", "complex", "gpt-fast", "FWD302"),
    ("pairing", "litgpt", "cache-gqa", "FWD302"),
    ("pairing", "rotary-embedding-torch", "smear", "FWD302"),
    ("pairing", "partial", "learned+rotary", "FWD302"),
    ("opposite", "half", "smear", "FWD302"),
    ("opposite", "complex", "gpt-fast", "FWD302"),
    ("opposite", "x-transformers", "plain", "FWD302"),
    ("frequency", "interleaved", "gqa", "FWD302"),
    ("frequency", "torchtune", "gpt-fast", "FWD302"),
    ("wrap", "half", "plain", "FWD303"),
    ("wrap", "complex", "gpt-fast", "FWD303"),
    ("offset", "half", "plain", "FWD304"),
    ("offset", "complex", "cache-gqa", "FWD304"),
    ("offset", "litgpt", "learned+rotary", "FWD304"),
]


@pytest.mark.parametrize("bug, kind, shape, code", BUGS, ids=[f"{b}-{k}-{s}" for b, k, s, _ in BUGS])
@pytest.mark.slow
def test_planted_rotary_bug_fails_its_code(bug, kind, shape, code):
    cls, fields = SHAPES[shape]
    result = rope_result(build(cls, rotary=kind, bug=bug, **fields))
    codes = {f.code for f in result.findings}
    assert result.status.value == "fail" and code in codes, summary(result)
    assert "FWD306" not in codes, summary(result)  # caught for the right reason, not as "not a rotation"
    if code != "FWD301":
        assert "FWD301" not in codes, summary(result)


def test_opposite_rotation_names_the_sign():
    result = rope_result(
        build(GptFastLM, rotary="half", bug="opposite", smear=True), rope={"base": 10000.0, "pairing": "half"}
    )
    (finding,) = [f for f in result.findings if f.code == "FWD302"]
    assert "opposite directions" in finding.message


# -- no rotary embedding: a skip with the reason, or FWD307 when rope is declared --------------------------------------


@pytest.mark.parametrize(
    "model, found",
    [
        (lambda: build(rotary=None, absolute="learned"), "learned table ('wpe'"),
        (lambda: build(GptFastLM, rotary=None, absolute="learned", **CACHE), "learned table ('wpe'"),
        (lambda: textbook(), "learned table ('position_embedding_table'"),
        (lambda: build(rotary=None, absolute="sinusoidal"), "varies with position"),
        (lambda: build(GptFastLM, rotary=None, smear=True), "varies with position"),
        (lambda: build(rotary=None), "no position encoding reaches q and k"),
    ],
    ids=["learned", "learned-cache", "textbook-gpt", "sinusoidal", "smear", "nope"],
)
def test_absolute_positions_are_not_rope(model, found):
    result = rope_result(model())
    assert result.status.value == "skip", summary(result)
    assert result.summary.startswith("does not apply: no rotary embedding") and found in result.summary, result.summary


@pytest.mark.parametrize(
    "model", [lambda: build(rotary=None, absolute="learned"), lambda: textbook()], ids=["learned", "textbook-gpt"]
)
def test_declared_rope_on_absolute_positions_fails_saying_what_was_found(model):
    result = rope_result(model(), rope={"base": 10000.0, "pairing": "half"})
    assert result.status.value == "fail", summary(result)
    (finding,) = [f for f in result.findings if f.code == "FWD307"]
    assert "found instead: absolute positions from a learned table" in finding.message


def test_textbook_gpt_with_rotary_heads():
    """One module per head (3-D q and k), blocks in nn.Sequential: every head is held and judged."""
    result = rope_result(textbook(rotary=True))
    assert_pass(result, "half", 8)
    assert result.metrics["judged_calls"] == 8  # 2 layers x 4 heads
    bug = rope_result(textbook(rotary=True, bug="q-only"))
    assert bug.status.value == "fail" and {f.code for f in bug.findings} == {"FWD301"}, summary(bug)


def test_rotated_heads_handed_to_an_inner_module_are_not_held():
    """Attend(q, k, v) takes (B, T, hs) tensors already rotated: the hidden state to hold is the head's input, the
    widest around the call (no config says the width here)."""
    assert_pass(rope_result(textbook(rotary=True, attend_module=True)), "half", 8, calls=8)
    bug = rope_result(textbook(rotary=True, bug="q-only", attend_module=True))
    assert bug.status.value == "fail" and {f.code for f in bug.findings} == {"FWD301"}, summary(bug)


# -- nothing measured is never a pass ------------------------------------------------------------------------------

ROPE = {"base": 10000.0, "pairing": "half"}


def test_inline_attention_is_judged_by_its_clean_rotations():
    """No module to hold, but q and k turn as rotations do: that is measured, and the bug is caught."""
    assert_pass(rope_result(inline(InlineNoPositionIds), rope=ROPE), "half", 8, calls=1)
    buggy = rope_result(inline(InlineNoPositionIds, bug="opposite"), rope=ROPE)
    assert buggy.status.value == "fail" and {f.code for f in buggy.findings} == {"FWD302"}, summary(buggy)


def test_nothing_measured_skips_with_the_reason():
    for bug in (None, "opposite"):  # never a pass: the bug is not seen, and the skip says why
        result = rope_result(inline(InlineNoPositionIds, learned=True, bug=bug), rope=ROPE)
        assert result.status.value == "skip", summary(result)
        assert "not measured" in result.summary and "could not be held" in result.summary, result.summary


def test_logits_shift_measures_when_the_probe_cannot():
    """The learned table here reads arange(T), not position_ids: only the rotation sees the shift."""
    clean = rope_result(inline(learned=True), rope=ROPE)
    assert clean.status.value == "pass" and "at the logits" in clean.summary, summary(clean)
    buggy = rope_result(inline(learned=True, bug="opposite"), rope=ROPE)
    assert buggy.status.value == "fail" and {f.code for f in buggy.findings} == {"FWD304"}, summary(buggy)


def test_undeclared_model_with_nothing_measured_skips_without_claiming_no_rotary():
    result = rope_result(inline(InlineNoPositionIds, learned=True))
    assert result.status.value == "skip" and result.summary.startswith("not measured"), summary(result)


# -- forwards that run attention in steps, other dtypes, scaled rotations ---------------------------------------------


def generate(model: TinyLM, input_ids: torch.Tensor, **_) -> torch.Tensor:
    """Generate-style: prefill half, then one token at a time through the cache (teacher-forced): [B, T, V]."""
    T = input_ids.shape[1]
    prompt = T // 2
    steps = [model(input_ids[:, :prompt])]
    for t in range(prompt, T):
        steps.append(model(input_ids[:, t : t + 1], torch.tensor([t], device=input_ids.device)))
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("kind", ["complex", "litgpt"])
@pytest.mark.slow
def test_prefill_then_decode_steps_are_one_measurement(kind):
    """Each layer's attention runs as a prefill of 8 queries and 8 single-query steps: put together they are the
    probe's 16 positions, the keys those the last step's cache holds."""
    result = rope_result(build(rotary=kind, **CACHE), forward=generate)
    assert_pass(result, PAIRING[kind], 8)
    buggy = rope_result(build(rotary=kind, bug="pairing", **CACHE), forward=generate)
    assert buggy.status.value == "fail" and {f.code for f in buggy.findings} == {"FWD302"}, summary(buggy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "kind, shape",
    [
        ("interleaved", "plain"),
        ("complex", "cache-gqa"),
        ("x-transformers", "plain"),
        ("torchtune", "gpt-fast"),
        ("half", "smear"),
    ],
)
def test_low_precision_correct_models_pass(dtype, kind, shape):
    """A slow pair of small magnitude stays below the rounding on one side only: no frequency mismatch for that."""
    cls, fields = SHAPES[shape]
    result = rope_result(build(cls, rotary=kind, **fields), dtype=dtype)
    assert result.status.value == "pass" and not result.findings, summary(result)
    assert result.metrics["pairing"] == PAIRING[kind], result.metrics


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "bug, code",
    [
        ("q-only", "FWD301"),
        ("pairing", "FWD302"),
        ("opposite", "FWD302"),
        ("frequency", "FWD302"),
        ("wrap", "FWD303"),
        ("offset", "FWD304"),
    ],
)
@pytest.mark.slow
def test_low_precision_bugs_fail_their_code(dtype, bug, code):
    cls, fields = SHAPES["cache-gqa"]
    result = rope_result(build(cls, rotary="complex", bug=bug, **fields), dtype=dtype)
    assert result.status.value == "fail" and code in {f.code for f in result.findings}, summary(result)


class XPosAttention(Attention):
    """x-transformers' xPos: q scaled by zeta^m, k by zeta^-m as they turn; q . k still depends on n - m only."""

    def rotate(self, q, k, positions, given):
        from x_transformers.x_transformers import apply_rotary_pos_emb

        freqs, scale = self.rotary.library(positions)
        return apply_rotary_pos_emb(q, freqs, scale), apply_rotary_pos_emb(k, freqs, scale**-1)


def test_scaled_rotation_is_no_finding():
    model = build(rotary="x-transformers")
    from x_transformers.x_transformers import RotaryEmbedding

    model.rotary.library = RotaryEmbedding(model.config.head_dim, use_xpos=True, scale_base=64)
    for block in model.layers:
        block.attn.__class__ = XPosAttention
    result = rope_result(model)
    assert result.status.value == "pass" and "xPos" in result.summary, summary(result)


def test_eager_attention_on_a_long_cache():
    """Eager scores [1, h, 16, 32] are judged when the observation records non-square q @ k^T; until then the check
    says it measured nothing. Never a pass without a measurement, never a failure of a clean model."""
    from fwdcheck.observe.observer import observing

    probe = build(GptFastLM, rotary="complex", attention="eager", **CACHE)
    with torch.no_grad(), observing(probe, 16, keep_tensors=True) as seen:
        probe(torch.zeros(1, 16, dtype=torch.long))
    recorded = any(mm.kind == "scores" for mm in seen.matmuls)
    for bug in (None, "pairing"):
        result = rope_result(
            build(GptFastLM, rotary="complex", attention="eager", bug=bug, **CACHE),
            rope={"base": 10000.0, "pairing": "interleaved"},
        )
        if not recorded:
            assert result.status.value == "skip" and "not measured" in result.summary, summary(result)
        elif bug is None:
            assert_pass(result, "interleaved", 8)
        else:
            assert result.status.value == "fail" and "FWD302" in {f.code for f in result.findings}, summary(result)


# -- the pieces the cache handling rests on ---------------------------------------------------------------------------


def test_written_slots_are_the_ones_two_tokens_wrote_differently():
    from fwdcheck.checks.observed_qk import written_slots

    stale = torch.randn(1, 2, 32, 8)
    a, b = stale.clone(), stale.clone()
    a[..., 3:19, :], b[..., 3:19, :] = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    assert written_slots(a, b) == list(range(3, 19))
    assert written_slots(a, b[..., :30, :]) is None  # a cache that changed size between the probes


def test_key_slots_prefer_query_positions_that_agree_with_what_was_written():
    from fwdcheck.checks.observed_qk import key_slots

    written = list(range(12, 28))
    assert key_slots(16, 32, torch.arange(12, 28), written) == written
    assert key_slots(16, 32, torch.arange(12, 28), None) == written  # positions alone index the cache
    assert key_slots(16, 32, torch.arange(16), written) == written  # an appending cache: the slots it wrote
    assert key_slots(16, 32, None, list(range(10))) is None  # neither tells: not judged
    assert key_slots(16, 20, torch.arange(12, 28), None) is None  # positions beyond the cache


def test_the_probe_leaves_no_hook_behind():
    model = build(GptFastLM, rotary="complex", **CACHE)
    rope_result(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
