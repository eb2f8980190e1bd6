"""packing: documents packed in one row read only themselves, at restarting positions, the way the model offers it:
the reference model's document_ids (planted bugs), Hugging Face causal LMs (restarting position_ids or a 4-D mask),
and a python model declaring its document mask in the config."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fwdcheck.config.registry import CheckEntry
from tests.conftest import run_checks
from tests.models import GPT, Block, CausalSelfAttention, GPTConfig

CHECK = "fwdcheck.checks.packing:Packing"


def result(model: dict, **top):
    return run_checks(model, [CHECK], **top).results[0]


def codes_of(got) -> set[str]:
    return {f.code for f in got.findings}


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"positional": "learned"},
        {"mask": "is_causal"},
        {"mask": "float"},
        {"attention": "eager"},
        {"n_kv_heads": 1},
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_packed_path_passes(reference, variant, dtype):
    got = result(reference(**variant), dtype=dtype, inputs={"batch_size": 2, "seq_len": 16})
    assert got.status.value == "pass", (got.summary, got.findings)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_no_document_mask_leaks(reference, attention):
    got = result(reference(bugs=["packing-no-document-mask"], attention=attention))
    assert got.status.value == "fail"
    assert codes_of(got) == {"FWD601"}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_positions_not_reset_with_learned_positions_fails(reference, attention):
    got = result(reference(bugs=["packing-positions-not-reset"], positional="learned", attention=attention))
    assert got.status.value == "fail"
    assert codes_of(got) == {"FWD602"}
    assert got.metrics["leak"] == 0.0  # isolated, but at the wrong positions


def test_positions_not_reset_are_invisible_to_rotary_positions(reference):
    """Rotary scores depend on n - m only: isolated documents at shifted positions give the same logits."""
    got = result(reference(bugs=["packing-positions-not-reset"]))
    assert got.status.value == "pass"


def test_packing_bugs_leave_the_unpacked_path_alone(reference):
    for bug in ("packing-no-document-mask", "packing-positions-not-reset"):
        report = run_checks(reference(bugs=[bug], positional="learned"))
        assert {r.name for r in report.results if r.status.value not in ("pass", "skip")} == {"packing"}, bug


@pytest.mark.parametrize(
    "name",
    ["GPT-2", "Llama (GQA)", "Mistral (sliding window 4)", "Qwen2", "Gemma (MQA)", "GPT-J (interleaved rotary)", "OPT"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hugging_face_causal_lms_pass(name, dtype):
    pytest.importorskip("transformers")
    from tests import compat

    got = result(compat.CASES[name][0], dtype=dtype, code_paths={"enabled": False})
    assert got.status.value == "pass", (got.summary, got.findings)
    # transformers 5 finds packed documents from restarting position_ids where the mask builder is handed them;
    # OPT's is not, so it gets a 4-D mask.
    assert ("4-D" in got.data["way"]) == (name == "OPT")


def test_hugging_face_masked_lm_skips():
    pytest.importorskip("transformers")
    from tests import compat

    got = result(compat.CASES["BERT (BertForMaskedLM)"][0], code_paths={"enabled": False})
    assert got.status.value == "skip"


# ---------------------------------------------------------------------------------------------------------------------
# A python model that declares its document mask: nanoGPT with doc_mask [B, 1, T, T] (True = may attend) and
# position_ids, declared as `packing: {argument: doc_mask, form: mask, position_ids: true}`.


class DocMaskAttention(CausalSelfAttention):
    def __init__(self, cfg: GPTConfig, forget_mask: bool = False):
        super().__init__(cfg)
        self.forget_mask = forget_mask

    def forward(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.heads(x)  # (B, nh, T, hs)
        if doc_mask is None or self.forget_mask:  # the bug: the packed path still calls is_causal=True alone
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=doc_mask)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class DocMaskBlock(Block):
    def forward(self, x, doc_mask=None):
        x = x + self.attn(self.ln_1(x), doc_mask)
        return x + self.mlp(self.ln_2(x))


class PackedGPT(GPT):
    def __init__(self, forget_mask: bool = False):
        super().__init__(GPTConfig(), DocMaskAttention, block=DocMaskBlock, forget_mask=forget_mask)

    def forward(self, input_ids, position_ids=None, doc_mask=None):
        B, T = input_ids.size()
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None]  # (1, T)
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        for block in self.h:
            x = block(x, doc_mask)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def packed_gpt(forget_mask: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return PackedGPT(forget_mask)


def declared(**kwargs) -> dict:
    return {
        "source": "python",
        "factory": "tests.test_packing:packed_gpt",
        "kwargs": kwargs,
        "packing": {"argument": "doc_mask", "form": "mask", "position_ids": True},
    }


def test_declared_document_mask_passes():
    got = result(declared())
    assert got.status.value == "pass", (got.summary, got.findings)
    assert "declared in the config" in got.data["way"]


def test_declared_document_mask_ignored_fails():
    got = result(declared(forget_mask=True))
    assert codes_of(got) == {"FWD601"}


def test_declared_without_restarting_positions_fails():
    """The model needs position_ids from the caller; declared as restarting them itself, the positions continue."""
    spec = declared()
    spec["packing"]["position_ids"] = False
    got = result(spec)
    assert codes_of(got) == {"FWD602"}


def test_model_offering_no_isolation_skips():
    got = result({"source": "python", "factory": "tests.test_packing:packed_gpt"})
    assert got.status.value == "skip"
    assert "offers no way to isolate packed documents" in got.summary


def test_short_rows_skip(reference):
    got = result(reference(), inputs={"batch_size": 2, "seq_len": 4})
    assert got.status.value == "skip"


def test_packed_rows_are_a_few_tokens_and_longer_than_a_declared_window(reference):
    """Eight tokens at any seq_len (documents of 2, 3 and 3); with a window of 4, documents 2 and 3 of 5 tokens, one
    past the band, so that the window runs over packed documents."""
    got = result(reference(), inputs={"batch_size": 2, "seq_len": 32})
    assert got.status.value == "pass", got.summary
    assert got.data["documents"] == {"document 1": [0, 2], "document 2": [2, 5], "document 3": [5, 8]}
    windowed = result(reference(window=4), inputs={"batch_size": 2, "seq_len": 32})
    assert windowed.status.value == "pass", windowed.summary
    assert windowed.data["documents"] == {"document 1": [0, 1], "document 2": [1, 6], "document 3": [6, 11]}
    leaking = result(reference(window=4, bugs=["packing-no-document-mask"]), inputs={"batch_size": 2, "seq_len": 32})
    assert {f.code for f in leaking.findings} == {"FWD601"}
    # a window rows of 16 cannot hold two documents past: nothing to show, the rows stay at 8
    wide = result(reference(window=8), inputs={"batch_size": 2, "seq_len": 16})
    assert wide.data["documents"]["document 3"] == [5, 8]


def test_registered_in_pyproject():
    entries = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["entry-points"]
    check = CheckEntry("packing", entries["fwdcheck.checks"]["packing"], "fwdcheck 0.1.0").load()
    assert check.name == "packing" and check.default is True and "packed documents" in check.applies_when
    assert set(check.codes) == {"FWD601", "FWD602", "FWD603", "FWD604"}
