"""What the reliability tests exercise, counted, as the lines docs/reliability.md quotes.

    python scripts/reliability_counts.py          # the counts, read from the tests themselves
    python scripts/reliability_counts.py --run    # run those tests first; the line is printed only if they pass

The counts come from the test modules, not from a copy: the bad-input corpus (tests/bad_inputs/*.yaml, through
tests/test_bad_inputs.CASES), the examples each fuzz property runs (the hypothesis settings in tests/test_fuzz.py) and
the model-failure modes (tests/test_model_failures.MODES, each run through the CLI and in-process with the model
compared bitwise before and after). A second line counts the fuzzing of a document's structure (depth, aliases) and
of the expected ledger (`--expect-ledger`), which the first line's fuzzed documents (configs) do not include. A third
counts the cases of tests/test_gate.py and tests/test_gate_supervised.py: what ordinary projects do that could make the
gate say pass when it should not, or harm what it runs in (a reused logits buffer, a worker that ends badly, a forked
child's report, an output over the model's code, text no report format can hold; a model that exits or hangs under
the pytest plugin or `fwdcheck diff`, two configs' same-named `models.py`, a `fwdcheck/` folder where the command
runs, a process the model leaves running, torch's defaults moved, lazy modules, an attribute grown with its buffer),
each run where it must pass and where it must fail. A fourth counts the cases marked `ordinary` (pytest -m ordinary
over ORDINARY): correct models in hostile-but-ordinary situations that must not be failed (recurrent and every other
form of dropout, spectral_norm and BatchNorm state a train forward updates, a model drawing nothing random, flex
attention without a backward on the CPU, masked vocabularies in a run and in `fwdcheck diff`, dict, tuple and
ModelOutput outputs, keyword-only forwards, adapters taking every check's extras, MLA value heads narrower than the
query heads, code compiled at import, ASCII-only streams, interrupted output); each file also holds the same model
with the bug planted, failing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reliability.md"  # where the lines are quoted; the tests hold it to them
GATE = ("tests/test_gate.py", "tests/test_gate_supervised.py")
ORDINARY = (
    "tests/test_train_state.py",
    "tests/test_calling.py",
    "tests/test_value_heads.py",
    "tests/test_ascii_streams.py",
    "tests/test_interrupted_writes.py",
    "tests/test_diff.py",
)
TESTS = ["tests/test_bad_inputs.py", "tests/test_fuzz.py", "tests/test_model_failures.py", *GATE, *ORDINARY]


def collected(paths: tuple[str, ...], *options: str) -> int:
    """The test cases of `paths` pytest collects with `options` (each parametrisation one case)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *options, *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(1 for row in proc.stdout.splitlines() if row.startswith(tuple(f"{path}::" for path in paths)))


def gate_count() -> int:
    """The test cases of the GATE files, as pytest collects them (each parametrisation one case)."""
    return collected(GATE)


def gate_line(n: int | None = None) -> str:
    return f"and {n if n is not None else gate_count()} cases of an ordinary project that could fool the gate"


def ordinary_count() -> int:
    """The cases of ORDINARY marked `ordinary`: correct models in hostile-but-ordinary situations."""
    return collected(ORDINARY, "-m", "ordinary")


def ordinary_line(n: int | None = None) -> str:
    return (
        f"and {n if n is not None else ordinary_count()} correct models in hostile-but-ordinary situations "
        "that must not be failed"
    )


def structure_counts() -> dict[str, int]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.test_fuzz import LEDGERS, STRUCTURES

    return {"fuzzed_structures": STRUCTURES.max_examples, "fuzzed_ledgers": LEDGERS.max_examples}


def structure_line(c: dict[str, int] | None = None) -> str:
    c = c or structure_counts()
    return (
        f"and {c['fuzzed_structures']} YAML documents nested deep or aliased, {c['fuzzed_ledgers']} fuzzed "
        "expected ledgers"
    )


def counts() -> dict[str, int]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.test_bad_inputs import CASES
    from tests.test_fuzz import ARBITRARY, MUTATIONS
    from tests.test_model_failures import MODES

    return {
        "bad_configs": len(CASES),
        "fuzzed_documents": ARBITRARY.max_examples + MUTATIONS.max_examples,
        "model_failure_modes": len(MODES),
    }


def line(c: dict[str, int] | None = None) -> str:
    c = c or counts()
    return (
        f"{c['bad_configs']} bad configs, {c['fuzzed_documents']} fuzzed documents, "
        f"{c['model_failure_modes']} model-failure modes, model bitwise unchanged in all"
    )


def main(argv: list[str]) -> int:
    if "--run" in argv:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=REPO)
        if proc.returncode != 0:
            print(f"the reliability tests failed (pytest exit {proc.returncode}); no counts line", file=sys.stderr)
            return proc.returncode
    print(line())
    print(structure_line())
    print(gate_line())
    print(ordinary_line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
