"""The terminal report shows what the checks found: the leak map, the ledger, the mask table, the RoPE numbers; a green
run briefly, a red one with the detail of what did not pass, in one line when asked; key numbers the verdict rests
on; ignored findings marked in every report."""

from __future__ import annotations

import functools
import io
import re
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

import fwdcheck
from fwdcheck.checks.mask_audit_view import may_read_grid
from fwdcheck.config.registry import select
from fwdcheck.model.reference import build
from fwdcheck.report import Report
from fwdcheck.report.github import to_github
from fwdcheck.report.junit import to_junit
from fwdcheck.report.markdown import to_markdown
from fwdcheck.report.terminal import Verbosity, key_number, render
from fwdcheck.result import Status
from tests import readme_example
from tests.conftest import run_checks
from tests.corpus import VOCAB, gpt_fast, modded, torch_models


def rendered(report, verbosity: Verbosity = Verbosity.VERBOSE, **options) -> str:
    console = Console(file=io.StringIO(), width=140, color_system=None)
    render(report, console, verbosity=verbosity, **options)
    return console.file.getvalue()


def test_exhaustive_leak_map_is_a_full_upper_triangle():
    report = run_checks(
        {"source": "reference", "bugs": ["no-causal-mask"]},
        ["future-token"],
        exhaustive=True,
        inputs={"batch_size": 2, "seq_len": 5},
    )
    text = rendered(report)
    rows = {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"│\s+(\d)  (.*?)│", text)}
    assert rows == {0: "####", 1: "###", 2: "##", 3: "#"}, rows
    assert "failed (exit 1)" in text


def test_long_sequences_bin_the_leak_map():
    report = run_checks(
        {"source": "reference", "max_seq_len": 256, "bugs": ["no-causal-mask"]},
        ["future-token"],
        exhaustive=True,
        inputs={"batch_size": 1, "seq_len": 150},
    )
    text = rendered(report)
    assert "3 positions per char" in text
    leak_map = text.split("query\\k")[1].split("# moved beyond")[0]
    assert "#" in leak_map
    rows = [line for line in leak_map.splitlines()[1:] if line.strip("│ ")]  # under the header, in the panel
    assert len(rows) == 24  # 50 rows of bins, the height capped


def test_long_sequences_on_a_causal_model_draw_no_map():
    report = run_checks(
        {"source": "reference", "max_seq_len": 256},
        ["future-token"],
        exhaustive=True,
        inputs={"batch_size": 1, "seq_len": 150},
    )
    text = rendered(report)
    assert "query\\k" not in text and "leak map: every earlier position still (50 query rows)" in text


def test_every_section_renders_for_a_clean_model():
    text = rendered(run_checks({"source": "reference", "attention": "eager", "n_kv_heads": 1}))
    for expected in (
        "shape-ledger",
        "[B,h,T,d_h]",
        "conventions",
        "True = may attend",
        "True = masked out",
        "may-read set",
        "probe q",
        "declared: pairing half",
        "passed (exit 0)",
    ):
        assert expected in text, expected


def test_messages_with_brackets_are_shown_verbatim():
    report = run_checks({"source": "reference", "bugs": ["no-causal-mask"]}, ["mask-audit"])
    report.results[0].findings[0].message = "mask [bold] text [/bold] kept"
    assert "mask [bold] text [/bold] kept" in rendered(report)


# -- attention that is not one square call, and what the checks could not run -----------------------------------------
# Real runs on the third-party corpus: gpt-fast's preallocated KV cache read by decode steps, nn.Transformer's encoder
# over a fixed source and its cross-attention, a forward that asserts T > 1.

RED = ("\x1b[31m", "\x1b[1;31m")


def styled(report, width: int = 120, verbosity: Verbosity = Verbosity.VERBOSE) -> str:
    """The report with its colours, as ANSI escapes: a failure is red, a note or a call not judged is dim."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system="standard", no_color=False)
    render(report, console, verbosity=verbosity)
    return console.file.getvalue()


def panel(text: str, check: str) -> str:
    """One check's detail panel, from its title to its bottom border (the summary table above repeats notes)."""
    lines, inside = [], False
    for line in text.splitlines():
        inside = inside or plain(line).startswith(f"╭─ {check} ")
        if inside and plain(line).startswith("╰"):
            return "\n".join(lines)
        if inside:
            lines.append(line)
    raise AssertionError(f"no {check} panel in:\n{plain(text)}")


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def grid_spans(call: dict) -> list[str]:
    """The style of each key slot the grid draws as readable, row by row."""
    caption, *lines = may_read_grid(call).renderables
    return [
        next((span.style for span in line.spans if span.start <= i < span.end), None)
        for line in lines
        for i, char in enumerate(line.plain)
        if char == "■"
    ]


