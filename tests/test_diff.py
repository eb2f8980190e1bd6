"""`fwdcheck diff A B`, both ways, on real third-party code: transformers' GPT-2 against a hand-written port under
other names (tests/gpt2_port.py, rename rules and transposed Conv1D weights) and against nanoGPT's model
(tests/corpus/nanogpt.py, GPT-2's own names); equal where the code computes the same thing (exit 0), and each planted
change named at the first pair of modules that parts (exit 1). Names that do not match one to one, and rename rules
that are not rules, are one line and exit 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.report.terminal import difference_plot, render_diff
from tests.gpt2_port import RENAME
from tests.test_cli import plain, usage_error

REPO = Path(__file__).resolve().parents[1]
INPUTS = {"batch_size": 2, "seq_len": 8, "seed": 0}
# transformers' GPT-2 at the sizes of the port and of tests/corpus (width 32, 2 layers, 4 heads, 96 tokens, 128
# positions), with the exact GELU both of them use
GPT2 = {
    "source": "hf",
    "config": {
        "model_type": "gpt2",
        "vocab_size": 96,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "activation_function": "gelu",
    },
}
REFERENCE = {"source": "reference", "vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2}

runner = CliRunner()


def port(bug: str | None = None) -> dict:
    return {
        "source": "python",
        "factory": "tests.gpt2_port:gpt",
        "kwargs": {"bug": bug} if bug else {},
        "path": [str(REPO)],
    }


def write(tmp_path: Path, name: str, model: dict, **top) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"model": model, "inputs": INPUTS, **top}))  # JSON is YAML
    return path


def diff(*args) -> tuple[int, dict, str]:
    result = runner.invoke(app, ["diff", *map(str, args), "--format", "json"], catch_exceptions=False)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout) if result.stdout.startswith("{") else {}, result.stderr


@pytest.mark.slow
def test_gpt2_and_a_port_under_other_names_are_equal(tmp_path):
    a = write(tmp_path, "gpt2.yaml", GPT2)
    b = write(tmp_path, "port.yaml", port(), diff={"rename": RENAME})
    code, report, _ = diff(a, b)
    assert code == 0 and report["equal"] and report["first_parting"] is None
    pairs = {p["a"]: p for p in report["pairs"]}
    assert pairs["transformer.h.0.attn.c_attn"]["b"] == "blocks.0.attn.qkv"  # paired by name, after renaming
    assert (
        pairs["transformer.h.1.mlp.act"]["b"] == "blocks.1.mlp.gelu" and not pairs["transformer.h.1.mlp.act"]["by_name"]
    )  # no name in common: paired by order, between c_fc and c_proj, among outputs of its shape
    assert pairs["(logits)"]["b"] == "(logits)"
    assert all(p["max_diff"] <= p["tolerance"] for p in report["pairs"])
    assert len(report["pairs"]) == 25
    transposed = next(n for n in report["notes"] if "weights transposed" in n)
    assert transposed.startswith("8 weights transposed (Conv1D -> Linear")  # c_proj's square ones among them


@pytest.mark.parametrize(
    "bug, first_a, first_b",
    [
        ("no-scale", "transformer.h.0.attn.c_proj", "blocks.0.attn.proj"),  # the scale lives between qkv and proj
        ("heads-swapped", "transformer.h.0.attn.c_proj", "blocks.0.attn.proj"),
        ("post-norm", "transformer.h.0.ln_1", "blocks.0.norm1"),  # norm1 reads x + attn(x), not x
    ],
)
@pytest.mark.slow
def test_a_planted_change_in_the_port_names_the_first_pair_that_parts(tmp_path, bug, first_a, first_b):
    a = write(tmp_path, "gpt2.yaml", GPT2)
    b = write(tmp_path, "port.yaml", port(bug), diff={"rename": RENAME})
    code, report, _ = diff(a, b)
    assert code == 1 and not report["equal"]
    first = report["first_parting"]
    assert (first["a"], first["b"]) == (first_a, first_b)
    assert first["max_diff"] > 10 * first["tolerance"]
    before = report["pairs"][: [p["a"] for p in report["pairs"]].index(first_a)]
    assert before and not any(p["parts"] for p in before)  # everything before it computes the same


@pytest.mark.slow
def test_gpt2s_tanh_gelu_against_the_exact_one_differs_first_at_the_activation(tmp_path):
    """GPT-2 itself uses the tanh approximation (gelu_new); a port with nn.GELU() computes another function there.
    With weights of order one the difference, a few 1e-4, stays within the tolerance of the activation's output
    (scaled by its largest value) and parts at the projection after it: the report names both."""
    a = write(
        tmp_path,
        "gpt2.yaml",
        {**GPT2, "config": {**GPT2["config"], "activation_function": "gelu_new", "initializer_range": 0.5}},
    )
    b = write(tmp_path, "port.yaml", port(), diff={"rename": RENAME})
    code, report, _ = diff(a, b)
    assert code == 1
    assert report["first_difference"]["a"] == "transformer.h.0.mlp.act"
    assert report["first_parting"]["a"] == "transformer.h.0.mlp.c_proj"
    before = report["pairs"][: [p["a"] for p in report["pairs"]].index("transformer.h.0.mlp.act")]
    assert all(p["max_diff"] == 0 for p in before)  # the same kernels on the same weights: bitwise alike


@pytest.mark.slow
def test_gpt2_and_nanogpt_share_names_and_differ_in_layout(tmp_path):
    """nanoGPT names its modules as GPT-2 does: no rename needed; nn.Linear against Conv1D is transposed, its tril
    buffer stays its own, and its positions [T, d] pair with GPT-2's [1, T, d]."""
    a = write(tmp_path, "gpt2.yaml", GPT2)
    b = write(
        tmp_path,
        "nanogpt.yaml",
        {
            "source": "python",
            "factory": "tests.corpus.nanogpt:gpt",
            "forward": "tests.corpus.nanogpt:every_position",
            "path": [str(REPO)],
        },
    )
    code, report, _ = diff(a, b)
    assert code == 0, report.get("first_parting")
    wpe = next(p for p in report["pairs"] if p["a"] == "transformer.wpe")
    assert (wpe["shape"], wpe["shape_b"], wpe["max_diff"]) == ([1, 8, 32], [8, 32], 0.0)
    assert any(
        n.startswith("buffers are each model's own") and "transformer.h.0.attn.bias" in n for n in report["notes"]
    )
    assert report["unpaired_b"] == ["transformer.h.0.attn.attn_dropout", "transformer.h.1.attn.attn_dropout"]


