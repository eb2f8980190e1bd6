"""From its second job on, a process runs each model in a worker forked from a server that has imported torch already
(fwdcheck/process/forkserver.py). What a model can observe of its process is what it observes in a new interpreter, and
a fork is refused where it could differ. What a forked worker does when the model misbehaves (exits, crashes, hangs,
is interrupted, outlives a supervisor killed with SIGKILL) is tested case by case beside the new interpreter's in
tests/test_supervisor.py.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.process import forkserver

# Each test starts a fork server or a new interpreter, some wait for one to time out: the slow tier.
pytestmark = [pytest.mark.skipif(not forkserver.supported(), reason="fork server: Linux only"), pytest.mark.slow]

OBSERVING = '''
import json, os, random, resource, signal, sys, threading
import torch, torch.nn as nn


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def observe():
    """A correct causal model whose construction writes down what it can see of its process."""
    seen = {
        "cwd": os.getcwd(),
        "environment": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "argv": sys.argv,
        "path": sys.path,
        "leads its session": os.getsid(0) == os.getpid() == os.getpgid(0),
        "handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                                                signal.SIGCHLD)},
        "descriptors": len(os.listdir("/proc/self/fd")),
        "main": (sys.modules["__main__"].__name__, os.path.basename(getattr(sys.modules["__main__"], "__file__", ""))),
        "umask": current_umask(),
        "open files limit": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "threads": threading.active_count(),
        "random": random.random(),
        "torch seed": torch.initial_seed(),
        "torch threads": torch.get_num_threads(),
        "parent": os.getppid(),
    }
    with open(os.path.join(os.environ["OBSERVATIONS"], f"{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    return model
'''


@pytest.fixture
def observing(tmp_path) -> Path:
    (tmp_path / "observing_model.py").write_text(OBSERVING)
    config = tmp_path / "observe.yaml"
    config.write_text(
        textwrap.dedent("""\
        model: {source: python, factory: "observing_model:observe", path: ["."], vocab_size: 16}
        checks: [shape-ledger]
        """)
    )
    (tmp_path / "seen").mkdir()
    return config


def test_a_forked_worker_sees_what_a_new_interpreter_sees(observing, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fwdcheck", "run", observing.name, observing.name, "-q"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OBSERVATIONS": str(tmp_path / "seen")},
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    new, forked = sorted(
        (json.loads(p.read_text()) for p in (tmp_path / "seen").iterdir()), key=lambda seen: seen["parent"] != proc.pid
    )
    assert new["parent"] == proc.pid and forked["parent"] != proc.pid  # the second is the fork server's child
    assert new["random"] != forked["random"]  # each draws its own seed
    for key in ("parent", "random"):
        del new[key], forked[key]
    assert forked == new


def test_a_signal_while_the_server_starts_still_writes_the_report(observing, tmp_path):
    """SIGTERM while the second config waits for the fork server's imports: the run ends as any run SIGTERM ends,
    with the report of what finished (the first config) written."""
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fwdcheck", "run", observing.name, observing.name, "--json", str(report), "-q"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OBSERVATIONS": str(tmp_path / "seen")},
    )
    deadline = time.monotonic() + 120
    while not any("fwdcheck.process.forkserver" in command for command in children_of(proc.pid)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    document = json.loads(report.read_text())
    assert document["exit_code"] == 143 and document["reports"][0]["exit_code"] == 0


def children_of(pid: int) -> list[str]:
    """The command lines of the processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return found


def in_process(*args: str) -> int:
    return CliRunner().invoke(app, ["run", *args, "-q"]).exit_code