def gpt_fast_generate(bug: str | None = None, checks: list[str] | None = None):
    """gpt-fast prefilling 4 tokens, then decoding 4 one at a time through a cache of 32 slots (input_pos)."""
    model = gpt_fast.transformer() if bug is None else gpt_fast.transformer_with(bug)
    return fwdcheck.check_model(model, checks, forward=gpt_fast.generate, vocab_size=VOCAB)


def test_calls_not_judged_are_dim_with_their_reason_never_red():
    report = fwdcheck.check_model(torch_models.transformer(source_length=8), ["mask-audit"])  # square cross-attention
    text = styled(report)
    mask = panel(text, "mask-audit")
    assert not any(red in mask for red in RED), plain(mask)
    shown = plain(mask)
    # nn.Transformer is an encoder-decoder: its cross-attention is judged (every source position), its encoder not
    assert shown.count("not judged:") == 2 and shown.count("every source") == 2, shown
    assert "encoder self-attention over the source held fixed: full attention by design" in shown
    for line in mask.splitlines():  # each such row says so in dim, beside its module's whole name
        if "not judged:" in line:
            assert "\x1b[2mnot judged:" in line, line
            assert re.search(r"transformer\.\w+\.layers\.\d\.(self_attn|multihead_attn) ", plain(line)), line
    # The grid is drawn for a judged call (the decoder's causal self-attention), not the encoder's full set.
    assert "may-read set of transformer.decoder.layers.0.self_attn" in shown
    assert "transformer.decoder.layers.0.multihead_attn" in shown


def test_a_call_not_judged_is_drawn_plain_when_it_is_all_there_is():
    report = fwdcheck.check_model(torch_models.transformer(source_length=8), ["mask-audit"])
    result = report.result("mask-audit")
    result.data["calls"] = [c for c in result.data["calls"] if not c["judged"]]
    mask = panel(styled(report, width=160), "mask-audit")
    caption = "may-read set of transformer.encoder.layers.0.self_attn (rows: queries; columns: 8 key slots)"
    assert f"{caption}: not judged, drawn plain" in plain(mask)
    assert not any(red in mask for red in RED)
    encoder = next(c for c in result.data["calls"] if c["module"].startswith("transformer.encoder"))
    assert set(grid_spans(encoder)) == {None} and len(grid_spans(encoder)) == 64  # every key, in no colour


def test_decode_steps_are_drawn_against_their_own_positions():
    report = gpt_fast_generate(checks=["mask-audit"])
    result = report.result("mask-audit")
    shown = plain(styled(report))
    assert "4 x 32 at 0..3" in shown and "1 x 32 at 7" in shown
    assert "query positions (L x S at ...) from: input_pos" in shown
    step = next(c for c in result.data["calls"] if c["query_positions"] == [4])
    # Query 0 of this step sits at position 4: slots 0..4 are its past and itself, green; none is the future.
    assert grid_spans(step) == ["green"] * 5

    result.data["calls"] = [c for c in result.data["calls"] if c["queries"] == 1]  # the decode steps alone
    text = styled(report)
    mask = panel(text, "mask-audit")
    assert "may-read set of layers.0.attention (rows: queries at 4 (input_pos); columns: 32 key slots)" in plain(mask)
    assert "■ ■ ■ ■ ■ · · ·" in plain(mask) and not any(red in mask for red in RED)


def test_a_mask_that_opens_later_slots_is_red_from_the_query_position_on():
    report = gpt_fast_generate("inverted-bool-mask", ["mask-audit"])
    step = next(c for c in report.result("mask-audit").data["calls"] if c["query_positions"] == [4])
    assert grid_spans(step) == ["red"] * 27  # slots 5..31: after position 4, and only those
    mask = plain(panel(styled(report), "mask-audit"))
    assert "inverted: the future only" in mask and "FWD202" in mask