@pytest.mark.slow
def test_a_refactor_against_its_original(tmp_path):
    """The reference model against itself with two heads swapped: the first pair to part is the output projection,
    every shape and mask alike."""
    a = write(tmp_path, "main.yaml", REFERENCE)
    assert diff(a, a)[0] == 0
    code, report, _ = diff(a, write(tmp_path, "branch.yaml", {**REFERENCE, "bugs": ["heads-swapped"]}))
    assert code == 1 and report["first_parting"]["a"] == "layers.0.attn.o_proj"


@pytest.mark.slow
def test_the_terminal_report_names_the_first_pair_and_plots_on_a_terminal(tmp_path):
    a = write(tmp_path, "gpt2.yaml", GPT2)
    b = write(tmp_path, "port.yaml", port("heads-swapped"), diff={"rename": RENAME})
    result = runner.invoke(app, ["diff", str(a), str(b)], catch_exceptions=False, env={"COLUMNS": "160"})
    assert result.exit_code == 1
    out = plain(result.stdout)
    assert re.search(r"transformer\.h\.0\.attn\.c_proj\s+blocks\.0\.attn\.proj .* ◀ first\n", out), out
    assert (
        out.rstrip()
        .splitlines()[-1]
        .startswith("they part at A transformer.h.0.attn.c_proj / B blocks.0.attn.proj: max |a - b| ")
    )
    assert "tol x1" not in out  # the plot is for a terminal only
    _, report, _ = diff(a, b)
    console = Console(record=True, width=100, force_terminal=True)
    render_diff(report, console, plot=True)
    lines = console.export_text().splitlines()
    threshold = next(line for line in lines if line.startswith("tol x1 "))
    first = [p["a"] for p in report["pairs"]].index(report["first_parting"]["a"])
    assert threshold[7 + first] == "█" and set(threshold[7 : 7 + first]) == {"·"}  # parts there, not before


