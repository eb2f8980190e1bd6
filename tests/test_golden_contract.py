"""The numeric contract (--save-golden / --expect-golden, fwdcheck/checks/golden.py), both ways: an unchanged model
passes after a rerun, in another process, at another thread count and on other CPU kernels; each planted change fails
and names the first module, in the order the outputs came, whose output moved; a golden file that is not one, or was
made for another run, is one line and exit 2.

The planted changes run in-process (runner.Run, as the pytest plugin runs a config) against a golden document from a
run of the clean model; the command-line tests go through the file itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fwdcheck.checks.golden_file import golden_from_dict
from fwdcheck.cli import app
from fwdcheck.config.schema import config_from_dict
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.plan import resolve
from fwdcheck.run.runner import Run
from tests import models
from tests.test_cli import plain, usage_error

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
CLEAN = {"source": "reference", "vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2}
INPUTS = {"batch_size": 2, "seq_len": 8, "seed": 0}
# 8 layers, wide enough that the kernels of another CPU round differently (tolerances.py's measurement)
EIGHT_LAYERS = {
    "source": "reference",
    "vocab_size": 512,
    "d_model": 128,
    "n_heads": 4,
    "n_layers": 8,
    "d_ff": 512,
    "max_seq_len": 128,
}


def golden_run(model: dict, expected: dict | None = None, dtype: str = "float32", inputs: dict = INPUTS):
    """The golden check's result on the model a config dict describes, compared with `expected` when given."""
    run = Run.build(
        resolve(
            config_from_dict({"model": model, "inputs": inputs, "dtype": dtype}),
            Overrides(checks=["golden"], expected={"--expect-golden": expected} if expected is not None else None),
        )
    )
    return run.check(run.load()).result("golden")


def saved(model: dict, dtype: str = "float32") -> dict:
    """The golden document of a run, as --expect-golden would read it back."""
    return golden_from_dict(golden_run(model, dtype=dtype).data["golden"], "golden")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def write_config(tmp_path: Path, model: dict, name: str = "model.yaml", **top) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"model": model, "inputs": top.pop("inputs", INPUTS), **top}))  # JSON is YAML
    return path


# -- an unchanged model passes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_unchanged_model_passes_a_rerun(dtype):
    result = golden_run(CLEAN, saved(CLEAN, dtype), dtype=dtype)
    assert result.status.value == "pass", [f.message for f in result.findings]
    assert result.metrics["moved_outputs"] == result.metrics["moved_parameters"] == 0
    assert "within tolerance of the golden file" in result.summary


def test_without_a_golden_file_it_records():
    result = golden_run(CLEAN)
    document = result.data["golden"]
    assert result.status.value == "pass" and "comparison" not in result.data
    names = [e["name"] for e in document["outputs"]]
    # every module's output in the order outputs complete (a child before its parent), the logits last
    assert names[:3] == ["wte", "drop", "layers.0.ln_1"]
    assert names.index("layers.0.attn.o_proj") < names.index("layers.0.attn") < names.index("layers.0")
    assert names[-1] == "(logits)"
    assert [e["name"] for e in document["parameters"]][:2] == ["wte.weight", "layers.0.ln_1.weight"]
    assert document["run"] == {**INPUTS, "dtype": "float32", "device": "cpu", "torch": document["run"]["torch"]}
    assert document["tolerance"] == {"rtol": 1e-4, "atol": 1e-6}


def test_a_module_called_twice_is_recorded_per_call():
    """A shared block run twice in one forward: its calls are `name` and `name#2`."""
    import torch

    from fwdcheck.observe.activations import module_outputs

    block = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(block, torch.nn.ReLU(), block)
    with torch.no_grad(), module_outputs(model) as calls:
        model(torch.ones(1, 4))
    assert [name for name, _ in calls] == ["0", "1", "0#2"]  # the block's second call under the first name


# -- each planted change fails and names the first module that moved -------------------------------------------------


PLANTED = {  # change -> (model fields, the first module output that moved, whether parameters moved)
    "post-norm": ({"norm": "post"}, "layers.0.attn.q_proj", False),
    "sdpa-scale-dropped": ({"bugs": ["sdpa-scale-dropped"]}, "layers.0.attn.o_proj", False),
    "eager-scale-1-over-d": ({"attention": "eager", "bugs": ["eager-scale-1-over-d"]}, "layers.0.attn.o_proj", False),
    "heads-swapped": ({"bugs": ["heads-swapped"]}, "layers.0.attn.o_proj", False),
    "init-std": ({"init_std": 0.03}, "wte", True),
}


