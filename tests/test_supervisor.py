"""`fwdcheck run` runs the model in a supervised worker process: model code that exits, crashes, hangs, prints or
installs exit hooks cannot end the run, pass the gate, or spoil a report on stdout.

Each case runs the real command (`python -m fwdcheck run`) as a subprocess on a tiny causal model whose forward
misbehaves after its first few calls, so that some checks finish before it does.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
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
        path.write_text(textwrap.dedent(f"""\
            model: {{source: python, factory: "supervised_models:{factory}", path: ["."], vocab_size: 16}}
            timeout_s: {timeout_s}
            """))
        return path

    return write


def fwdcheck(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fwdcheck", "run", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def codes(check: dict) -> set[str]:
    return {f["code"] for f in check["findings"]}


def assert_died_during_a_check(proc, how: str, code: str = "FWD005") -> dict:
    """Exit 1; the JSON report on stdout is whole; shape-ledger (which ran before the model misbehaved) kept its
    pass; the check running when it happened is `error` with `code`, naming how; the rest are not run."""
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["exit_code"] == 1
    by_name = checks(report)
    assert by_name["shape-ledger"]["status"] == "pass"
    running = by_name["future-token"]
    assert running["status"] == "error" and code in codes(running), running
    assert how in running["summary"], running["summary"]
    for later in ("mask-audit", "rope"):
        assert by_name[later]["status"] == "error" and by_name[later]["summary"].startswith("not run: ")
    assert "Traceback" not in proc.stderr
    return report


def test_os_exit_0_in_forward_fails_the_gate(config):
    proc = fwdcheck(config("exit_0"), "--format", "json")
    assert_died_during_a_check(proc, "exited with code 0")


def test_segfault_in_forward_is_fwd005_naming_the_signal(config):
    proc = fwdcheck(config("segfault"), "--format", "json")
    assert_died_during_a_check(proc, "SIGSEGV")


def test_oom_kill_is_fwd005_naming_sigkill(config):
    proc = fwdcheck(config("oom_killed"), "--format", "json")
    assert_died_during_a_check(proc, "SIGKILL")


def test_forward_that_swallows_the_timeout_is_killed_by_the_supervisor(config):
    proc = fwdcheck(config("hang_forever", timeout_s=4), "--format", "json", timeout=120)
    assert_died_during_a_check(proc, "timeout_s (4 s)", code="FWD004")


def test_exit_hook_of_the_model_does_not_decide_the_exit_code(config):
    proc = fwdcheck(config("leaky_with_exit_hook"), "--format", "json", "--check", "future-token")
    report = json.loads(proc.stdout)
    assert report["exit_code"] == 1 and proc.returncode == 1
    assert "FWD101" in codes(checks(report)["future-token"])


def test_worker_that_exits_while_loading_reports_every_check(config):
    proc = fwdcheck(config("exits_while_loading"), "--format", "json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert all(c["status"] == "error" and "before the model loaded" in c["summary"] for c in report["checks"])


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


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_writes_the_partial_report(config, tmp_path, signum, exit_code):
    """A CI runner cancelling the job (SIGTERM) or a Ctrl-C: the worker is ended, the report files are written with
    what finished, and the exit code says which signal."""
    report_path = tmp_path / "report.json"
    args = [sys.executable, "-m", "fwdcheck", "run", config("hang"), "--json", report_path, "--format", "junit"]
    proc = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _has_children(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(4)  # the worker imports torch, loads the model and hangs in its first forward
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == exit_code, stderr
    report = json.loads(report_path.read_text())
    assert report["exit_code"] == exit_code
    assert any(c["status"] == "error" for c in report["checks"])
    ET.fromstring(stdout)
    assert "Traceback" not in stderr


def _has_children(pid: int) -> bool:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return children.exists() and children.read_text().strip() != ""


def test_in_process_runs_without_a_worker(config):
    proc = fwdcheck(config("chatty"), "--format", "json", "--in-process")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["exit_code"] == 0