def test_refused_passes_and_the_single_row_are_said_under_the_leak_map():
    report = fwdcheck.check_model(
        modded.gpt_with("smear-roll", min_two_tokens=True),
        ["shape-ledger", "future-token"],
        vocab_size=VOCAB,
        dims=modded.DIMS,
    )
    text = styled(report)
    future = plain(panel(text, "future-token"))
    assert "prefix pass at k=1 skipped: the model raised AssertionError at T=1" in future
    assert "single row (batch size 1, T=2): tokens >= 1 replaced" in future
    for line in panel(text, "future-token").splitlines():
        if "prefix pass at k=1 skipped" in line:
            assert "\x1b[2mprefix pass" in line, line  # a note, not a finding
    ledger = plain(panel(text, "shape-ledger"))
    assert "logits are 128 wide for a vocabulary of 96 (V_pad): a padded output vocabulary" in ledger
    assert "axes of size 16 are shown by their size" in ledger


def test_rope_says_what_it_read_over_a_cache_and_what_it_skipped():
    rope = plain(panel(styled(gpt_fast_generate(checks=["rope"])), "rope"))
    assert "probe q" in rope and "interleaved" in rope
    assert "probe: 2 call(s) read a KV cache; only the key slots holding the probe's positions were read" in rope
    assert "logits shift: skipped: forward takes no position_ids" in rope


def test_the_single_row_note_says_why_it_did_not_run():
    report = run_checks({"source": "reference"}, ["future-token"], inputs={"batch_size": 1, "seq_len": 8})
    assert "single row: not needed: the comparisons above already ran one row beside several" in rendered(report)


def test_a_long_cache_is_drawn_as_a_window_around_the_query_position():
    """100 slots would wrap the grid; the window drawn holds the query's position and the slot it wrongly reads."""
    row = [int(j <= 80 or j == 90) for j in range(100)]
    call = {
        "module": "layers.0.attention",
        "may_read": [row],
        "judged": True,
        "query_positions": [80],
        "positions_from": "input_pos",
        "pattern": "leaky: some future keys",
    }
    caption, line = may_read_grid(call).renderables
    assert caption.plain == (
        "may-read set of layers.0.attention (rows: queries at 80 (input_pos); columns: 100 key slots, 45..92 shown)"
    )
    assert line.plain.split() == ["■"] * 36 + ["·"] * 9 + ["■", "·", "·"]
    assert grid_spans(call) == ["green"] * 36 + ["red"]


# -- how much is shown: quiet when green, the detail of what did not pass, one line when asked -------------------------


@functools.cache
def reference_run(*bugs: str, checks: tuple[str, ...] | None = None, **model) -> Report:
    """A run of the reference model with the bugs planted, shared by the tests below (reports are read, not changed)."""
    return run_checks({"source": "reference", "bugs": list(bugs), **model}, list(checks) if checks else None)


def test_a_passing_run_is_its_summary_table_and_verdict():
    report = reference_run()
    text = rendered(report, Verbosity.DEFAULT)
    assert "╭─" not in text, text  # no detail panel
    lines = text.splitlines()
    assert len(lines) <= 4 + 2 * len(report.results), text  # a title, the header, its rule, the verdict: one row each
    for name in [entry.name for entry in select(None)]:  # every default check applies to the reference model
        assert re.search(rf"^{name}\s+pass\s+\S.*\s\d+\.\d\ds\s", text, re.MULTILINE), text  # key number and time
    assert lines[-1] == "passed (exit 0)" and report.exit_code == 0


def test_a_failing_run_details_only_the_checks_that_did_not_pass():
    report = reference_run("no-causal-mask")
    text = rendered(report, Verbosity.DEFAULT)
    # a mask dropped everywhere: the cached decode and the gradients read the future too
    failing = [("future-token", "fail"), ("mask-audit", "fail"), ("kv-cache", "fail"), ("grad-causality", "fail")]
    assert re.findall(r"^╭─ (\S+) (\S+)", text, re.MULTILINE) == failing
    assert "FWD101" in text and "FWD201" in text and "query\\k" in text
    assert text.splitlines()[-1] == f"failed (exit {report.exit_code})" and report.exit_code == 1


def test_verbose_details_every_check_that_ran():
    report = reference_run(positional="learned")  # rope and rope-precision do not apply: nothing to detail
    panels = re.findall(r"^╭─ (\S+) (\S+)", rendered(report), re.MULTILINE)
    assert panels == [(r.name, "pass") for r in report.results if r.name not in ("rope", "rope-precision")]
    assert len(panels) == 9


