"""shape-ledger on model code written the way people write it, not the way fwdcheck's reference model is.

Each correct model must pass with no warning: a head count that only the tensors show (eager q @ k^T, einsum,
nn.MultiheadAttention), a fused projection, value embeddings, a KV cache longer than the sequence, a padded
vocabulary, a forward that decodes one token at a time, sizes that collide. Each planted bug must still fail with
its code. Models have no config object fwdcheck can read unless the case says so: what is named is read off the
tensors, or declared with `dims`.

Shapes in comments use B (batch), T (sequence), C (model width), nh (query heads), nkv (key/value heads),
hs (head size), S (key slots of a cache).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fwdcheck.api import check_model

VOCAB, WIDTH, HEADS, LAYERS, BLOCK = 64, 32, 4, 2, 64


def ledger(model: nn.Module, **kwargs):
    """The shape-ledger result for a module handed over directly, as the Python API does."""
    kwargs.setdefault("vocab_size", VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.TransformerEncoder's nested-tensor notices
        report = check_model(model, ["shape-ledger"], **kwargs)
    return report.result("shape-ledger")


def rows(result) -> dict[str, dict]:
    return {e["name"]: e for e in result.data["entries"]}


def not_passing(result) -> list[str]:
    return [f"{f.code} {f.status.value}: {f.message}" for f in result.findings if f.status.value != "pass"]


def assert_clean(result):
    """Passes with nothing to warn about: the verdict a correct model must get."""
    assert result.status.value == "pass", not_passing(result)
    assert not not_passing(result), not_passing(result)


# =====================================================================================================================
# Correct models in the common textbook shapes


class EagerAttention(nn.Module):
    """nanoGPT's non-flash branch: fused c_attn, heads by view + transpose, masked_fill on a registered tril."""

    def __init__(self, d: int, n_head: int, block_size: int, softmax_dim: int = -1):
        super().__init__()
        self.n_head, self.softmax_dim = n_head, softmax_dim
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=self.softmax_dim)
        y = att @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, d_ff) inside


class Block(nn.Module):
    def __init__(self, d: int, d_ff: int, attn: nn.Module):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), attn, nn.LayerNorm(d), MLP(d, d_ff)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TextbookGPT(nn.Module):
    """A GPT as tutorials write it: hyperparameters as constructor arguments, no config object to read."""

    def __init__(self, vocab=VOCAB, d=WIDTH, n_head=HEADS, n_layer=LAYERS, block_size=BLOCK, d_ff=4 * WIDTH, **attn):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(block_size, d),
                h=nn.ModuleList(Block(d, d_ff, EagerAttention(d, n_head, block_size, **attn)) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        T = idx.size(1)
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)


class HeadModuleGPT(nn.Module):
    """The lecture-style GPT: one nn.Module per head in an nn.ModuleList (each attends [B,T,hs] -> [B,T,T]), the
    blocks in an nn.Sequential. The longest ModuleList is a block's heads, not the layers."""

    class Head(nn.Module):
        def __init__(self, d, hs, block_size):
            super().__init__()
            self.key, self.query, self.value = (nn.Linear(d, hs, bias=False) for _ in range(3))
            self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

        def forward(self, x):
            B, T, C = x.shape
            k, q = self.key(x), self.query(x)  # (B, T, hs)
            wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, T)
            wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
            wei = F.softmax(wei, dim=-1)
            return wei @ self.value(x)  # (B, T, hs)

    class MultiHead(nn.Module):
        def __init__(self, d, n_head, block_size):
            super().__init__()
            self.heads = nn.ModuleList(HeadModuleGPT.Head(d, d // n_head, block_size) for _ in range(n_head))
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))  # (B, T, C)

    def __init__(self, vocab=VOCAB, d=WIDTH, n_head=HEADS, n_layer=LAYERS, block_size=BLOCK):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab, d)
        self.position_embedding_table = nn.Embedding(block_size, d)
        self.blocks = nn.Sequential(*(Block(d, 4 * d, self.MultiHead(d, n_head, block_size)) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.token_embedding_table(idx) + self.position_embedding_table(torch.arange(T, device=idx.device))
        return self.lm_head(self.ln_f(self.blocks(x)))  # (B, T, V)


class EncoderAsDecoder(nn.Module):
    """nn.TransformerEncoder with a causal mask, as the PyTorch word-language-model tutorial builds a decoder."""

    def __init__(self, vocab=VOCAB, d=WIDTH, n_head=HEADS, n_layer=LAYERS, block_size=BLOCK, d_ff=64, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        layer = nn.TransformerEncoderLayer(d, n_head, d_ff, dropout=0.1, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=batch_first)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(T, device=ids.device))  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)  # (T, T) 0 / -inf
        if not self.batch_first:
            return self.head(self.encoder(x.transpose(0, 1), mask=mask, is_causal=True)).transpose(0, 1)
        return self.head(self.encoder(x, mask=mask, is_causal=True))  # (B, T, V)


def x_transformers_decoder(**attn_kwargs) -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=BLOCK, attn_layers=Decoder(dim=WIDTH, depth=LAYERS, heads=HEADS, **attn_kwargs)
    )


