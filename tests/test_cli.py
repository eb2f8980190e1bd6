"""The command line, end to end: exit codes, the one-line errors, the reports, list/explain/init/--version.

Everything runs in-process through typer's CliRunner against `fwdcheck.cli.app` (real torch, real tiny models), except
the check that `--help` does not import torch, which needs a fresh interpreter.

With the Click this project uses (>= 8.2) CliRunner keeps the streams apart: `result.stdout` is stdout only,
`result.stderr` is stderr only, and `result.output` is both interleaved. The assertions below lean on that split.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import threading
from contextlib import suppress
from pathlib import Path

import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

from fwdcheck import __version__
from fwdcheck.cli import app

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_configs"
TOY = SAMPLES / "toy.yaml"
TOY_CHECKS = ["shape-ledger", "future-token", "mask-audit", "rope"]  # the toy's own `checks:`
BROKEN = sorted((SAMPLES / "broken").glob("*.yaml"))
# What a config without `checks:` runs: every default check, each skipping where it does not apply
CHECKS = [
    *("shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "packing", "label-shift", "grad-causality"),
    *("backends", "rope-precision", "attention-stats"),
]
HELPERS = "fwdcheck_cli_helpers"  # the module name of the tiny test models written into tmp_path

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

runner = CliRunner()


def plain(text: str) -> str:
    """Without colour codes, should the environment force colour (FORCE_COLOR) on rich."""
    return ANSI.sub("", text)


def invoke(*args) -> Result:
    # catch_exceptions=False: an exception escaping the CLI fails the test with its traceback instead of hiding it.
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def run_json(*args) -> tuple[Result, dict]:
    result = invoke("run", *args, "--format", "json")
    assert "Traceback" not in result.output, result.output
    return result, json.loads(result.stdout)


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def usage_error(result, *fragments: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr, no traceback; the line holds every fragment."""
    assert result.exit_code == 2, result.output
    assert result.stdout == "", result.stdout
    assert "Traceback" not in result.output
    lines = plain(result.stderr).splitlines()
    assert len(lines) == 1, f"expected one line of error, got {len(lines)}:\n{result.stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def expected_failures(config: Path) -> list[str]:
    """The checks named on the config's `# Expected to fail: a, b (why).` comment line."""
    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        match = re.match(r"#\s*Expected to fail:\s*(.*)", line)
        if match:
            names = re.findall(r"[a-z][a-z-]+", re.sub(r"\(.*", "", match.group(1)))
            return [n for n in names if n in CHECKS]
    raise AssertionError(f"{config.name} has no 'Expected to fail:' comment")


# ---------------------------------------------------------------------------------------------------------------------
# Tiny models for the python source, written into tmp_path by a fixture (never repository files)

HELPER_SOURCE = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H = 16, 8, 2


class Boom(nn.Module):
    """Builds fine; raises during the forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)

    def forward(self, input_ids):
        raise ValueError("boom")


class LastOnly(nn.Module):
    """nanoGPT at inference: logits for the last position only, [B, 1, V]."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))[:, -1:, :]


def every_position(model, input_ids, **kwargs):
    """A forward adapter for LastOnly: the logits of every position."""
    return model.head(model.embed(input_ids))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, D))