def test_quiet_is_one_line_with_what_decided_the_exit_code():
    failing = reference_run("no-causal-mask")
    line = rendered(failing, Verbosity.QUIET)
    assert line.count("\n") == 1, line
    assert line.startswith(
        "fwdcheck: failed (exit 1) — future-token FWD101 FWD105, mask-audit FWD201, kv-cache FWD503 FWD501, "
        "grad-causality FWD121 · "
    ), line
    assert re.search(r" · checks \d+\.\d s$", line.rstrip())
    passing = rendered(reference_run(positional="learned"), Verbosity.QUIET)
    assert passing.startswith(
        "fwdcheck: passed (exit 0) — 9 checks (shape-ledger, future-token, mask-audit, kv-cache, packing, "
        "label-shift, grad-causality, backends, attention-stats); did not apply: rope, rope-precision · "
    ), passing
    nothing = reference_run(positional="learned", checks=("rope",))
    assert rendered(nothing, Verbosity.QUIET).startswith(
        "fwdcheck: nothing ran (exit 5) — 0 checks; did not apply: rope"
    )
    # a skip the run's inputs cause (too short to decode after a prefill) is not a check that does not apply
    short = run_checks({"source": "reference"}, ["kv-cache"], inputs={"batch_size": 2, "seq_len": 3})
    assert rendered(short, Verbosity.QUIET).startswith("fwdcheck: nothing ran (exit 5) — 0 checks; skipped: kv-cache")


def test_every_view_ends_with_the_exit_code_the_run_returns():
    for report in (reference_run(), reference_run("batch-mix"), reference_run(positional="learned", checks=("rope",))):
        for verbosity in Verbosity:
            assert f"(exit {report.exit_code})" in rendered(report, verbosity).splitlines()[-1]


def test_the_quiet_line_says_its_time_is_the_checks():
    """`-q` gave '· 0.3 s' for a run of 17 s wall time (start, imports, the model's build): the figure says what it
    measures."""
    line = rendered(reference_run("no-causal-mask"), Verbosity.QUIET).splitlines()[-1]
    assert re.search(r" · checks \d+\.\d s$", line), line


def test_durations_can_be_left_out():
    report = reference_run("no-causal-mask")
    for verbosity in Verbosity:
        text = rendered(report, verbosity, durations=False)
        assert not re.search(r"\d\.\d+ ?s\b", text), text


# -- key numbers and summaries: the measurement the verdict rests on ---------------------------------------------------


def test_the_key_number_is_the_change_that_failed():
    for bug in ("batch-mix", "no-causal-mask"):
        result = reference_run(bug).result("future-token")
        m = result.metrics
        assert result.status == Status.FAIL and m["decided_by"] == "max_change" and m["max_change"] > m["threshold"]
        assert key_number(result) == f"{m['max_change']:.2g} / {m['threshold']:.2g}"
    batch_mix = reference_run("batch-mix").result("future-token").metrics
    assert batch_mix["max_change"] == batch_mix["batch_max_change"] > 0.01  # samples read each other, and by this much


def test_dropout_live_in_eval_is_the_key_number_when_nothing_moved():
    result = reference_run("sdpa-dropout-in-eval", dropout=0.1).result("future-token")
    assert result.status == Status.FAIL and result.metrics["max_change"] <= result.metrics["threshold"]
    assert key_number(result) == "dropout in 2 calls"


def test_a_pass_shows_the_largest_change_of_every_comparison():
    result = reference_run().result("future-token")
    m = result.metrics
    compared = [
        m[name] for name in ("max_change_before_cut", "batch_max_change", "prefix_max_change", "single_row_max_change")
    ]
    assert m["max_change"] == max(compared) <= m["threshold"]
    assert key_number(result) == f"{max(compared):.2g} / {m['threshold']:.2g}"
    # the first forward (cuts 7 and 1) vouched alone: the summary counts the cuts that ran
    assert m["cuts"] == [1, 7]
    assert result.summary == (
        f"2 cuts + batch + prefix + single row: max change {max(compared):.2g} vs threshold {m['threshold']:.2g}"
        "; the train path passes (T=8)"
    )


