"""One run is resolved once: the config read, the caller's overrides applied, the checks selected and their options
validated a single time, in the process that validates, whichever way the run comes in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fwdcheck
from fwdcheck.cli import app
from fwdcheck.config import registry, schema
from fwdcheck.run.overrides import Overrides

pytest_plugins = ["pytester"]

CONFIG = """\
model: {source: reference, vocab_size: 16, d_model: 8, n_heads: 2, n_layers: 1, d_ff: 16}
inputs: {batch_size: 2, seq_len: 4}
checks: [shape-ledger, future-token]
options:
  future-token: {exhaustive: false}
"""


def counted(monkeypatch, owner, name: str) -> list[int]:
    """Calls of fwdcheck's function `owner.name` counted, wherever a module of fwdcheck holds it by name."""
    original = getattr(owner, name)
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("fwdcheck") and module is not owner and getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def counts(monkeypatch) -> dict[str, list[int]]:
    return {
        "applies overrides": counted(monkeypatch, Overrides, "applied"),
        "selects checks": counted(monkeypatch, registry, "select"),
        "validates options": counted(monkeypatch, registry, "check_options"),
        "parses YAML": counted(monkeypatch, schema, "load_config"),
    }


def tally(counts: dict[str, list[int]]) -> dict[str, int]:
    return {what: calls[0] for what, calls in counts.items()}


def test_the_command_line_resolves_a_run_once(tmp_path: Path, counts):
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    result = CliRunner().invoke(
        app,
        ["run", str(config), "--in-process", "--format", "json", "--seed", "3", "--dtype", "float32"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert '"seed": 3' in result.stdout
    assert tally(counts) == {"applies overrides": 1, "selects checks": 1, "validates options": 1, "parses YAML": 1}


def test_the_api_resolves_a_run_once(counts):
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    report = fwdcheck.check_model(model, ["shape-ledger"], seq_len=4)
    assert report.exit_code == 0
    assert tally(counts) == {"applies overrides": 1, "selects checks": 1, "validates options": 1, "parses YAML": 0}


def test_the_pytest_plugin_resolves_a_run_once(pytester: pytest.Pytester, monkeypatch, counts):
    """Collection reads the config, applies the command line's options and selects the checks (the items, a golden
    file beside the config adding its check) once; the run's plan is made of the items -k keeps, nothing selected or
    applied again. The supervised worker is replaced by a run in this process, which takes the plan as it is."""
    from fwdcheck.process import supervisor
    from fwdcheck.process.worker import execute

    config = pytester.path / "fwdcheck-tiny.yaml"
    config.write_text(CONFIG)
    golden = config.with_suffix(".golden.json")
    saved = CliRunner().invoke(app, ["run", str(config), "--in-process", "--save-golden", str(golden)])
    assert saved.exit_code == 0 and golden.exists(), saved.output
    for calls in counts.values():  # what saving the golden file cost is not the plugin's
        calls[0] = 0

    plans = []

    def in_this_process(job, timeout_s=None, progress=None):
        plans.append(job.plan)
        return execute(job, progress=progress)

    monkeypatch.setattr(supervisor, "run_supervised", in_this_process)
    result = pytester.runpytest_inprocess("--fwdcheck", str(config), "-k", "not future", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, deselected=1)
    assert [[entry.name for entry in plan.entries] for plan in plans] == [["shape-ledger", "golden"]]
    assert plans[0].config.checks == ["shape-ledger", "golden"] and "--expect-golden" in plans[0].expected
    assert tally(counts) == {"applies overrides": 1, "selects checks": 1, "validates options": 1, "parses YAML": 1}


def test_the_plan_travels_as_it_was_made(tmp_path: Path):
    """The Job's JSON carries the plan whole: the config with the overrides in it, the checks in order, their
    validated options, the caller's overrides; nothing read again on the other side."""
    import json

    from fwdcheck.config.schema import load_config
    from fwdcheck.process.events import Job
    from fwdcheck.run.plan import resolve

    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    plan = resolve(load_config(config), Overrides(seed=3, options={"future-token": {"exhaustive": True}}))
    assert plan.config.inputs.seed == 3 and [e.name for e in plan.entries] == ["shape-ledger", "future-token"]
    assert plan.options["future-token"].exhaustive is True  # the flag on top of the config's section
    job = Job(config=str(config), factory=None, plan=plan)
    config.unlink()  # the worker never reads the file again
    arrived = Job.from_wire(json.loads(json.dumps(job.to_wire())))
    assert arrived == job and arrived.plan is not plan
    assert arrived.plan.config.model_fields_set == plan.config.model_fields_set  # a named dtype stays named
    assert arrived.overrides.seed == 3


def test_settings_read_every_key_of_the_config():
    """A check reads the config's keys on its settings (`session.settings.inputs`): each one, as the config holds
    it, so that a key added to the config is not forgotten there."""
    from fwdcheck.config.schema import RunConfig
    from fwdcheck.run.settings import Settings

    config = RunConfig(checks=["rope"], timeout_s=5)
    settings = Settings(config)
    assert all(getattr(settings, name) is getattr(config, name) for name in RunConfig.model_fields)


@pytest.mark.slow
def test_the_worker_runs_the_plan_it_is_handed(tmp_path: Path):
    """A supervised worker makes its run of the Job's plan: the config file, gone once the plan was made, is not
    read again, and the overrides are in the report."""
    from fwdcheck.config.schema import load_config
    from fwdcheck.process.events import Job
    from fwdcheck.process.supervisor import run_supervised
    from fwdcheck.run.plan import resolve

    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    plan = resolve(load_config(config), Overrides(checks=["shape-ledger"], seed=5))
    config.unlink()
    job = Job(config=str(config), factory=None, plan=plan, sys_path=[p for p in sys.path if p])
    report = run_supervised(job, timeout_s=120)
    assert report.exit_code == 0, report.notes
    assert [r.name for r in report.results] == ["shape-ledger"] and report.environment["seed"] == 5
