"""The ordinary corpus: the cases marked `ordinary` in scripts/reliability_counts.ORDINARY, correct models in
hostile-but-ordinary situations that must not be failed, counted as docs/reliability.md's fourth line says."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def counts_module():
    spec = importlib.util.spec_from_file_location("reliability_counts", REPO / "scripts" / "reliability_counts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # collects six test files in a new interpreter
def test_the_reliability_page_counts_the_ordinary_corpus():
    counts = counts_module()
    n = counts.ordinary_count()
    every = counts.collected(counts.ORDINARY)
    assert 40 <= n < every  # the marked cases, not every case: each file also fails the bugs planted
    line = counts.ordinary_line(n)
    assert re.search(rf"\band {n} correct models\b", line)
    assert line in " ".join(counts.PAGE.read_text().split()), f"{counts.PAGE.name} should say: {line}"


def test_every_file_of_the_corpus_marks_cases():
    """A file listed in ORDINARY with no marked case would count nothing while the page names it."""
    for path in counts_module().ORDINARY:
        assert "@pytest.mark.ordinary" in (REPO / path).read_text(), path
