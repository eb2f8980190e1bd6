"""`fwdcheck shrink` over every architecture of transformers' causal-LM, seq2seq, image-text-to-text and masked-LM
mappings: each config class's defaults, as a user's `source: hf` config names them (`config: {model_type: ...}`,
with the class the family's sweep names), shrunk by the command's own code (shrink_file), and each model counted on
the meta device before and after.

    python -m tests.shrink_sweep              # one line per architecture, then the counts per mapping
    python -m tests.shrink_sweep --summary    # the counts only

What each architecture can come to: `shrunk` (something was cut and the model is small), `too big` (something was
cut, but the shrunk model still keeps over MAX_SHRUNK_PARAMETERS: `fwdcheck shrink` exits 4), `unchanged` (nothing to
cut: small already, exit 0, or big with sizes the rules do not read, exit 4), `refused` (its shrunk config does not
build: exit 2) and `not built` (its config class's own defaults do not build a model, unshrunk: nothing to measure).
tests/test_shrink.py runs it (the slow tier) and holds the expectations.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from tests.arch_sweep import SWEEPS, _defaults_build, _quiet, architectures

KINDS = ("causal-lm", "seq2seq", "image-text-to-text", "masked-lm")


@dataclass(frozen=True)
class Outcome:
    model_type: str
    kind: str
    verdict: str  # shrunk | too big | unchanged | refused | not built
    before: int | None = None
    after: int | None = None
    largest: tuple[str, int] | None = None
    said: str = ""  # why it was refused


@functools.cache
def outcome(model_type: str, kind: str) -> Outcome:
    """The architecture's defaults shrunk as `fwdcheck shrink` shrinks them, and what that came to."""
    from fwdcheck.errors import UsageError
    from fwdcheck.model.sources.shrink import shrink_file

    named = SWEEPS[kind].named_class
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        path = Path(folder) / f"{model_type}.yaml"
        cls = f"  class: {named}\n" if named else ""
        path.write_text(f"model:\n  source: hf\n{cls}  config: {{model_type: {model_type}}}\n", encoding="utf-8")
        try:
            shrunk = shrink_file(path, Path(folder) / "out.yaml")
        except UsageError as exc:
            verdict = "refused" if _defaults_build(model_type, kind) else "not built"
            return Outcome(model_type, kind, verdict, said=str(exc).splitlines()[0][:200])
    counted = shrunk.parameters
    assert counted is not None  # a Hugging Face config is always counted
    if counted.before is None:
        return Outcome(model_type, kind, "not built", after=counted.after)
    verdict = "too big" if counted.too_big else "shrunk"
    if not shrunk.cut:
        verdict = "unchanged"
    return Outcome(model_type, kind, verdict, counted.before, counted.after, counted.largest)


def outcomes(kind: str) -> list[Outcome]:
    return [outcome(name, kind) for name in architectures(kind)]


def millions(count: int | None) -> str:
    return "-" if count is None else f"{count / 1e6:,.0f}M" if count >= 10e6 else f"{count / 1e6:.2g}M"


def summary(kind: str) -> str:
    counts: dict[str, int] = {}
    for o in outcomes(kind):
        counts[o.verdict] = counts.get(o.verdict, 0) + 1
    shown = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
    return f"{kind}: {len(architectures(kind))} enumerated: {shown}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="the counts per mapping only")
    parser.add_argument("--kind", choices=KINDS, action="append", help="only this mapping (repeatable)")
    args = parser.parse_args()
    for kind in args.kind or KINDS:
        if not args.summary:
            for o in outcomes(kind):
                part = f" (largest part {o.largest[0]}: {millions(o.largest[1])})" if o.verdict == "too big" else ""
                print(f"{kind} {o.model_type}: {o.verdict} {millions(o.before)} -> {millions(o.after)}{part} {o.said}")
        print(summary(kind), flush=True)
