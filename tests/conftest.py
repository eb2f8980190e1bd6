"""Shared helpers: build a config from a dict and run checks on it, as the CLI would."""

from __future__ import annotations

import os

import pytest

# One torch thread per test process, before anything imports torch: `pytest -n auto` runs a process per core, and
# several threads in each (the model processes the CLI tests start inherit this too) would only contend for them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fwdcheck.config.schema import config_from_dict
from fwdcheck.report import Report
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.plan import resolve
from fwdcheck.run.runner import Run


def run_checks(model: dict, checks: list[str] | None = None, **top) -> Report:
    """Run the named checks (the config's, else the default ones, when None) on the model a config dict describes,
    as the command line's worker runs a config file."""
    document = {"model": model, "inputs": top.pop("inputs", {"batch_size": 2, "seq_len": 8}), **top}
    run = Run.build(resolve(config_from_dict(document), Overrides(checks=checks)))
    return run.check(run.load())


def statuses(report: Report) -> dict[str, str]:
    return {r.name: r.status.value for r in report.results}


def codes(report: Report, check: str) -> set[str]:
    return {f.code for f in report.result(check).findings}


@pytest.fixture
def reference():
    """A small reference model config; keyword overrides."""

    def make(**fields) -> dict:
        return {"source": "reference", "vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2, **fields}

    return make


@pytest.fixture
def rope_on_q_only(monkeypatch):
    """An architecture's apply_rotary_pos_emb functions rotating q and handing k back unrotated."""

    def plant(family: str):
        import importlib

        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in [n for n in vars(module) if n.startswith("apply_rotary_pos_emb")]:  # DeepSeek's _interleave too
            original = getattr(module, name)

            def q_only(q, k, *args, original=original, **kwargs):
                return original(q, k, *args, **kwargs)[0], k

            monkeypatch.setattr(module, name, q_only)

    return plant


@pytest.fixture(autouse=True)
def fast_tier_starts_no_worker(request, monkeypatch):
    """The inner loop (`pytest -m "not slow"`) runs in its own process: a test that starts a supervised worker (a
    `fwdcheck run` or `diff` through the command line without --in-process) costs a process a run, and a new
    interpreter per test process, and belongs to the slow tier (tests/test_tiers.py says what else does)."""
    if request.node.get_closest_marker("slow") is None:
        from fwdcheck.process import supervisor

        def refused(*args, **kwargs):
            pytest.fail("this test starts a supervised worker: mark it @pytest.mark.slow", pytrace=False)

        monkeypatch.setattr(supervisor, "supervised", refused)
