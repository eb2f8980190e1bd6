"""A FWD002 of a call convention (a forward that needs another argument; a dict under another key) says what to do:
the config's `forward:` adapter, with the call it would make, and `fwdcheck explain FWD002` gives the fix in full. A
dict with a `logits` key needs no adapter."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fwdcheck.cli import app

runner = CliRunner()

MODELS = """
import torch.nn as nn
from fwdcheck.model.reference import build


class Wrapped(nn.Module):
    def __init__(self, key):
        super().__init__()
        self.key = key
        self.inner = build(vocab_size=16, d_model=8, n_heads=2, n_layers=1)

    def forward(self, idx):
        return {self.key: self.inner(idx)}


class NeedsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = build(vocab_size=16, d_model=8, n_heads=2, n_layers=1)

    def forward(self, idx, cache):
        return self.inner(idx)


def dict_out():
    return Wrapped("out")


def dict_logits():
    return Wrapped("logits")


def needs_cache():
    return NeedsCache()


def logits(model, input_ids, position_ids=None):
    return model(input_ids)["out"]
"""


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "my_models.py").write_text(MODELS)
    return tmp_path


def run(folder, factory: str, *extra: str, forward: str | None = None):
    adapter = f", forward: 'my_models:{forward}'" if forward else ""
    config = folder / f"{factory}.yaml"
    config.write_text(f"model: {{source: python, factory: 'my_models:{factory}', vocab_size: 16{adapter}}}\n")
    return runner.invoke(app, ["run", str(config), "--in-process", *extra])


def test_a_dict_under_another_key_names_the_adapter(folder):
    result = run(folder, "dict_out", "-q")
    assert result.exit_code == 1
    line = result.stdout.strip().splitlines()[-1]
    assert "forward returned dict (keys 'out'); fwdcheck needs logits [B, T, V]" in line
    assert "name a `forward:` adapter in the config" in line
    assert "`def logits(model, input_ids, position_ids=None): return model(input_ids)['out']`" in line
    assert "(`fwdcheck explain FWD002`)" in line
    # and the adapter it names fixes it
    fixed = run(folder, "dict_out", "-q", forward="logits")
    assert fixed.exit_code == 0, fixed.output


def test_a_forward_that_needs_another_argument_names_the_adapter(folder):
    result = run(folder, "needs_cache", "--format", "json")
    assert result.exit_code == 1
    (finding,) = {f["message"] for c in json.loads(result.stdout)["checks"] for f in c["findings"]}
    assert "the model raised TypeError: NeedsCache.forward() missing 1 required positional argument: 'cache'" in finding
    assert "return model(input_ids, cache=...)` (`fwdcheck explain FWD002`)" in finding


def test_a_dict_with_a_logits_key_works_as_is(folder):
    result = run(folder, "dict_logits", "-q")
    assert result.exit_code == 0, result.output


def test_explain_fwd002_gives_the_fix():
    result = runner.invoke(app, ["explain", "FWD002"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "FWD002 (fwdcheck itself): the model raised" in text
    assert "write a forward adapter" in text and "`model.forward: 'my_module:logits'`" in text
    assert "def logits(model, input_ids, position_ids=None): return model(input_ids)['out']" in text
    assert "A dict with a `logits` key" in text
