"""flex_attention observed and judged: models that compute attention with torch's
torch.nn.attention.flex_attention.flex_attention and a BlockMask (or a score_mod), as torchtitan, attention-gym and
modded-nanogpt build them, on the CPU, where flex_attention runs unfused.

The observer reads the kernel call flex_attention ends in, without disturbing the compilation flex_attention does
for itself; mask-audit evaluates the BlockMask's mask_mod at every (batch, head, query, key) index the call covers
and the score_mod on a probe of scores. Both ways: causal, sliding-window and document masks (and a causal
score_mod) pass every check; a window shifted one token into the future, a document mask that lets a document read
the next, and a score_mod off by one fail mask-audit and future-token; a strict causal mask (q > kv) fails mask-audit;
a BlockMask built for fewer tokens than the call is FWD209 at the kernel, the model's own error through flex_attention.

Shapes: B (batch), T (sequence), nh (heads), hs (head size), C (width).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fwdcheck

flex = pytest.importorskip("torch.nn.attention.flex_attention")

# flex_attention compiles its kernels as it first meets a mask: seconds a test, the slow tier as a whole.
pytestmark = pytest.mark.slow

VOCAB, WIDTH, HEADS, LAYERS, WINDOW, DOCUMENT, PREFIX = 32, 16, 2, 2, 3, 5, 4


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def window_one_ahead(b, h, q_idx, kv_idx):  # the band shifted by one: each query reads the next token
    return (kv_idx <= q_idx + 1) & (q_idx - kv_idx < WINDOW)


def strict_causal(b, h, q_idx, kv_idx):  # > where >= is meant: no query reads itself, the first reads nothing
    return q_idx > kv_idx


def documents(b, h, q_idx, kv_idx):  # documents of DOCUMENT tokens packed in a row, causal within each
    return (q_idx // DOCUMENT == kv_idx // DOCUMENT) & (q_idx >= kv_idx)


def document_reads_next(b, h, q_idx, kv_idx):  # the next document's tokens are opened too
    same = (q_idx // DOCUMENT == kv_idx // DOCUMENT) & (q_idx >= kv_idx)
    return same | (kv_idx // DOCUMENT == q_idx // DOCUMENT + 1)


def prefix_lm(b, h, q_idx, kv_idx):  # the first PREFIX tokens read each other both ways, the rest causally
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def causal_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


def causal_score_one_ahead(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx + 1 >= kv_idx, score, -float("inf"))


MASKS = {
    "causal": causal,
    "sliding-window": sliding_window,
    "documents": documents,
    "window-one-ahead": window_one_ahead,
    "strict-causal": strict_causal,
    "document-reads-next": document_reads_next,
    "prefix-lm": prefix_lm,
}
SCORE_MODS = {"causal-score": causal_score, "score-one-ahead": causal_score_one_ahead}


class FlexAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, block_mask, score_mod):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
        y = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class FlexModel(nn.Module):
    """Learned positions, LAYERS blocks of flex attention; `mask` names a mask_mod or a score_mod above."""

    def __init__(self, mask: str = "causal"):
        super().__init__()
        torch.manual_seed(0)
        self.mask = mask
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(64, WIDTH)
        self.blocks = nn.ModuleList(FlexAttention() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        block_mask, score_mod = None, SCORE_MODS.get(self.mask)
        if self.mask in MASKS:  # built for this call's length, as create_block_mask is meant to be used
            block_mask = flex.create_block_mask(MASKS[self.mask], None, None, T, T, device=input_ids.device)
        x = self.embed(input_ids) + self.positions(torch.arange(T, device=input_ids.device))  # (B, T, C)
        for block in self.blocks:
            x = x + block(x, block_mask, score_mod)
        return self.head(x)


def run(mask: str):
    report = fwdcheck.check_model(FlexModel(mask), vocab_size=VOCAB, seq_len=12)
    return {r.name: r for r in report.results}


def codes(result) -> set[str]:
    return {f.code for f in result.findings if f.status.value in ("fail", "warn")}


@pytest.mark.parametrize("mask", ["causal", "sliding-window", "documents", "causal-score"])
def test_correct_flex_masks_pass_every_check(mask):
    results = run(mask)
    for name in ("shape-ledger", "future-token", "mask-audit"):
        assert results[name].status.value == "pass", (name, results[name].summary)
    audit = results["mask-audit"]
    rows = audit.data["calls"]
    assert rows and all(r["api"] == "flex" and r["judged"] for r in rows)
    assert audit.metrics["judged_calls"] == len(rows)


@pytest.mark.parametrize(
    ("mask", "audit_codes", "leaks"),
    [
        ("window-one-ahead", {"FWD204"}, True),
        ("document-reads-next", {"FWD204"}, True),
        ("score-one-ahead", {"FWD204"}, True),
        ("strict-causal", {"FWD205", "FWD210"}, False),
    ],
)
def test_wrong_flex_masks_fail(mask, audit_codes, leaks):
    results = run(mask)
    audit = results["mask-audit"]
    assert audit.status.value == "fail", audit.summary
    assert codes(audit) == audit_codes
    assert all(f.source and f.source.startswith("tests/test_flex_attention.py:") for f in audit.findings)
    # future-token sees every mask that reads the future; a query that reads nothing reads no future either
    assert results["future-token"].status.value == ("fail" if leaks else "pass"), results["future-token"].summary


def test_a_prefix_lm_mask_is_judged_as_sdpa_would_be():
    """A prefix-LM mask is right for a prefix-LM and not causal: its prefix tokens read the prefix tokens after them.
    mask-audit says which (the queries before the prefix's end), exactly as for the same mask handed to SDPA, and
    future-token sees the same reads."""
    results = run("prefix-lm")
    audit = results["mask-audit"]
    assert codes(audit) == {"FWD204"}, audit.summary
    row = audit.data["calls"][0]
    expected = [[int(kv < PREFIX or q >= kv) for kv in range(12)] for q in range(12)]
    assert row["may_read"] == expected
    assert results["future-token"].status.value == "fail"


def test_the_mask_is_read_exactly_not_by_blocks():
    """At 12 tokens every mask lies in one 128 x 128 block: the block-level view would open everything. The may-read
    set is the mask_mod's, entry for entry."""
    results = run("sliding-window")
    row = results["mask-audit"].data["calls"][0]
    expected = flex.create_mask(sliding_window, 1, 1, 12, 12, device="cpu")[0, 0].int().tolist()
    assert row["may_read"] == expected
    assert "mask_mod sliding_window" in row["values"]


class BlockMaskBuiltOnce(FlexModel):
    """A causal BlockMask built once, for `built_for` tokens, and handed to every call whatever its length: through
    flex_attention (which refuses other lengths itself) or straight to the kernel it ends in (which does not: a
    fused kernel then reads only the blocks the mask was built for)."""

    def __init__(self, built_for: int, to_the_kernel: bool):
        super().__init__("causal")
        self.block_mask = flex.create_block_mask(causal, None, None, built_for, built_for, device="cpu")
        self.to_the_kernel = to_the_kernel

    def forward(self, input_ids):
        from torch._higher_order_ops.flex_attention import flex_attention as flex_kernel

        B, T = input_ids.shape
        x = self.embed(input_ids) + self.positions(torch.arange(T))  # (B, T, C)
        for block in self.blocks:
            q, k, v = block.qkv(x).view(B, T, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
            if self.to_the_kernel:
                y = flex_kernel(q, k, v, flex._identity, self.block_mask.as_tuple(), q.shape[-1] ** -0.5, {})[0]
            else:
                y = flex.flex_attention(q, k, v, block_mask=self.block_mask)  # (B, nh, T, hs)
            x = x + block.proj(y.transpose(1, 2).reshape(B, T, WIDTH))
        return self.head(x)


@pytest.mark.parametrize(("built_for", "status"), [(12, "pass"), (8, "fail")])
def test_a_block_mask_for_other_lengths_handed_to_the_kernel_fails(built_for, status):
    """The unfused kernel evaluates the mask_mod everywhere, so the logits are right on the CPU (future-token
    passes); the lengths the BlockMask was built for are what tells."""
    model = BlockMaskBuiltOnce(built_for, to_the_kernel=True)
    report = fwdcheck.check_model(model, vocab_size=VOCAB, seq_len=12, code_paths={"train": False})
    audit = report.result("mask-audit")
    assert audit.status.value == status, audit.summary
    assert codes(audit) == ({"FWD209"} if status == "fail" else set())
    if status == "fail":
        assert "built for 8 queries over 8 keys, but the call has 12 over 12" in audit.findings[0].message
    assert report.result("future-token").status.value == "pass"
    # The train path's cell runs 8 tokens: a mask built once for 12 and reused there is told as well
    (train,) = fwdcheck.check_model(model, vocab_size=VOCAB, seq_len=12).result("mask-audit").paths.rows
    assert train.codes == (() if built_for == 8 else ("FWD209",)), train


def test_a_block_mask_for_a_shorter_length_is_the_models_own_error():
    """flex_attention refuses a BlockMask built for fewer tokens than the call: the model raises on its own, and is
    told so with torch's words, never passed and never taken for fwdcheck's failure."""
    report = fwdcheck.check_model(BlockMaskBuiltOnce(8, to_the_kernel=False), vocab_size=VOCAB, seq_len=12)
    for name in ("shape-ledger", "future-token", "mask-audit"):
        result = report.result(name)
        assert result.status.value == "error" and {f.code for f in result.findings} == {"FWD002"}, result.summary
        assert "block_mask was created for block_mask.shape=(1, 1, 8, 8)" in result.summary


# -- observation never blames the model for what observation does ---------------------------------------------------


@torch.compile(backend="eager", fullgraph=True)
def compiled_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class CompiledAttentionModel(FlexModel):
    """Attention in a torch.compile'd function (fullgraph, as flex_attention compiles itself): observed as it runs
    eagerly, so the SDPA call inside is seen and judged."""

    def forward(self, input_ids):
        B, T = input_ids.shape
        x = self.embed(input_ids) + self.positions(torch.arange(T))  # (B, T, C)
        for block in self.blocks:
            q, k, v = block.qkv(x).view(B, T, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
            x = x + block.proj(compiled_attention(q, k, v).transpose(1, 2).reshape(B, T, WIDTH))
        return self.head(x)


class RaisesUnderAnyMode(FlexModel):
    """Runs untouched, refuses to run under a torch function mode: what raises under observation is the
    observation's doing, however it comes about."""

    def forward(self, input_ids):
        if torch._C._is_torch_function_mode_enabled():
            raise RuntimeError("not under a torch function mode")
        return super().forward(input_ids)


def test_compiled_attention_is_observed_and_judged():
    results = {r.name: r for r in fwdcheck.check_model(CompiledAttentionModel(), vocab_size=VOCAB).results}
    audit = results["mask-audit"]
    assert audit.status.value == "pass", audit.summary
    assert [r["api"] for r in audit.data["calls"]][:LAYERS] == ["sdpa"] * LAYERS
    assert results["shape-ledger"].status.value == "pass"


def test_a_model_that_raises_only_under_observation_is_not_blamed():
    results = {r.name: r for r in fwdcheck.check_model(RaisesUnderAnyMode(), vocab_size=VOCAB).results}
    assert results["future-token"].status.value == "pass"  # untouched forwards: the model runs
    # attention-stats and backends record SDPA's calls under a torch function mode of their own: the same refusal
    for name in ("shape-ledger", "mask-audit", "attention-stats", "backends"):
        codes_here = {f.code for f in results[name].findings}
        assert results[name].status.value == "error" and codes_here == {"FWD003"}, (name, results[name].summary)
        assert "broke a forward that runs untouched" in results[name].summary  # the observer's or the recorder's


def test_recording_sdpa_on_a_longer_row_that_breaks_the_model_is_not_blamed_on_it():
    """A declared window wider than the short row gives backends a recorded row of its own: a model that refuses to
    run under the recorder (a torch function mode) there is fwdcheck's failure too, not the model's error."""
    result = fwdcheck.check_model(RaisesUnderAnyMode(), ["backends"], vocab_size=VOCAB, window=12, seq_len=32)
    backends = result.results[0]
    assert backends.status.value == "error" and {f.code for f in backends.findings} == {"FWD003"}, backends.summary
    assert "recording SDPA's calls broke a forward that runs untouched" in backends.summary


# -- transformers' flex_attention path, in the code-path matrix ---------------------------------------------------


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


WITH_FLEX = {"attn_implementation": ["eager", "sdpa", "flex_attention"]}


def flex_rows(result):
    return [r for r in result.paths.rows if r.path.startswith("flex_attention")]


def test_transformers_flex_path_runs_only_when_named():
    report = fwdcheck.check_model(tiny_llama(), checks=["mask-audit"])
    assert not flex_rows(report.result("mask-audit"))


def test_transformers_flex_path_joins_the_matrix_and_passes():
    report = fwdcheck.check_model(tiny_llama(), checks=["future-token", "mask-audit"], code_paths=WITH_FLEX)
    for result in report.results:
        rows = flex_rows(result)
        assert len(rows) == 3 and {r.status.value for r in rows} == {"pass"}, (result.name, rows)
        assert result.status.value == "pass"


def test_transformers_flex_path_that_drops_the_mask_fails_there(monkeypatch):
    """The flex_attention function registered in transformers' attention registry, with the mask dropped: only the
    flex_attention cells take it, and only they fail."""
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def mask_dropped(module, query, key, value, attention_mask, **kwargs):
        return flex_attention_forward(module, query, key, value, None, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flex_attention", mask_dropped)
    report = fwdcheck.check_model(tiny_llama(), checks=["future-token", "mask-audit"], code_paths=WITH_FLEX)
    audit = report.result("mask-audit")
    assert audit.status.value == "fail"
    failing = {r.path for r in audit.paths.rows if r.status.value == "fail"}
    assert failing == {r.path for r in flex_rows(audit)}
    # every key read, the padding keys of the left-padded cell among them
    assert {f.code for f in audit.findings if f.status.value == "fail"} == {"FWD201", "FWD208"}
    assert report.result("future-token").status.value == "fail"


def test_gradient_checks_skip_flex_attention_without_a_backward_on_the_cpu():
    """torch's flex_attention has no backward on the CPU: the environment's limit, not the model's bug. grad-causality
    and grad-reach skip saying so, as the train path's cell runs on without gradients; the run exits 0."""
    if torch.cuda.is_available():
        pytest.skip("flex_attention has a backward on this machine's GPU")
    checks = ["future-token", "mask-audit", "grad-causality", "grad-reach"]
    report = fwdcheck.check_model(FlexModel("causal"), checks, vocab_size=VOCAB, seq_len=12)
    for check in ("grad-causality", "grad-reach"):
        result = report.result(check)
        assert result.status.value == "skip", result.findings
        assert "FlexAttention does not support backward on CPU" in result.summary and "environment" in result.summary
    assert report.exit_code == 0, [(r.name, r.status.value) for r in report.results]
