"""The test tiers: `pytest -m "not slow"` is the inner loop, plain `pytest` runs everything.

The slow tier must hold what costs seconds a test by its nature: every file whose tests launch ranks through the
distributed launcher (`--nproc`, `distributed: {nproc: N}`, the models of tests/distributed_models.py), the fuzzers
and the third-party corpus, each marked as a whole (`pytestmark = pytest.mark.slow`). Read from the sources, not
collected, so that this test costs milliseconds. A test that starts a supervised worker is slow too: in the inner
loop the worker is refused (tests/conftest.py `fast_tier_starts_no_worker`), so that such a test fails there until
it is marked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LAUNCHES_RANKS = re.compile(r"--nproc\b|\bnproc\b|\bdistributed_models\b")
SLOW_AS_A_WHOLE = {"test_fuzz.py", "test_corpus.py"}


def module_marks(path: Path) -> set[str]:
    """The names of the marks a file's module-level `pytestmark` holds (one mark, or a list or tuple of them)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            continue
        for mark in node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]:
            mark = mark.func if isinstance(mark, ast.Call) else mark  # pytest.mark.skipif(...)
            if isinstance(mark, ast.Attribute) and isinstance(mark.value, ast.Attribute) and mark.value.attr == "mark":
                names.add(mark.attr)
    return names


def launches_ranks(path: Path) -> bool:
    return LAUNCHES_RANKS.search(path.read_text(encoding="utf-8")) is not None


def test_rank_launches_fuzzers_and_the_corpus_are_slow_as_a_whole():
    files = [p for p in sorted(TESTS.glob("test_*.py")) if p.name != Path(__file__).name]
    must = {p.name for p in files if launches_ranks(p)} | SLOW_AS_A_WHOLE
    assert {"test_distributed.py", "test_fuzz.py", "test_corpus.py"} <= must, must  # the rule still finds them
    unmarked = sorted(name for name in must if "slow" not in module_marks(TESTS / name))
    assert not unmarked, f"mark these files slow as a whole (pytestmark = pytest.mark.slow): {unmarked}"


def test_bad_input_cases_that_launch_ranks_are_slow():
    """The bad-input corpus is one parametrised test: a case that gets as far as starting its ranks is marked alone."""
    from tests import test_bad_inputs

    assert test_bad_inputs.LAUNCHES_RANKS <= {c.id for c in test_bad_inputs.CASES}, "a case named there was renamed"
    (parametrize,) = [
        m for m in test_bad_inputs.test_bad_input_gets_one_clear_line.pytestmark if m.name == "parametrize"
    ]
    marked = {p.id for p in parametrize.args[1] if any(m.name == "slow" for m in p.marks)}
    assert test_bad_inputs.LAUNCHES_RANKS <= marked


def test_the_rule_reads_marks_as_they_are_written(tmp_path):
    cases = {
        "pytestmark = pytest.mark.slow\n": {"slow"},
        "pytestmark = [pytest.mark.skipif(True, reason='x'), pytest.mark.slow]\n": {"skipif", "slow"},
        "pytestmark: list = (pytest.mark.slow,)\n": {"slow"},
        "import pytest\n\n\n@pytest.mark.slow\ndef test_one():\n    pass\n": set(),  # a test's mark is not the file's
        "# pytestmark = pytest.mark.slow\n": set(),
    }
    for source, marks in cases.items():
        (tmp_path / "test_x.py").write_text(source)
        assert module_marks(tmp_path / "test_x.py") == marks, source


@pytest.mark.parametrize(
    "source, launches",
    [
        ('launch(tmp_path, config, "--nproc", "2")', True),
        ('config = {"distributed": {"nproc": 2}}', True),
        ('factory = "tests.distributed_models:gpt"', True),
        ("import torch.distributed as dist", False),
    ],
)
def test_the_rule_finds_a_launch(tmp_path, source, launches):
    (tmp_path / "test_x.py").write_text(source + "\n")
    assert launches_ranks(tmp_path / "test_x.py") is launches