@pytest.mark.parametrize("change", list(PLANTED))
def test_planted_change_fails_naming_the_first_module(change):
    fields, first, parameters_moved = PLANTED[change]
    base = {
        **CLEAN,
        "attention": fields.get("attention", "sdpa"),
        **({"init_std": 0.02} if "init_std" in fields else {}),
    }
    result = golden_run({**base, **fields}, saved(base))
    assert result.status.value == "fail"
    by_code = {f.code: f for f in result.findings}
    moved = by_code["FWD961"]
    assert moved.where == first and moved.message.startswith(f"{first}: output moved by ")
    assert result.data["comparison"]["moved"][0]["name"] == first
    if parameters_moved:
        assert by_code["FWD962"].message.startswith("parameters changed (init or loading): first wte.weight")
        assert "parameters changed too (FWD962)" in moved.message
    else:
        assert "FWD962" not in by_code
        assert "only the computation changed" in moved.message
    # the change really is beyond rounding: the first output moved by more than ten times its tolerance
    assert result.metrics["moved_by"] > 10 * result.metrics["tolerance"]
    assert result.metrics["logits_moved"] is True and "; logits moved by " in result.summary


def test_post_norm_also_names_the_parameters_it_removed():
    """Post-norm has no final norm (ln_f is an Identity): its parameters are gone, said as such (FWD963)."""
    result = golden_run({**CLEAN, "norm": "post"}, saved(CLEAN))
    gone = next(f for f in result.findings if f.code == "FWD963")
    assert gone.message == "parameters added or removed: gone ln_f.weight, ln_f.bias"


def test_a_shape_change_is_a_shape_contract_difference_not_a_numeric_one():
    result = golden_run({**CLEAN, "d_ff": 64}, saved(CLEAN))
    outputs, parameters = [f.message for f in result.findings if f.code == "FWD965"]
    assert outputs.startswith(
        "module outputs changed shape or dtype (a shape contract difference, not compared "
        "numerically): layers.0.mlp.up: [2, 8, 32] float32 -> [2, 8, 64] float32"
    )
    assert parameters.startswith(
        "parameters changed shape or dtype (a shape contract difference, not compared "
        "numerically): layers.0.mlp.up.weight: [32, 16] float32 -> [64, 16] float32"
    )
    assert "layers.0.mlp.up" not in [m["name"] for m in result.data["comparison"]["moved"]]
    moved = next(f for f in result.findings if f.code == "FWD961")
    assert moved.where == "layers.0.mlp.down"  # the same shape, other values: compared, and moved


def test_a_block_removed_is_named():
    result = golden_run({**CLEAN, "n_layers": 1}, saved(CLEAN))
    gone = [f.message for f in result.findings if f.code == "FWD963"]
    assert gone[0].startswith(
        "module outputs added or removed: gone layers.1.ln_1, layers.1.attn.q_proj, layers.1.attn.k_proj and "
    )
    assert gone[1].startswith("parameters added or removed: gone layers.1.ln_1.weight")


def test_nan_where_the_golden_file_is_finite_is_named():
    """The eager path with the inverted mask: a fully masked row's softmax is NaN, in the first attention."""
    eager = {**CLEAN, "attention": "eager"}
    result = golden_run({**eager, "bugs": ["inverted-bool-mask"]}, saved(eager))
    nan = next(f for f in result.findings if f.code == "FWD964")
    assert nan.where == "layers.0.attn.o_proj", nan.message
    assert nan.message.startswith("NaN or Inf where the golden file has finite values, first in layers.0.attn.o_proj: ")


# -- a refactor of structure only is judged by its numbers -------------------------------------------------------------


class _GeluModuleMLP(torch.nn.Module):
    """nanoGPT's MLP with the activation as a module (`self.act = nn.GELU()`) instead of F.gelu: one more module
    output per block, the same numbers; with `approximate="tanh"` the numbers change too."""

    def __init__(self, cfg, approximate: str = "none"):
        super().__init__()
        self.c_fc = torch.nn.Linear(cfg.n_embd, cfg.n_inner)
        self.act = torch.nn.GELU(approximate=approximate)
        self.c_proj = torch.nn.Linear(cfg.n_inner, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))  # (B, T, 4C) inside, (B, T, C) out