class LearnedPositions(nn.Module):
    """GPT-2 style: learned absolute positions, causal SDPA, no rotary embedding."""

    def __init__(self, max_positions=32):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(max_positions, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, V)

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Jitter(nn.Module):
    """Position-wise (so causal) with a little randomness left on in eval mode: a noise floor, not a leak."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, input_ids):
        logits = self.head(self.embed(input_ids))
        return logits + 5e-6 * torch.rand_like(logits)


def build_boom():
    return Boom()


def build_last_only():
    return LastOnly()


def build_learned():
    return LearnedPositions()


def build_jitter():
    return Jitter()


def build_raises():
    raise RuntimeError("no weights at /nowhere")


def build_not_module():
    return {"not": "a module"}


def build_marked(marker):
    """build_learned, leaving a file behind: proof that the model was built."""
    open(marker, "w").close()
    return LearnedPositions()
'''


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    """Writes the helper models into tmp_path; returns a function that writes a python-source config next to them
    (`python_path: ["."]`, relative to the config file) and returns its path."""
    (tmp_path / f"{HELPERS}.py").write_text(HELPER_SOURCE)
    monkeypatch.delitem(sys.modules, HELPERS, raising=False)  # each test imports its own copy, and forgets it after

    def write(factory: str, *, name: str = "model.yaml", extra: str = "", top: str = "") -> Path:
        config = tmp_path / name
        config.write_text(
            "model:\n"
            "  source: python\n"
            f'  factory: "{HELPERS}:{factory}"\n'
            '  python_path: ["."]\n'
            "  vocab_size: 16\n"
            + textwrap.indent(textwrap.dedent(extra), "  ")
            + "inputs: {batch_size: 2, seq_len: 4}\n"
            + textwrap.dedent(top)
        )
        return config

    yield write
    sys.modules.pop(HELPERS, None)


# ---------------------------------------------------------------------------------------------------------------------
# run: the sample configs


@pytest.mark.slow
def test_toy_passes_with_every_check_in_the_summary():
    result = invoke("run", TOY)
    out = plain(result.stdout)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    for name in TOY_CHECKS:
        assert re.search(rf"^\s*{name}\s+pass\b", out, re.MULTILINE), f"no passing summary row for {name}:\n{out}"
    assert "passed (exit 0)" in out
    assert "Traceback" not in result.output


def test_every_broken_config_is_tested():
    assert len(BROKEN) >= 8, BROKEN
    for config in BROKEN:
        assert expected_failures(config), config


@pytest.mark.parametrize("config", BROKEN, ids=[p.stem for p in BROKEN])
@pytest.mark.slow
def test_broken_config_fails_with_its_expected_checks(config):
    expected = expected_failures(config)
    result, report = run_json(config)
    assert result.exit_code == 1, result.output
    assert report["exit_code"] == 1
    assert report["status"] == "fail"
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert list(statuses) == CHECKS
    assert statuses[expected[0]] == "fail", statuses
    for name in expected:  # every named check, not only the first, fails on each of today's configs
        assert statuses[name] == "fail", (name, statuses)
        failing = [f for f in check(report, name)["findings"] if f["status"] == "fail"]
        assert failing and all(re.fullmatch(r"FWD\d{3}", f["code"]) for f in failing), failing


@pytest.mark.slow
def test_broken_config_rich_report_says_failed():
    config = SAMPLES / "broken" / "no-causal-mask.yaml"
    result = invoke("run", config)
    out = plain(result.stdout)
    assert result.exit_code == 1, result.output
    assert re.search(r"^\s*future-token\s+fail\b", out, re.MULTILINE), out
    assert "FWD101" in out and "FWD201" in out
    assert "failed (exit 1)" in out


# ---------------------------------------------------------------------------------------------------------------------
# run: usage and configuration errors, exit 2, one line, no traceback


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


USAGE_CASES = [
    pytest.param(lambda tmp, h: ["run", tmp / "missing.yaml"], ["missing.yaml", "no such file"], id="missing-file"),
    pytest.param(
        lambda tmp, h: ["run", tmp / "conf[ig].yaml"], ["conf[ig].yaml: no such file"], id="missing-file-with-brackets"
    ),  # the message is text, not rich markup
    pytest.param(lambda tmp, h: ["run", "--model", "mod[x]:f"], ["cannot import 'mod[x]'"], id="brackets-in-model"),
    pytest.param(
        lambda tmp, h: ["run", _write(tmp, "empty.yaml", "")], ["empty.yaml", "the file is empty"], id="empty-file"
    ),
    pytest.param(
        lambda tmp, h: ["run", _write(tmp, "bad.yaml", "model: [1, 2\ninputs: {\n")],
        ["bad.yaml", "not valid YAML at line"],
        id="not-yaml",
    ),
    pytest.param(
        lambda tmp, h: ["run", _write(tmp, "list.yaml", "- model\n- inputs\n")],
        ["list.yaml", "top level must be a mapping", "not a list"],
        id="top-level-list",
    ),
    pytest.param(
        lambda tmp, h: ["run", _write(tmp, "typo.yaml", "model:\n  source: reference\n  n_head: 2\n")],
        ["typo.yaml", "model.n_head: unknown key", "did you mean 'n_heads'?"],
        id="unknown-key",
    ),
    pytest.param(
        lambda tmp, h: [
            "run",
            _write(tmp, "typo2.yaml", "model: {source: reference}\nchecks: [rope]\ntolerence: {rtol: 0.1}\n"),
        ],
        ["tolerence: unknown key", "did you mean 'tolerance'?"],
        id="unknown-top-level-key",
    ),
    pytest.param(
        lambda tmp, h: ["run", TOY, "--check", "nope"],
        ["unknown check 'nope'", "known:", *CHECKS],
        id="unknown-check-config-selects",
    ),
    pytest.param(
        lambda tmp, h: ["run", SAMPLES / "reference-learned.yaml", "--check", "nope"],
        ["unknown check 'nope'", "known:", *CHECKS],
        id="unknown-check-config-selects-none",
    ),
    pytest.param(
        lambda tmp, h: ["run", TOY, "--model", "os.path:join"],
        ["either a config file or --model"],
        id="config-and-model",
    ),
    pytest.param(lambda tmp, h: ["run"], ["give a config file", "--model"], id="neither-config-nor-model"),
    pytest.param(
        lambda tmp, h: ["run", "--model", "nodots"],
        ["model.factory", "'nodots' is not of the form 'package.module:callable'"],
        id="model-no-colon",
    ),
    pytest.param(
        lambda tmp, h: ["run", "--model", "no_such_module_xyz:f"],
        ["cannot import 'no_such_module_xyz'", "No module named"],
        id="model-cannot-import",
    ),
    pytest.param(
        lambda tmp, h: ["run", h("build_raises")],
        [f"factory '{HELPERS}:build_raises' raised RuntimeError: no weights at /nowhere"],
        id="factory-raises",
    ),
    pytest.param(
        lambda tmp, h: ["run", h("build_not_module")],
        [f"factory '{HELPERS}:build_not_module' returned dict, not a torch.nn.Module"],
        id="factory-not-a-module",
    ),
    pytest.param(
        lambda tmp, h: ["run", h("no_such_factory")], [f"module '{HELPERS}' has no attribute"], id="factory-missing"
    ),
    pytest.param(
        lambda tmp, h: ["run", TOY, "--device", "cuda"],
        ["device 'cuda' requested", "no CUDA device"],
        id="device-cuda-without-cuda",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
    ),
    pytest.param(lambda tmp, h: ["explain", "nope"], ["unknown check 'nope'", "known:", *CHECKS], id="explain-unknown"),
]


@pytest.mark.parametrize(("make_args", "fragments"), USAGE_CASES)
@pytest.mark.slow
def test_usage_error_is_one_line_exit_2(tmp_path, helpers, make_args, fragments):
    result = invoke(*make_args(tmp_path, helpers))
    usage_error(result, *fragments)


@pytest.mark.slow
def test_usage_error_line_is_not_wrapped_even_when_long(tmp_path):
    """stderr is not a terminal under CliRunner (nor in CI logs): the error must stay on one line anyway."""
    name = "a_module_name_long_enough_that_the_error_line_runs_well_past_eighty_columns_xyz"
    line = usage_error(invoke("run", "--model", f"{name}:f"), f"cannot import '{name}'")
    assert len(line) > 120


def test_debug_shows_the_traceback(tmp_path):
    result = invoke("run", "--model", "nodots", "--debug")
    assert result.exit_code == 2
    assert "Traceback" in result.stderr
    assert plain(result.stderr).rstrip().splitlines()[-1].startswith("error: ")


# ---------------------------------------------------------------------------------------------------------------------
# run: python-source models that misbehave while being checked


@pytest.mark.slow
def test_model_raising_in_forward_is_an_error_of_every_check(helpers):
    result, report = run_json(helpers("build_boom"))
    assert result.exit_code == 1, result.output
    assert report["exit_code"] == 1
    assert report["status"] == "error"
    assert [c["name"] for c in report["checks"]] == CHECKS
    # every check that applies meets the error; those that do not (no cache, loss, packing, rotary) say so first
    applies = [c for c in report["checks"] if not c["summary"].startswith("does not apply: ")]
    assert {c["name"] for c in applies} >= {"shape-ledger", "future-token", "mask-audit", "grad-causality"}
    assert {c["status"] for c in report["checks"] if c not in applies} == {"skip"}
    assert [c["status"] for c in applies] == ["error"] * len(applies)
    for c in applies:
        assert "ValueError: boom" in c["summary"]
        finding = c["findings"][0]
        assert finding["code"] == "FWD002"
        assert "ValueError: boom" in finding["message"]
        assert f"{HELPERS}.py" in (finding["where"] or ""), finding  # the model's own line that raised
    # the rich report says the same
    rich = invoke("run", helpers("build_boom", name="again.yaml"))
    assert rich.exit_code == 1
    assert "ValueError: boom" in plain(rich.stdout)
    assert "Traceback" not in rich.output


@pytest.mark.slow
def test_logits_of_the_last_position_only_need_an_adapter(helpers):
    result, report = run_json(helpers("build_last_only"))
    assert result.exit_code == 1, result.output
    assert report["status"] == "error"
    applies = [c for c in report["checks"] if not c["summary"].startswith("does not apply: ")]
    assert {c["name"] for c in applies} >= {"shape-ledger", "future-token", "mask-audit", "grad-causality"}
    assert [c["status"] for c in applies] == ["error"] * len(applies)
    messages = set()
    for c in applies:
        (finding,) = c["findings"]
        assert finding["code"] == "FWD002"
        assert (
            "forward returned the logits of the last position only ([B, 1, V] for input_ids [B, T])"
            in (finding["message"])
        )
        assert "return model(input_ids, targets=input_ids)[0]` (`fwdcheck explain FWD002`)" in finding["message"]
        messages.add(finding["message"])
    assert len(messages) == 1  # alike at every length (the rope probe's own too): the terminal says it once
    quiet = runner.invoke(app, ["run", str(helpers("build_last_only")), "-q"])
    assert quiet.stdout.count("last position only") == 1 and "1 positions" not in quiet.stdout


@pytest.mark.slow
def test_forward_adapter_returning_every_position_passes(helpers):
    config = helpers("build_last_only", extra=f'forward: "{HELPERS}:every_position"\n')
    result, report = run_json(config, "--check", "future-token", "--check", "shape-ledger")
    assert result.exit_code == 0, result.output
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("future-token", "pass"), ("shape-ledger", "pass")]


@pytest.mark.slow
def test_learned_positions_pass_and_rope_skips(helpers):
    result, report = run_json(helpers("build_learned"))
    assert result.exit_code == 0, result.output
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert {name: statuses[name] for name in TOY_CHECKS} == {
        "shape-ledger": "pass",
        "future-token": "pass",
        "mask-audit": "pass",
        "rope": "skip",
    }
    assert check(report, "rope")["summary"].startswith("does not apply: no rotary embedding")
    # the others pass where they apply, and say so where they do not (no cache, loss, packing, rotary function)
    assert all(c["status"] == "pass" or c["summary"].startswith("does not apply: ") for c in report["checks"]), statuses


@pytest.mark.slow
def test_nothing_ran_exits_5(helpers):
    config = helpers("build_learned")
    result, report = run_json(config, "--check", "rope")
    assert result.exit_code == 5, result.output
    assert report["exit_code"] == 5
    assert report["status"] == "skip"
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("rope", "skip")]
    assert "no rotary embedding" in report["checks"][0]["summary"]
    rich = invoke("run", config, "--check", "rope")
    assert rich.exit_code == 5
    assert "nothing ran (exit 5)" in plain(rich.stdout)


@pytest.mark.slow
def test_model_flag_resolves_from_the_working_directory(helpers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result, report = run_json("--model", f"{HELPERS}:build_learned", "--check", "future-token")
    assert result.exit_code == 0, result.output
    assert report["config"] is None
    assert report["model"]["label"] == f"{HELPERS}:build_learned"
    assert report["model"]["source"] == "python"
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("future-token", "pass")]


@pytest.mark.slow
def test_fail_on_warn(helpers):
    # A noise floor between 1/10 and 1x the float32 tolerance: with noise_factor 100, FWD106 warns (FWD103 does not
    # fail, the noise being under the tolerance).
    config = helpers("build_jitter", top="tolerance: {noise_factor: 100}\n")
    result, report = run_json(config, "--check", "future-token")
    assert result.exit_code == 0, result.output
    assert report["status"] == "warn"
    assert [f["code"] for f in report["checks"][0]["findings"] if f["status"] == "warn"] == ["FWD106"]
    assert not [f for f in report["checks"][0]["findings"] if f["status"] == "fail"]

    strict, report = run_json(config, "--check", "future-token", "--fail-on", "warn")
    assert strict.exit_code == 1, strict.output
    assert report["exit_code"] == 1
    assert report["status"] == "warn"


# ---------------------------------------------------------------------------------------------------------------------
# run: models that fail in ways `except Exception` or a plain `.float()` does not expect (issue 11): each is an error
# FWD002 of every check, with a report and exit 1; never exit 3, never a traceback. The model is left as found.

BAD_MODELS = REPO / "tests" / "bad_inputs" / "models"
ODD = {
    "ZeroVocabulary": ["with an empty vocabulary axis (V = 0)"],
    "MetaLogits": ["on the meta device (shapes, no values) for inputs on cpu"],
    "SparseLogits": ["as a sparse_coo tensor; fwdcheck needs dense logits"],
    "ComplexLogits": ["of dtype complex64; logits are real numbers"],
    "LogitsPropertyRaises": ["RuntimeError: logits were not computed: call generate() first"],
    "RaisesUnprintable": ["the model raised Unprintable: <its message cannot be shown: its __str__ raised>"],
    "Cancelled": ["the model raised CancelledError: forward was cancelled"],
    "GeneratorExits": ["the model raised GeneratorExit"],
    "RaisesOwnBaseException": ["the model raised Abort: abort the step"],
    "RaisesExceptionGroup": ["the model raised BaseExceptionGroup: two workers failed"],
}


def odd_document(kind: str) -> dict:
    return {
        "model": {
            "source": "python",
            "factory": "odd_failures:build",
            "kwargs": {"kind": kind},
            "python_path": [str(BAD_MODELS)],
            "vocab_size": 16,
        },
        "inputs": {"batch_size": 2, "seq_len": 4},
    }


@pytest.fixture
def forget_odd_models():
    yield
    for name in ("odd_failures", "misbehaving"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("kind", list(ODD))
@pytest.mark.slow
def test_model_failing_oddly_is_an_error_of_every_check(kind, tmp_path, forget_odd_models):
    if kind == "RaisesExceptionGroup" and sys.version_info < (3, 11):
        pytest.skip("exception groups need Python 3.11")
    config = tmp_path / f"{kind}.yaml"
    config.write_text(json.dumps(odd_document(kind)))
    result, report = run_json(config)
    assert result.exit_code == 1, result.output
    assert result.stderr == ""  # no traceback, no torch warning (a complex cast) ahead of the report
    assert [c["name"] for c in report["checks"]] == CHECKS
    for c in report["checks"]:
        if c["summary"].startswith("does not apply: "):  # no cache, loss, packing or rotary: said before any forward
            assert c["status"] == "skip"
            continue
        assert c["status"] == "error", (c["name"], c["summary"])
        finding = c["findings"][0]
        assert finding["code"] == "FWD002", finding
        for fragment in ODD[kind]:
            assert fragment in finding["message"], (fragment, finding["message"])


@pytest.mark.parametrize("kind", ["MetaLogits", "Cancelled", "RaisesUnprintable"])
def test_model_failing_oddly_is_left_as_found(kind, tmp_path, forget_odd_models):
    from fwdcheck.config.registry import select
    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.model.sources import load_model
    from fwdcheck.run.runner import run_model
    from fwdcheck.run.settings import Settings
    from tests.test_model_state import assert_same, snapshot

    config = config_from_dict(odd_document(kind), origin=tmp_path / "odd.yaml")
    model = load_model(config)
    model.module.train()
    before = snapshot(model.module)
    report = run_model(model, Settings.from_config(config), select(None))
    assert report.exit_code == 1
    assert_same(before, snapshot(model.module))


@pytest.mark.slow
def test_model_whose_eval_raises_is_an_error_of_every_check(tmp_path, forget_odd_models):
    config = tmp_path / "eval.yaml"
    config.write_text(json.dumps(odd_document("EvalRaises")))
    result = invoke("run", config, "--format", "json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert {c["status"] for c in report["checks"]} == {"error"}
    assert all("cannot be put in eval mode" in c["summary"] for c in report["checks"])


# ---------------------------------------------------------------------------------------------------------------------
# run: the JSON report and --output


@pytest.mark.slow
def test_json_report_schema():
    result, report = run_json(TOY)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert {"schema_version", "fwdcheck_version", "status", "exit_code", "model", "environment", "checks"} <= set(
        report
    )
    assert report["schema_version"] == 1
    assert report["fwdcheck_version"] == __version__
    assert report["status"] == "pass" and report["exit_code"] == 0
    assert report["config"] == str(TOY)
    assert report["model"]["source"] == "reference" and report["model"]["vocab_size"] == 16
    env = report["environment"]
    assert env["device"] == "cpu" and env["dtype"] == "float32"
    assert (env["batch_size"], env["seq_len"], env["seed"]) == (2, 4, 0)
    assert [c["name"] for c in report["checks"]] == TOY_CHECKS
    for c in report["checks"]:
        assert {"name", "status", "summary", "findings", "metrics", "data", "duration_s"} <= set(c), c.keys()
        assert c["status"] == "pass"
        assert isinstance(c["duration_s"], float) and c["duration_s"] >= 0
        for f in c["findings"]:
            assert {"code", "status", "message", "where"} <= set(f)
    entries = check(report, "shape-ledger")["data"]["entries"]
    assert entries
    for e in entries:
        assert {"name", "shape", "dims"} <= set(e), e
        assert len(e["shape"]) == len(e["dims"])
    by_name = {e["name"]: e for e in entries}
    assert by_name["input_ids"]["shape"] == [2, 4] and by_name["input_ids"]["dims"] == ["B", "T"]
    assert by_name["logits"]["shape"] == [2, 4, 16] and by_name["logits"]["dims"] == ["B", "T", "V"]


@pytest.mark.slow
def test_overrides_reach_the_report():
    result, report = run_json(TOY, "--seed", "7", "--check", "shape-ledger")
    assert result.exit_code == 0, result.output
    assert report["environment"]["seed"] == 7
    assert [c["name"] for c in report["checks"]] == ["shape-ledger"]


def test_check_outside_the_configs_selection(tmp_path):
    config = _write(
        tmp_path,
        "only-rope.yaml",
        TOY.read_text().replace("checks: [shape-ledger, future-token, mask-audit, rope]", "checks: [rope]"),
    )
    usage_error(
        invoke("run", config, "--check", "mask-audit"), "--check mask-audit is not among the config's checks (rope)"
    )


@pytest.mark.slow
def test_output_json_file_is_written_whole(tmp_path):
    out = tmp_path / "report.json"
    result = invoke("run", TOY, "--format", "json", "--output", out)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # the report goes to the file instead of stdout
    report = json.loads(out.read_text())
    assert report["exit_code"] == 0 and [c["name"] for c in report["checks"]] == TOY_CHECKS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's 0600


@pytest.mark.slow
def test_output_rich_goes_to_the_file_only(tmp_path):
    out = tmp_path / "report.txt"
    result = invoke("run", TOY, "--output", out)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    text = out.read_text()
    assert "\x1b[" not in text
    for name in TOY_CHECKS:
        assert re.search(rf"^\s*{name}\s+pass\b", text, re.MULTILINE), text
    assert "passed (exit 0)" in text


def test_output_to_a_directory_is_a_usage_error(tmp_path):
    usage_error(invoke("run", TOY, "--format", "json", "--output", tmp_path), "--output", "is a directory")
    assert list(tmp_path.iterdir()) == []


def test_output_that_cannot_be_written_is_a_usage_error(tmp_path):
    not_a_dir = _write(tmp_path, "file.txt", "x")
    usage_error(
        invoke("run", TOY, "--format", "json", "--output", not_a_dir / "report.json"), "--output", "cannot write there"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


# The devices are reached through a link in tmp_path, never named directly: should write_whole ever replace its target
# again (it did, as root: /dev/null and /dev/full became regular files), the link is what gets replaced, not /dev.


def _device_link(tmp_path: Path, device: str) -> Path:
    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    link = tmp_path / Path(device).name
    link.symlink_to(device)
    return link


@pytest.mark.slow
def test_output_to_dev_null_leaves_the_device_a_device(tmp_path):
    null = _device_link(tmp_path, os.devnull)
    result = invoke("run", TOY, "--check", "shape-ledger", "--format", "json", "--output", null)
    assert result.exit_code == 0, result.output
    assert null.is_symlink() and stat.S_ISCHR(os.stat(null).st_mode)  # written to, not replaced by a regular file


@pytest.mark.parametrize("option", ["--output", "--json", "--junit", "--save-ledger"])
@pytest.mark.slow
def test_output_to_a_full_disk_is_one_line(option, tmp_path):
    full = _device_link(tmp_path, "/dev/full")
    result = invoke("run", TOY, "--check", "shape-ledger", "--format", "markdown", option, full)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = plain(result.stderr).splitlines()
    assert lines == [f"error: {option} {full}: cannot write there (disk full: No space left on device)"], lines
    assert full.is_symlink() and stat.S_ISCHR(os.stat(full).st_mode)
    if option != "--output":  # the report on stdout was still written: one output failing does not stop the others
        assert "shape-ledger" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["/dev/stdout", "/dev/fd/1"])
def test_output_to_dev_stdout_reaches_stdout(stream, tmp_path):
    """/dev/stdout is a link to /proc/self/fd/1: replacing it (or the file behind it) left the reader with nothing."""
    link = _device_link(tmp_path, stream) if stream == "/dev/stdout" else stream
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fwdcheck",
            "run",
            str(TOY),
            "--check",
            "shape-ledger",
            "--format",
            "json",
            "--output",
            str(link),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["exit_code"] == 0
    assert proc.stderr == ""


@pytest.mark.slow
def test_output_to_a_fifo_reaches_its_reader(tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    result = invoke("run", TOY, "--check", "shape-ledger", "--format", "json", "--output", fifo)
    reader.join(timeout=60)
    assert result.exit_code == 0, result.output
    assert received and json.loads(received[0])["exit_code"] == 0
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.slow
def test_output_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    target = reports / "latest.json"
    target.write_text("stale")
    link = tmp_path / "report.json"
    link.symlink_to(Path("reports") / "latest.json")
    dangling = tmp_path / "new.json"
    dangling.symlink_to(Path("reports") / "new.json")  # a link to a file not written yet
    result = invoke("run", TOY, "--check", "shape-ledger", "--format", "json", "--output", link, "--json", dangling)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and dangling.is_symlink()
    assert json.loads(target.read_text())["exit_code"] == 0
    assert json.loads((reports / "new.json").read_text())["exit_code"] == 0
    assert sorted(p.name for p in reports.iterdir()) == ["latest.json", "new.json"]  # no temporary file left


def _checkpoint_run(tmp_path: Path) -> Path:
    """The sample checkpoint config and its weights, copied into tmp_path."""
    for name in ("reference.yaml", "reference.safetensors"):
        (tmp_path / name).write_bytes((SAMPLES / "checkpoint" / name).read_bytes())
    return tmp_path / "reference.yaml"


@pytest.mark.parametrize(
    "which", ["config", "config-through-a-link", "config-hard-link", "checkpoint", "expected-ledger"]
)
@pytest.mark.slow
def test_output_over_an_input_of_the_run_is_refused(tmp_path, which):
    config = _checkpoint_run(tmp_path)
    ledger = tmp_path / "ledger.json"
    assert invoke("run", config, "--check", "shape-ledger", "--save-ledger", ledger).exit_code == 0
    inputs = {p: p.read_bytes() for p in (config, tmp_path / "reference.safetensors", ledger)}
    args = ["run", config, "--check", "shape-ledger", "--expect-ledger", ledger]
    if which == "config":
        args += ["--output", config]
        named = "is the config file"
    elif which == "config-through-a-link":
        (tmp_path / "out.yaml").symlink_to(config.name)
        args += ["--markdown", tmp_path / "out.yaml"]
        named = "is the config file"
    elif which == "config-hard-link":
        os.link(config, tmp_path / "same.yaml")
        args += ["--junit", tmp_path / "same.yaml"]
        named = "is the config file"
    elif which == "checkpoint":
        args += ["--json", tmp_path / "reference.safetensors"]
        named = "is the checkpoint"
    else:
        args += ["--save-ledger", ledger]
        named = "is the --expect-ledger file"
    usage_error(invoke(*args), named, "fwdcheck does not write a report over a file the run reads")
    assert {p: p.read_bytes() for p in inputs} == inputs


def test_two_outputs_into_one_file_are_refused(tmp_path):
    usage_error(
        invoke("run", TOY, "--json", tmp_path / "r.json", "--junit", tmp_path / "r.json"),
        f"--junit {tmp_path / 'r.json'} is also the file of --json",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing-directory", "under-a-file", "read-only-directory"])
def test_unwritable_output_fails_before_the_model_loads(tmp_path, helpers, where):
    marker = tmp_path / "built"
    config = helpers("build_marked", extra=f"kwargs: {{marker: '{marker}'}}\n")
    if where == "missing-directory":
        target, fragment = tmp_path / "nowhere" / "report.xml", "does not exist"
    elif where == "under-a-file":
        target, fragment = _write(tmp_path, "file.txt", "x") / "report.xml", "cannot write there (Not a directory)"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target, fragment = locked / "report.xml", "cannot write there (Permission denied)"
    try:
        usage_error(invoke("run", config, "--junit", target), f"--junit {target}", fragment)
    finally:
        (tmp_path / "locked").exists() and (tmp_path / "locked").chmod(0o700)
    assert not marker.exists(), "the model was built although no report could be written"


@pytest.mark.slow
def test_unwritable_step_summary_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path))  # a directory: no file can be appended to, root or not
    result = invoke("run", TOY, "--check", "shape-ledger", "--format", "github", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert "fwdcheck passed (exit 0)" in result.stdout
    lines = plain(result.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: $GITHUB_STEP_SUMMARY {tmp_path}: cannot append"), lines
    assert json.loads((tmp_path / "r.json").read_text())["exit_code"] == 0  # the other reports are written


def _closed_stdout():
    os.close(1)


@pytest.mark.parametrize("stdout", ["closed", pytest.param("full", marks=pytest.mark.slow)])  # full: a run, seconds
def test_stdout_that_cannot_take_the_report_is_one_line(stdout):
    """Python sets sys.stdout to None when descriptor 1 is closed; /dev/full fails the flush. Each is one line on
    stderr and exit 2, not exit 3 or Python's shutdown traceback."""
    if stdout == "full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    args = [sys.executable, "-m", "fwdcheck", "run", str(TOY), "--check", "shape-ledger", "--format", "json"]
    with open("/dev/full" if stdout == "full" else os.devnull, "w") as sink:
        done = subprocess.run(
            args,
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            preexec_fn=_closed_stdout if stdout == "closed" else None,
        )
    stderr, returncode = done.stderr, done.returncode
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert returncode == 2, (returncode, stderr)
    lines = plain(stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert ("stdout is closed" if stdout == "closed" else "cannot write the report to stdout") in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["json", "rich"])
