"""Config errors in a config's own words: no pydantic wording reaches the user, `class:` is named as written,
bf16/fp16 are dtypes, and a factory spelled `pkg.mod.fn` or misnamed gets a did-you-mean."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

import fwdcheck
from fwdcheck.cli import app
from fwdcheck.config.schema import config_from_dict
from fwdcheck.errors import ConfigError, UsageError
from fwdcheck.model.reference import build

REFERENCE = {"source": "reference", "vocab_size": 16, "d_model": 8, "n_heads": 2}
PYDANTIC_WORDS = ("Input should", "Input is not", "String should", "instance of", "<class", "valid dictionary")


def error_of(document: dict) -> str:
    with pytest.raises(ConfigError) as raised:
        config_from_dict(document)
    return str(raised.value)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"model": REFERENCE, "ignore": ["FWD101"]}, "ignore[0]: expected a mapping (key: value pairs) (got 'FWD101')"),
        ({"model": {"source": "hf", "path": 3}}, "model.path: expected a path (a string) (got 3)"),
        ({"model": {"source": "python", "factory": "m:f", "path": [{"a": 1}]}}, "model.path[0]: expected a path"),
        ({"model": REFERENCE, "dtype": "float64"}, "dtype: expected one of float32, bfloat16 or float16"),
        ({"model": REFERENCE, "inputs": {"batch_size": "two"}}, "inputs.batch_size: expected a whole number"),
        ({"model": REFERENCE, "inputs": {"seq_len": 1}}, "inputs.seq_len: must be at least 2 (got 1)"),
        ({"model": REFERENCE, "timeout_s": 0}, "timeout_s: must be greater than 0 (got 0)"),
        ({"model": REFERENCE, "checks": "rope"}, "checks: expected a list (got 'rope')"),
        ({"model": REFERENCE, "meta": "perhaps"}, "meta: expected true or false (got 'perhaps')"),
        ({"model": REFERENCE, "device": "tpu"}, "device: expected cpu, cuda, cuda:N or auto (got 'tpu')"),
        ({"model": REFERENCE, "ignore": [{"code": "FWD101", "reason": ""}]}, "ignore[0].reason: must not be empty"),
        ({"model": {**REFERENCE, "n_layers": 2.5}}, "model.n_layers: expected a whole number, not a fraction"),
        ({"model": {"source": "hf", "config": {"model_type": "gpt2"}, "class": 3}}, "model.class: expected a text"),
    ],
)
def test_no_pydantic_wording(document, expected):
    message = error_of(document)
    assert expected in message, message
    assert not [word for word in PYDANTIC_WORDS if word in message], message


def test_an_option_of_a_check_in_plain_words():
    with pytest.raises(UsageError) as raised:
        fwdcheck.check_model(build(vocab_size=16, d_model=8, n_heads=2), options={"future-token": {"exhaustive": []}})
    message = str(raised.value)
    assert "options.future-token.exhaustive: expected true or false" in message, message
    assert "Input should" not in message


def test_class_is_named_as_users_write_it():
    message = error_of({"model": {"source": "hf", "config": {"model_type": "gpt2"}, "clas": "GPT2LMHeadModel"}})
    assert "model.clas: unknown key; did you mean 'class'?" in message
    message = error_of({"model": {"source": "hf", "config": {"model_type": "gpt2"}, "zzz": 1}})
    assert "class" in message.split("valid keys:")[1] and "cls" not in message


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("fp32", "float32"),
        ("torch.bfloat16", "bfloat16"),
        ("half", "float16"),
    ],
)
def test_dtype_spellings(spelling, dtype):
    assert config_from_dict({"model": REFERENCE, "dtype": spelling}).dtype == dtype


def test_bf16_through_the_api():
    report = fwdcheck.check_model(build(vocab_size=16, d_model=8, n_heads=2), dtype="bf16", checks=["shape-ledger"])
    assert report.environment["dtype"] == "bfloat16"


def test_a_dotted_factory_gets_the_colon_spelling():
    message = error_of({"model": {"source": "python", "factory": "mypkg.models.build_gpt"}})
    assert "model.factory: 'mypkg.models.build_gpt' is not of the form 'package.module:callable'" in message
    assert message.endswith("did you mean 'mypkg.models:build_gpt'?")
    assert message.count("mypkg.models.build_gpt") == 1  # the value named once


@pytest.mark.slow
def test_a_misnamed_factory_gets_a_did_you_mean(tmp_path, monkeypatch):
    (tmp_path / "words_model.py").write_text(
        "import torch.nn as nn\n\n\ndef build_model():\n    return nn.Linear(2, 2)\n"
    )
    monkeypatch.delitem(sys.modules, "words_model", raising=False)
    config = tmp_path / "model.yaml"
    config.write_text(
        'model: {source: python, factory: "words_model:build_modle", python_path: ["."], vocab_size: 16}\n'
    )
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    sys.modules.pop("words_model", None)
    assert result.exit_code != 0
    assert "module 'words_model' has no attribute 'build_modle'; did you mean 'words_model:build_model'?" in (
        result.output
    ), result.output


# -- one meaning per key: `path:` names the model's files, `python_path:` the sys.path directories --------------


def write_python_config(tmp_path, key: str) -> object:
    (tmp_path / "words_tiny.py").write_text(
        "import torch.nn as nn\n\n\ndef build():\n    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))\n"
    )
    (tmp_path / "project").mkdir()
    config = tmp_path / "project" / "model.yaml"
    config.write_text(
        f'model: {{source: python, factory: "words_tiny:build", {key}: [".."], vocab_size: 16}}\n'
        "inputs: {batch_size: 2, seq_len: 4}\nchecks: [shape-ledger]\n"
    )
    return config


@pytest.mark.parametrize("key", ["python_path", "path"])
@pytest.mark.slow
def test_python_path_as_checkpoint_names_it_and_the_former_path_still_read(tmp_path, monkeypatch, key):
    monkeypatch.delitem(sys.modules, "words_tiny", raising=False)
    config = write_python_config(tmp_path, key)
    result = CliRunner().invoke(app, ["run", str(config), "--format", "json"], catch_exceptions=False)
    sys.modules.pop("words_tiny", None)
    assert result.exit_code == 0, result.output
    import json

    notes = json.loads(result.stdout)["notes"]
    former = [n for n in notes if "former name" in n]
    if key == "path":
        assert former == ["model.path: python_path's former name (sys.path directories), still read; write python_path"]
    else:
        assert former == []


def test_python_path_and_path_together_are_refused():
    message = error_of({"model": {"source": "python", "factory": "m:f", "path": ["a"], "python_path": ["b"]}})
    assert "give python_path alone: path is its former name" in message