@pytest.mark.slow
def test_names_that_do_not_match_are_one_line(tmp_path):
    a = write(tmp_path, "gpt2.yaml", GPT2)
    b = write(tmp_path, "port.yaml", port())  # no rename rules
    line = usage_error(
        runner.invoke(app, ["diff", str(a), str(b)], catch_exceptions=False),
        "the two models' parameters do not match one to one after renaming: 29 of A's parameters "
        "have no counterpart in B: transformer.wte.weight, ",
    )
    assert "29 of B's have none in A: tok_emb.weight, " in line and "--rename" in line


@pytest.mark.slow
def test_rules_that_map_two_names_to_one_are_one_line(tmp_path):
    a = write(tmp_path, "a.yaml", REFERENCE)
    usage_error(
        runner.invoke(app, ["diff", str(a), str(a), "--rename", r"layers\.\d+ -> layers.0"], catch_exceptions=False),
        "the rename rules map two of A's parameters to one of B's: layers.0.ln_1.weight and "
        "layers.1.ln_1.weight both become layers.0.ln_1.weight",
    )


@pytest.mark.parametrize(
    "rule, said",
    [
        ("layers.0 layers.1", "--rename 'layers.0 layers.1': a rename rule needs '->'"),
        ("layers.(\\d -> x", "--rename 'layers.(\\d -> x': not a valid regular expression and replacement: missing )"),
        ("layers -> \\3", "invalid group reference 3"),
    ],
)
def test_a_rename_option_that_is_no_rule_is_one_line(tmp_path, rule, said):
    a = write(tmp_path, "a.yaml", REFERENCE)
    usage_error(runner.invoke(app, ["diff", str(a), str(a), "--rename", rule], catch_exceptions=False), said)


@pytest.mark.slow
def test_a_config_that_cannot_run_is_one_line(tmp_path):
    a = write(tmp_path, "a.yaml", REFERENCE)
    usage_error(
        runner.invoke(app, ["diff", str(a), str(tmp_path / "none.yaml")], catch_exceptions=False),
        "none.yaml: no such file",
    )
    small = write(tmp_path, "small.yaml", {**REFERENCE, "vocab_size": 8})
    usage_error(
        runner.invoke(app, ["diff", str(a), str(small)], catch_exceptions=False),
        "A's wte.weight [32, 16] and B's wte.weight [8, 16] differ in shape (not a transpose either)",
    )