def test_reader_gone_before_the_report_is_a_clean_exit(fmt):
    """A reader that quit (`| head`, a closed pipe) wanted no more: the exit code is the run's, stderr is empty."""
    args = [sys.executable, "-m", "fwdcheck", "run", str(TOY), "--check", "shape-ledger", "--format", fmt]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the report is written
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, stderr
    assert stderr == ""


# ---------------------------------------------------------------------------------------------------------------------
# run: a config or an expected ledger that cannot be read as one


def test_config_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)

    def release():  # should the run open it after all, give it an end of file: a failing test, not a hung one
        with suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(10, release)
    timer.daemon = True
    timer.start()
    try:
        usage_error(invoke("run", fifo), f"{fifo}: is a FIFO (named pipe), not a regular file")
    finally:
        timer.cancel()


def test_config_that_is_a_device_is_refused():
    usage_error(invoke("run", "/dev/zero"), "/dev/zero: is a character device, not a regular file")


def _saved_ledger(tmp_path: Path) -> dict:
    ledger = tmp_path / "saved.json"
    assert invoke("run", TOY, "--check", "shape-ledger", "--save-ledger", ledger).exit_code == 0
    return json.loads(ledger.read_text())


def _deep(depth: int) -> str:
    return '{"entries": [], "extra": ' + "[" * depth + "]" * depth + "}"


