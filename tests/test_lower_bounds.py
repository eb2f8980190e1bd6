"""The dependency lower bounds are run, not guessed: CI installs the lowest typer, click, rich, pydantic and pyyaml
pyproject.toml allows into a venv of their own and runs the sample configs there (scripts/verify_lower_bounds.py);
docs/compatibility.md names those versions. This holds the three to each other; the run itself is CI's (it installs
a venv: minutes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("verify_lower_bounds", REPO / "scripts" / "verify_lower_bounds.py")
assert spec is not None and spec.loader is not None
verify = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verify)


def test_the_lowest_versions_are_pyprojects_bounds():
    pins = dict(p.split("==") for p in verify.lowest_pins())
    assert list(pins) == ["typer", "click", "rich", "pydantic", "pyyaml"]
    assert pins["typer"] == "0.16"  # typer 0.12 to 0.15 with click >= 8.2: booleans read as 'False'


def test_ci_runs_the_sample_configs_on_the_lowest_versions():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "python scripts/verify_lower_bounds.py --venv" in ci
    assert ci.index("verify_lower_bounds") < ci.index("python -m pytest")  # before the suite, as a gate


def test_the_docs_name_the_versions_verified():
    page = (REPO / "docs" / "compatibility.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if "(the lowest allowed), torch" in line)
    for pin in verify.lowest_pins():
        name, version = pin.split("==")
        assert f"{name} {version}" in row or f"{name} {version}.0" in row, (pin, row)
    assert "torch 2.5" in page and "no CPU wheel" in page