def nanogpt_gelu(activation: str = "function") -> torch.nn.Module:
    """tests.models.nanogpt with its MLP's activation as F.gelu ("function"), as an nn.GELU() module ("module"), or
    as nn.GELU(approximate="tanh") ("tanh module"); the weights are the same in all three."""
    model = models.nanogpt()
    if activation != "function":
        approximate = "tanh" if activation == "tanh module" else "none"
        for block in model.h:
            refactored = _GeluModuleMLP(model.config, approximate)
            refactored.load_state_dict(block.mlp.state_dict())
            block.mlp = refactored
    return model


def _gelu(activation: str) -> dict:
    return {
        "source": "python",
        "factory": "tests.test_golden_contract:nanogpt_gelu",
        "kwargs": {"activation": activation},
    }


def test_a_module_that_only_restructures_is_a_note_and_the_logits_are_said_unchanged():
    """F.gelu become an nn.GELU() module: new module outputs (h.N.mlp.act), every number the same: a pass that names
    the new modules and says the logits did not move."""
    result = golden_run(_gelu("module"), saved(_gelu("function")))
    assert result.status.value == "pass", [f.message for f in result.findings]
    note = next(f for f in result.findings if f.code == "FWD963")
    assert note.status.value == "pass"
    assert note.message.startswith("module outputs added or removed: new h.0.mlp.act, h.1.mlp.act")
    assert result.summary.startswith("structure only: new h.0.mlp.act, h.1.mlp.act")
    assert "logits unchanged" in result.summary
    assert result.metrics["logits_moved"] is False and result.metrics["moved_outputs"] == 0
    # and back: the module removed again is the same note, said as gone
    back = golden_run(_gelu("function"), saved(_gelu("module")))
    assert back.status.value == "pass" and back.summary.startswith("structure only: gone h.0.mlp.act")


def test_a_new_module_that_changes_the_numbers_still_fails():
    """nn.GELU(approximate="tanh"): the same new modules, but the MLP's outputs move (1.2e-4 against 8e-5): a fail,
    although the logits stay within theirs (0.18 of it), which the summary says."""
    result = golden_run(_gelu("tanh module"), saved(_gelu("function")))
    assert result.status.value == "fail"
    by_code = {f.code: f for f in result.findings}
    assert by_code["FWD961"].where == "h.0.mlp.c_proj"  # the first output both runs have that moved
    assert by_code["FWD963"].status.value == "fail"
    assert result.metrics["logits_moved"] is False and result.summary.endswith(
        "logits unchanged (0.18 of their tolerance)"
    )


def test_an_unchanged_run_says_the_logits_did_not_move():
    result = golden_run(CLEAN, saved(CLEAN))
    assert "logits unchanged" in result.summary and result.metrics["logits_moved"] is False


# -- through the file, from the command line ---------------------------------------------------------------------------


@pytest.mark.slow
def test_save_then_expect_through_the_file(tmp_path):
    config = write_config(tmp_path, CLEAN)
    golden, again = tmp_path / "golden.json", tmp_path / "again.json"
    result = invoke("run", config, "--check", "shape-ledger", "--save-golden", golden)  # adds the golden check
    assert result.exit_code == 0, result.output
    assert "golden" in plain(result.stdout)
    assert invoke("run", config, "--save-golden", again, "-q").exit_code == 0
    assert golden.read_bytes() == again.read_bytes(), "a rerun writes the same bytes"
    result = invoke("run", config, "--check", "shape-ledger", "--expect-golden", golden, "--format", "json")
    assert result.exit_code == 0, result.output
    golden_result = next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "golden")
    assert golden_result["status"] == "pass"


@pytest.mark.slow
def test_the_file_is_one_module_a_line_and_small(tmp_path):
    config = write_config(tmp_path, EIGHT_LAYERS)
    golden = tmp_path / "golden.json"
    assert invoke("run", config, "--save-golden", golden, "-q").exit_code == 0
    lines = golden.read_text().splitlines()
    document = json.loads(golden.read_text())
    entries = [json.loads(line.strip().rstrip(",")) for line in lines if line.startswith('    {"name"')]
    assert entries == document["outputs"] + document["parameters"]  # each entry whole on its own line
    assert len(document["outputs"]) == 8 * 13 + 5 and len(document["parameters"]) == 8 * 10 + 4
    assert golden.stat().st_size < 64_000, golden.stat().st_size


