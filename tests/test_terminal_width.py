"""The terminal report laid out for the console's width: every sample config's report at 80 and 120 columns, in the
default and the verbose view, has no line wider than the console and cuts no word a reader needs: a mask-audit call's
module, mask convention, flags (is_causal, dropout_p) and verdict stay whole, and only a passing check's summary in
the default view may end in an ellipsis (its detail is a -v away). At 80 columns the mask's shape gives way first."""

from __future__ import annotations

import functools
import io
import re
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console

import fwdcheck
from fwdcheck.config.registry import select
from fwdcheck.config.schema import load_config
from fwdcheck.model.sources import load_model
from fwdcheck.report import Report
from fwdcheck.report.terminal import Verbosity, render
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings
from tests.corpus import torch_models

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted((ROOT / "sample_configs").rglob("*.yaml"))
WIDTHS = (80, 120)


@functools.cache
def report_of(config_path: Path) -> Report:
    config = load_config(config_path)
    if config.model.source == "hf":
        pytest.importorskip("transformers")
    return run_model(load_model(config), Settings.from_config(config), select(config.checks), config_path=config_path)


def rendered(report: Report, width: int, verbosity: Verbosity) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    render(report, console, verbosity=verbosity)
    return console.file.getvalue()


def assert_laid_out(report: Report, text: str, width: int, verbosity: Verbosity, modules_whole: bool = True) -> None:
    lines = text.splitlines()
    too_wide = [line for line in lines if cell_len(line) > width]
    assert not too_wide, "\n".join(too_wide)
    names = "|".join(re.escape(r.name) for r in report.results)
    for line in lines:
        if "…" in line:  # only a passing check's summary, in the default view, is cut short
            assert verbosity == Verbosity.DEFAULT and re.match(rf"({names})\s+pass\b", line), line
    if "what each call used" not in text:
        return
    assert re.search(r"module\s.*\smask\s.*\sflags\s.*\smay read", text), text
    words = set(re.findall(r"[^\s│,]+", text))
    for call in report.result("mask-audit").data["calls"]:
        cells = [call["mask"], call["pattern"].split()[0].rstrip(",")] + ([call["module"]] if modules_whole else [])
        cells += ["is_causal"] if call.get("is_causal") else []
        cells += [f"dropout_p={call['dropout_p']:g}"] if call.get("dropout_p") else []
        for cell in cells:
            assert cell in words, (cell, text)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    "config",
    [
        # a Hugging Face model is built (on the meta device too): seconds, the slow tier
        pytest.param(
            p, id=str(p.relative_to(ROOT / "sample_configs")), marks=[pytest.mark.slow] if p.parent.name == "hf" else []
        )
        for p in SAMPLES
    ],
)
@pytest.mark.slow
def test_every_sample_config_fits_the_width(config, width):
    report = report_of(config)
    for verbosity in (Verbosity.DEFAULT, Verbosity.VERBOSE):
        text = rendered(report, width, verbosity)
        assert_laid_out(report, text, width, verbosity)
        if width >= 120:
            assert "left out to fit the width" not in text, text


def test_the_mask_shape_gives_way_first_at_80_columns():
    text = rendered(report_of(ROOT / "sample_configs" / "broken" / "sdpa-dropout-in-eval.yaml"), 80, Verbosity.DEFAULT)
    assert "shape: left out to fit the width" in text
    assert re.search(r"layers\.0\.attn\s+sdpa\s+bool\s+True on \d+%\s+dropout_p=0\.1\s+9 x 9\s+causal", text), text


def test_long_module_names_fold_only_when_nothing_else_can_give_way():
    """nn.Transformer's calls: module names of 40 characters and more, calls not judged with their reason."""
    report = fwdcheck.check_model(torch_models.transformer(source_length=8), ["mask-audit"])
    text = rendered(report, 80, Verbosity.VERBOSE)
    assert_laid_out(report, text, 80, Verbosity.VERBOSE, modules_whole=False)
    assert "api, shape, values, L x S: left out to fit the width" in text
    wide = rendered(report, 120, Verbosity.VERBOSE)
    assert "transformer.decoder.layers.0.multihead_attn" in wide and "left out" not in wide
