"""Hugging Face models as people have them: a hub id read from the local cache (never downloaded), one line saying
how to fetch it when it is not there; an inline config key its config class does not know is refused with a
did-you-mean, while every spelling the class does take passes."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from fwdcheck.cli import app  # noqa: E402
from fwdcheck.config import hub_cache  # noqa: E402
from fwdcheck.config.schema import config_from_dict, load_config  # noqa: E402
from fwdcheck.errors import ConfigError, ModelLoadError  # noqa: E402
from fwdcheck.model.sources import load_model  # noqa: E402
from fwdcheck.model.sources.hf import refuse_unknown_keys  # noqa: E402
from tests import compat  # noqa: E402

runner = CliRunner()
HUB_ID = "acme-lab/Tiny-GPT2"
TINY_GPT2 = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)


def fake_cache(root, hub_id: str = HUB_ID, commit: str = "0123abcd", with_ref: bool = True):
    """The hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/config.json}, written by
    transformers itself (save_pretrained) into the snapshot."""
    from transformers import GPT2Config

    repository = root / f"models--{hub_id.replace('/', '--')}"
    snapshot = repository / "snapshots" / commit
    GPT2Config(**TINY_GPT2).save_pretrained(snapshot)
    if with_ref:
        (repository / "refs").mkdir(parents=True)
        (repository / "refs" / "main").write_text(commit)
    return snapshot


def config_file(tmp_path, path: str):
    config = tmp_path / "project" / "fwdcheck.yaml"
    config.parent.mkdir(exist_ok=True)
    config.write_text(f"model: {{source: hf, path: {path}}}\ninputs: {{batch_size: 2, seq_len: 8}}\n")
    return config


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
@pytest.mark.slow
def test_a_hub_id_is_read_from_the_cache(tmp_path, monkeypatch, variable):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "hf" / ("hub" if variable == "HF_HOME" else "")
    snapshot = fake_cache(cache)
    monkeypatch.setenv(variable, str(tmp_path / "hf" if variable == "HF_HOME" else cache))
    config = config_file(tmp_path, HUB_ID)
    assert load_config(config).model.path == snapshot
    result = runner.invoke(app, ["run", str(config), "--check", "shape-ledger"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "passed (exit 0)" in result.stdout


def test_without_refs_main_the_snapshot_there_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    snapshot = fake_cache(tmp_path / "cache", with_ref=False)
    assert load_config(config_file(tmp_path, HUB_ID)).model.path == snapshot


def test_a_local_directory_of_that_name_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    fake_cache(tmp_path / "cache")
    config = config_file(tmp_path, HUB_ID)
    local = config.parent / HUB_ID
    local.mkdir(parents=True)
    assert load_config(config).model.path == local


def test_a_hub_id_not_cached_is_one_line_saying_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    config = config_file(tmp_path, "meta-llama/Llama-3.2-1B")
    result = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert "model.path: 'meta-llama/Llama-3.2-1B' is no directory here" in lines[0]
    assert "not in the Hugging Face cache" in lines[0] and str(tmp_path / "empty-cache") in lines[0]
    # the command the installed huggingface_hub has (2.x has `hf`, no `huggingface-cli`)
    assert "fetch it with `hf download meta-llama/Llama-3.2-1B`" in lines[0]
    assert "huggingface-cli" not in lines[0]


@pytest.mark.parametrize(
    ("installed", "command"),
    [("2.4.0", "hf download"), ("0.34.1", "hf download"), ("0.26.2", "huggingface-cli download")],
)
def test_the_fetch_command_is_the_one_the_installed_huggingface_hub_has(monkeypatch, installed, command):
    monkeypatch.setattr(hub_cache, "version", lambda name: installed)
    assert hub_cache.fetch_command("org/name") == f"{command} org/name"


def test_a_local_path_that_is_not_a_hub_id_says_no_such_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    spec = load_config(config_file(tmp_path, "./models/tiny/v1")).model  # three parts: no hub id
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(config_from_dict({"model": {"source": "hf", "path": str(spec.path)}}))


# -- inline config keys ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gpt2_n_layers_is_refused_with_a_did_you_mean(tmp_path):
    config = tmp_path / "gpt2.yaml"
    config.write_text(
        "model:\n  source: hf\n  config: {model_type: gpt2, n_layers: 2, n_embd: 16, n_head: 2, vocab_size: 64}\n"
    )
    result = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert re.search(r"model\.config\.n_layers: unknown to GPT2Config; did you mean 'n_layer'\?", result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("model_type", "typo", "meant"),
    [
        ("llama", "num_hiden_layers", "num_hidden_layers"),
        ("mistral", "num_key_value_head", "num_key_value_heads"),
        ("t5", "num_layer", "num_layers"),
        ("bert", "hidden_sise", "hidden_size"),
        ("qwen2", "intermediate_sizes", "intermediate_size"),
    ],
)
def test_typos_are_refused_on_other_config_classes(model_type, typo, meant):
    from transformers import CONFIG_MAPPING

    with pytest.raises(ModelLoadError, match=rf"model\.config\.{typo}: unknown to \w+; did you mean '{meant}'\?"):
        import transformers

        refuse_unknown_keys(CONFIG_MAPPING[model_type], {typo: 3}, transformers)


@pytest.mark.parametrize(
    ("model_type", "keys"),
    [
        ("gpt2", {"num_hidden_layers": 2, "hidden_size": 16}),  # attribute_map aliases of n_layer, n_embd
        ("t5", {"hidden_size": 16, "num_attention_heads": 2}),  # of d_model, num_heads
        ("llama", {"rope_theta": 5e5, "rope_scaling": None, "torch_dtype": "float32", "tie_word_embeddings": True}),
        ("llama", {"rope_theta": 10000.0}),  # a former spelling at its default value
        ("mistral", {"sliding_window": 16, "pad_token_id": 0, "use_cache": False, "output_hidden_states": False}),
        ("bert", {"is_decoder": True, "classifier_dropout": 0.1, "id2label": {0: "a", 1: "b"}}),
    ],
)
def test_keys_a_config_class_takes_pass(model_type, keys):
    import transformers

    refuse_unknown_keys(transformers.CONFIG_MAPPING[model_type], keys, transformers)


@pytest.mark.parametrize("name", [n for n, case in compat.CASES.items() if "config" in case[0]])
def test_every_tiny_config_of_the_compatibility_table_passes(name):
    import transformers

    config = dict(compat.CASES[name][0]["config"])
    model_type = config.pop("model_type")
    refuse_unknown_keys(transformers.CONFIG_MAPPING[model_type], config, transformers)


def test_the_model_is_refused_before_it_is_built(monkeypatch):
    built = []
    import transformers

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "_from_config", lambda *a, **k: built.append(1))
    with pytest.raises(ModelLoadError):
        load_model(config_from_dict({"model": {"source": "hf", "config": {"model_type": "gpt2", "n_layers": 1}}}))
    assert built == []


def test_a_hub_id_error_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="hf download org/name"):
        config_from_dict({"model": {"source": "hf", "path": "org/name"}}, origin=tmp_path / "c.yaml")
