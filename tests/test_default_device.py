"""torch's global default device is read and put back the same way on every torch of the supported range.

torch 2.5's `torch.get_default_device()` raises AttributeError after `torch.set_default_device(None)`, and from 2.6
it answers an enclosing `with torch.device()` block. fwdcheck reads the global default alone
(fwdcheck/model/default_device.py): these tests hold it to that on the installed torch, and run fwdcheck's two
callers (model_code, GlobalState) with torch.get_default_device replaced by torch 2.5's own reading of the same
thread-local, so a caller that still asks it fails here as it did on 2.5.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fwdcheck.model.default_device import global_default_device, set_global_default_device
from fwdcheck.model.tested import model_code
from fwdcheck.run.model_state import GlobalState


@pytest.fixture(autouse=True)
def no_default_left():
    yield
    torch.set_default_device(None)


def torch_2_5_get_default_device() -> torch.device:
    """torch 2.5.1's torch.get_default_device, as released: the thread-local alone, `.device` read off whatever
    set_default_device left there (None after set_default_device(None))."""
    holder = torch._GLOBAL_DEVICE_CONTEXT
    if hasattr(holder, "device_context"):
        device = holder.device_context.device
        return device if device.index is not None else torch.tensor([]).device
    return torch.device("cpu")


def test_no_global_default_reads_none_also_after_it_was_removed():
    assert global_default_device() is None
    torch.set_default_device("meta")
    assert global_default_device() == torch.device("meta")
    torch.set_default_device(None)
    assert global_default_device() is None


def test_a_with_block_is_not_the_global_default():
    with torch.device("meta"):
        assert torch.empty(1).device.type == "meta"
        assert global_default_device() is None
    torch.set_default_device("meta")
    with torch.device("cpu"):
        assert global_default_device() == torch.device("meta")


def test_putting_back_none_removes_the_global_default():
    torch.set_default_device("meta")
    set_global_default_device(None)
    assert torch.empty(1).device.type == "cpu"


def test_model_code_puts_back_the_default_device_under_torch_2_5s_reader(monkeypatch):
    torch.set_default_device("meta")
    torch.set_default_device(None)  # leaves the None torch 2.5's reader raises on
    monkeypatch.setattr(torch, "get_default_device", torch_2_5_get_default_device)
    with pytest.warns(RuntimeWarning, match="default device"), model_code("the model raised"):
        torch.set_default_device("meta")  # what a model's forward may do
    assert torch.empty(1).device.type == "cpu"


def test_global_state_taken_inside_a_with_block_does_not_install_the_block_for_good(monkeypatch):
    monkeypatch.setattr(torch, "get_default_device", torch_2_5_get_default_device)
    torch.set_default_device("meta")
    torch.set_default_device(None)
    with torch.device("meta"):
        state = GlobalState.take()
        torch.set_default_device("meta")  # model code sets a global default inside fwdcheck's meta block
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state.restore()
    assert global_default_device() is None
    assert torch.empty(1).device.type == "cpu"
