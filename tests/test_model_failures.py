"""A broken model never breaks the run, and the model under test is never harmed.

Each failure mode is a model from tests/bad_inputs/models/misbehaving.py that builds fine and then misbehaves in
forward: it raises, exits, returns the wrong type or shape, returns NaN or Inf, hangs, or is interrupted by Ctrl-C.
Every mode runs twice:

- through the command line (`fwdcheck run CONFIG --format json`, in-process): the documented exit code, a complete
  JSON report on stdout naming what went wrong, nothing on stderr, no traceback;
- in-process through fwdcheck.model.sources.load_model + fwdcheck.run.runner.run_model, on a model found in training
mode, in
  float64, with a user hook, a gradient, a frozen parameter and a non-default dropout p: afterwards the model is
  exactly as found (tests/test_model_state.py's snapshot: parameters and buffers bitwise, storages, dtypes, training
  flags, dropout p, requires_grad, grads, hooks; plus devices) and so is the process (RNG states, default dtype, grad
  mode, torch function modes, global module hooks, sys.path, signal handlers and the interval timer).

Ctrl-C is also sent for real, as SIGINT to a `python -m fwdcheck` subprocess hung in a forward.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.config.registry import select
from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings
from tests.test_model_state import assert_same, snapshot

MODELS = Path(__file__).resolve().parent / "bad_inputs" / "models"
MODULE = "misbehaving"
SOURCE = MODELS / f"{MODULE}.py"
CHECKS = ["shape-ledger", "future-token", "mask-audit", "rope"]
RAISE_LINE = next(i for i, line in enumerate(SOURCE.read_text().splitlines(), 1) if "RAISES-HERE" in line)

runner = CliRunner()


# ---------------------------------------------------------------------------------------------------------------------
# The failure modes


def statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def findings(report: dict, check: str) -> list[dict]:
    return next(c for c in report["checks"] if c["name"] == check)["findings"]


def every_check_errors(*fragments: str, code: str = "FWD002", where: str | None = None) -> Callable[[dict], None]:
    def expect(report: dict) -> None:
        assert statuses(report) == dict.fromkeys(CHECKS, "error"), statuses(report)
        for check in report["checks"]:
            (finding,) = check["findings"]
            assert finding["code"] == code and finding["status"] == "error", finding
            for fragment in fragments:
                assert fragment in finding["message"], (fragment, finding["message"])
                assert fragment in check["summary"], (fragment, check["summary"])
            if where is not None:
                assert (finding["where"] or "").endswith(where), finding

    return expect


def nonfinite(where: str | None = None) -> Callable[[dict], None]:
    """NaN or Inf is never a pass: future-token fails FWD104; the checks that read only shapes or masks may pass."""

    def expect(report: dict) -> None:
        s = statuses(report)
        assert s["future-token"] == "fail", s
        nan = [f for f in findings(report, "future-token") if f["code"] == "FWD104"]
        assert nan and all(f["status"] == "fail" for f in nan), findings(report, "future-token")
        if where is not None:
            assert where in nan[0]["where"], nan[0]
        assert report["status"] == "fail"

    return expect


def one_check_timed_out(report: dict) -> None:
    """Only future-token's batched forward (rows of the full length, other than the inputs' own) hangs: that check
    ends as an error after the limit, and the checks before and after it still run to their own verdicts."""
    assert statuses(report) == {
        "shape-ledger": "pass",
        "future-token": "error",
        "mask-audit": "pass",
        "rope": "skip",
    }, statuses(report)
    (finding,) = findings(report, "future-token")
    assert finding["code"] == "FWD004"
    assert "timed out after 1 s" in finding["message"]


def raised_midway(report: dict) -> None:
    s = statuses(report)
    assert list(s) == CHECKS
    assert s["shape-ledger"] == "pass", s  # ran before the model broke
    errors = [c for c in report["checks"] if c["status"] == "error"]
    assert errors and all("RuntimeError: KV cache full: it holds 3 forwards" in c["summary"] for c in errors), errors
    assert all(c["status"] in ("pass", "skip", "error") for c in report["checks"])


def interrupted(report: dict) -> None:
    s = statuses(report)
    assert list(s) == CHECKS, s  # every selected check is in the report, the ones that ran and the rest
    assert s["shape-ledger"] == "pass", s
    rest = [c for c in report["checks"] if c["name"] != "shape-ledger"]
    assert all(c["status"] == "error" and "interrupted" in c["summary"] for c in rest), rest


def rotary_raised(report: dict) -> None:
    s = statuses(report)
    assert s == {"shape-ledger": "pass", "future-token": "pass", "mask-audit": "pass", "rope": "error"}, s
    (finding,) = findings(report, "rope")
    assert finding["code"] == "FWD002"
    assert "the rotary function raised RuntimeError: rotary cache holds 8 positions" in finding["message"]
    assert f"{SOURCE.name}:" in (finding["where"] or ""), finding


@dataclass(frozen=True)
class Mode:
    name: str
    factory: str
    expect: Callable[[dict], None]
    exit_code: int = 1
    kwargs: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # more model keys
    top: dict = field(default_factory=dict)  # more top-level keys


MODES = [
    Mode(
        "raises-in-forward",
        "build_raises_in_forward",
        every_check_errors("ValueError: mix expects 3 dims, got 4", where=f"{SOURCE.name}:{RAISE_LINE} in _mix"),
    ),
    Mode("exits-in-forward", "build_exits_in_forward", every_check_errors("the model raised SystemExit: 0")),
    Mode("raises-midway", "build_raises_midway", raised_midway, kwargs={"after": 4}),
    Mode("returns-string", "build_returns_string", every_check_errors("forward returned str; fwdcheck needs logits")),
    Mode("returns-none", "build_returns_none", every_check_errors("forward returned NoneType")),
    Mode(
        "logits-[B,V]",
        "build_last_position_squeezed",
        every_check_errors(
            "fwdcheck needs logits [B, T, V] for every position", "no positions axis", "name a `forward:` adapter"
        ),
    ),
    Mode(
        "logits-[B,1,V]",
        "build_last_position_kept",
        every_check_errors("last position only", "name a `forward:` adapter"),
    ),
    Mode("nan-logits", "build_nan_logits", nonfinite()),
    Mode("nan-at-one-position", "build_nan_at_last_position", nonfinite(where="(0, 3), (1, 3)")),
    Mode("nan-when-future-changes", "build_nan_on_new_inputs", nonfinite(where="when tokens >=")),
    Mode("inf-logits", "build_inf_logits", nonfinite()),
    Mode("hangs", "build_hangs", one_check_timed_out, kwargs={"rows": 2}, top={"timeout_s": 1}),
    Mode("ctrl-c", "build_interrupts", interrupted, exit_code=130, kwargs={"after": 3}),
    Mode(
        "raises-keyboard-interrupt",
        "build_interrupts",
        every_check_errors("the model raised KeyboardInterrupt: raised by the model"),
        kwargs={"after": 1, "own": True},
    ),
    Mode(
        "rotary-function-raises",
        "build_clean",
        rotary_raised,
        model={"rotary_function": f"{MODULE}:rotary_raises", "rope": {"base": 10000.0, "rotary_dim": 4}},
    ),
]


def document(mode: Mode) -> dict:
    return {
        "model": {
            "source": "python",
            "factory": f"{MODULE}:{mode.factory}",
            "path": [str(MODELS)],
            "vocab_size": 16,
            "kwargs": dict(mode.kwargs),
            **mode.model,
        },
        "inputs": {"batch_size": 2, "seq_len": 4, "seed": 0},
        "checks": CHECKS,  # how a failure is reported, on the four checks every model gets
        **mode.top,
    }


@pytest.fixture(autouse=True)
def forget_misbehaving():
    yield
    sys.modules.pop(MODULE, None)


# A model that hangs waits out its time limit: the slow tier.
MODE_CASES = [pytest.param(m, id=m.name, marks=[pytest.mark.slow] if m.name == "hangs" else []) for m in MODES]


# ---------------------------------------------------------------------------------------------------------------------
# Through the command line: exit code and report


@pytest.mark.parametrize("mode", MODE_CASES)
@pytest.mark.slow
def test_cli_reports_the_failure(mode: Mode, tmp_path):
    config = tmp_path / f"{mode.name}.yaml"
    config.write_text(yaml.safe_dump(document(mode), sort_keys=False))
    result = runner.invoke(app, ["run", str(config), "--format", "json"], catch_exceptions=False)
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, everything
    assert result.exit_code == mode.exit_code, everything
    report = json.loads(result.stdout)  # a whole report, even for a model that hangs, exits or is interrupted
    assert report["exit_code"] == mode.exit_code
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert result.stderr == ""
    mode.expect(report)


# ---------------------------------------------------------------------------------------------------------------------
# In-process: the model and the process are left exactly as found


def _user_hook(module, args, output):
    return None


def found_state(module: nn.Module) -> nn.Module:
    """A model as a user might hand it over mid-training: train mode, float64, a gradient, a frozen parameter, a user
    hook, dropout at a non-default p."""
    module.to(torch.float64).train()
    module.embed.weight.grad = torch.full_like(module.embed.weight, 0.5)
    module.head.bias.requires_grad_(False)
    module.drop.p = 0.3
    module.head.register_forward_hook(_user_hook)
    return module


def devices(module: nn.Module) -> dict[str, torch.device]:
    return {k: v.device for k, v in module.state_dict(keep_vars=True).items()}


def process_state() -> dict:
    modules = nn.modules.module
    return {
        "rng": torch.get_rng_state(),
        "python_random": random.getstate(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "function_mode": torch._C._is_torch_function_mode_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "global_hooks": [
            len(h)
            for h in (modules._global_forward_hooks, modules._global_forward_pre_hooks, modules._global_backward_hooks)
        ],
        "sys_path": list(sys.path),
        "sigalrm": signal.getsignal(signal.SIGALRM),
        "sigint": signal.getsignal(signal.SIGINT),
        "itimer": signal.getitimer(signal.ITIMER_REAL),
        "env": {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
    }


def assert_process_same(before: dict, after: dict) -> None:
    assert torch.equal(before.pop("rng"), after.pop("rng")), "the global torch RNG state moved"
    assert before == after


@pytest.mark.parametrize("mode", MODE_CASES)
def test_model_left_exactly_as_found(mode: Mode, tmp_path):
    config = config_from_dict(document(mode), origin=tmp_path / f"{mode.name}.yaml")
    model = load_model(config)
    module = found_state(model.module)
    before, where = snapshot(module), devices(module)
    extra = {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in ("calls", "seen")}
    torch.manual_seed(1234)
    random.seed(1234)
    process = process_state()

    report = run_model(model, Settings.from_config(config), select(config.checks), config_path=None)

    assert_process_same(process, process_state())
    assert_same(before, snapshot(module))
    assert devices(module) == where
    assert all(p.dtype == torch.float64 for p in module.parameters())
    assert module.training and module.drop.p == 0.3
    assert {k: v for k, v in vars(module).items() if k in extra} == extra
    assert report.exit_code == mode.exit_code
    mode.expect(report.to_dict())


# ---------------------------------------------------------------------------------------------------------------------
# Ctrl-C for real


@pytest.mark.slow
def test_sigint_ends_with_130_and_the_report_so_far(tmp_path):
    """SIGINT to `fwdcheck run --format json` hung in future-token's forward: exit 130, and a whole JSON report on
    stdout holding the check that finished and the ones interrupted."""
    marker = tmp_path / "hanging"
    mode = Mode("sigint", "build_hangs", interrupted, kwargs={"rows": 2, "marker": str(marker)}, top={"timeout_s": 600})
    config = tmp_path / "hang.yaml"
    config.write_text(yaml.safe_dump(document(mode), sort_keys=False))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fwdcheck", "run", str(config), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the model never started hanging (exit {proc.poll()})"
        time.sleep(0.3)  # well inside the sleep loop
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in stdout + stderr, stderr
    assert proc.returncode == 130, (proc.returncode, stderr)
    report = json.loads(stdout)
    assert report["exit_code"] == 130
    interrupted(report)
    assert re.search(r"interrupted", report["checks"][1]["summary"])


# ---------------------------------------------------------------------------------------------------------------------
# A rotary function on a model that declares no head size


@pytest.mark.slow
def test_rotary_function_without_a_known_head_size_is_not_an_internal_error(tmp_path):
    """The head size then comes from the attention calls the probe saw; the raising function is the model's error."""
    mode = Mode(
        "rotary-no-head-size",
        "build_clean",
        rotary_raised,
        model={"rotary_function": f"{MODULE}:rotary_raises", "rope": {"base": 10000.0}},
    )
    config = tmp_path / "rotary.yaml"
    config.write_text(yaml.safe_dump(document(mode), sort_keys=False))
    result = runner.invoke(app, ["run", str(config), "--format", "json", "--check", "rope"], catch_exceptions=False)
    assert result.exit_code in (1, 2), result.output


