"""Cross-attention told from self-attention by what the keys are computed from, not by argument names: queries from
the module's own hidden state and keys from another sequence it was handed (BLT's byte-to-patch attention) are not
judged as causal self-attention; keys from its own hidden state are, whatever else the module takes. A real leak
through cross-attention (a memory holding future tokens) still fails future-token."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fwdcheck import check_model

D, H, V = 16, 2, 32


class CrossAttention(nn.Module):
    """Queries from `stream`, keys and values from `memory` (a name fwdcheck does not know), eager softmax."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, stream: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        B, L, _ = stream.shape
        S = memory.shape[1]
        q = self.q(stream).view(B, L, H, D // H).transpose(1, 2)  # (B, H, L, d_h)
        k = self.k(memory).view(B, S, H, D // H).transpose(1, 2)  # (B, H, S, d_h)
        v = self.v(memory).view(B, S, H, D // H).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5  # (B, H, L, S)
        # Query i reads slots j >= S - 1 - i: the memory is newest first (slot S - 1 - t summarises bytes 0..t).
        i, j = torch.arange(L, device=stream.device)[:, None], torch.arange(S, device=stream.device)[None]
        scores = scores.masked_fill(j < S - 1 - i, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D)


class SelfAttentionWithResidual(nn.Module):
    """Self-attention handed its hidden state and the residual beside it: q and k both from the hidden state."""

    def __init__(self, causal: bool):
        super().__init__()
        self.qkv, self.causal = nn.Linear(D, 3 * D), causal

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d_h)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
        if self.causal:
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return residual + (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)


class PatchModel(nn.Module):
    """Bytes read a memory of running summaries kept newest first, as a square [T, T] attention: byte i reads the
    summaries of bytes 0..t for t <= i, which sit at slots j >= T - 1 - i, so most slots it reads lie past i. Causal
    all the same, as BLT's byte-to-patch attention is. `ahead` summaries reach that many bytes further: a leak."""

    def __init__(self, ahead: int = 0, self_causal: bool = True):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.ahead = ahead
        self.own = SelfAttentionWithResidual(self_causal)
        self.cross = CrossAttention()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, D)
        T = ids.shape[1]
        running = x.cumsum(1) / torch.arange(1, T + 1, device=ids.device)[None, :, None]  # (B, T, D): causal means
        reach = [min(t + self.ahead, T - 1) for t in range(T)]
        memory = running[:, reach].flip(1)  # (B, T, D): slot T - 1 - t summarises bytes 0..t (+ ahead)
        x = self.own(x, x.clone())
        return self.head(x + self.cross(x, memory))


def run(model: nn.Module):
    return check_model(model.eval(), ["mask-audit", "future-token", "shape-ledger"], vocab_size=V)


def statuses(report) -> dict[str, str]:
    return {r.name: r.status.value for r in report.results}


def test_cross_attention_to_causal_patches_is_not_judged_as_self_attention():
    torch.manual_seed(0)
    report = run(PatchModel())
    assert statuses(report) == {"mask-audit": "pass", "future-token": "pass", "shape-ledger": "pass"}, [
        (r.name, r.findings) for r in report.results
    ]


def test_a_memory_holding_future_tokens_still_fails_future_token():
    torch.manual_seed(0)
    report = run(PatchModel(ahead=1))
    assert report.result("future-token").status.value == "fail"


def test_self_attention_handed_a_second_tensor_is_still_judged():
    torch.manual_seed(0)
    report = run(PatchModel(self_causal=False))
    result = report.result("mask-audit")
    assert result.status.value == "fail"
    assert {"FWD201", "FWD204"} & {f.code for f in result.findings if f.status.value == "fail"}
    assert any("own" in (f.where or "") for f in result.findings)


@pytest.mark.parametrize("name", ["memory", "encoder_hidden_states"])
def test_the_keys_source_decides_whatever_its_name(name):
    """The same cross-attention with its memory argument named as transformers names an encoder's output."""
    torch.manual_seed(0)
    model = PatchModel()
    if name != "memory":
        forward = model.cross.forward

        def renamed(stream, encoder_hidden_states):
            return forward(stream, encoder_hidden_states)

        model.cross.forward = renamed
    assert run(model).result("mask-audit").status.value == "pass"


# BLT at small sizes: a byte encoder and decoder cross-attending to patches, a global transformer over the patches.
BLT_PART = dict(
    hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, head_dim=16, num_hidden_layers=1
)
BLT = {
    "source": "hf",
    "config": {
        "model_type": "blt",
        "vocab_size": 260,
        "use_cache": False,  # transformers 5.25 BLT cannot make its own cache from this config
        "max_position_embeddings": 128,
        "encoder_hash_byte_group_vocab": 64,
        "patcher_config": {**BLT_PART, "num_hidden_layers": 2, "max_position_embeddings": 128},
        "encoder_config": {**BLT_PART, "hidden_size_global": 32, "max_position_embeddings": 128},
        "decoder_config": {
            **BLT_PART,
            "hidden_size_global": 32,
            "num_hidden_layers": 2,
            "max_position_embeddings": 128,
        },
        "global_config": {**BLT_PART, "num_hidden_layers": 2, "max_position_embeddings": 128},
    },
}


@pytest.mark.slow
def test_blt_byte_to_patch_cross_attention_is_not_judged_as_causal_self_attention():
    pytest.importorskip("transformers")
    from tests.conftest import run_checks

    report = run_checks(BLT, ["mask-audit", "shape-ledger"])
    mask = report.result("mask-audit")
    assert "FWD204" not in {f.code for f in mask.findings}, mask.findings
    assert report.result("shape-ledger").status.value == "pass", report.result("shape-ledger").findings
