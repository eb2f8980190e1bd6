"""A new model source is one module and one row in SOURCES: a config file naming it validates (its errors said as any
source's are), load_model loads it and `fwdcheck run` checks it, `fwdcheck init` and `--source`'s help offer it, and
`fwdcheck shrink` refuses it in one line when its record names no rules, with no edit elsewhere.

The toy source's module (its config class and its loader) is written to tmp_path, and its record is put in the table
for the test and taken out after; without the row, the same file is an unknown source. Shrink's dispatch through a
record is shown on the reference source's row with its rules taken away.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.config.schema import load_config
from fwdcheck.config.sources import SOURCES, Source, resolve
from fwdcheck.errors import ConfigError
from fwdcheck.model.sources import load_model, starter_config

# The whole of the new source's code: its config class and its loader, in a module of its own.
TOY_MODULE = '''\
"""The `toy` source: fwdcheck's reference transformer at a width the config gives."""

from typing import Literal

from fwdcheck.config.schema import Config, ModelSpec
from fwdcheck.model.reference import build
from fwdcheck.model.sources import from_module
from fwdcheck.model.tested import ModelUnderTest


class ToyModel(ModelSpec):
    source: Literal["toy"]
    width: int = 8


def load_toy(spec: ToyModel, config: Config) -> ModelUnderTest:
    model = from_module(build(vocab_size=16, d_model=spec.width, n_heads=2, n_layers=1, max_seq_len=32))
    model.source = "toy"  # from_module reads any module as a factory's would be
    return model
'''
TOY_TEMPLATE = """\
model:
  source: toy
  width: 8                 # the model's width
"""
# The one row.
TOY = Source("toy", spec="toy_source:ToyModel", loader="toy_source:load_toy", template=TOY_TEMPLATE)


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    (tmp_path / "toy_source.py").write_text(TOY_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("toy_source", None)


def test_a_new_source_is_read_from_a_config_file_loaded_and_offered_through_its_row(toy_module):
    before = dict(SOURCES)
    path = toy_module / "toy.yaml"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SOURCES, "toy", TOY)
        assert "toy_source" not in sys.modules  # the row names its code; nothing is imported until it is used

        # `fwdcheck init --source toy` writes its starter config, and the others' starters name it.
        result = CliRunner().invoke(app, ["init", "--source", "toy", str(path)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        text = path.read_text(encoding="utf-8")
        assert TOY_TEMPLATE in text and text.startswith(f"# fwdcheck config: `fwdcheck run {path}`")
        assert "`fwdcheck init --source reference|python|hf|checkpoint`" in text
        assert "--source python|hf|checkpoint|toy`" in starter_config("reference", "x.yaml")

        # The YAML file names `source: toy`: its section is validated as the row's class, and load_model dispatches
        # through the row to the toy's loader.
        path.write_text(text.replace("width: 8", "width: 16"), encoding="utf-8")
        config = load_config(path)
        assert type(config.model) is resolve(TOY.spec) and config.model.model_dump() == {"source": "toy", "width": 16}
        model = load_model(config)
        assert model.source == "toy" and model.dims["d"] == 16
        assert tuple(model.logits(torch.zeros(2, 8, dtype=torch.long)).shape) == (2, 8, 16)

        # Its mistakes are said as any source's are: in one line, located, with a did-you-mean from its own class.
        path.write_text(text.replace("width: 8", "widht: 16"), encoding="utf-8")
        with pytest.raises(ConfigError, match=r"model\.widht: unknown key; did you mean 'width'\?"):
            load_config(path)
        path.write_text(text.replace("width: 8", "width: wide"), encoding="utf-8")
        with pytest.raises(ConfigError, match=r"model\.width: expected a whole number \(got 'wide'\)"):
            load_config(path)

        # And `fwdcheck run` checks it from the file.
        path.write_text(text, encoding="utf-8")
        result = CliRunner().invoke(
            app, ["run", str(path), "--in-process", "--check", "shape-ledger", "--format", "json"]
        )
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["model"]["source"] == "toy" and [c["status"] for c in report["checks"]] == ["pass"]

    # Without its row, the same file names an unknown source.
    assert SOURCES == before and "toy" not in SOURCES
    with pytest.raises(
        ConfigError, match="model.source: unknown source 'toy'; known: reference, python, hf, checkpoint"
    ):
        load_config(path)


def test_the_command_line_help_lists_a_registered_source(toy_module):
    """`--source`'s help is read off the table when the command line is built: a row put in first is listed, and
    reading the row imports neither the source's module nor torch."""
    script = textwrap.dedent("""\
        import sys
        from typer.testing import CliRunner
        from fwdcheck.config.sources import SOURCES, Source

        SOURCES["toy"] = Source("toy", spec="toy_source:ToyModel", loader="toy_source:load_toy", template="model:\\n")
        from fwdcheck.cli import app

        print(" ".join(CliRunner().invoke(app, ["init", "--help"]).output.split()))  # as one line, however wrapped
        print("imported:", sorted(m for m in ("torch", "toy_source") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=toy_module)
    assert proc.returncode == 0, proc.stderr
    assert "The model source the config describes: reference | python | hf | checkpoint | toy." in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == "imported: []"


def test_shrink_follows_the_record_and_refuses_a_source_without_rules(tmp_path, monkeypatch):
    """Shrink's dispatch is the record's `shrink`: rules of the row's own are called with the original config, and a
    row with none is refused in one line (exit 2), nothing written."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "ref.yaml"
    config.write_text(yaml.safe_dump({"model": {"source": "reference", "n_layers": 6}}), encoding="utf-8")
    seen = []

    def rules(original):
        seen.append((original.path, original.spec.n_layers, original.output))
        return {**original.model, "n_layers": 1}, resolve("fwdcheck.model.sources.shrink:Edits")({})

    before = dict(SOURCES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SOURCES, "reference", dataclasses.replace(SOURCES["reference"], shrink=rules))
        result = CliRunner().invoke(app, ["shrink", str(config)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert seen == [(config, 6, Path("ref.shrunk.yaml"))]
        assert yaml.safe_load(Path("ref.shrunk.yaml").read_text(encoding="utf-8"))["model"]["n_layers"] == 1

        patch.setitem(SOURCES, "reference", dataclasses.replace(SOURCES["reference"], shrink=None))
        result = CliRunner().invoke(app, ["shrink", str(config), "-o", "none.yaml"], catch_exceptions=False)
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.strip().splitlines() == [
            f"error: {config}: fwdcheck shrink has no rules for `source: reference` models"
        ]
        assert not Path("none.yaml").exists()
    assert SOURCES == before
