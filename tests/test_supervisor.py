"""`fwdcheck run` runs the model in a supervised worker process: model code that exits, crashes, hangs, prints or
installs exit hooks cannot end the run, pass the gate, or spoil a report on stdout.

Each case runs the real command (`python -m fwdcheck run`) as a subprocess on a tiny causal model whose forward
misbehaves after its first few calls, so that some checks finish before it does. The cases marked `worker` run twice:
the model in a new interpreter (a process's first job), and in a worker forked from the fork server (a second config
of the same command, after a correct model: fwdcheck/process/forkserver.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

MODELS = '''
import atexit, ctypes, os, signal, time
import torch, torch.nn as nn


class Causal(nn.Module):
    """A correct causal model (a running mean of embeddings) whose forward misbehaves from call `after` on."""

    def __init__(self, misbehave, after=3):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.misbehave, self.after, self.calls = misbehave, after, 0

    def forward(self, ids):
        self.calls += 1
        if self.calls > self.after:
            self.misbehave(self)
        x = self.emb(ids)
        counts = torch.arange(1, ids.shape[1] + 1, device=ids.device).view(1, -1, 1)
        return self.head(x.cumsum(1) / counts)


def leaky_forward(self, ids):
    return self.head(self.emb(ids).mean(1, keepdim=True).expand(-1, ids.shape[1], -1))


def exits(_):
    os._exit(0)


def segfaults(_):
    ctypes.string_at(0)


def killed(_):
    os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does


def hangs_swallowing_everything(_):
    while True:
        try:
            time.sleep(0.05)
        except BaseException:
            pass


def hangs(_):
    time.sleep(3600)


def prints(_):
    print("step", flush=True)


def noop(_):
    pass


def exit_0():
    return Causal(exits)


def segfault():
    return Causal(segfaults)


def oom_killed():
    return Causal(killed)


def hang_forever():
    return Causal(hangs_swallowing_everything)


def hang():
    return Causal(hangs, after=0)


def hangs_saying_where(_):
    with open(os.environ["HANGING_PIDS"], "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    time.sleep(3600)


def hang_saying_where():
    return Causal(hangs_saying_where, after=0)


def correct():
    return Causal(noop)


def chatty():
    print("number of parameters: 0.01M")  # as nanoGPT's constructor does
    return Causal(prints, after=0)


def leaky_with_exit_hook():
    atexit.register(lambda: os._exit(0))  # would make the process exit 0 whatever fwdcheck decided
    model = Causal(noop)
    model.forward = leaky_forward.__get__(model)
    return model


def exits_while_loading():
    os._exit(0)
'''


@pytest.fixture
def config(tmp_path):
    (tmp_path / "supervised_models.py").write_text(MODELS)

    def write(factory: str, timeout_s: float = 120) -> Path:
        path = tmp_path / f"{factory}.yaml"
        path.write_text(
            textwrap.dedent(f"""\
            model: {{source: python, factory: "supervised_models:{factory}", path: ["."], vocab_size: 16}}
            timeout_s: {timeout_s}
            """)
        )
        return path

    return write


def fwdcheck(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fwdcheck", "run", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


@dataclass
class Worker:
    """Where the model of the config under test runs: `worker(path)` is the command's config arguments."""

    forked: bool
    first: list[Path]  # run before it: a correct model, so that the config under test is the command's second job

    def __call__(self, path: Path) -> list[Path]:
        return [*self.first, path]


@pytest.fixture(params=["new-interpreter", "forked"])
def worker(request, config) -> Worker:
    forked = request.param == "forked"
    return Worker(forked, [config("correct")] if forked else [])


def checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def codes(check: dict) -> set[str]:
    return {f["code"] for f in check["findings"]}


def assert_died_during_a_check(report: dict, how: str, code: str = "FWD005") -> None:
    """Exit 1; shape-ledger (which ran before the model misbehaved) kept its pass; the check running when it happened
    is `error` with `code`, naming how; the rest are not run."""
    assert report["exit_code"] == 1
    by_name = checks(report)
    assert by_name["shape-ledger"]["status"] == "pass"
    running = by_name["future-token"]
    assert running["status"] == "error" and code in codes(running), running
    assert how in running["summary"], running["summary"]
    for later in ("mask-audit", "rope"):
        assert by_name[later]["status"] == "error" and by_name[later]["summary"].startswith("not run: ")


def assert_model_left_its_mark(report: dict, name: str) -> None:
    """What each misbehaving model below must leave in its report, in a new interpreter or a forked worker."""
    if name in ("exit_0", "segfault", "oom_killed"):
        assert_died_during_a_check(
            report, {"exit_0": "exited with code 0", "segfault": "SIGSEGV", "oom_killed": "SIGKILL"}[name]
        )
    elif name == "hang_forever":
        assert_died_during_a_check(report, "timeout_s (4 s)", code="FWD004")
    elif name == "leaky_with_exit_hook":
        assert report["exit_code"] == 1 and "FWD101" in codes(checks(report)["future-token"])
    elif name == "exits_while_loading":
        assert report["exit_code"] == 1
        assert all(c["status"] == "error" and "before the model loaded" in c["summary"] for c in report["checks"])
    else:
        raise AssertionError(name)


