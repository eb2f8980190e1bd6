"""What a run with no `checks:` catches, before and after the default became every check that applies.

    python benchmarks/default_catch.py            # every planted bug of the reference model, on both attention paths
    python benchmarks/default_catch.py --sdpa     # the SDPA path only: half the runs

A corpus of bug reproductions: every bug the reference model plants (fwdcheck/config/bugs.py, as
tests/test_bug_matrix.py runs them), grouped by the class of bug that shipped in public code (a causal mask lost,
a cache decoded at the wrong position, labels shifted twice, ...). Each bug runs twice on the same model and
inputs: with the former default selection (the four checks a config without `checks:` used to run) and with today's
(`checks: [default]`). A bug counts as caught when at least one check fails. The table prints, per class, how many
of its reproductions each selection catches and which checks failed.

The model, its length and dtype are those tests/test_bug_matrix.py uses for the bug (rope angles in bfloat16 at
4096 positions, packed documents with learned positions), so that each bug can show at all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.conftest's run_checks, from a checkout

from fwdcheck.config.bugs import BUGS  # noqa: E402
from tests.conftest import run_checks  # noqa: E402
from tests.test_bug_matrix import BUG_RUN  # noqa: E402 -- (model fields, dtype) where a bug needs them to show

FORMER_DEFAULT = ["shape-ledger", "future-token", "mask-audit", "rope"]

# The class of shipped bug each planted bug reproduces
CLASSES = {
    "causal mask lost or inverted": ["no-causal-mask", "inverted-bool-mask", "float-mask-01", "sdpa-dropout-in-eval"],
    "samples read each other": ["batch-mix"],
    "rope applied wrong": ["rope-k-unrotated", "rope-pairing-mismatch", "rope-absolute-offset"],
    "cache decode (position, mask, rope offset)": [
        "kv-cache-position-off-by-one",
        "kv-cache-mask-top-left",
        "kv-cache-rope-restart",
    ],
    "attention scale on one path": ["eager-scale-1-over-d", "sdpa-scale-dropped"],
    "rope angles in half precision": ["rope-angles-in-model-dtype"],
    "labels shifted twice or not at all": ["label-no-shift", "label-double-shift"],
    "packed documents not kept apart": ["packing-no-document-mask", "packing-positions-not-reset"],
    "sliding window one key wider": ["sliding-window-one-wider"],
    "scale applied twice, OPT-style": ["scale-applied-twice"],
    "every shape kept (heads swapped)": ["heads-swapped"],
}
MODEL = {"source": "reference", "vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2, "dropout": 0.1}


def failing(bug: str, attention: str, checks: list[str] | None) -> list[str]:
    """The checks that fail on the reference model with this bug planted."""
    fields, dtype = BUG_RUN.get(bug, ({}, "float32"))
    report = run_checks({**MODEL, "bugs": [bug], "attention": attention, **fields}, checks, dtype=dtype)
    return [r.name for r in report.results if r.status.value == "fail"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdpa", action="store_true", help="the SDPA path only")
    args = parser.parse_args()
    assert sorted(b for bugs in CLASSES.values() for b in bugs) == sorted(BUGS), "a planted bug without a class"
    paths = ["sdpa"] if args.sdpa else ["sdpa", "eager"]
    print(f"{'class of bug':<44} {'runs':>4} {'former default':>15} {'default now':>12}   failing now")
    totals = [0, 0, 0]
    for name, bugs in CLASSES.items():
        runs = before = after = 0
        seen: dict[str, None] = {}
        for bug in bugs:
            for attention in paths:
                runs += 1
                before += bool(failing(bug, attention, FORMER_DEFAULT))
                now = failing(bug, attention, None)
                after += bool(now)
                seen.update(dict.fromkeys(now))
        totals = [totals[0] + runs, totals[1] + before, totals[2] + after]
        print(f"{name:<44} {runs:>4} {before:>9}/{runs:<5} {after:>6}/{runs:<5}   {', '.join(seen) or '-'}")
    runs, before, after = totals
    print(
        f"{'all':<44} {runs:>4} {before:>9}/{runs:<5} {after:>6}/{runs:<5}   "
        f"({before / runs:.0%} -> {after / runs:.0%} caught by a run with no `checks:`)"
    )


if __name__ == "__main__":
    main()
