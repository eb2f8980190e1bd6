"""The model sources: one record per source in SOURCES, naming the config class a config file's `model:` section is
validated as, each loader imported only when used."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from typing import get_args

import pytest

from fwdcheck.config.callables import resolve_callable
from fwdcheck.config.schema import ModelSpec, model_classes
from fwdcheck.config.sources import SOURCES, resolve


def test_each_record_names_a_config_class_that_declares_its_source():
    """SOURCES is the one list of the sources: the config's `model:` section is validated as the class its `source:`
    key names through it (model_classes), as load_model, `init`, `--source`'s help and `shrink` read it; each row's
    class is a ModelSpec whose `source` is the row's name."""
    assert model_classes() == {name: resolve(source.spec) for name, source in SOURCES.items()}
    for name, source in SOURCES.items():
        assert source.name == name
        spec = resolve(source.spec)
        assert issubclass(spec, ModelSpec) and get_args(spec.model_fields["source"].annotation) == (name,), spec


def test_each_loader_is_its_own_module_taking_its_config_class():
    for source, record in SOURCES.items():
        reference = record.loader
        assert isinstance(reference, str), source  # imported when a config names the source, not before
        loader = resolve_callable(reference, what="loader")
        assert loader.__module__ == f"fwdcheck.model.sources.{source}", reference
        assert list(inspect.signature(loader).parameters) == ["spec", "config"], reference
        assert inspect.get_annotations(loader)["spec"] == model_classes()[source].__name__, reference


def test_each_shrink_rule_is_a_function_of_the_original_in_the_torch_free_shrink_module():
    for source, record in SOURCES.items():
        assert isinstance(record.shrink, str), source
        rules = resolve_callable(record.shrink, what="shrink rules")
        assert rules.__module__ == "fwdcheck.model.sources.shrink", record.shrink
        assert list(inspect.signature(rules).parameters) == ["original"], record.shrink


def test_the_table_is_read_without_torch_or_pydantic():
    """`fwdcheck --help` reads the table for `init --source`'s help: the records name code, they do not import it."""
    script = textwrap.dedent("""\
        import sys
        from fwdcheck.model.sources import SOURCES, starter_config

        starter_config("hf", "x.yaml")
        print(sorted(m for m in ("torch", "pydantic", "yaml", "fwdcheck.config.schema") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_reference_run_imports_no_other_source():
    script = textwrap.dedent("""\
        import sys
        from fwdcheck.config.schema import config_from_dict
        from fwdcheck.model.sources import load_model

        load_model(config_from_dict({"model": {"source": "reference"}}))
        print(sorted(m for m in ("transformers", "safetensors", "fwdcheck.model.sources.python",
                                 "fwdcheck.model.sources.checkpoint", "fwdcheck.model.sources.hf") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
