"""Workers forked from a process that has imported torch and fwdcheck already, for a process that runs several jobs:
several configs in one `fwdcheck run`, a test suite or a script driving the command in one interpreter. A new
interpreter spends about two seconds importing torch before the model's first line runs; a fork, milliseconds.

The first job of a process runs in a new interpreter, as it always has (a single `fwdcheck run` never starts a fork
server). The second starts the server: `python -m fwdcheck.forkserver`, its own session, stdin and output on
/dev/null, torch and fwdcheck imported, then nothing but forking on request. From then on each worker is a fork of it
that is what a new `python -m fwdcheck.worker` would be where a worker's behaviour can tell:

- its own session and process group (the supervisor signals the group), the default signal handlers;
- the supervisor's working directory, environment and a new seed for `random`; sys.path as a new interpreter started
  there would have it; sys.argv the worker's file alone (as the worker sets it anyway);
- stdin the job, stdout and stderr the pipe the supervisor relays, the event pipe: no other descriptor of the server;
- dies with its parent, the server, which dies with the supervisor (PR_SET_PDEATHSIG both): a supervisor killed with
  SIGKILL leaves neither behind;
- the server reaps it and writes its wait status to a pipe of the supervisor's, which reads the exit code and the
  signal from it as from a child of its own (ForkedWorker).

A fork is refused, and the job gets a new interpreter, where it could differ from one: an environment other than the
server's (torch, OpenMP and Python read variables as they start: OMP_NUM_THREADS, ATEN_CPU_CAPABILITY, PYTHON*),
except for variables only read later (VOLATILE); a server that died or does not answer; a platform without pidfds or
descriptor passing (Linux alone has both). What a fork cannot undo: the hash seed of str is the server's (a new
interpreter draws its own), and modules the server imported are imported already (the ones any worker imports before
the model's code runs).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

# Variables that no import reads, set per test or per terminal: a difference in them still lets a worker be forked
# (the fork gets the supervisor's values all the same).
VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "COLUMNS", "LINES", "GITHUB_STEP_SUMMARY"})
ANSWER_S = 120.0  # for the server to say it forked (the first request waits for its imports)
MAX_FDS = 4  # a request's descriptors: the job's stdin, the output pipe, the event pipe, the status pipe


def supported() -> bool:
    return sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


# ---------------------------------------------------------------------------------------------------------------------
# The supervisor's side


class ForkedWorker:
    """A worker forked by the server, handled as subprocess.Popen handles a child (the part the supervisor uses):
    its exit status comes from the server, its parent, on `status_fd`."""

    def __init__(self, pid: int, status_fd: int, stdin_fd: int):
        self.pid = pid
        self.status_fd = status_fd
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not select.select([self.status_fd], [], [], timeout)[0]:
            if timeout == 0:
                return None
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        status = _read_line(self.status_fd)
        os.close(self.status_fd)
        # No status: the server died, and the kernel killed the worker with it (PR_SET_PDEATHSIG).
        self.returncode = os.waitstatus_to_exitcode(int(status)) if status else -signal.SIGKILL
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


class _Server:
    """The running server, as this process sees it: the socket it takes requests on (one message a request)."""

    def __init__(self):
        self.environment = _lasting(os.environ)
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        here = Path(__file__).resolve().parent.parent  # the fwdcheck this process runs, not another on the way
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fwdcheck.forkserver", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), cwd=here, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:
            self.socket.close()
            raise
        finally:
            theirs.close()
        self.forked = 0

    def fork(self, stdin_r: int, output_w: int, events_w: int) -> tuple[int, int] | None:
        """(pid, status pipe) of a new worker; None (and the server stopped) when it cannot fork one."""
        status_r, status_w = os.pipe()
        request = json.dumps({"cwd": os.getcwd(), "environment": dict(os.environ)}).encode()
        try:
            socket.send_fds(self.socket, [request], [stdin_r, output_w, events_w, status_w])
            sent = True
        except OSError:  # it died, or the environment is larger than one message
            sent = False
        finally:
            os.close(status_w)
        ready = sent and select.select([status_r], [], [], ANSWER_S)[0]
        pid = _read_line(status_r) if ready else ""
        if not pid:  # it died or hangs: a new interpreter this time, a new server next time
            os.close(status_r)
            self.stop()
            return None
        self.forked += 1
        return int(pid), status_r

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.socket.close()  # the server ends when its socket closes
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


_lock = threading.Lock()
_server: _Server | None = None
_jobs = 0


def start_worker(events_w: int, output_w: int) -> ForkedWorker | None:
    """A worker forked from this process's server, its stdin a new pipe (ForkedWorker.stdin), stdout and stderr
    `output_w`, events on `events_w`; None where this job is to run in a new interpreter (the first job of the
    process; a fork refused: see the module's docstring)."""
    global _server, _jobs
    with _lock:
        _jobs += 1
        if _jobs == 1 or not supported() or os.environ.get("FWDCHECK_NO_FORK_SERVER"):
            return None
        if _server is not None and (not _server.alive() or _server.environment != _lasting(os.environ)):
            _server.stop()
            _server = None
        if _server is None:
            try:
                _server = _Server()
            except OSError:
                return None
            atexit.register(_server.stop)
        stdin_r, stdin_w = os.pipe()
        try:
            forked = _server.fork(stdin_r, output_w, events_w)
        finally:
            os.close(stdin_r)
        if forked is None:
            os.close(stdin_w)
            _server = None
            return None
        return ForkedWorker(*forked, stdin_w)


def server() -> _Server | None:
    """This process's fork server, if it has one running."""
    return _server


def _lasting(environment) -> dict[str, str]:
    """The environment less the variables that no import reads."""
    return {k: v for k, v in environment.items() if k not in VOLATILE}


def _read_line(fd: int) -> str:
    """One short line the other side wrote at once (a pid, a wait status); '' at end of file."""
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = os.read(fd, 64)
        except OSError:
            return ""
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()


# ---------------------------------------------------------------------------------------------------------------------
# The server's side


def serve(sock: socket.socket) -> None:
    """Fork a worker per request; reap each worker and write its wait status to the request's status pipe. Ends when
    the supervisor closes its end of `sock` (or dies: PR_SET_PDEATHSIG)."""
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status pipe)
    while True:
        ready = select.select([sock, *children], [], [])[0]
        for pidfd in [fd for fd in ready if fd in children]:
            pid, status_w = children.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            _write(status_w, f"{status}\n")
            os.close(status_w)
            os.close(pidfd)
        if sock not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, MAX_FDS)
        if not message:  # the supervisor closed its end, or ended
            return
        if len(fds) != MAX_FDS:
            for fd in fds:
                os.close(fd)
            continue
        stdin_r, output_w, events_w, status_w = fds
        pid = os.fork()
        if pid == 0:
            inherited = [sock.fileno(), status_w, *children, *(s for _, s in children.values())]
            _become_worker(json.loads(message), stdin_r, output_w, events_w, inherited)
        for fd in (stdin_r, output_w, events_w):
            os.close(fd)
        children[os.pidfd_open(pid)] = (pid, status_w)
        _write(status_w, f"{pid}\n")