class FusedGQA(nn.Module):
    """One projection for q, k and v of grouped-query attention: [B, T, (nh + 2 nkv) hs], split; k/v repeated to nh
    heads, or (repeat=False) handed over with nkv heads and SDPA's enable_gqa."""

    def __init__(self, d, n_head, n_kv, hs, repeat=True):
        super().__init__()
        self.n_head, self.n_kv, self.hs, self.repeat = n_head, n_kv, hs, repeat
        self.qkv = nn.Linear(d, (n_head + 2 * n_kv) * hs, bias=False)
        self.proj = nn.Linear(n_head * hs, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x)  # (B, T, (nh + 2 nkv) hs)
        q, k, v = qkv.split([self.n_head * self.hs, self.n_kv * self.hs, self.n_kv * self.hs], dim=-1)
        q = q.view(B, T, self.n_head, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv, self.hs).transpose(1, 2)
        if self.repeat:
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not self.repeat)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class SDPAModel(nn.Module):
    """A decoder around any attention module taking and returning [B, T, C]; value embeddings optional (an
    nn.Embedding of the ids of another width, mixed into the residual through a projection)."""

    def __init__(
        self, attn_factory, vocab=VOCAB, d=WIDTH, n_layer=LAYERS, d_ff=4 * WIDTH, value_embed=0, padded_vocab=None
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.value_embeds = nn.Embedding(vocab, value_embed) if value_embed else None
        self.ve_proj = nn.Linear(value_embed, d, bias=False) if value_embed else None
        self.layers = nn.ModuleList(Block(d, d_ff, attn_factory()) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, padded_vocab or vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids)  # (B, T, C)
        if self.value_embeds is not None:
            x = x + self.ve_proj(self.value_embeds(ids))  # (B, T, dv) -> (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # (B, T, V) or (B, T, V_pad)


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


class KVCache(nn.Module):
    """gpt-fast's cache: [max_batch, nkv, max_seq, hs] buffers written at input_pos; every slot is handed on."""

    def __init__(self, max_batch, n_kv, max_seq, hs):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(max_batch, n_kv, max_seq, hs))
        self.register_buffer("v_cache", torch.zeros(max_batch, n_kv, max_seq, hs))

    def update(self, input_pos, k_val, v_val):
        B = k_val.shape[0]
        self.k_cache[:B, :, input_pos] = k_val
        self.v_cache[:B, :, input_pos] = v_val
        return self.k_cache[:B], self.v_cache[:B]  # (B, nkv, S, hs)