def test_an_environment_that_changes_gets_a_server_started_in_it(observing, tmp_path, monkeypatch):
    """OMP_NUM_THREADS (and any variable an import could read) differs from the server's: a new server, started
    in the new environment, forks the worker."""
    monkeypatch.setenv("OBSERVATIONS", str(tmp_path / "seen"))
    monkeypatch.chdir(tmp_path)
    assert in_process(observing.name) == 0  # this process's first job, or a fork
    before = forkserver.server()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert in_process(observing.name) == 0
    after = forkserver.server()
    assert after is not None and after is not before
    last = newest_observation(tmp_path)
    assert last["parent"] == after.process.pid  # forked by the new server
    assert last["torch threads"] == 2 and last["environment"]["OMP_NUM_THREADS"] == "2"


@pytest.fixture
def served(observing, tmp_path, monkeypatch):
    """This process, in the test's directory, with a fork server that has forked a worker (two jobs run)."""
    monkeypatch.setenv("OBSERVATIONS", str(tmp_path / "seen"))
    monkeypatch.chdir(tmp_path)
    assert in_process(observing.name) == 0
    assert in_process(observing.name) == 0
    assert newest_observation(tmp_path)["parent"] == forkserver.server().process.pid
    return forkserver.server()


def test_a_server_that_died_is_replaced(served, observing):
    dead = served
    dead.process.kill()
    dead.process.wait()
    assert in_process(observing.name) == 0
    assert forkserver.server() is not dead and forkserver.server().alive()


def test_variables_read_only_later_do_not_restart_the_server(served, observing, tmp_path, monkeypatch):
    server = served
    monkeypatch.setenv("COLUMNS", "77")
    assert in_process(observing.name) == 0
    assert forkserver.server() is server
    last = newest_observation(tmp_path)
    assert last["parent"] == server.process.pid
    assert last["environment"]["COLUMNS"] == "77"  # the fork has the value all the same


def newest_observation(tmp_path: Path) -> dict:
    newest = max((tmp_path / "seen").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    return json.loads(newest.read_text())


def test_a_server_outlives_the_thread_that_started_it(observing, tmp_path, monkeypatch):
    """The server ends with the supervisor's process, not with the thread whose job started it."""
    monkeypatch.setenv("OBSERVATIONS", str(tmp_path / "seen"))
    monkeypatch.setenv("FWDCHECK_TEST_SERVER", str(tmp_path))  # an environment of its own: a server of its own
    monkeypatch.chdir(tmp_path)
    assert in_process(observing.name) == 0  # this process's first job, or a fork of another server
    codes = []
    thread = threading.Thread(target=lambda: codes.append(in_process(observing.name)))
    thread.start()
    thread.join()
    started_by_the_thread = forkserver.server()
    assert codes == [0] and started_by_the_thread.alive()
    assert in_process(observing.name) == 0
    assert forkserver.server() is started_by_the_thread
    assert newest_observation(tmp_path)["parent"] == started_by_the_thread.process.pid


def test_umask_and_limits_set_after_the_server_started_reach_the_fork(served, observing, tmp_path):
    server = served
    previous_umask = os.umask(0o077)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
    try:
        assert in_process(observing.name) == 0
    finally:
        os.umask(previous_umask)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    last = newest_observation(tmp_path)
    assert last["parent"] == server.process.pid and last["umask"] == 0o077
    assert last["open files limit"] == [min(soft, 512), hard]


def test_a_server_too_slow_to_start_is_given_up(observing, tmp_path, monkeypatch):
    """A server that is not ready in time is stopped and counted: the job runs in a new interpreter, and no later
    job waits for that server again."""
    monkeypatch.setenv("OBSERVATIONS", str(tmp_path / "seen"))
    monkeypatch.setenv("FWDCHECK_TEST_SERVER", "slow")  # an environment of its own: a server of its own
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(forkserver, "READY_S", 0.05)  # less than its imports take
    monkeypatch.setattr(forkserver, "_failed_starts", 0)
    assert in_process(observing.name) == 0
    assert in_process(observing.name) == 0
    assert forkserver._failed_starts >= 1 and forkserver.server() is None
    assert newest_observation(tmp_path)["parent"] == os.getpid()  # a new interpreter, this process's child
