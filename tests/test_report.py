"""The terminal report shows what the checks found: the leak map, the ledger, the mask table, the RoPE numbers."""

from __future__ import annotations

import io
import re

from rich.console import Console

import fwdcheck
from fwdcheck.report.terminal import may_read_grid, render
from tests.conftest import run_checks
from tests.corpus import VOCAB, gpt_fast, modded, torch_models


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


# -- attention that is not one square call, and what the checks could not run -----------------------------------------
# Real runs on the third-party corpus: gpt-fast's preallocated KV cache read by decode steps, nn.Transformer's encoder
# over a fixed source and its cross-attention, a forward that asserts T > 1.

RED = ("\x1b[31m", "\x1b[1;31m")


def styled(report, width: int = 120) -> str:
    """The report with its colours, as ANSI escapes: a failure is red, a note or a call not judged is dim."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system="standard", no_color=False)
    render(report, console)
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
    return [next((span.style for span in line.spans if span.start <= i < span.end), None)
            for line in lines for i, char in enumerate(line.plain) if char == "■"]


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
    assert shown.count("not judged:") == 4 and shown.count("another sequence") >= 2, shown
    assert "cross-attention: keys from another sequence, not judged for causality (2 calls)" in shown
    assert "another sequence: queries not computed from the input tokens" in shown
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
    report = fwdcheck.check_model(modded.gpt_with("smear-roll", min_two_tokens=True), ["shape-ledger", "future-token"],
                                  vocab_size=VOCAB, dims=modded.DIMS)
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
    call = {"module": "layers.0.attention", "may_read": [row], "judged": True, "query_positions": [80],
            "positions_from": "input_pos", "pattern": "leaky: some future keys"}
    caption, line = may_read_grid(call).renderables
    assert caption.plain == ("may-read set of layers.0.attention (rows: queries at 80 (input_pos); columns: 100 key "
                             "slots, 45..92 shown)")
    assert line.plain.split() == ["■"] * 36 + ["·"] * 9 + ["■", "·", "·"]
    assert grid_spans(call) == ["green"] * 36 + ["red"]