class CachedAttention(nn.Module):
    """gpt-fast's Attention: fused wqkv for GQA, the cache updated at input_pos, SDPA with a boolean mask sliced
    from a [S, S] tril by input_pos (keys [B, nh, S, hs] for T queries). eager=True computes the same by hand."""

    def __init__(self, d, n_head, n_kv, hs, eager=False):
        super().__init__()
        self.n_head, self.n_kv, self.hs, self.eager = n_head, n_kv, hs, eager
        self.wqkv = nn.Linear(d, (n_head + 2 * n_kv) * hs, bias=False)
        self.wo = nn.Linear(n_head * hs, d, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, mask, input_pos):
        B, T, _ = x.shape
        kv_size = self.n_kv * self.hs
        q, k, v = self.wqkv(x).split([self.n_head * self.hs, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_head, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv, self.hs).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, nkv, S, hs)
        k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)  # (B, nh, S, hs)
        v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        if self.eager:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hs)  # (B, nh, T, S)
            y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class CachedBlock(nn.Module):
    def __init__(self, d, n_head, n_kv, hs, d_ff, eager=False):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = CachedAttention(d, n_head, n_kv, hs, eager)
        self.feed_forward = MLP(d, d_ff)

    def forward(self, x, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), mask, input_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class GptFast(nn.Module):
    """gpt-fast's Transformer at a tiny size: caches allocated for prompt + new tokens rounded up to a multiple of
    8, so T = 8 queries read S = 32 key slots. generate=True runs forward as generation does: a prefill of the first
    half, then one token at a time through the cache, the logits of every step concatenated to [B, T, V]."""

    def __init__(
        self,
        vocab=VOCAB,
        d=WIDTH,
        n_head=HEADS,
        n_kv=2,
        hs=WIDTH // HEADS,
        n_layer=LAYERS,
        d_ff=4 * WIDTH,
        max_new_tokens=20,
        prompt=8,
        generate=False,
        eager=False,
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(CachedBlock(d, n_head, n_kv, hs, d_ff, eager) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        self.n_kv, self.hs, self.generate = n_kv, hs, generate
        self.max_seq_length = find_multiple(prompt + max_new_tokens, 8)  # 8 + 20 -> 32 slots
        self.max_batch_size = 0

    def setup_caches(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, self.n_kv, self.max_seq_length, self.hs).to(
                self.output.weight.device
            )
        S = self.max_seq_length
        self.causal_mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=self.output.weight.device))

    def step(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]  # (1, 1, T, S)
        x = self.tok_embeddings(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, mask, input_pos)
        return self.output(self.norm(x))  # (B, T, V)

    def forward(self, idx, input_pos=None):
        B, T = idx.shape
        if self.max_batch_size < B:
            self.setup_caches(B)
        if not self.generate:
            return self.step(idx, torch.arange(T, device=idx.device) if input_pos is None else input_pos)
        prefill = T // 2
        logits = [self.step(idx[:, :prefill], torch.arange(prefill, device=idx.device))]  # (B, T/2, V)
        for t in range(prefill, T):
            logits.append(self.step(idx[:, t : t + 1], torch.tensor([t], device=idx.device)))  # (B, 1, V)
        return torch.cat(logits, dim=1)  # (B, T, V)


class MHADecoder(nn.Module):
    """nn.MultiheadAttention called directly (batch_first), its causal mask a bool triu(1): no config object."""

    class Block(nn.Module):
        def __init__(self, d, n_head):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, n_head, batch_first=True)
            self.mlp = MLP(d, 4 * d)

        def forward(self, x, mask):
            h = self.ln_1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]  # (B, T, C)
            return x + self.mlp(self.ln_2(x))

    def __init__(self, vocab=VOCAB, d=WIDTH, n_head=HEADS, n_layer=LAYERS, block_size=BLOCK):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(self.Block(d, n_head) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(T, device=ids.device))
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=ids.device), diagonal=1)  # True = masked
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


class MetaLlamaAttention(nn.Module):
    """Meta's llama reference layout: the cache is [max_batch, max_seq, nkv, hs], written at start_pos and read
    back up to start_pos + T, then transposed to [B, nh, S, hs] for attention. transpose=False forgets the
    transposes (the bug): SDPA gets [B, T, nh, hs] and attends over heads."""

    def __init__(self, d, n_head, max_batch, max_seq, transpose=True):
        super().__init__()
        self.n_head, self.hs, self.transpose = n_head, d // n_head, transpose
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.register_buffer("cache_k", torch.zeros(max_batch, max_seq, n_head, self.hs), persistent=False)
        self.register_buffer("cache_v", torch.zeros(max_batch, max_seq, n_head, self.hs), persistent=False)

    def forward(self, x, start_pos: int):
        B, T, _ = x.shape
        xq = self.wq(x).view(B, T, self.n_head, self.hs)  # (B, T, nh, hs)
        xk = self.wk(x).view(B, T, self.n_head, self.hs)
        xv = self.wv(x).view(B, T, self.n_head, self.hs)
        self.cache_k[:B, start_pos : start_pos + T] = xk  # fails for B > max_batch: the cache fixes the batch
        self.cache_v[:B, start_pos : start_pos + T] = xv
        keys = self.cache_k[:B, : start_pos + T]  # (B, S, nh, hs)
        values = self.cache_v[:B, : start_pos + T]
        if self.transpose:
            xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # (B, nh, ., hs)
        y = F.scaled_dot_product_attention(xq, keys, values, is_causal=T > 1)
        if self.transpose:
            y = y.transpose(1, 2)
        return self.wo(y.reshape(B, T, -1))


