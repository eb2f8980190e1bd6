"""The example reports in the README and the docs, rendered from real runs of the configs they name.

    python -m tests.readme_example            # print them
    python -m tests.readme_example --write    # rewrite the examples between their markers

tests/test_report.py asserts that the README and docs/index.md hold exactly the first (`example`), so the numbers it
quotes are the ones a run gives. The runs are deterministic (the configs' seeds, float32 on the CPU) and the text
leaves every duration out. The numeric contract's and `fwdcheck diff`'s examples (`golden`, `diff`, in
docs/what-changed.md) are asserted with their numbers masked (tests/test_diff.py): they quote differences down to
the last bits of float32, which another CPU's kernels round differently, while every name, verdict and exit code
must stay what a run gives.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import tempfile
from pathlib import Path

import torch
from rich.console import Console

from fwdcheck.checks.golden_file import golden_text, read_golden
from fwdcheck.config.registry import select
from fwdcheck.config.schema import load_config
from fwdcheck.model.sources import load_model
from fwdcheck.report.terminal import render, render_diff
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.plan import resolve
from fwdcheck.run.runner import Run, run_model
from fwdcheck.run.settings import Settings
from tests.doc_sections import DOCS, README, ROOT, read_section, write_sections

CONFIG = "sample_configs/broken/inverted-bool-mask.yaml"
WIDTH = 110  # the header line whole, and about what a README code block shows without scrolling
PANELS = 1  # detail panels shown; the others are elided, the verdict line closes the example


def example() -> str:
    """The fenced block: the command, then its default report up to the end of the first detail panel, then '...',
    the short summary and the verdict line."""
    config = load_config(ROOT / CONFIG)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # SDPA's CPU kernels split their sums by thread: backends' kernel change, to the last bit
    try:
        report = run_model(load_model(config), Settings.from_config(config), select(config.checks), config_path=CONFIG)
    finally:
        torch.set_num_threads(threads)
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None)
    render(report, console, durations=False)
    lines = [line.rstrip() for line in console.file.getvalue().splitlines()]
    panel_ends = [i for i, line in enumerate(lines) if line.startswith("╰")]
    shown = lines[: panel_ends[PANELS - 1] + 1] if len(panel_ends) > PANELS else lines[:-1]
    elided = ["..."] if len(panel_ends) > PANELS else []
    summary = next((i for i, line in enumerate(lines) if line.startswith("short summary")), len(lines) - 1)
    return "\n".join(["```", f"$ fwdcheck run {CONFIG}", *shown, *elided, *lines[summary:], "```"])


GOLDEN_MAIN, GOLDEN_BRANCH = "examples/golden/main.yaml", "examples/golden/branch.yaml"
DIFF_A, DIFF_B, DIFF_PARTS = "examples/diff/gpt2.yaml", "examples/diff/port.yaml", "examples/diff/port-no-scale.yaml"
TABLE_ROWS = 7  # rows of the parting diff's table shown before "..."


def _console() -> Console:
    return Console(file=io.StringIO(), width=WIDTH, color_system=None)


def _lines(console: Console) -> list[str]:
    # paths of this checkout as the reader's clone has them
    return [line.rstrip().replace(f"{ROOT}/", "") for line in console.file.getvalue().splitlines()]


def golden_example() -> str:
    """--save-golden on main.yaml (its one line with -q), then --expect-golden on branch.yaml: the table, the
    golden panel up to its first moved outputs, '...' and the verdict line."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "golden.json"
        config = load_config(ROOT / GOLDEN_MAIN)
        run = Run.build(resolve(config, Overrides(checks=[*config.checks, "golden"])))
        saved = run.check(run.load(), config_path=GOLDEN_MAIN)
        path.write_text(golden_text(saved.result("golden"), saved))
        size = path.stat().st_size
        expected = read_golden(path, f"--expect-golden {path}")
    console = _console()
    render(saved, console, durations=False, verbosity="quiet")
    saving = _lines(console)
    config = load_config(ROOT / GOLDEN_BRANCH)
    overrides = Overrides(checks=[*config.checks, "golden"], expected={"--expect-golden": expected})
    run = Run.build(resolve(config, overrides))
    console = _console()
    render(run.check(run.load(), config_path=GOLDEN_BRANCH), console, durations=False)
    lines = _lines(console)
    moved = next(i for i, line in enumerate(lines) if re.search(r"module outputs that moved \(\d+\)", line))
    return "\n".join(
        [
            "```",
            f"$ fwdcheck run {GOLDEN_MAIN} --save-golden golden.json -q",
            *saving,
            f"$ wc -c golden.json  # one module a line: {len(expected['outputs'])} outputs, "
            f"{len(expected['parameters'])} parameters and buffers",
            f"{size} golden.json",
            f"$ fwdcheck run {GOLDEN_BRANCH} --expect-golden golden.json",
            *lines[: moved + 6],
            "...",
            lines[-1],
            "```",
        ]
    )


def _diff(a: str, b: str) -> dict:
    from typer.testing import CliRunner

    from fwdcheck.cli import app

    result = CliRunner().invoke(app, ["diff", str(ROOT / a), str(ROOT / b), "--format", "json"], catch_exceptions=False)
    return json.loads(result.stdout)


def diff_example() -> str:
    """GPT-2 against its port (equal, as piped: no plot), then against the port with the scale dropped (as on a
    terminal: the plot; the table cut after its first rows)."""
    console = _console()
    render_diff(_diff(DIFF_A, DIFF_B), console)
    equal = _lines(console)
    console = _console()
    render_diff(_diff(DIFF_A, DIFF_PARTS), console, plot=True)
    parts = _lines(console)
    plot = next(i for i, line in enumerate(parts) if line.startswith("tol x1") or re.match(r"\s+1e[+-]\d+ ", line))
    return "\n".join(
        [
            "```",
            f"$ fwdcheck diff {DIFF_A} {DIFF_B}",
            *equal,
            f"$ fwdcheck diff {DIFF_A} {DIFF_PARTS}   # on a terminal: the plot",
            *parts[: 2 + TABLE_ROWS],
            "...",
            *parts[plot:],
            "```",
        ]
    )


EXAMPLES = {"example": example, "golden": golden_example, "diff": diff_example}  # marker name -> its text


# Where each example is shown: the README's example on the site's front page too
PAGES = {
    "example": (README, DOCS / "index.md"),
    "golden": (DOCS / "what-changed.md",),
    "diff": (DOCS / "what-changed.md",),
}


def marker(name: str) -> str:
    return name if name == "example" else f"{name}-example"


def documented_example(name: str = "example", page: Path | None = None) -> str:
    """The example as a page shows it (by default the first page that holds it)."""
    return read_section(page or PAGES[name][0], marker(name))


def write() -> None:
    bodies: dict[Path, dict[str, str]] = {}
    for name, make in EXAMPLES.items():
        text = make()
        for page in PAGES[name]:
            bodies.setdefault(page, {})[marker(name)] = text
    for page, sections in bodies.items():
        write_sections(page, sections)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the examples in the README and docs/")
    if parser.parse_args().write:
        write()
    else:
        print("\n\n".join(make() for make in EXAMPLES.values()))