LEDGER_CASES = {
    "entries-null": (lambda saved: {**saved, "entries": None}, "entries: expected a list (got None)"),
    "entries-not-a-list": (
        lambda saved: {**saved, "entries": {"logits": ["B"]}},
        "entries: expected a list",
    ),
    "name-a-number": (
        lambda saved: {**saved, "entries": [{**saved["entries"][0], "name": 3}]},
        "entries[0].name: expected a text (a string) (got 3)",
    ),
    "dims-a-string": (
        lambda saved: {**saved, "entries": [{**saved["entries"][0], "dims": "BT"}]},
        "entries[0].dims: expected a list (got 'BT')",
    ),
    "dims-nested": (
        lambda saved: {**saved, "entries": [{**saved["entries"][0], "dims": [["B"], ["T"]]}]},
        "entries[0].dims[0]: expected a text (a string)",
    ),
    "shape-and-dims-disagree": (
        lambda saved: {**saved, "entries": [{**saved["entries"][0], "shape": [2]}]},
        "'input_ids' has 1 sizes in shape but 2 names in dims",
    ),
    "dimension-nan": (
        lambda saved: {**saved, "dims": {**saved["dims"], "h": "NaN"}},
        "dims.h: expected a whole number (got nan)",
    ),
    "dimension-a-float": (
        lambda saved: {**saved, "dims": {**saved["dims"], "h": 2.5}},
        "dims.h: expected a whole number",
    ),
    "duplicated-entry": (
        lambda saved: {**saved, "entries": saved["entries"] + saved["entries"][-1:]},
        "is listed twice (first as entries[",
    ),
    "newer-version": (lambda saved: {**saved, "fwdcheck_ledger": 2}, "fwdcheck_ledger: expected 1 (got 2)"),
    "no-entries": (lambda saved: {"dims": saved["dims"]}, "not a ledger written by --save-ledger"),
    "nested-100-deep": (lambda saved: _deep(100), "nested more than 64 levels deep"),
    "nested-100000-deep": (lambda saved: _deep(100_000), "nested too deeply"),
}


