"""Shared helpers: build a config from a dict and run checks on it, as the CLI would."""

from __future__ import annotations

import pytest

from fwdcheck.config import config_from_dict
from fwdcheck.registry import select
from fwdcheck.report import Report
from fwdcheck.runner import run_model
from fwdcheck.session import Settings
from fwdcheck.sources import load_model


def run_checks(model: dict, checks: list[str] | None = None, **top) -> Report:
    """Run the named checks (all when None) on the model a config dict describes."""
    document = {"model": model, "inputs": top.pop("inputs", {"batch_size": 2, "seq_len": 8}), **top}
    config = config_from_dict(document)
    return run_model(load_model(config), Settings.from_config(config), select(checks))


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
