"""backends: eager and SDPA attention, and SDPA's kernels, give the same logits; a scale or mask written differently on
one path fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from tests.conftest import codes, run_checks

CHECK = "fwdcheck.checks.backends:Backends"
NO_PATHS = {"enabled": False}  # the code-path matrix is another check's business: keep these runs to one path


def hf_spec(model_type: str, **fields) -> dict:
    from tests import compat

    return compat.hf(model_type, **{**compat.LLAMA_LIKE, **fields})


def result(report):
    return report.results[0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_reference_model_passes_both_ways_round(reference, attention):
    r = result(run_checks(reference(attention=attention), [CHECK]))
    assert r.status.value == "pass", r.findings
    assert set(r.data["implementations"]["compared"]) == {"sdpa", "eager"}
    assert r.data["implementations"]["default"] == attention
    assert r.data["kernels_ran"]["math"] == 2 and r.data["kernels_ran"]["flash"] == 2  # both run on CPU
    assert "left_padding" in r.data["implementations"]  # the reference forward takes no attention_mask: said so


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_eager_scale_one_over_d_fails_in_every_dtype(reference, dtype):
    report = run_checks(reference(bugs=["eager-scale-1-over-d"]), [CHECK], dtype=dtype)
    r = result(report)
    assert r.status.value == "fail"
    assert codes(report, "backends") == {"FWD801"}
    assert "eager and sdpa" in r.findings[0].message
    assert report.exit_code == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_clean_model_passes(reference, dtype):
    assert result(run_checks(reference(), [CHECK], dtype=dtype)).status.value == "pass"


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("llama", {"num_key_value_heads": 2}),
        ("mistral", {"num_key_value_heads": 2, "sliding_window": 4}),
        ("qwen2", {"num_key_value_heads": 2}),
        ("gemma", {"num_key_value_heads": 1, "head_dim": 8}),
    ],
)
def test_hf_models_pass_with_left_padding(model_type, fields):
    r = result(run_checks(hf_spec(model_type, **fields), [CHECK], code_paths=NO_PATHS))
    assert r.status.value == "pass", r.findings
    assert r.data["implementations"]["left_padding"] == 3
    assert set(r.data["padded_changes"]) == {"eager"}
    assert "flex_attention not run" in r.data["flex_attention"]


def test_hf_llama_bfloat16_passes():
    assert (
        result(
            run_checks(hf_spec("llama", num_key_value_heads=2), [CHECK], code_paths=NO_PATHS, dtype="bfloat16")
        ).status.value
        == "pass"
    )


def test_gpt2_passes():
    from tests import compat

    assert result(run_checks(compat.CASES["GPT-2"][0], [CHECK], code_paths=NO_PATHS)).status.value == "pass"


def test_eager_path_that_ignores_the_padding_mask_fails_on_padded_rows_only(monkeypatch):
    """The eager function builds its own causal mask and drops the one it was given: without padding both agree,
    with left padding the real tokens read the pads on the eager path."""
    import transformers.models.llama.modeling_llama as llama

    original = llama.eager_attention_forward

    def own_causal_mask(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        L, S = query.shape[-2], key.shape[-2]
        causal = torch.full((L, S), float("-inf"), dtype=query.dtype).triu(1)  # the padding mask is lost
        return original(module, query, key, value, causal[None, None], scaling, dropout, **kwargs)

    monkeypatch.setattr(llama, "eager_attention_forward", own_causal_mask)
    report = run_checks(hf_spec("llama", num_key_value_heads=2), [CHECK], code_paths=NO_PATHS)
    assert result(report).status.value == "fail"
    assert codes(report, "backends") == {"FWD802"}
    assert "left-padded by 3" in result(report).findings[0].message


def test_a_kernel_that_differs_from_math_fails(reference, monkeypatch):
    """No kernel of this torch is wrong on CPU: the flash kernel's output is perturbed to show the verdict."""
    from fwdcheck.checks import backends

    replay = backends._replay

    def off_by_a_little(arguments, backend):
        out = replay(arguments, backend)
        return out + 1e-2 if out is not None and backend == backends.SDPBackend.FLASH_ATTENTION else out

    monkeypatch.setattr(backends, "_replay", off_by_a_little)
    report = run_checks(reference(), [CHECK])
    assert codes(report, "backends") == {"FWD803"}
    assert "flash kernel differs from the math kernel" in result(report).findings[0].message


class EagerOnly(nn.Module):
    """A python model with one attention path and no switch: SDPA kernels are still compared."""

    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids):
        B, T = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (B, h, T, hs) each
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            y = scores.softmax(-1) @ v
        return self.head(y.transpose(1, 2).reshape(B, T, 16))


def test_python_model_without_switch_compares_kernels_only():
    r = fwdcheck.check_model(EagerOnly(sdpa=True), [CHECK]).results[0]
    assert r.status.value == "pass"
    assert "no attention switch" in r.data["implementations"]
    assert "SDPA kernels math vs flash" in r.summary


def test_python_model_without_sdpa_or_switch_skips():
    r = fwdcheck.check_model(EagerOnly(sdpa=False), [CHECK]).results[0]
    assert r.status.value == "skip"
    assert "no attention switch" in r.summary and "no scaled_dot_product_attention call" in r.summary


def test_switch_is_put_back(reference):
    from fwdcheck.config.registry import select
    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.model.sources import load_model
    from fwdcheck.run.runner import run_model
    from fwdcheck.run.settings import Settings

    config = config_from_dict({"model": reference(attention="eager"), "inputs": {"batch_size": 2, "seq_len": 8}})
    model = load_model(config)
    run_model(model, Settings.from_config(config), select([CHECK]))
    assert model.module.config.attention == "eager"


def test_registered_and_default_where_it_applies():
    from fwdcheck.config.registry import available, info

    entry = available()["backends"]
    assert info(entry).default and "attention switch" in info(entry).applies_when
    assert set(info(entry).codes) == {"FWD801", "FWD802", "FWD803"}