@pytest.mark.parametrize("case", list(LEDGER_CASES))
@pytest.mark.slow
def test_expected_ledger_of_the_wrong_shape_is_one_line(tmp_path, case):
    make, fragment = LEDGER_CASES[case]
    document = make(_saved_ledger(tmp_path))
    text = document if isinstance(document, str) else json.dumps(document)
    ledger = tmp_path / "expected.json"
    ledger.write_text(text.replace('"NaN"', "NaN"))  # json.dumps quotes it; a hand-edited file may not
    usage_error(
        invoke("run", TOY, "--check", "shape-ledger", "--expect-ledger", ledger), f"--expect-ledger {ledger}", fragment
    )


# ---------------------------------------------------------------------------------------------------------------------
# list, explain, init, --version


def test_list_shows_the_four_checks():
    result = invoke("list")
    out = plain(result.stdout)
    assert result.exit_code == 0, result.output
    for name in CHECKS:
        assert re.search(rf"^{name}\s+fwdcheck\[{name}\]", out, re.MULTILINE), out


def test_explain_future_token():
    result = invoke("explain", "future-token")
    out = plain(result.stdout)
    assert result.exit_code == 0, result.output
    assert out.startswith("future-token (fwdcheck[future-token])")
    for code in ("FWD101", "FWD102", "FWD103"):
        assert code in out
    assert "leak map" in out