def _become_worker(request: dict, stdin_r: int, output_w: int, events_w: int, inherited: list[int]) -> None:
    """In the forked child: become what `python -m fwdcheck.worker` started by the supervisor would be, then run it."""
    try:
        os.setsid()
        for fd in inherited:
            os.close(fd)
        os.dup2(stdin_r, 0)
        os.dup2(output_w, 1)
        os.dup2(output_w, 2)
        os.close(stdin_r)
        os.close(output_w)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["environment"])
        if sys.path and sys.path[0] == _STARTED_IN:  # `python -m` puts the directory it started in first
            sys.path[0] = request["cwd"]
        random.seed()
        from fwdcheck import worker

        sys.modules["__main__"] = worker
        worker.main([str(events_w), str(os.getppid())])
    finally:
        os._exit(70)  # worker.main ends the process itself; here only if it could not start


def _write(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode())
    except OSError:  # the supervisor has gone: nobody reads the status
        pass


_STARTED_IN = os.getcwd()


def main(argv: list[str]) -> None:
    sock_fd, supervisor = int(argv[0]), int(argv[1])
    from fwdcheck.lifetime import die_with_parent

    die_with_parent(supervisor)
    # What every worker imports before the model's code runs (fwdcheck.worker.main), once, here; and the registered
    # checks read (registry caches what it reads of each check's file, by the file's size and time).
    import fwdcheck.registry
    import fwdcheck.runner  # noqa: F401
    import fwdcheck.worker  # noqa: F401

    try:
        fwdcheck.registry.select(None)
    except Exception:  # each worker meets it again, and reports it
        pass

    serve(socket.socket(fileno=sock_fd))
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
