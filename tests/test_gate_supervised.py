"""A gate nothing ordinary can fool, continued: every way in is supervised, and a run leaves nothing behind.

Each class both ways, against the command line, the pytest plugin and `fwdcheck diff` as a project uses them: a model
that exits or hangs ends its own items, never the pytest session nor the diff; two configs' same-named `models.py`
are two models; a `fwdcheck/` folder where the command runs does not shadow the package; a process the model starts
does not outlive the run; a model that moves torch's default device, holds lazy modules, or grows a position table
with an int beside it is checked, and left as found. (A model's own KeyboardInterrupt is a mode of
tests/test_model_failures.py.)
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fwdcheck

pytest_plugins = ["pytester"]

MODELS = '''
import os
import subprocess
import time

import torch
import torch.nn as nn


class Model(nn.Module):
    """V = 16, D = 8. `how` is what it does besides: leak (position i reads token i + 1), exit (os._exit(0) in its
    first forward), hang (sleeps in its first forward), spawn (starts a process that would outlive the run), meta
    (sets torch's default device to meta after its first forward), float64 (the default dtype), lazy (a lazy head)."""

    def __init__(self, how="clean"):
        super().__init__()
        self.how = how
        self.calls = 0
        self.token_embedding_table_of_the_model = nn.Embedding(16, 8)  # a long name, as real ones are
        self.head = nn.LazyLinear(16) if "lazy" in how else nn.Linear(8, 16)

    def forward(self, input_ids):
        self.calls += 1
        x = self.token_embedding_table_of_the_model(input_ids)  # (B, T, D)
        if "leak" in self.how:
            x = x + torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)  # i reads i + 1
        if self.calls == 1 and self.how == "exit":
            os._exit(0)
        if self.calls == 1 and self.how == "hang":
            time.sleep(3600)
        if self.calls == 1 and self.how == "spawn":
            subprocess.Popen(["sleep", "3600"], env={**os.environ, "FWDCHECK_GATE_CHILD": os.environ["MARKER"]})
        logits = self.head(x)
        if "meta" in self.how:
            torch.set_default_device("meta")
        if "float64" in self.how:
            torch.set_default_dtype(torch.float64)
        return logits


def build(how="clean"):
    torch.manual_seed(0)
    return Model(how)