@pytest.mark.slow
def test_init_writes_a_config_that_passes_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "fwdcheck.yaml"
    result = invoke("init", path)
    assert result.exit_code == 0, result.output
    assert f"wrote {path}" in plain(result.stdout).replace("\n", "")
    written = path.read_text()
    assert written.startswith(f"# fwdcheck config: `fwdcheck run {path}`")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask

    run = invoke("run", path)
    assert run.exit_code == 0, run.output
    assert "passed (exit 0)" in plain(run.stdout)

    path.write_text(written + "# edited\n")
    usage_error(invoke("init", path), str(path), "exists; pass --force to overwrite it")
    assert path.read_text().endswith("# edited\n")  # untouched

    forced = invoke("init", path, "--force")
    assert forced.exit_code == 0, forced.output
    assert path.read_text() == written


def test_init_into_a_missing_directory_names_the_path_not_output(tmp_path):
    target = tmp_path / "nowhere" / "fwdcheck.yaml"
    line = usage_error(invoke("init", target), str(target), "does not exist")
    assert "--output" not in line


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"fwdcheck {__version__}"


def test_no_arguments_shows_help():
    result = invoke()
    assert result.exit_code in (0, 2)  # no_args_is_help: Click exits 0 before 8.2, 2 from 8.2 on
    for command in ("run", "list", "explain", "init"):
        assert command in plain(result.output)


