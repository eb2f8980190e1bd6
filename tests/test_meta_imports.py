"""A model's code is imported before fwdcheck enters the meta device, so tensors it makes at import time are real.

On transformers 4.46 with torchao installed, a modeling file imports torchao, whose import-time tensors fail on the
meta device; the hf source built through an Auto class, which imports the modeling file at the first build, inside
its `with torch.device("meta")` block, and every hf config exited 2. Here a module does what torchao did (reads a
value off a tensor it makes at import time, which a meta tensor cannot give): the hf source's modeling file, hooked
as Python imports it, and a python source's factory module.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest
import torch

from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from tests import compat

MODEL_TYPE = "biogpt"  # a modeling file the lookup below imports afresh
MODELING = f"transformers.models.{MODEL_TYPE}"


class ImportTimeTensor(importlib.abc.MetaPathFinder):
    """Finds nothing; as Python looks for the modeling module, makes a tensor and reads a value off it, as torchao's
    import-time code does (on the meta device: RuntimeError, and the import fails)."""

    def __init__(self) -> None:
        self.devices: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name == f"{MODELING}.modeling_{MODEL_TYPE}":
            table = torch.ones(2)
            self.devices.append(table.device.type)
            float(table.sum())
        return None


@pytest.fixture
def modeling_imported_afresh(monkeypatch):
    transformers = pytest.importorskip("transformers")
    for name in [n for n in sys.modules if n == MODELING or n.startswith(f"{MODELING}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(transformers.AutoModelForCausalLM._model_mapping._modules, MODEL_TYPE, raising=False)
    finder = ImportTimeTensor()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    return finder


@pytest.mark.slow  # builds a Hugging Face model
@pytest.mark.parametrize("meta", [True, False])
def test_hf_imports_the_modeling_file_before_the_meta_device(modeling_imported_afresh, meta):
    spec = compat.hf(MODEL_TYPE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = load_model(config_from_dict({"model": spec, "meta": meta}))
    assert modeling_imported_afresh.devices == ["cpu"]
    assert next(model.module.parameters()).device.type == ("meta" if meta else "cpu")


FACTORY = """
import torch
import torch.nn as nn

SCALE = float(torch.ones(2).sum())  # a value read off an import-time tensor: a meta tensor has none


def build():
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
"""


def test_python_source_imports_the_factory_before_the_meta_device(tmp_path):
    (tmp_path / "import_time_tensor.py").write_text(FACTORY)
    document = {
        "model": {"source": "python", "factory": "import_time_tensor:build", "python_path": [str(tmp_path)]},
        "meta": True,
    }
    model = load_model(config_from_dict(document))
    assert next(model.module.parameters()).device.type == "meta"