'''


def project(root: Path, how: str, name: str = "m.yaml", module: str = "gate_models", top: str = "") -> Path:
    """A config in `root` whose factory is `module`:build(how), the module beside it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(MODELS)
    config = root / name
    config.write_text(
        f"model:\n  source: python\n  factory: {module}:build\n  kwargs: {{how: {how}}}\n  vocab_size: 16\n"
        f"checks: [shape-ledger, future-token]\n{top}"
    )
    return config


def run_json(*args) -> tuple[int, dict]:
    from tests.test_cli import invoke

    result = invoke("run", *args, "--format", "json")
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout)


def statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def codes(report: dict, check: str) -> set[str]:
    return {f["code"] for c in report["checks"] if c["name"] == check for f in c["findings"]}


# -- every way in is supervised: the pytest plugin ---------------------------------------------------------------------


@pytest.mark.slow  # pytest inside pytest, a worker per config, one held to its time limit
@pytest.mark.parametrize("how, code, failed", [("exit", "FWD005", 2), ("hang", "FWD004", 1)])
def test_a_model_that_exits_or_hangs_fails_its_items_not_the_pytest_session(pytester, how, code, failed):
    """The first forward (shape-ledger's) exits: both of the config's items fail; or hangs past timeout_s: that
    check fails and the next runs. The other config's items pass, and the session ends with its summary."""
    project(pytester.path / "bad", how, top="timeout_s: 1\n")
    project(pytester.path / "good", "clean")
    result = pytester.runpytest("-p", "no:cacheprovider", "--fwdcheck", "bad", "--fwdcheck", "good", "-rf")
    result.assert_outcomes(passed=4 - failed, failed=failed)
    assert result.ret == 1
    result.stdout.fnmatch_lines([f"FAILED bad/m.yaml::shape-ledger - error: {code}*"])


@pytest.mark.slow  # pytest inside pytest, a worker per config
def test_same_named_model_modules_in_one_pytest_session_are_two_models(pytester):
    """a/models.py is clean and b/models.py leaks: each config's code is imported fresh, in its own worker."""
    project(pytester.path / "a", "clean", module="models")
    project(pytester.path / "b", "leak", module="models")
    result = pytester.runpytest("-p", "no:cacheprovider", "--fwdcheck", "a", "--fwdcheck", "b", "-rf")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["FAILED b/m.yaml::future-token - fail: FWD101*"])


@pytest.mark.slow  # pytest inside pytest, a worker per config
def test_a_worker_that_does_not_end_cleanly_fails_every_item_of_its_config(pytester):
    """The model hangs when fwdcheck puts back its training mode, after the last check: the streamed passes are no
    verdict, and every item of the config fails with the "(end of run)" error."""
    from tests.test_gate import ENDS_BADLY

    (pytester.path / "ends_badly.py").write_text(ENDS_BADLY)
    (pytester.path / "m.yaml").write_text(
        "model:\n  source: python\n  factory: ends_badly:build\n  kwargs: {how: killed}\n  vocab_size: 16\n"
        "checks: [shape-ledger, future-token]\n"
        "code_paths: {train: false}\n"  # the train path's cell would put it in training mode before the end
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--fwdcheck", "m.yaml", "-rf")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["FAILED m.yaml::future-token - error: FWD005: after the last check, the model*"])


# -- every way in is supervised: the command line ----------------------------------------------------------------------


@pytest.mark.slow  # two worker processes
def test_same_named_model_modules_in_one_run_are_two_models(tmp_path, monkeypatch):
    a = project(tmp_path / "a", "clean", module="models")
    b = project(tmp_path / "b", "leak", module="models")
    monkeypatch.chdir(tmp_path)
    code, document = run_json(a, b)
    first, second = document["reports"]
    assert statuses(first) == {"shape-ledger": "pass", "future-token": "pass"}
    assert statuses(second)["future-token"] == "fail" and "FWD101" in codes(second, "future-token")
    assert code == 1


@pytest.mark.slow  # a new interpreter for the worker
@pytest.mark.parametrize("how, exit_code", [("clean", 0), ("leak", 1)])
def test_a_fwdcheck_folder_where_the_command_runs_does_not_shadow_the_package(tmp_path, monkeypatch, how, exit_code):
    """`fwdcheck run fwdcheck/m.yaml` in a project whose `fwdcheck/` folder is a package of its own: the worker
    imports fwdcheck from where the command's own lives. A new interpreter (no fork server) is what would import
    it from the working directory."""
    config = project(tmp_path / "fwdcheck", how)
    (tmp_path / "fwdcheck" / "__init__.py").write_text("raise ImportError('the project folder, not the package')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FWDCHECK_NO_FORK_SERVER", "1")
    code, report = run_json(config.relative_to(tmp_path))
    assert code == exit_code, report
    assert statuses(report)["future-token"] == ("pass" if how == "clean" else "fail")


# -- every way in is supervised: fwdcheck diff ------------------------------------------------------------------------


def diff(tmp_path: Path, how_a: str, how_b: str = "clean", *rename: str):
    from tests.test_cli import invoke

    a = project(tmp_path / "a", how_a, top="timeout_s: 1\n")
    b = project(tmp_path / "b", how_b)
    return invoke("diff", a, b, "--format", "json", *(arg for rule in rename for arg in ("--rename", rule)))


@pytest.mark.slow  # a worker process each, some held to their time limit
@pytest.mark.parametrize(
    "how, rename, said",
    [
        ("exit", [], "exited with code 0 (sys.exit or os._exit in model code) during forward A"),
        ("hang", [], "stayed silent past A's timeout_s (1 s) during forward A"),
        # nested repetitions backtrack exponentially on a long name they do not match (…_model.weight)
        ("clean", [r"^(\w+_?)+\.bias$ -> \1.bias"], "stayed silent past A's timeout_s (1 s) during weights"),
    ],
)
def test_diff_of_a_model_that_exits_or_hangs_or_a_rule_that_backtracks_is_an_error(tmp_path, how, rename, said):
    result = diff(tmp_path, how, "clean", *rename)
    assert result.exit_code == 1, result.output
    assert said in result.stderr and "Traceback" not in result.output
    assert result.stdout == ""


@pytest.mark.slow  # a worker process each
@pytest.mark.parametrize("how_b, exit_code", [("clean", 0), ("leak", 1)])
def test_diff_of_two_supervised_models_still_compares_them(tmp_path, how_b, exit_code):
    result = diff(tmp_path, "clean", how_b)
    assert result.exit_code == exit_code, result.output
    assert json.loads(result.stdout)["equal"] is (exit_code == 0)


# -- leave nothing behind, harm nothing --------------------------------------------------------------------------------


def marked(marker: str) -> list[int]:
    """The processes whose environment carries the marker."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"FWDCHECK_GATE_CHILD={marker}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.slow  # a worker process
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the processes in /proc")
@pytest.mark.parametrize("how", ["spawn", "clean"])
def test_a_process_the_model_started_does_not_outlive_the_run(tmp_path, monkeypatch, how):
    marker = f"{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv("MARKER", marker)
    monkeypatch.chdir(tmp_path)
    code, report = run_json(project(tmp_path, how))
    assert code == 0 and statuses(report)["future-token"] == "pass"
    ended = [n for n in report["notes"] if "processes the model started" in n]
    deadline = time.monotonic() + 10  # SIGKILL is delivered, not waited for
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(marker) == []
    assert bool(ended) is (how == "spawn"), report["notes"]


@pytest.mark.parametrize("how", ["meta", "float64"])
def test_a_model_that_changes_torchs_defaults_as_it_runs_is_checked_and_they_are_put_back(how):
    ns: dict = {}
    exec(MODELS, ns)
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    with pytest.warns(RuntimeWarning, match="put back after it"):
        report = fwdcheck.check_model(ns["build"](how), ["shape-ledger", "future-token"], vocab_size=16)
    assert report.exit_code == 0, report.results
    assert (torch.get_default_dtype(), torch.get_default_device()) == (dtype, device)
    with pytest.warns(RuntimeWarning, match="put back after it"):
        leaky = fwdcheck.check_model(ns["build"](f"{how}-leak"), ["future-token"], vocab_size=16)
    assert "FWD101" in {f.code for f in leaky.result("future-token").findings}


MOVES_DEFAULTS_MIDWAY = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Midway(nn.Module):
    '''One attention call, torch's default device set to meta just before it: fwdcheck's own reading of the call
    (mask-audit's positions, the kv-cache slot tables) runs while the model's forward still holds meta.'''

    def __init__(self, leak):
        super().__init__()
        self.leak = leak
        self.emb = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids):
        x = self.emb(input_ids)  # (B, T, D)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, T, D) each
        torch.set_default_device("meta")
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=not self.leak)
        return self.head(x + attended.squeeze(1))
"""


@pytest.mark.parametrize("leak", [False, True])
def test_fwdcheck_reads_a_forward_that_moved_the_default_device_midway_with_its_own_tensors(leak):
    ns: dict = {}
    exec(MOVES_DEFAULTS_MIDWAY, ns)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="put back after it"):
        report = fwdcheck.check_model(ns["Midway"](leak), ["future-token", "mask-audit"], vocab_size=16)
    assert report.exit_code == (1 if leak else 0), report.results
    assert report.result("mask-audit").status.value == ("fail" if leak else "pass")
    assert ("FWD201" in {f.code for f in report.result("mask-audit").findings}) is leak
    assert torch.get_default_device() == torch.device("cpu")


@pytest.mark.slow  # a worker process
@pytest.mark.parametrize("how, exit_code", [("meta", 0), ("lazy", 0), ("lazy-leak", 1)])
def test_defaults_moved_and_lazy_modules_through_the_command_line(tmp_path, monkeypatch, how, exit_code):
    monkeypatch.chdir(tmp_path)
    code, report = run_json(project(tmp_path, how))
    assert code == exit_code, report
    assert report["model"]["parameters"] == 16 * 8 + 8 * 16 + 16
    assert statuses(report)["future-token"] == ("pass" if exit_code == 0 else "fail")


@pytest.mark.parametrize("how", ["lazy", "lazy-leak"])
def test_lazy_modules_through_the_api_are_materialised_then_counted(how):
    ns: dict = {}
    exec(MODELS, ns)
    report = fwdcheck.check_model(ns["build"](how), ["shape-ledger", "future-token"], vocab_size=16)
    assert report.model["parameters"] == 16 * 8 + 8 * 16 + 16
    assert any("materialised" in note for note in report.notes)
    assert report.result("future-token").status.value == ("pass" if how == "lazy" else "fail")


GROWS = """
import torch
import torch.nn as nn


class GrowsItsTable(nn.Module):
    '''An older rotary cache's habit: a position table grown on demand, an int and a buffer updated together.'''

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.cached = 4
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        if T > self.cached:
            self.cached, self.table = T, torch.arange(float(T))
        assert self.table.shape[0] == self.cached, (self.table.shape, self.cached)
        return self.head(self.emb(input_ids)) + self.table[:T, None] * 0
"""


@pytest.mark.parametrize("seq_len", [8, 4])  # grows during the run, or not
def test_every_attribute_the_run_changed_is_put_back(seq_len):
    ns: dict = {}
    exec(textwrap.dedent(GROWS), ns)
    model = ns["GrowsItsTable"]()
    report = fwdcheck.check_model(model, ["shape-ledger", "future-token"], vocab_size=16, seq_len=seq_len)
    assert report.exit_code == 0
    assert model.cached == 4 and model.table.shape == (4,)
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 16)  # the model still runs
