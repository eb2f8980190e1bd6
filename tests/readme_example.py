"""The example report in the README, rendered from a real run of the config it names.

    python -m tests.readme_example            # print it
    python -m tests.readme_example --write    # rewrite the README's example between its markers

tests/test_report.py asserts that the README holds exactly this text, so the numbers it quotes are the ones a run
gives. The run is deterministic (the config's seed, float32 on the CPU) and the text leaves every duration out.
"""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

from rich.console import Console

from fwdcheck.config import load_config
from fwdcheck.registry import select
from fwdcheck.report.terminal import render
from fwdcheck.runner import run_model
from fwdcheck.session import Settings
from fwdcheck.sources import load_model

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIG = "sample_configs/broken/inverted-bool-mask.yaml"
START, END = "<!-- example:start -->", "<!-- example:end -->"
WIDTH = 110  # the header line whole, and about what a README code block shows without scrolling
PANELS = 1  # detail panels shown; the others are elided, the verdict line closes the example


def example() -> str:
    """The fenced block: the command, then its default report up to the end of the first detail panel, then '...'
    and the verdict line."""
    config = load_config(ROOT / CONFIG)
    report = run_model(load_model(config), Settings.from_config(config), select(config.checks), config_path=CONFIG)
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None)
    render(report, console, durations=False)
    lines = [line.rstrip() for line in console.file.getvalue().splitlines()]
    panel_ends = [i for i, line in enumerate(lines) if line.startswith("╰")]
    shown = lines[:panel_ends[PANELS - 1] + 1] if len(panel_ends) > PANELS else lines[:-1]
    elided = ["..."] if len(panel_ends) > PANELS else []
    return "\n".join(["```", f"$ fwdcheck run {CONFIG}", *shown, *elided, lines[-1], "```"])


def readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    return match.group(1) if match else ""


def write() -> None:
    text = README.read_text(encoding="utf-8")
    block = f"{START}\n{example()}\n{END}"
    README.write_text(re.sub(re.escape(START) + r"\n.*?" + re.escape(END), lambda _: block, text, flags=re.S),
                      encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the README's example")
    if parser.parse_args().write:
        write()
    else:
        print(example())