@pytest.mark.slow
def test_a_planted_change_fails_through_the_file(tmp_path):
    golden = tmp_path / "golden.json"
    assert invoke("run", write_config(tmp_path, CLEAN), "--save-golden", golden, "-q").exit_code == 0
    swapped = write_config(tmp_path, {**CLEAN, "bugs": ["heads-swapped"]}, "swapped.yaml")
    result = invoke("run", swapped, "--expect-golden", golden)
    assert result.exit_code == 1
    out = plain(result.stdout)
    assert "FWD961" in out and "layers.0.attn.o_proj: output moved by" in out
    assert "module outputs that moved" in out  # the panel lists them in order


def _fwdcheck(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fwdcheck", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200", **env},
        cwd=REPO,
    )


@pytest.mark.slow
@pytest.mark.parametrize("elsewhere", ["two-threads", "baseline-cpu-kernels"])
def test_another_process_thread_count_and_cpu_kernels_pass(tmp_path, elsewhere):
    """Saved in one process with one thread; expected in another with two threads, or with the CPU's baseline
    kernels instead of its AVX-512 ones (what another CPU computes: every output differs in its last bits)."""
    config = write_config(tmp_path, EIGHT_LAYERS, inputs={"batch_size": 4, "seq_len": 64, "seed": 0})
    golden = tmp_path / "golden.json"
    saving = _fwdcheck(["run", str(config), "--save-golden", str(golden), "-q"], OMP_NUM_THREADS="1")
    assert saving.returncode == 0, saving.stdout + saving.stderr
    env = (
        {"OMP_NUM_THREADS": "2"}
        if elsewhere == "two-threads"
        else {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    )
    expecting = _fwdcheck(["run", str(config), "--expect-golden", str(golden), "--format", "json"], **env)
    assert expecting.returncode == 0, expecting.stdout[-3000:] + expecting.stderr
    result = next(c for c in json.loads(expecting.stdout)["checks"] if c["name"] == "golden")
    assert result["status"] == "pass" and result["metrics"]["closest"] < 0.1, result["summary"]


# -- what is not a golden file for this run ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_file(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("golden")
    config = write_config(folder, CLEAN)
    golden = folder / "golden.json"
    assert invoke("run", config, "--save-golden", golden, "-q").exit_code == 0
    return config, json.loads(golden.read_text())


BAD_FILES = {
    "not-json": ("{ this is not json", "not a readable JSON golden file"),
    "a-list": ("[]", "not a golden file written by --save-golden (a JSON object with 'fwdcheck_golden')"),
    "another-version": (lambda d: {**d, "fwdcheck_golden": 2}, "golden file format 2; this fwdcheck reads format 1"),
    "nan": (lambda d: json.dumps(d).replace('"absmax": ', '"absmax": NaN, "x": ', 1), "NaN is not JSON"),
    "mean-a-string": (
        lambda d: {**d, "outputs": [{**d["outputs"][0], "mean": "0.1"}]},
        "outputs[0].mean: expected a number",
    ),
    "no-run": (lambda d: {k: v for k, v in d.items() if k != "run"}, "run: required key is missing"),
    "listed-twice": (
        lambda d: {**d, "parameters": d["parameters"] + d["parameters"][:1]},
        "'wte.weight' is listed twice (first as parameters[0])",
    ),
    "negative-tolerance": (
        lambda d: {**d, "tolerance": {"rtol": -1, "atol": 0}},
        "tolerance.rtol: must be at least 0",
    ),
    # A tolerance a hand edit raised until it excuses any change would pass every model (tolerance_bounds.py).
    "tolerance-excuses-any-change": (
        lambda d: {**d, "tolerance": {"rtol": 1e9, "atol": 0}},
        "tolerance.rtol: must be below 1",
    ),
    # Cut short, a file would compare fewer numbers (zip stops at the shorter): a model with rows swapped could pass.
    "values-emptied": (
        lambda d: {**d, "outputs": [{**e, "values": []} for e in d["outputs"]]},
        "values holds 0 numbers; a tensor of shape",
    ),
    "digest-emptied": (
        lambda d: {**d, "parameters": [{**e, "digest": []} for e in d["parameters"]]},
        "digest holds 0 numbers, not 4",
    ),
    "nan-beyond-its-count": (
        lambda d: {**d, "outputs": [{**e, "values": [None] * len(e["values"])} for e in d["outputs"]]},
        "more NaN or Inf than the tensor's",
    ),
    "no-logits": (
        lambda d: {**d, "outputs": [e for e in d["outputs"] if e["name"] != "(logits)"]},
        "outputs: no '(logits)' entry",
    ),
    # json.loads keeps the last of a key given twice: an empty `outputs` after the real one would compare nothing.
    "a-key-twice": (
        lambda d: json.dumps(d, indent=1).replace('\n "parameters"', '\n "outputs": [],\n "parameters"', 1),
        "the key 'outputs' is given twice, at line",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.slow
def test_a_file_that_is_not_a_golden_file_is_one_line(tmp_path, saved_file, case):
    config, document = saved_file
    make, fragment = BAD_FILES[case]
    made = make(document) if callable(make) else make
    golden = tmp_path / "golden.json"
    golden.write_text(made if isinstance(made, str) else json.dumps(made))
    usage_error(invoke("run", config, "--expect-golden", golden), f"--expect-golden {golden}: ", fragment)


def test_the_file_holds_what_fingerprints_hold():
    """The torch-free reader's idea of a fingerprint is the fingerprint's own."""
    from fwdcheck.checks import golden_file
    from fwdcheck.observe import activations

    assert (golden_file.SAMPLED, golden_file.DIGEST_ROWS, golden_file.LOGITS) == (
        activations.SAMPLED,
        activations.DIGEST_ROWS,
        activations.LOGITS,
    )


@pytest.mark.slow
def test_a_missing_file_or_a_directory_is_one_line(tmp_path, saved_file):
    config, _ = saved_file
    usage_error(
        invoke("run", config, "--expect-golden", tmp_path / "nowhere.json"),
        "nowhere.json: no such file (write one with --save-golden)",
    )
    usage_error(invoke("run", config, "--expect-golden", tmp_path), f"--expect-golden {tmp_path}: is a directory")


@pytest.mark.parametrize(
    "other, said",
    [
        ({"inputs": {**INPUTS, "seed": 7}}, "seed 0 (this run: 7)"),
        ({"inputs": {**INPUTS, "batch_size": 3, "seq_len": 6}}, "batch_size 2 (this run: 3), seq_len 8 (this run: 6)"),
        ({"dtype": "bfloat16"}, "dtype float32 (this run: bfloat16)"),
    ],
)
def test_a_golden_file_of_another_config_is_a_usage_error(tmp_path, saved_file, other, said):
    _, document = saved_file
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps(document))
    config = write_config(tmp_path, CLEAN, **other)
    usage_error(
        invoke("run", config, "--expect-golden", golden),
        f"--expect-golden {golden}: made with another "
        f"config: {said}; a golden file is compared at the inputs and dtype it was made with",
    )


def test_seed_on_the_command_line_counts_as_another_config(tmp_path, saved_file):
    config, document = saved_file
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps(document))
    usage_error(invoke("run", config, "--expect-golden", golden, "--seed", "1"), "seed 0 (this run: 1)")


def test_save_golden_refuses_what_it_cannot_write(tmp_path, saved_file):
    config, document = saved_file
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps(document))
    usage_error(
        invoke("run", config, "--expect-golden", golden, "--save-golden", golden),
        f"--save-golden {golden} is the --expect-golden file; fwdcheck does not write a report over a file",
    )
    usage_error(
        invoke("run", config, config, "--save-golden", tmp_path / "g.json"),
        "--save-golden takes one config",
    )
    usage_error(
        invoke("run", config, "--save-golden", tmp_path / "g.json", "--meta"),
        "--save-golden needs values; on the meta device only shapes exist",
    )
    assert not (tmp_path / "g.json").exists()


def test_explain_names_the_codes():
    result = invoke("explain", "FWD961")
    assert result.exit_code == 0 and "(golden)" in result.stdout
    listing = invoke("explain", "golden").stdout
    for code in ("FWD961", "FWD962", "FWD963", "FWD964", "FWD965"):
        assert code in listing