def test_a_model_declared_not_causal_is_summarised_by_what_was_judged():
    model = build(vocab_size=16, d_model=8, n_heads=2, n_layers=2, bugs=["no-causal-mask"])
    result = fwdcheck.check_model(model, ["future-token"], causal=False, vocab_size=16).result("future-token")
    m = result.metrics
    assert result.status == Status.PASS and "max_change_before_cut" not in m
    assert result.summary == (
        f"batch: max change {m['batch_max_change']:.2g} vs threshold {m['threshold']:.2g}; "
        "part (a) not judged: bidirectional by design (model.causal: false in the config), so later "
        "tokens may move earlier logits; judged instead: samples independent, deterministic forwards, left padding "
        "where the code paths add it; the train path passes (T=8)"
    )


def test_a_skipped_check_shows_no_number():
    report = reference_run(positional="learned")
    rope = report.result("rope")
    assert rope.status == Status.SKIP and key_number(rope) == ""
    row = re.search(r"^rope\s+skip\s+(.*)$", rendered(report, Verbosity.DEFAULT), re.MULTILINE).group(1)
    # neither a key number nor a duration before the summary
    assert row.startswith("does not apply: no rotary embedding"), row


# -- ignored findings: shown, marked with the config's reason, counted nowhere -----------------------------------------

REASON = "known; fixed in #12"


def test_ignored_findings_are_marked_in_every_report():
    report = run_checks(
        {"source": "reference", "bugs": ["no-causal-mask"]},
        ["mask-audit"],
        ignore=[{"code": "FWD201", "reason": REASON}],
    )
    assert report.exit_code == 0 and report.result("mask-audit").findings[0].ignored == REASON

    for verbosity in (Verbosity.DEFAULT, Verbosity.VERBOSE):
        text = styled(report, verbosity=verbosity)
        marked = [line for line in text.splitlines() if "FWD201" in line and "[ignored: FWD201]" not in line]
        assert marked and not any(red in line for red in RED for line in marked), marked
        assert all("\x1b[2m" in line for line in marked), marked  # dim
        assert re.search(rf"ignored: {re.escape(REASON)}", plain(text)), plain(text)
    assert "ignored: mask-audit FWD201" in rendered(report, Verbosity.QUIET)

    assert f"| FWD201 | fail (ignored: {REASON}) |" in to_markdown(report)
    junit = ET.fromstring(to_junit(report)).find("testsuite/testcase")
    assert junit.find("failure") is None and f"(ignored: {REASON})" in junit.find("system-out").text
    github = to_github(report)
    assert "::error" not in github
    assert re.search(
        rf"^::notice [^:]*title=fwdcheck mask-audit FWD201 \(ignored\)::.*\(ignored: {REASON}\)$", github, re.MULTILINE
    ), github


# -- the README's and the docs' examples are real runs ---------------------------------------------------------------


@pytest.mark.parametrize("page", readme_example.PAGES["example"], ids=lambda p: p.name)
def test_readme_example_is_what_a_run_prints(page):
    assert readme_example.documented_example("example", page) == readme_example.example(), (
        f"run `python -m tests.readme_example --write` and commit {page.name}"
    )


NUMBER = re.compile(r"(?<![\w.#])(?<!exit )-?\d+(\.\d+)?(e[+-]?\d+)?(?![\w.])")


def masked(text: str) -> str:
    """The text with every number a run measures as N: names, verdicts and exit codes left as they are."""
    return NUMBER.sub("N", text)


@pytest.mark.parametrize("name", ["diff", "golden"])
@pytest.mark.slow
def test_the_readme_examples_of_what_changed_are_what_a_run_prints(name):
    """The numeric contract's and fwdcheck diff's examples, their numbers masked (tests/readme_example.py says
    why)."""
    assert masked(readme_example.documented_example(name)) == masked(readme_example.EXAMPLES[name]()), (
        "run `python -m tests.readme_example --write` and commit docs/what-changed.md"
    )


@pytest.mark.parametrize(("bug", "shown"), [("no-causal-mask", False), ("inverted-bool-mask", True)])
def test_the_conventions_table_comes_with_a_convention_finding_only(bug, shown):
    """A missing mask's panel is the calls and the finding; a mask in the other API's convention (FWD202) is where
    the table of each API's convention is what the reader needs."""
    text = rendered(run_checks({"source": "reference", "bugs": [bug]}, ["mask-audit"]), Verbosity.DEFAULT)
    assert "what each call used" in text
    assert ("True = may attend" in text) is shown and ("conventions" in text.split("what each call used")[0]) is shown