class MetaLlama(nn.Module):
    def __init__(self, vocab=VOCAB, d=WIDTH, n_head=HEADS, n_layer=LAYERS, max_batch=2, max_seq=BLOCK, **attn):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    attention_norm=nn.LayerNorm(d),
                    attention=MetaLlamaAttention(d, n_head, max_batch, max_seq, **attn),
                    ffn_norm=nn.LayerNorm(d),
                    feed_forward=MLP(d, 4 * d),
                )
            )
            for _ in range(n_layer)
        )
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, start_pos: int = 0):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer["attention"](layer["attention_norm"](h), start_pos)
            h = h + layer["feed_forward"](layer["ffn_norm"](h))
        return self.output(h)


class SplitHeadsSwapped(FusedGQA):
    """Bug: heads split as view(B, T, hs, nh): attention runs with hs heads of nh, against the declared sizes."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.n_head * self.hs, dim=-1)  # 3 x (B, T, C); nkv == nh here
        q, k, v = (t.view(B, T, self.hs, self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, hs, T, nh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class UntransposedSDPA(FusedGQA):
    """Bug: nanoGPT's heads split with view but never transposed; SDPA gets [B, T, nh, hs]."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.n_head * self.hs, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, self.hs) for t in (q, k, v))  # (B, T, nh, hs): transpose forgotten
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # attends over the heads of one position
        return self.proj(y.reshape(B, T, -1))


# =====================================================================================================================
# Correct models: pass with no warning, and the axes carry the names the tensors show


def test_textbook_eager_gpt_heads_are_read_off_q_at_k():
    result = ledger(TextbookGPT())
    assert_clean(result)
    entries = rows(result)
    assert entries["transformer.h.0.attn q (q @ k^T)"]["dims"] == ["B", "h", "T", "d_h"]
    assert entries["transformer.h.0.attn k^T (q @ k^T)"]["dims"] == ["B", "h", "d_h", "T"]
    assert entries["transformer.h.0.attn attention weights"]["dims"] == ["B", "h", "T", "T"]
    assert {k: result.data["dims"][k] for k in ("h", "d_h", "d")} == {"h": 4, "d_h": 8, "d": 32}


def test_one_module_per_head_is_not_taken_for_the_layers():
    """The longest ModuleList is one block's heads ([B,T,d] -> [B,T,hs]): not blocks, not hidden states."""
    result = ledger(HeadModuleGPT())
    assert_clean(result)
    entries = rows(result)
    assert not any(e["role"] == "hidden" for e in entries.values())
    assert entries["blocks.0.attn.heads.0 q (q @ k^T)"]["dims"] == ["B", "T", "d_h"]
    assert entries["blocks.0.attn.heads.0 attention weights"]["dims"] == ["B", "T", "T"]


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_heads_come_from_num_heads(batch_first):
    result = ledger(EncoderAsDecoder(batch_first=batch_first))
    assert_clean(result)
    entries = rows(result)
    assert entries["encoder.layers.0.self_attn attention weights"]["dims"] == ["B", "h", "T", "T"]
    assert entries["encoder.layers.0 output"]["dims"] == (["B", "T", "d"] if batch_first else ["T", "B", "d"])
    assert result.data["dims"]["h"] == 4


def test_multihead_attention_called_directly():
    result = ledger(MHADecoder())
    assert_clean(result)
    assert rows(result)["blocks.0.attn attention weights"]["dims"] == ["B", "h", "T", "T"]
    assert rows(result)["blocks.0.attn query (MHA input)"]["dims"] == ["T", "B", "d"]


def test_x_transformers_decoder():
    pytest.importorskip("x_transformers")
    result = ledger(x_transformers_decoder())
    assert_clean(result)
    weights = [e for e in result.data["entries"] if e["role"] == "weights"]
    assert weights and all(e["dims"] == ["B", "h", "T", "T"] for e in weights)
    assert result.data["dims"]["d_h"] == 64  # its default dim_head, not d / h: read off the tensors


