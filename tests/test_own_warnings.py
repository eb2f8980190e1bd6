"""fwdcheck's own warnings never reach the report as the model's: a warning raised by fwdcheck's code (a `float()` of
a grad-carrying tensor in an observer's reader, as the train cell once raised on every eager softmax) is left out of
the notes, while the model's warnings, even those torch names at a line where fwdcheck forwards the model's call,
stay. And on the whole corpus (the sample configs, every planted bug) fwdcheck raises none of its own."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.config.bugs import BUGS
from fwdcheck.observe.observer import ZeroAttentionDropout
from fwdcheck.process import worker
from fwdcheck.process.warnings_heard import PACKAGE, warnings_heard

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
GRAD_SCALAR = "Converting a tensor with requires_grad=True to a scalar"


def fwdcheck_code(source: str) -> dict:
    """Functions whose code reads as if a module of fwdcheck's package had it (its filename is there)."""
    names: dict = {"torch": torch, "warnings": warnings}
    exec(compile(source, str(PACKAGE / "observe" / "planted.py"), "exec"), names)
    return names


def test_a_warning_of_fwdcheck_code_is_its_own_and_the_models_is_not():
    planted = fwdcheck_code("def warns():\n    warnings.warn('from fwdcheck')\n")
    with warnings_heard() as heard:
        warnings.simplefilter("always")
        planted["warns"]()
        warnings.warn("from the model", stacklevel=1)
    assert [(str(w.message), w.own) for w in heard] == [("from fwdcheck", True), ("from the model", False)]
    (note,) = worker.warning_notes(heard)  # the model's, named where it was raised; fwdcheck's left out
    assert note.startswith(f"warning: UserWarning: from the model ({Path(__file__).name}:")


def test_through_a_function_mode_the_caller_decides():
    """torch names the mode's forwarding line as where an op warned (a softmax without `dim`): fwdcheck's reader
    making that call is fwdcheck's warning; the model making it through the same mode is the model's, and stays."""
    scores = torch.ones(2, 3)
    planted = fwdcheck_code("def reads(x):\n    return torch.nn.functional.softmax(x)\n")
    with warnings_heard() as heard, ZeroAttentionDropout():
        warnings.simplefilter("always")
        planted["reads"](scores)
        torch.nn.functional.softmax(scores)  # the model's own
    assert ["Implicit dimension choice for softmax" in str(w.message) for w in heard] == [True, True]
    assert all(Path(w.filename).name == "observer.py" for w in heard)  # both named at the mode's line
    assert [w.own for w in heard] == [True, False]
    assert len(worker.warning_notes(heard)) == 1


CORPUS = sorted(
    [p for p in (REPO / "sample_configs").rglob("*.yaml") if "llama-3-8b" not in p.name and "hf" not in p.parts]
)
SMALL = {"vocab_size": 16, "d_model": 24, "n_heads": 4, "n_layers": 2}
CHECKS = ["shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "label-shift", "packing", "grad-reach"]


def run_hearing(monkeypatch, args: list[str]) -> tuple[list, str]:
    heard_lists: list = []
    notes = worker.warning_notes

    def recording(caught):
        heard_lists.append(list(caught))
        return notes(caught)

    monkeypatch.setattr(worker, "warning_notes", recording)
    result = runner.invoke(app, ["run", *args, "--in-process", "--format", "json"], catch_exceptions=False)
    return [w for heard in heard_lists for w in heard], result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("config", CORPUS, ids=[str(p.relative_to(REPO)) for p in CORPUS])
def test_the_sample_configs_raise_no_warning_of_fwdchecks_own(monkeypatch, config):
    heard, out = run_hearing(monkeypatch, [str(config)])
    own = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in heard if w.own]
    assert own == []
    assert GRAD_SCALAR not in out


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(BUGS))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_planted_bugs_raise_no_warning_of_fwdchecks_own(monkeypatch, tmp_path, bug, attention):
    config = tmp_path / "planted.yaml"
    model = {"source": "reference", **SMALL, "positional": "rope", "attention": attention, "bugs": [bug]}
    import yaml

    config.write_text(yaml.safe_dump({"model": model, "inputs": {"batch_size": 3, "seq_len": 9}, "checks": CHECKS}))
    heard, out = run_hearing(monkeypatch, [str(config)])
    own = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in heard if w.own]
    assert own == []
    assert GRAD_SCALAR not in out