# ---------------------------------------------------------------------------------------------------------------------
# The counts line (scripts/reliability_counts.py)


def test_reliability_counts_line():
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "reliability_counts.py"
    spec = importlib.util.spec_from_file_location("reliability_counts", script)
    counts_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts_module)

    from tests.test_bad_inputs import CASES
    from tests.test_fuzz import ARBITRARY, MUTATIONS

    counts = counts_module.counts()
    assert counts == {
        "bad_configs": len(CASES),
        "fuzzed_documents": ARBITRARY.max_examples + MUTATIONS.max_examples,
        "model_failure_modes": len(MODES),
    }
    assert counts["bad_configs"] >= 40 and counts["fuzzed_documents"] >= 300 and counts["model_failure_modes"] >= 10
    line = counts_module.line(counts)
    assert re.fullmatch(
        r"\d+ bad configs, \d+ fuzzed documents, \d+ model-failure modes, model bitwise unchanged in "
        r"all",
        line,
    ), line
    print(f"\n{line}")
    # The page quotes the line, and it must stay true.
    quoted = re.search(
        r"\d+ bad configs, \d+ fuzzed documents, \d+ model-failure modes[^\n]*", counts_module.PAGE.read_text()
    )
    assert quoted is not None, f"{counts_module.PAGE.name} should quote: {line}"
    assert quoted.group(0).startswith(line), (
        f"{counts_module.PAGE.name} says {quoted.group(0)!r}; the tests give {line!r}"
    )
