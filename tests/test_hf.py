"""Hugging Face architectures built offline from tiny configs: the verdicts the compatibility table promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fwdcheck.config.schema import config_from_dict  # noqa: E402
from fwdcheck.errors import ModelLoadError  # noqa: E402
from fwdcheck.model.sources import load_model  # noqa: E402
from tests import compat  # noqa: E402
from tests.conftest import run_checks, statuses  # noqa: E402
from tests.doc_sections import ROOT  # noqa: E402


# The architecture sweep (every model of the compatibility table, each on every code path) is the slow tier; so is the
# table's test, which builds the same reports.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(compat.CASES))
def test_architecture_verdicts(name):
    spec, _, expected, pairing = compat.CASES[name]
    report = compat.report(name)
    assert statuses(report) == expected, [(r.name, r.findings) for r in report.results if r.status.value != "pass"]
    rope = report.result("rope")
    if pairing:
        assert rope.metrics["pairing"] == pairing
        assert rope.metrics["base"] == pytest.approx(10000.0, rel=0.01)  # read from the model, not assumed
    elif rope.status.value == "skip":
        assert "no rotary embedding" in rope.summary


@pytest.mark.slow
def test_readme_table_is_what_the_tests_verified():
    assert compat.documented_table() == compat.table(), (
        "run `python -m tests.compat --write` and commit docs/compatibility.md"
    )


@pytest.mark.slow
def test_hf_matrix_runs_every_code_path_by_default():
    report = compat.report("Llama (GQA)")
    rows = report.result("future-token").paths.rows
    labels = {r.path for r in rows}
    assert len(rows) == 2 * 2 * 3 * 2 + 1  # flex_attention only when code_paths names it; the train path
    assert rows[-1].path == "train mode, default attention, mask absent, B=2"
    assert "eager, mask left-pad, output_attentions=True, B=1" in labels
    assert "sdpa, mask ones, output_attentions=False, B=2" in labels


@pytest.mark.slow
def test_bert_is_bidirectional_by_design_on_every_path():
    """Read off BertSelfAttention.is_causal: no path reports a leak, and each says why the cuts were not judged."""
    result = compat.report("BERT (BertForMaskedLM)").result("future-token")
    assert {r.status.value for r in result.paths.rows} == {"pass"}
    assert not any(f.code == "FWD101" for f in result.findings)
    assert "bidirectional by design" in result.summary


def test_directory_with_weights_round_trips(tmp_path):
    """save_pretrained, then source: hf path: the weights are the saved ones and the verdicts the same."""
    spec = compat.CASES["Llama (GQA)"][0]
    built = load_model(config_from_dict({"model": spec})).module
    built.save_pretrained(tmp_path)
    loaded = load_model(config_from_dict({"model": {"source": "hf", "path": str(tmp_path)}}))
    for name, tensor in built.state_dict().items():
        assert torch.equal(tensor, loaded.module.state_dict()[name]), name
    assert any("weights loaded" in n for n in loaded.extra["notes"])
    report = run_checks({"source": "hf", "path": str(tmp_path)}, code_paths={"enabled": False})
    assert set(statuses(report).values()) == {"pass"}


def test_directory_without_weights_is_random_and_seeded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(compat.CASES["Qwen2"][0]["config"]))
    first = load_model(config_from_dict({"model": {"source": "hf", "path": str(tmp_path)}}))
    second = load_model(config_from_dict({"model": {"source": "hf", "path": str(tmp_path)}}))
    assert any("random initialisation" in n for n in first.extra["notes"])
    assert all(torch.equal(a, b) for a, b in zip(first.module.parameters(), second.module.parameters(), strict=True))


@pytest.mark.parametrize(
    "model, message",
    [
        ({"source": "hf", "path": "/no/such/dir"}, "no such directory"),
        ({"source": "hf", "config": {"model_type": "llama"}, "class": "NoSuchModel"}, "has no class 'NoSuchModel'"),
        ({"source": "hf", "config": {"model_type": "not-a-model"}}, "inline config"),
    ],
)
def test_load_errors_are_one_line(model, message):
    with pytest.raises(ModelLoadError, match=message) as error:
        load_model(config_from_dict({"model": model}))
    assert "\n" not in str(error.value)


def test_directory_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(config_from_dict({"model": {"source": "hf", "path": str(tmp_path)}}))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(config_from_dict({"model": {"source": "hf", "path": str(tmp_path)}}))


def test_load_is_offline_and_the_environment_restored(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    seen = {}
    import transformers

    original = transformers.AutoConfig.for_model

    def spy(*args, **kwargs):
        seen["offline"] = os.environ.get("HF_HUB_OFFLINE")
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "for_model", spy)
    load_model(config_from_dict({"model": compat.CASES["Qwen2"][0]}))
    assert seen["offline"] == "1"
    assert "HF_HUB_OFFLINE" not in os.environ


def test_trust_remote_code_is_said_in_the_report():
    report = run_checks({**compat.CASES["Qwen2"][0], "trust_remote_code": True}, ["shape-ledger"])
    assert any("trust_remote_code is on" in note for note in report.notes)


def test_rescaled_rope_declares_no_base():
    """llama3 / yarn rescale the frequencies: the base alone no longer describes them, so it is not compared."""
    spec = compat.hf(
        "llama",
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
        **compat.LLAMA_LIKE,
    )
    model = load_model(config_from_dict({"model": spec}))
    assert model.rope.base is None and model.rope.pairing is None  # a config states no pairing
    report = run_checks(spec, ["rope"])
    assert report.result("rope").status.value == "pass"


LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads the peak memory through Linux's /proc")
def test_meta_ledger_of_an_8b_config_stays_under_a_gigabyte(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    (tmp_path / "check.yaml").write_text("model: {source: hf, path: .}\ninputs: {batch_size: 2, seq_len: 16}\n")
    # The model loads in this script's own process (--in-process), whose peak is read from the kernel after
    # resetting it: a process forked from a large one (a pytest worker) inherits its high-water mark, which
    # getrusage would report.
    script = textwrap.dedent(f"""
        import json, re
        from typer.testing import CliRunner
        from fwdcheck.cli import app
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the high-water mark restarts from what is resident now
        result = CliRunner().invoke(app, ["run", {str(tmp_path / "check.yaml")!r}, "--meta", "--format", "json",
                                          "--in-process"])
        report = json.loads(result.stdout)
        peak_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
        print(json.dumps({{"exit": result.exit_code, "peak_kib": peak_kib, "report": report}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["exit"] == 0
    assert measured["peak_kib"] < 1024 * 1024  # under 1 GiB for a 32 GB-in-float32 model
    checks = {c["name"]: c for c in measured["report"]["checks"]}
    assert checks["shape-ledger"]["status"] == "pass"
    assert {checks[n]["status"] for n in ("future-token", "mask-audit", "rope")} == {"skip"}
    assert "shrunk config" in checks["rope"]["summary"]
    entries = {e["name"]: e for e in checks["shape-ledger"]["data"]["entries"]}
    assert entries["model.layers.31.self_attn k"]["shape"] == [2, 8, 16, 128]
    assert entries["model.layers.31.self_attn k"]["dims"] == ["B", "h_kv", "T", "d_h"]
    assert entries["logits"]["dims"] == ["B", "T", "V"] and entries["logits"]["shape"] == [2, 16, 128256]


@pytest.mark.slow
def test_falcon_output_attentions_path_leaks_exactly_where_plain_torch_says_it_does():
    """fwdcheck flags exactly the Falcon cells whose path leaks by a direct measurement in plain torch: the
    output_attentions=True cells where transformers ignores the causal mask there (up to 5.24), none where not."""
    leaks = compat.falcon_leaks(8)
    assert not leaks[False]  # the default path of every release is causal
    report = run_checks(compat.FALCON, ["future-token", "shape-ledger"])
    rows = report.result("future-token").paths.rows
    flagged = {r.path for r in rows if "FWD101" in r.codes}
    assert flagged == {r.path for r in rows if leaks["output_attentions=True" in r.path]}
    assert report.result("shape-ledger").status.value == "pass"  # multi-query: k and v have one head (h_kv=1)


def test_sliding_window_wider_than_the_naming_pass_is_named_right():
    """The ledger's small second pass is shorter than the window: the model takes another code path there (no
    window mask, kv heads not repeated). Axes are still named from the sizes, without a false FWD401."""
    spec = compat.hf("mistral", num_key_value_heads=2, sliding_window=8, **compat.LLAMA_LIKE)
    report = run_checks(spec, inputs={"batch_size": 2, "seq_len": 16}, code_paths={"enabled": False})
    assert set(statuses(report).values()) == {"pass"}
    assert "restricted" in report.result("mask-audit").summary


def test_longrope_attention_factor_is_divided_out():
    """Phi-3 longrope scales cos and sin by an attention factor: a uniform scale, not a broken rotation."""
    spec = compat.hf(
        "phi3",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.1, 2.2, 2.3]},
    )
    result = run_checks(spec, ["rope"]).result("rope")
    assert result.status.value == "pass", result.findings
    assert result.data["component_scale"] == pytest.approx(1.2247, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted((ROOT / "sample_configs" / "hf").glob("*.yaml")), ids=lambda p: p.name)
def test_hf_sample_configs_pass(config):
    from typer.testing import CliRunner

    from fwdcheck.cli import app

    result = CliRunner().invoke(app, ["run", str(config), "--format", "json"])
    assert result.exit_code == 0, result.output
    statuses_by_check = {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}
    assert statuses_by_check["shape-ledger"] == "pass"