@pytest.mark.slow
def test_rename_rules_on_the_command_line_do_what_the_configs_do(tmp_path):
    """The port's rules given as --rename instead of in B's config: the same pairs, equal."""
    a = write(tmp_path, "gpt2.yaml", GPT2)
    b = write(tmp_path, "port.yaml", port())
    result = runner.invoke(
        app,
        ["diff", str(a), str(b), "--format", "json", *(arg for rule in RENAME for arg in ("--rename", rule))],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["equal"] and len(report["pairs"]) == 25
    assert sum(p["by_name"] for p in report["pairs"]) == 23  # the two activations by order


def test_the_plot_marks_the_first_pair_that_parts_and_shares_columns_when_narrow():
    pairs = [
        {"a": f"m{i}", "max_diff": d, "tolerance": 1e-3, "parts": d is None or d > 1e-3}
        for i, d in enumerate([0.0, 1e-5, 2e-4, 5e-2, None, 1e-4])
    ]
    lines = difference_plot(pairs, 80).plain.splitlines()
    assert [line[:7] for line in lines[:4]] == ["  1e+2 ", "  1e+1 ", "tol x1 ", "  1e-1 "]  # inf: a decade more
    assert lines[2][7:] == "···██·" and lines[0][7:] == "    █ "  # parts at m3 and m4; the NaN one reaches the top
    assert lines[-2] == " " * 10 + "^ #4 m3, the first to part"
    narrow = difference_plot(pairs, 2).plain.splitlines()
    assert narrow[1][7:] == "·█" and narrow[-2] == " " * 8 + "^ #4 m3, the first to part"
    assert narrow[-1].endswith("(3 pairs a column, the largest shown)")
    assert (
        difference_plot([{**p, "max_diff": 0.0, "parts": False} for p in pairs], 80).plain.splitlines()[0]
        == "tol x1 ······"
    )  # nothing differs: the threshold row and one below it, nothing marked


def test_the_examples_configs_are_the_tests_port():
    """examples/diff/port.yaml, which the README runs, holds the rules this file's port is tested with."""
    from fwdcheck.config.schema import load_config

    assert load_config(REPO / "examples" / "diff" / "port.yaml").diff.rename == RENAME
    assert load_config(REPO / "examples" / "diff" / "port-no-scale.yaml").diff.rename == RENAME


TINY = """
import torch.nn as nn


class Tiny(nn.Module):
    def __init__(self, raises):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)
        self.raises = raises

    def forward(self, ids):
        if self.raises:
            raise RuntimeError("shape mismatch in the rewrite")
        return self.out(self.emb(ids))  # (B, T, V)


def build(raises=False):
    return Tiny(raises)
"""


@pytest.mark.slow
def test_a_model_that_raises_is_exit_1_and_one_line(tmp_path):
    (tmp_path / "diff_tiny_model.py").write_text(TINY)
    a = write(tmp_path, "a.yaml", {"source": "python", "factory": "diff_tiny_model:build"})
    b = write(tmp_path, "b.yaml", {"source": "python", "factory": "diff_tiny_model:build", "kwargs": {"raises": True}})
    assert diff(a, a)[0] == 0
    result = runner.invoke(app, ["diff", str(a), str(b)], catch_exceptions=False)
    assert result.exit_code == 1 and result.stdout == "" and "Traceback" not in result.output
    (line,) = plain(result.stderr).splitlines()
    assert line.startswith("error: ") and "shape mismatch in the rewrite" in line, line


@pytest.mark.slow
def test_outputs_paired_by_order_that_differ_while_what_follows_agrees_are_not_a_parting(tmp_path):
    """act (GELU) and drop (an identity in eval) share a shape and a place: paired by order, they differ, and the
    projection after them agrees, so the models compute the same thing and the pair is named as mispaired."""
    model = {"source": "python", "path": [str(REPO)]}
    a = write(tmp_path, "a.yaml", {**model, "factory": "tests.diff_models:GeluModule"})
    b = write(tmp_path, "b.yaml", {**model, "factory": "tests.diff_models:DropoutThenFunctionalGelu"})
    code, report, _ = diff(a, b)
    assert code == 0 and report["first_parting"] is None
    pairs = {p["a"]: p for p in report["pairs"]}
    assert pairs["act"]["b"] == "drop" and pairs["act"]["parts"] and not pairs["act"]["by_name"]
    assert not pairs["proj"]["parts"] and pairs["(logits)"]["max_diff"] == 0
    assert any("act and drop, paired by order" in note and "not counted" in note for note in report["notes"])


@pytest.mark.parametrize(
    "factory, parting, sides",
    [
        ("NaNOut", "fc", "A and B"),  # NaN in both: nothing shows they compute the same thing
        ("InfLogits", "(logits)", "A and B"),  # an Inf equal in both is a value, but never in the logits
    ],
)
@pytest.mark.slow
def test_nan_or_inf_logits_are_never_equal(tmp_path, factory, parting, sides):
    a = write(tmp_path, "a.yaml", {"source": "python", "path": [str(REPO)], "factory": f"tests.diff_models:{factory}"})
    code, report, _ = diff(a, a)
    assert code == 1 and not report["equal"]
    assert report["first_parting"]["a"] == parting and report["first_parting"]["nonfinite"] == sides
    shown = plain(runner.invoke(app, ["diff", str(a), str(a)], catch_exceptions=False).stdout)
    assert f"they part at A {parting}: A and B hold NaN or Inf there" in " ".join(shown.split())


@pytest.mark.slow
def test_an_inf_both_models_hold_in_a_module_output_is_equal(tmp_path):
    """A float mask's -inf is an exact value: the same in both, it does not part."""
    a = write(
        tmp_path, "a.yaml", {"source": "python", "path": [str(REPO)], "factory": "tests.diff_models:MaskedScores"}
    )
    code, report, _ = diff(a, a)
    pairs = {p["a"]: p for p in report["pairs"]}
    assert code == 0 and report["equal"] and pairs["mask"]["max_diff"] == 0 and pairs["mask"]["nonfinite"] == ""


def masked(tmp_path: Path, name: str, **kwargs) -> Path:
    model = {"source": "python", "path": [str(REPO)], "factory": "tests.diff_models:MaskedVocabulary", "kwargs": kwargs}
    return write(tmp_path, name, model)


@pytest.mark.slow
@pytest.mark.ordinary
def test_a_masked_vocabulary_is_diffed_on_its_finite_entries(tmp_path):
    """-inf where both models hold -inf (a masked vocabulary) is equal, as future-token holds it: two copies of a
    model that masks a quarter of its vocabulary are equal (exit 0), where they were once refused as NaN or Inf."""
    a = masked(tmp_path, "a.yaml")
    code, report, _ = diff(a, a)
    logits = {p["a"]: p for p in report["pairs"]}["(logits)"]
    assert code == 0 and report["equal"] and logits["max_diff"] == 0 and logits["nonfinite"] == ""
    shown = plain(runner.invoke(app, ["diff", str(a), str(a)], catch_exceptions=False).stdout)
    assert "equal within tolerance" in " ".join(shown.split())


@pytest.mark.parametrize(
    "b, largest",
    [
        ({"first_masked": 20}, None),  # entries 20..23 -inf in B only: a difference as large as they come
        ({"shift": 0.5}, 0.5),  # the finite entries moved behind the same mask
    ],
)
@pytest.mark.slow
def test_a_change_behind_a_masked_vocabulary_parts_at_the_logits(tmp_path, b, largest):
    a = masked(tmp_path, "a.yaml")
    code, report, _ = diff(a, masked(tmp_path, "b.yaml", **b))
    first = report["first_parting"]
    assert code == 1 and first["a"] == "(logits)" and first["nonfinite"] == ""
    if largest is None:  # infinite (the JSON report's null), never the largest float
        assert first["max_diff"] is None
    else:
        assert first["max_diff"] == pytest.approx(largest)
    shown = " ".join(plain(runner.invoke(app, ["diff", str(a), str(tmp_path / "b.yaml")]).stdout).split())
    assert f"they part at A (logits): max |a - b| {'inf' if largest is None else '0.5'}" in shown


@pytest.mark.slow
def test_a_position_with_every_entry_masked_is_still_refused(tmp_path):
    """A position whose logits are all -inf predicts nothing: no comparison vouches for it, in B alone or in both."""
    a, dead = masked(tmp_path, "a.yaml"), masked(tmp_path, "dead.yaml", dead=3)
    for first_config, sides in ((a, "B"), (dead, "A and B")):
        code, report, _ = diff(first_config, dead)
        assert code == 1 and not report["equal"]
        assert report["first_parting"]["a"] == "(logits)" and report["first_parting"]["nonfinite"] == sides
    shown = " ".join(plain(runner.invoke(app, ["diff", str(a), str(dead)]).stdout).split())
    assert "they part at A (logits): B holds NaN or Inf there (NaN, +inf, or a position with every entry -inf)" in shown
