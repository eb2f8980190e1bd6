"""The model sources: one loader per member of the config's ModelSource union, imported only when used."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from fwdcheck.config.callables import resolve_callable
from fwdcheck.config.schema import MODEL_CLASSES
from fwdcheck.model.sources import LOADERS


def test_every_source_has_a_loader_and_every_loader_a_source():
    assert set(LOADERS) == set(MODEL_CLASSES)


def test_each_loader_is_its_own_module_taking_its_config_class():
    for source, reference in LOADERS.items():
        loader = resolve_callable(reference, what="loader")
        assert loader.__module__ == f"fwdcheck.model.sources.{source}", reference
        assert list(inspect.signature(loader).parameters) == ["spec", "config"], reference
        assert inspect.get_annotations(loader)["spec"] == MODEL_CLASSES[source].__name__, reference


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
