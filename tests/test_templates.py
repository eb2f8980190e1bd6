"""`fwdcheck init`'s starter configs: one per model source, each valid exactly as written, and running.

The reference, python and hf templates run through the same path as the CLI (load_config, load_model, run_model) to
exit 0; the checkpoint one names a weights file the user replaces, so its run stops with one exit-2 line naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.config.registry import select
from fwdcheck.config.schema import load_config
from fwdcheck.config.sources import SOURCES
from fwdcheck.errors import UsageError
from fwdcheck.model.sources import load_model, starter_config
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings

# A key left commented out in a template, as the user would uncomment it: `  # n_kv_heads: 1   # ...`.
COMMENTED_KEY = re.compile(r"^(\s*)# ([a-z_]+: .*)$")


def write(tmp_path: Path, source: str, text: str | None = None) -> Path:
    path = tmp_path / f"{source}.yaml"
    path.write_text(starter_config(source, str(path)) if text is None else text, encoding="utf-8")
    return path


@pytest.mark.parametrize("source", SOURCES)
def test_every_template_validates_as_written(tmp_path, source):
    path = write(tmp_path, source)
    text = path.read_text(encoding="utf-8")
    assert text.startswith(f"# fwdcheck config: `fwdcheck run {path}`")
    assert load_config(path).model.source == source


@pytest.mark.parametrize("source", ["reference", "python", "hf"])
@pytest.mark.slow
def test_template_runs_and_passes(tmp_path, source):
    if source == "hf":
        pytest.importorskip("transformers")
    config = load_config(write(tmp_path, source))
    report = run_model(load_model(config), Settings.from_config(config), select(config.checks))
    assert report.exit_code == 0, [(r.name, r.status.value, r.summary) for r in report.results]


def test_python_template_points_at_a_factory_that_exists_and_says_to_replace_it():
    text = starter_config("python", "fwdcheck.yaml")
    assert 'factory: "fwdcheck.model.reference:build"' in text and "Replace the factory" in text
    assert "kwargs: {" in text  # sizes as kwargs: `fwdcheck shrink` can shrink them


def test_checkpoint_template_stops_with_one_line_naming_the_file_to_replace(tmp_path):
    path = write(tmp_path, "checkpoint")
    result = CliRunner().invoke(app, ["run", str(path), "--in-process"], catch_exceptions=False)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors: no such file" in lines[0], result.stderr


@pytest.mark.parametrize("source", SOURCES)
def test_each_commented_key_validates_once_uncommented(tmp_path, source):
    lines = starter_config(source, "fwdcheck.yaml").splitlines()
    commented = [i for i, line in enumerate(lines) if COMMENTED_KEY.match(line)]
    assert commented
    for i in commented:
        if source == "hf" and lines[i].lstrip().startswith("# path:"):  # a directory in place of `config:`
            continue
        edited = [*lines[:i], COMMENTED_KEY.sub(r"\1\2", lines[i]), *lines[i + 1 :]]
        load_config(write(tmp_path, source, "\n".join(edited) + "\n"))


def test_an_unknown_source_names_the_known_ones():
    with pytest.raises(UsageError, match="unknown source 'onnx'; known: reference, python, hf, checkpoint"):
        starter_config("onnx", "fwdcheck.yaml")