def test_fused_projections_are_not_ledger_rows_even_when_as_wide_as_the_mlp():
    """c_attn [B,T,3d] and a fused GQA projection [B,T,(h+2h_kv)d_h], with d_ff declared at exactly that width:
    only the MLP's layer is the feed-forward state."""
    fused = (TextbookGPT(d_ff=3 * WIDTH), 3 * WIDTH), (SDPAModel(lambda: FusedGQA(32, 4, 2, 8), d_ff=64), 64)
    for model, d_ff in fused:
        result = ledger(model, dims={"d_ff": d_ff})
        assert_clean(result)
        ffn = [e for e in result.data["entries"] if e["role"] == "ffn"]
        assert [e["name"] for e in ffn] in (["transformer.h.0.mlp.c_fc output"], ["layers.0.mlp.c_fc output"])
        assert ffn[0]["dims"] == ["B", "T", "d_ff"]


def test_value_embedding_of_another_width_is_not_the_token_embedding():
    result = ledger(SDPAModel(lambda: FusedGQA(32, 4, 2, 8), value_embed=16))
    assert_clean(result)
    entries = rows(result)
    assert entries["token embedding (wte)"]["dims"] == ["B", "T", "d"]
    assert entries["embedding (value_embeds)"]["dims"] == ["B", "T", "16"]  # its own width, shown by size


def test_kv_cache_longer_than_the_sequence_names_its_slots():
    """gpt-fast: 8 queries read 32 cache slots; 32 is also the model width, and no name rests on that."""
    result = ledger(GptFast())
    assert_clean(result)
    entries = rows(result)
    assert entries["layers.0.attention k"]["shape"] == [2, 4, 32, 8]  # repeated from 2 kv heads to h
    assert entries["layers.0.attention k"]["dims"] == ["B", "h", "S", "d_h"]
    assert entries["layers.0.attention attention weights"]["dims"] == ["B", "h", "T", "S"]


def test_kv_cache_with_eager_attention():
    result = ledger(GptFast(eager=True))
    by_role = {e["role"]: e["dims"] for e in result.data["entries"] if e["name"].startswith("layers.0.attention ")}
    if "weights" not in by_role:
        pytest.skip("the observation does not recognise non-square eager scores")
    assert_clean(result)
    assert by_role == {
        "scores_q": ["B", "h", "T", "d_h"],
        "scores_k": ["B", "h", "d_h", "S"],
        "weights": ["B", "h", "T", "S"],
        "scores_v": ["B", "h", "S", "d_h"],
    }


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_generate_style_forward_names_what_it_can_and_shows_the_rest_by_size(eager):
    """Prefill on 4 tokens, then 4 decode steps of 1 through the cache: blocks output [B,4,d] and [B,1,d]."""
    result = ledger(GptFast(generate=True, eager=eager))
    assert_clean(result)
    entries = rows(result)
    assert entries["layers.0 output"]["dims"] == ["B", "4", "d"]
    assert entries["layers.0 output #4"]["dims"] == ["B", "1", "d"]
    assert entries["logits"]["dims"] == ["B", "T", "V"]
    assert any("shown by their size" in note for note in result.data["notes"])
    if not eager:
        assert entries["layers.0.attention#4 q"]["dims"] == ["B", "h", "1", "d_h"]
    elif "layers.0.attention#4 attention weights" in entries:  # eager decode steps, where they are recognised
        assert entries["layers.0.attention#4 attention weights"]["dims"] == ["B", "h", "1", "S"]


def test_padded_vocabulary_is_a_note():
    result = ledger(SDPAModel(lambda: FusedGQA(32, 4, 2, 8), vocab=96, padded_vocab=128), vocab_size=96)
    assert_clean(result)
    assert rows(result)["logits"]["dims"] == ["B", "T", "V_pad"]
    assert any("128 wide for a vocabulary of 96" in note for note in result.data["notes"])


