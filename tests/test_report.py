"""The terminal report shows what the checks found: the leak map, the ledger, the mask table, the RoPE numbers."""

from __future__ import annotations

import io
import re

from rich.console import Console

from fwdcheck.report.terminal import render
from tests.conftest import run_checks


def rendered(report) -> str:
    console = Console(file=io.StringIO(), width=140, color_system=None)
    render(report, console)
    return console.file.getvalue()


def test_exhaustive_leak_map_is_a_full_upper_triangle():
    report = run_checks({"source": "reference", "bugs": ["no-causal-mask"]}, ["future-token"], exhaustive=True,
                        inputs={"batch_size": 2, "seq_len": 5})
    text = rendered(report)
    rows = {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"│\s+(\d)  (.*?)│", text)}
    assert rows == {0: "####", 1: "###", 2: "##", 3: "#"}, rows
    assert "failed (exit 1)" in text


def test_long_sequences_bin_the_leak_map():
    report = run_checks({"source": "reference", "max_seq_len": 256}, ["future-token"], exhaustive=True,
                        inputs={"batch_size": 1, "seq_len": 150})
    text = rendered(report)
    assert "3 positions per char" in text
    leak_map = text.split("query\\k")[1].split("# moved beyond")[0]
    assert "." in leak_map and "#" not in leak_map


def test_every_section_renders_for_a_clean_model():
    text = rendered(run_checks({"source": "reference", "attention": "eager", "n_kv_heads": 1}))
    for expected in ("shape-ledger", "[B,h,T,d_h]", "conventions", "True = may attend", "True = masked out",
                     "may-read set", "probe q", "declared: pairing half", "passed (exit 0)"):
        assert expected in text, expected


def test_messages_with_brackets_are_shown_verbatim():
    report = run_checks({"source": "reference", "bugs": ["no-causal-mask"]}, ["mask-audit"])
    report.results[0].findings[0].message = "mask [bold] text [/bold] kept"
    assert "mask [bold] text [/bold] kept" in rendered(report)