@pytest.mark.slow
def test_help_and_version_do_not_import_torch():
    script = textwrap.dedent("""\
        import sys
        from fwdcheck.cli import main

        for argv in (["--help"], ["run", "--help"], ["--version"]):
            sys.argv = ["fwdcheck", *argv]
            try:
                main()
            except SystemExit as exc:
                assert exc.code in (0, None), (argv, exc.code)
        print("torch imported:", "torch" in sys.modules)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"}
    )
    assert proc.returncode == 0, proc.stderr
    assert "Exit codes" in proc.stdout  # the help really was printed
    assert f"fwdcheck {__version__}" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == "torch imported: False"


@pytest.mark.slow
def test_list_and_explain_import_no_torch_and_no_check():
    """`list` and `explain` read what the built-ins declare from their spec modules (fwdcheck/checks/<name>_spec.py),
    imported as any module is: neither torch nor a check's own module is loaded."""
    script = textwrap.dedent("""\
        import sys
        from fwdcheck.cli import main

        for argv in (["list"], ["explain", "FWD101"], ["explain", "golden"]):
            sys.argv = ["fwdcheck", *argv]
            try:
                main()
            except SystemExit as exc:
                assert exc.code in (0, None), (argv, exc.code)
        checks = sorted(m for m in sys.modules if m.startswith("fwdcheck.checks.") and not m.endswith("_spec"))
        print("torch imported:", "torch" in sys.modules, "checks imported:", checks)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"}
    )
    assert proc.returncode == 0, proc.stderr
    assert "shape-ledger" in proc.stdout and "sharding" in proc.stdout  # the list was printed
    assert "logits at earlier positions moved when later tokens changed" in proc.stdout  # FWD101 explained
    assert "--expect-golden" in proc.stdout  # golden explained
    assert proc.stdout.rstrip().splitlines()[-1] == "torch imported: False checks imported: []"


def test_dtype_on_the_command_line_takes_the_configs_spellings():
    """`--dtype bf16` as `dtype: bf16` in a config: the run is in bfloat16; a dtype no spelling names is refused with
    one line saying what is taken, exit 2."""
    result = runner.invoke(app, ["run", str(TOY), "--dtype", "bf16", "--in-process", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["environment"]["dtype"] == "bfloat16"
    refused = runner.invoke(app, ["run", str(TOY), "--dtype", "int8"])
    assert refused.exit_code == 2
    assert "'int8' is no dtype fwdcheck runs in: float32, bfloat16, float16 (or bf16, fp16, fp32, half)" in (
        refused.output
    )


def test_a_module_not_found_says_where_it_looked_and_what_is_there(tmp_path):
    """`factory: models:build` beside a model.py: one line naming the folder looked in and the module there whose
    name is close; from another folder, `--model models:build` names the working directory it looked in."""
    (tmp_path / "model.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    (tmp_path / "fwdcheck.yaml").write_text("model: {source: python, factory: 'models:build'}\n")
    result = runner.invoke(app, ["run", str(tmp_path / "fwdcheck.yaml"), "--in-process"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert "factory 'models:build': cannot import 'models': No module named 'models'; did you mean 'model'?" in line
    assert f"(looked in {tmp_path} and the installed packages: run from the module's folder" in line