def run_one(config, name: str, *args: str) -> dict:
    proc = fwdcheck(config(name, timeout_s=4 if name == "hang_forever" else 120), "--format", "json", *args)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_os_exit_0_in_forward_fails_the_gate(config):
    assert_model_left_its_mark(run_one(config, "exit_0"), "exit_0")


@pytest.mark.slow
def test_segfault_in_forward_is_fwd005_naming_the_signal(config):
    assert_model_left_its_mark(run_one(config, "segfault"), "segfault")


@pytest.mark.slow
def test_oom_kill_is_fwd005_naming_sigkill(config):
    assert_model_left_its_mark(run_one(config, "oom_killed"), "oom_killed")


@pytest.mark.slow
def test_forward_that_swallows_the_timeout_is_killed_by_the_supervisor(config):
    assert_model_left_its_mark(run_one(config, "hang_forever"), "hang_forever")


@pytest.mark.slow
def test_exit_hook_of_the_model_does_not_decide_the_exit_code(config):
    assert_model_left_its_mark(
        run_one(config, "leaky_with_exit_hook", "--check", "future-token"), "leaky_with_exit_hook"
    )


@pytest.mark.slow
def test_worker_that_exits_while_loading_reports_every_check(config):
    assert_model_left_its_mark(run_one(config, "exits_while_loading"), "exits_while_loading")


@pytest.mark.slow
def test_each_misbehaviour_in_a_forked_worker_leaves_the_same_report(config):
    """One command, several configs: the first model runs in a new interpreter, every later one in a worker forked
    from the fork server. Each misbehaving model leaves what it leaves in a new interpreter, and the command's
    exit code and its report on stdout are its own."""
    names = [
        "exit_0",
        "segfault",
        "oom_killed",
        "hang_forever",
        "leaky_with_exit_hook",
        "exits_while_loading",
        "chatty",
    ]
    paths = [config(name, timeout_s=4 if name == "hang_forever" else 120) for name in names]
    proc = fwdcheck(config("correct"), *paths, "--format", "json")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    first, *reports = json.loads(proc.stdout)["reports"]
    assert first["exit_code"] == 0 and len(reports) == len(names)
    for name, report in zip(names, reports, strict=True):
        if name == "chatty":
            assert report["exit_code"] == 0
        else:
            assert_model_left_its_mark(report, name)
    assert "number of parameters" in proc.stderr and "step" in proc.stderr  # the forked worker's prints, relayed


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["json", "junit"])
def test_model_prints_go_to_stderr_and_reports_on_stdout_stay_valid(config, fmt):
    proc = fwdcheck(config("chatty"), "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    if fmt == "json":
        assert json.loads(proc.stdout)["exit_code"] == 0
    else:
        ET.fromstring(proc.stdout)
    assert "number of parameters" in proc.stderr and "step" in proc.stderr
    assert "number of parameters" not in proc.stdout and "step" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_writes_the_partial_report(config, worker, tmp_path, signum, exit_code):
    """A CI runner cancelling the job (SIGTERM) or a Ctrl-C: the worker is ended, the report files are written with
    what finished, and the exit code says which signal."""
    report_path = tmp_path / "report.json"
    args = [
        sys.executable,
        "-m",
        "fwdcheck",
        "run",
        *worker(config("hang_saying_where")),
        "--json",
        report_path,
        "--format",
        "junit",
    ]
    proc = subprocess.Popen(
        [str(a) for a in args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HANGING_PIDS": str(tmp_path / "pids")},
    )
    hanging_pid, _ = wait_for_the_hang(tmp_path / "pids")
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == exit_code, stderr
    report = json.loads(report_path.read_text())
    assert report["exit_code"] == exit_code
    reports = report.get("reports", [report])
    assert any(c["status"] == "error" for c in reports[-1]["checks"])
    ET.fromstring(stdout)
    assert "Traceback" not in stderr
    assert_ended(hanging_pid)


@pytest.mark.slow
def test_a_supervisor_killed_with_sigkill_leaves_no_process_behind(config, worker, tmp_path):
    """SIGKILL gives the supervisor no chance to end its worker: the kernel does (the worker, and a fork server with
    its worker, die with their parent)."""
    args = [sys.executable, "-m", "fwdcheck", "run", *worker(config("hang_saying_where")), "-q"]
    proc = subprocess.Popen(
        [str(a) for a in args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HANGING_PIDS": str(tmp_path / "pids")},
    )
    hanging_pid, parent_pid = wait_for_the_hang(tmp_path / "pids")
    assert (parent_pid != proc.pid) == worker.forked  # a forked worker's parent is the fork server
    proc.kill()
    proc.wait(timeout=30)
    assert_ended(hanging_pid)
    assert_ended(parent_pid)


def wait_for_the_hang(pids: Path) -> tuple[int, int]:
    """(pid, parent pid) of the worker whose model now hangs in a forward, as the model wrote them."""
    deadline = time.monotonic() + 120
    while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid, parent = map(int, pids.read_text().split())
    return pid, parent


def assert_ended(pid: int, within_s: float = 30) -> None:
    """`pid` has ended (or is a zombie its parent has yet to reap)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} is still running")


@pytest.mark.slow
def test_in_process_runs_without_a_worker(config):
    proc = fwdcheck(config("chatty"), "--format", "json", "--in-process")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["exit_code"] == 0
