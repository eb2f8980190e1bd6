"""The model sources: one record per member of the config's ModelSource union, each loader imported only when used."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from fwdcheck.config.callables import resolve_callable
from fwdcheck.config.schema import MODEL_CLASSES
from fwdcheck.model.sources import SOURCES, resolve


def test_every_source_has_a_record_and_every_record_a_source():
    """The union in schema.py is written out for pydantic and the type checker; SOURCES is the table everything else
    reads (load_model, `init`, `--source`'s help, `shrink`): both name the same sources, with the same classes."""
    assert set(SOURCES) == set(MODEL_CLASSES)
    for name, source in SOURCES.items():
        assert source.name == name
        assert resolve(source.spec) is MODEL_CLASSES[name], source.spec


def test_each_loader_is_its_own_module_taking_its_config_class():
    for source, record in SOURCES.items():
        reference = record.loader
        assert isinstance(reference, str), source  # imported when a config names the source, not before
        loader = resolve_callable(reference, what="loader")
        assert loader.__module__ == f"fwdcheck.model.sources.{source}", reference
        assert list(inspect.signature(loader).parameters) == ["spec", "config"], reference
        assert inspect.get_annotations(loader)["spec"] == MODEL_CLASSES[source].__name__, reference


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