def test_shared_sizes_are_named_by_position():
    """V == d_ff, h == d_h, h_kv == B, S == d: each axis by its place in the layout, not by the collision."""
    result = ledger(
        SDPAModel(lambda: FusedGQA(16, 4, 2, 4, repeat=False), vocab=128, d=16, d_ff=128),
        vocab_size=128,
        dims={"d_ff": 128},
    )
    assert_clean(result)
    entries = rows(result)
    assert entries["logits"]["dims"] == ["B", "T", "V"]
    assert entries["layers.0.mlp.c_fc output"]["dims"] == ["B", "T", "d_ff"]
    assert entries["layers.0.attn q"]["dims"] == ["B", "h", "T", "d_h"]  # 4 heads of 4
    assert entries["layers.0.attn k"]["shape"] == [2, 2, 8, 4]
    assert entries["layers.0.attn k"]["dims"] == ["B", "h_kv", "T", "d_h"]  # 2 kv heads, batch of 2
    cached = rows(ledger(GptFast()))  # S = 32 = d
    assert cached["layers.0.attention k"]["dims"] == ["B", "h", "S", "d_h"]


def test_fixed_batch_cache_names_batch_axes_by_position():
    """A cache allocated for max_batch_size 2 refuses the naming pass's other batch size: it runs again at B=2."""
    result = ledger(MetaLlama())
    assert_clean(result)
    assert any("it ran at B=2" in note for note in result.data["notes"])
    assert rows(result)["layers.0.attention k"]["dims"] == ["B", "h", "T", "d_h"]


class OneShapeOnly(TextbookGPT):
    """Refuses every input but [2, 8] (code written for one batch of one length)."""

    def forward(self, idx):
        assert tuple(idx.shape) == (2, 8), f"expected a [2, 8] batch, got {list(idx.shape)}"
        return super().forward(idx)


def test_model_refusing_the_naming_pass_is_named_by_position_with_a_note():
    result = ledger(OneShapeOnly())
    assert_clean(result)
    assert any("named by position and size only" in note for note in result.data["notes"])
    assert rows(result)["transformer.h.0.attn q (q @ k^T)"]["dims"] == ["B", "h", "T", "d_h"]


def test_declared_dims_name_the_axes_and_win():
    declared = ledger(TextbookGPT(), dims={"h": 4, "d_h": 8})
    assert_clean(declared)
    assert declared.data["dims"]["h"] == 4
    from tests.conftest import run_checks

    spec = {"source": "python", "factory": "tests.test_ledger_third_party:TextbookGPT", "dims": {"h": 4, "d_ff": 128}}
    result = run_checks(spec, ["shape-ledger"]).result("shape-ledger")
    assert_clean(result)
    assert result.data["dims"]["d_ff"] == 128
    assert rows(result)["transformer.h.0.mlp.c_fc output"]["dims"] == ["B", "T", "d_ff"]


# =====================================================================================================================
# Planted bugs: still caught


def test_declared_head_count_contradicted_fails():
    """The user says 8 heads, the model runs 4: evidence against the declaration, not a guess of fwdcheck's."""
    result = ledger(TextbookGPT(), dims={"h": 8})
    assert result.status.value == "fail"
    assert {f.code for f in result.findings if f.status.value == "fail"} == {"FWD401"}


def test_heads_and_head_size_swapped_fail_against_declared_sizes():
    result = ledger(SDPAModel(lambda: SplitHeadsSwapped(32, 4, 4, 8)), dims={"h": 4, "d_h": 8})
    assert result.status.value == "fail"
    assert "FWD401" in {f.code for f in result.findings}
    assert rows(result)["layers.0.attn q"]["dims"] == ["B", "d_h", "T", "h"]


def test_missing_transpose_fails_without_any_config():
    result = ledger(SDPAModel(lambda: UntransposedSDPA(32, 4, 4, 8)))
    assert result.status.value == "fail"
    assert {"FWD402", "FWD401"} <= {f.code for f in result.findings}
    assert rows(result)["layers.0.attn q"]["dims"][:2] == ["B", "T"]


def test_missing_transpose_with_a_cache_fails_even_when_the_batch_is_fixed():
    result = ledger(MetaLlama(transpose=False))
    assert result.status.value == "fail"
    assert "FWD402" in {f.code for f in result.findings}


def test_softmax_over_the_queries_fails_on_eager_code():
    result = ledger(TextbookGPT(softmax_dim=-2))
    assert {f.code for f in result.findings if f.status.value == "fail"} == {"FWD403"}


def test_logits_narrower_than_the_vocabulary_fail():
    result = ledger(SDPAModel(lambda: FusedGQA(32, 4, 2, 8), vocab=96, padded_vocab=64), vocab_size=96)
    assert result.status.value == "fail"
    assert [f.code for f in result.findings if f.status.value == "fail"] == ["FWD401"]
    assert "logits" in result.findings[0].message
