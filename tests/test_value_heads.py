"""Value heads narrower than query/key heads (multi-head latent attention, DeepSeek V2/V3: v_head_dim differs from
qk_nope_head_dim + qk_rope_head_dim): the shape ledger names the value width d_v apart from d_h, read from the
config, declared in `dims:`, or read off the first v, and a correct model passes; a declared value width the
tensors contradict still fails.

Shapes: B (batch), T (sequence), d (width), h (heads), V (vocabulary).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck

VOCAB = 64


@dataclass
class MLAArgs:
    """The fields torchtitan's DeepSeek-V3 ModelArgs names its sizes by."""

    vocab_size: int = VOCAB
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 4
    v_head_dim: int = 6


class LatentAttention(nn.Module):
    """Queries and keys of qk_nope + qk_rope dims per head, values of v_head_dim: SDPA takes v narrower than q and
    k, and the output projection reads h x v_head_dim."""

    def __init__(self, args: MLAArgs):
        super().__init__()
        self.args = args
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * qk)
        self.wk = nn.Linear(args.dim, args.n_heads * qk)
        self.wv = nn.Linear(args.dim, args.n_heads * args.v_head_dim)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim)

    def forward(self, x):
        B, T, _ = x.shape
        h, qk, dv = self.args.n_heads, self.args.qk_nope_head_dim + self.args.qk_rope_head_dim, self.args.v_head_dim
        q = self.wq(x).view(B, T, h, qk).transpose(1, 2)  # (B, h, T, qk)
        k = self.wk(x).view(B, T, h, qk).transpose(1, 2)  # (B, h, T, qk)
        v = self.wv(x).view(B, T, h, dv).transpose(1, 2)  # (B, h, T, dv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, dv)
        return self.wo(y.transpose(1, 2).reshape(B, T, h * dv))  # (B, T, d)


class MLAModel(nn.Module):
    def __init__(self, with_config: bool = True):
        super().__init__()
        torch.manual_seed(0)
        args = MLAArgs()
        if with_config:
            self.config = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(LatentAttention(args) for _ in range(args.n_layers))
        self.output = nn.Linear(args.dim, args.vocab_size)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)  # (B, T, d)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(h)  # (B, T, V)


def ledger(model: nn.Module, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwdcheck.check_model(model, ["shape-ledger"], **kw).result("shape-ledger")


def v_rows(result) -> list[dict]:
    return [row for row in result.data["entries"] if row["name"].endswith(" v")]


@pytest.mark.ordinary
def test_mla_read_from_its_config_passes_with_d_v_apart_from_d_h():
    result = ledger(MLAModel())
    assert result.status.value == "pass", result.findings
    assert result.data["dims"]["d_h"] == 12 and result.data["dims"]["d_v"] == 6
    assert all(row["dims"][-1] == "d_v" for row in v_rows(result))


@pytest.mark.ordinary
def test_mla_declared_in_dims_passes():
    result = ledger(MLAModel(with_config=False), dims={"d": 32, "h": 4, "d_h": 12, "d_v": 6})
    assert result.status.value == "pass", result.findings


@pytest.mark.ordinary
def test_mla_value_width_read_off_the_tensors_when_nothing_states_it():
    result = ledger(MLAModel(with_config=False), dims={"d": 32, "h": 4, "d_h": 12})
    assert result.status.value == "pass", result.findings
    assert result.data["dims"]["d_v"] == 6


def test_a_declared_value_width_the_tensors_contradict_fails():
    result = ledger(MLAModel(with_config=False), dims={"d": 32, "h": 4, "d_h": 12, "d_v": 8})
    assert result.status.value == "fail"
    assert {f.code for f in result.findings} == {"FWD401"}


@pytest.mark.slow  # builds a transformers model
@pytest.mark.ordinary
def test_transformers_deepseek_v3_names_its_value_heads():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    result = ledger(DeepseekV3ForCausalLM(config).eval(), code_paths={"enabled": False})
    assert result.status.value == "pass", result.findings
    assert result.data["dims"]["d_v"] == 6
    assert all(row["dims"] == ["B", "h_kv", "T", "d_v"] for row in v_rows(result)), v_rows(result)
