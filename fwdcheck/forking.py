"""The worker forked from a fork server, so that the runs of one process import torch once.

A worker started as a new interpreter spends most of a small model's run importing torch (1.5 to 2.5 s on a 2-core
machine, for a check that takes a fraction of that). `fwdcheck run a.yaml b.yaml`, and the CLI driven in-process by a
test suite, start one worker per run; multiprocessing's fork server imports torch and fwdcheck once (its preload)
and forks each worker from there, with what a new interpreter would have had set up by the worker itself
(worker.forked): its own session, its output on the supervisor's pipe, the supervisor's working directory and
environment. The fork server ends with this process, and a worker with its fork server (PR_SET_PDEATHSIG).

Libraries read some variables only as they load (the OpenMP, MKL and oneDNN thread and kernel settings, torch's
own): a worker forked from a server that loaded them under other values would not run as a new interpreter would,
so when one of those differs from what the server started with, the worker is a new interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from multiprocessing import reduction

from fwdcheck.worker import Job, forked

PRELOAD = ["torch", "fwdcheck.runner"]  # what every run imports; transformers is left to the runs that need it
# Variables read when the preloaded libraries load (or by the interpreter itself).
READ_AT_LOAD = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "ATEN_", "TORCH_", "PYTORCH_",
                "CUDA_", "NCCL_", "LD_", "MALLOC_", "PYTHON")

_started_with: dict[str, str] | None = None  # the load-time variables the fork server started with


def usable() -> bool:
    """Whether a worker forked from this process's fork server would run as a new interpreter would. Linux only:
    elsewhere a process that imported torch's native libraries is not safe to fork (macOS's system frameworks)."""
    if not sys.platform.startswith("linux") or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    return _started_with is None or _started_with == _load_time_environment()


def start(job: Job, events_fd: int, output_fd: int) -> Forked:
    """The worker, forked from the fork server (started now, on this process's first run)."""
    global _started_with
    context = multiprocessing.get_context("forkserver")
    if _started_with is None:
        context.set_forkserver_preload(PRELOAD)
        _started_with = _load_time_environment()
    process = context.Process(target=forked, name="fwdcheck-worker",
                              args=(job, _Fd(events_fd), _Fd(output_fd), os.getcwd(), dict(os.environ)))
    process.start()
    return Forked(process)


def _load_time_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(READ_AT_LOAD)}


class Forked:
    """A forked worker, answering as the subprocess.Popen of a new interpreter does (pid, poll, wait, returncode:
    negative for the signal that ended it)."""

    def __init__(self, process: multiprocessing.Process):
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("fwdcheck worker", timeout)
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)


class _Fd:
    """A descriptor handed to the forked worker: the fork server passes it on, and the worker gets its number."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(handed) -> int:
    return handed.detach()
