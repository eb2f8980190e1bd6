"""Workers forked from a process that has imported torch and fwdcheck already, for a process that runs several jobs:
several configs in one `fwdcheck run`, a test suite or a script driving the command in one interpreter. A new
interpreter spends about two seconds importing torch before the model's first line runs; a fork, milliseconds.

A single `fwdcheck run` never starts a fork server. The second job of a process starts one (a new interpreter running
fwdcheck.process.forkserver, fwdcheck/process/interpreter.py's command: its own session, stdin and output on /dev/null,
torch and fwdcheck imported, then nothing but forking on request) and waits for it as it would for a new interpreter's
imports (a signal ends the wait; so does READY_S, and the job then runs in a new interpreter). From then on each worker
is a fork of the server, made what a new interpreter running fwdcheck.process.worker would be where a worker's behaviour
can
tell:

- it dies with its parent, the server (PR_SET_PDEATHSIG, armed first), which ends with the supervisor's process (a
  pidfd of it) or when the supervisor closes its socket: a supervisor killed with SIGKILL leaves neither behind;
- its own session and process group (the supervisor signals the group), the default signal handlers;
- the supervisor's working directory, environment, umask and resource limits, and a new seed for `random`; sys.path
  as a new interpreter started there would have it; sys.argv the worker's file alone (as the worker sets it anyway);
- stdin the job, stdout and stderr the pipe the supervisor relays, the event pipe: no other descriptor of the server;
- the server reaps it and writes its wait status to a pipe of the supervisor's, which reads the exit code and the
  signal from it as from a child of its own (ForkedWorker); a worker that could not become all of the above ends
  before reading its job, and the job runs in a new interpreter.

A fork is refused, and the job gets a new interpreter, where it could differ from one: an environment other than the
server's (torch, OpenMP and Python read variables as they start: OMP_NUM_THREADS, ATEN_CPU_CAPABILITY, PYTHON*),
except for variables only read later (VOLATILE); another CPU affinity (OpenMP sizes its pool by it); another working
directory when PYTHONPATH holds relative entries (Python made them absolute against the server's); a server that died
or does not answer; CUDA initialized in the server; a platform without pidfds or descriptor passing (Linux has both).
A server whose environment no longer matches is retired, and stopped once its last worker has ended. What a fork
cannot undo: the hash seed of str is the server's (a new interpreter draws its own), and the modules the server
imported (torch and fwdcheck's own, the ones any worker imports before the model's code runs) are imported already.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress

from fwdcheck.process import interpreter

# Variables that no import reads, set per test or per terminal: a difference in them still lets a worker be forked
# (the fork gets the supervisor's values all the same).
VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "COLUMNS", "LINES", "GITHUB_STEP_SUMMARY"})
READY_S = 60.0  # for a server to import torch and fwdcheck; past it, the job runs in a new interpreter
ANSWER_S = 10.0  # for a ready server's fork to say it has become a worker
MAX_FAILED_STARTS = 3  # servers that died or never answered, after which this process forks no more
MAX_FDS = 4  # a request's descriptors: the job's stdin, the output pipe, the event pipe, the status pipe
LIMITS = [getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")]


def supported() -> bool:
    """Linux with pidfds (kernel 5.3) and descriptor passing, as this process finds them."""
    if sys.platform != "linux" or not hasattr(socket, "send_fds") or not hasattr(signal, "pidfd_send_signal"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an older kernel, or a sandbox that forbids the call
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------------
# The supervisor's side


class ForkedWorker:
    """A worker forked by the server, handled as subprocess.Popen handles a child (the part the supervisor uses):
    signals go through a pidfd (never to a reused pid), the exit status comes from the server on the status pipe."""

    def __init__(self, pid: int, status: _Lines, stdin_fd: int, server: _Server):
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)  # it is alive: it waits for its job on stdin
        self.status = status
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.server = server
        self.returncode: int | None = None
        self.lost_with_server = False  # ended because its server did (killed), not by anything of its own

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            line = self.status.next(timeout)
        except TimeoutError:
            if timeout == 0:
                return None
            assert timeout is not None  # next() times out only when given a timeout
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout) from None
        kind, _, value = (line or "").partition(" ")
        if kind == "status":
            self.returncode = os.waitstatus_to_exitcode(int(value))
        else:  # the server ended, and the kernel killed the worker with it (PR_SET_PDEATHSIG)
            self.returncode, self.lost_with_server = -signal.SIGKILL, True
        self.status.close()
        os.close(self.pidfd)
        self.server.live -= 1
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self.pidfd, signum)

    def signal_group(self, signum: int) -> None:
        """The signal to the worker's process group (it leads it), while the worker has not been seen to end."""
        if self.poll() is None:
            os.killpg(self.pid, signum)


class _Lines:
    """Lines read from a pipe as they come, whatever the reads cut: `pid N` and `status S` from the server, `ready`
    from the forked child."""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""

    def next(self, timeout: float | None) -> str | None:
        """The next line; None at end of file; TimeoutError when none comes within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        os.close(self.fd)


class _Server:
    """A running server, as this process sees it: the socket it takes requests on (one message a request)."""

    def __init__(self, identity: tuple):
        self.identity = identity
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                interpreter.command("fwdcheck.process.forkserver", str(theirs.fileno()), str(os.getpid())),
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            self.socket.close()
            raise
        finally:
            theirs.close()
        self.said_ready = False
        self.live = 0  # workers forked and not yet seen to end

    def ready(self, within_s: float, cancelled: Callable[[], bool]) -> bool:
        """Whether it has said it is ready, waiting up to `within_s` for it while it starts and nothing cancels."""
        deadline = time.monotonic() + within_s
        while not self.said_ready and self.alive() and not cancelled() and time.monotonic() < deadline:
            if select.select([self.socket], [], [], 0.1)[0]:
                try:
                    self.said_ready = self.socket.recv(16) == b"ready"
                except OSError:
                    break
                if not self.said_ready:  # it closed its end: it has ended, or is ending
                    break
        return self.said_ready and self.alive()

    def fork(self, cwd: str, stdin_r: int, output_w: int, events_w: int, stdin_w: int) -> ForkedWorker | None:
        """A new worker, once it has said it is one; None when the fork is refused (its child could not become a
        worker, the server died or does not answer)."""
        status_r, status_w = os.pipe()
        request = json.dumps(
            {
                "cwd": cwd,
                "environment": dict(os.environ),
                "umask": _umask(),
                "limits": {str(r): resource.getrlimit(r) for r in LIMITS},
            }
        ).encode()
        try:
            socket.send_fds(self.socket, [request], [stdin_r, output_w, events_w, status_w])
        except OSError:  # it died, or the environment is larger than one message
            os.close(status_r)
            return None
        finally:
            os.close(status_w)
        lines, pid, became = _Lines(status_r), None, False
        deadline = time.monotonic() + ANSWER_S
        while not (pid and became):
            try:
                line = lines.next(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                line = None
            kind, _, value = (line or "").partition(" ")
            if kind == "pid":
                pid = int(value)
            elif kind == "ready":
                became = True
            else:  # it ended before becoming a worker, or the server did not answer
                lines.close()
                return None
        try:
            worker = ForkedWorker(pid, lines, stdin_w, self)
        except OSError:  # it ended between saying it is a worker and now (killed from outside)
            lines.close()
            return None
        self.live += 1
        return worker

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.socket.close()  # the server ends when its socket closes
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


_lock = threading.Lock()
_current: _Server | None = None  # the server for this process's present environment
_retired: list[_Server] = []  # servers of an earlier environment, stopped once their last worker has ended
_jobs = 0
_failed_starts = 0


def start_worker(events_w: int, output_w: int, cancelled: Callable[[], bool] = lambda: False) -> ForkedWorker | None:
    """A worker forked from this process's server, its stdin a new pipe (ForkedWorker.stdin), stdout and stderr
    `output_w`, events on `events_w`; None where this job is to run in a new interpreter (see the module's
    docstring). A server just started is waited for (it imports what a new interpreter would), unless `cancelled`
    says a signal came."""
    global _current, _jobs, _failed_starts
    with _lock:
        _jobs += 1
        if (
            _jobs == 1
            or os.environ.get("FWDCHECK_NO_FORK_SERVER")
            or _failed_starts >= MAX_FAILED_STARTS
            or not supported()
        ):
            return None
        try:
            cwd, wanted = os.getcwd(), _identity()
        except OSError:  # no working directory (deleted): a new interpreter says what that means
            return None
        for old in [s for s in _retired if s.live <= 0 or not s.alive()]:
            old.stop()
            _retired.remove(old)
        if _current is not None and (not _current.alive() or _current.identity != wanted):
            if not _current.said_ready:
                _failed_starts += not _current.alive()
            _retired.append(_current)
            _current = None
        if _current is None:
            try:
                _current = _Server(wanted)
            except OSError:
                _failed_starts += 1
                return None
        if not _current.ready(READY_S, cancelled):
            if not cancelled():  # it died or hangs while it starts: no later job waits for it again
                _current.stop()
                _current = None
                _failed_starts += 1
            return None
        stdin_r, stdin_w = os.pipe()
        worker = None
        try:
            worker = _current.fork(cwd, stdin_r, output_w, events_w, stdin_w)
        finally:
            os.close(stdin_r)
            if worker is None:
                os.close(stdin_w)
        if worker is None and not _current.alive():
            _retired.append(_current)
            _current = None
        return worker


def server() -> _Server | None:
    """This process's present fork server, if it has started one."""
    return _current


@atexit.register
def _stop_all() -> None:
    for s in [*_retired, *([_current] if _current else [])]:
        s.stop()


def _identity() -> tuple:
    """What a fork cannot take from the request, because the interpreter and the libraries it loads read it as they
    start: the environment (less VOLATILE), the CPU affinity, and the working directory where PYTHONPATH is relative."""
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k not in VOLATILE))
    relative = any(p and not os.path.isabs(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep))
    return environment, tuple(sorted(os.sched_getaffinity(0))), os.getcwd() if relative else None


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would, for a moment, for every thread)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


# ---------------------------------------------------------------------------------------------------------------------
# The server's side


def serve(sock: socket.socket, supervisor_fd: int) -> None:
    """Fork a worker per request; reap each worker and write its wait status to the request's status pipe. Ends when
    the supervisor's process ends or closes its end of `sock`."""
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status pipe)
    pid: int | None  # of a request's worker; None: the fork failed
    pidfd: int | None  # None: the worker could not be watched
    while True:
        watched: list[socket.socket | int] = [sock, supervisor_fd, *children]
        ready = select.select(watched, [], [])[0]
        if supervisor_fd in ready:
            return
        for pidfd in [fd for fd in ready if fd in children]:
            pid, status_w = children.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            _write(status_w, f"status {status}\n")
            os.close(status_w)
            os.close(pidfd)
        if sock not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, MAX_FDS)
        if not message:  # the supervisor closed its end
            return
        if len(fds) != MAX_FDS:
            for fd in fds:
                os.close(fd)
            continue
        stdin_r, output_w, events_w, status_w = fds
        server_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError:  # the request's status pipe closes unanswered: the job runs in a new interpreter
            pid = None
        if pid == 0:
            inherited = [sock.fileno(), supervisor_fd, *children, *(s for _, s in children.values())]
            _become_worker(json.loads(message), stdin_r, output_w, events_w, status_w, server_pid, inherited)
        for fd in (stdin_r, output_w, events_w):
            os.close(fd)
        pidfd = None
        if pid is not None:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if pidfd is None:
            os.close(status_w)
            continue
        assert pid is not None  # a pidfd is opened only for a worker forked
        children[pidfd] = (pid, status_w)
        _write(status_w, f"pid {pid}\n")


def _become_worker(
    request: dict, stdin_r: int, output_w: int, events_w: int, status_w: int, server_pid: int, inherited: list[int]
) -> None:
    """In the forked child: become what the worker's new interpreter started by the supervisor would be, say so on the
    status pipe, then run the worker. Anything that fails before it is a worker ends the child unannounced."""
    try:
        from fwdcheck.process.lifetime import die_with_parent

        die_with_parent(server_pid)  # first: the server may end at any moment
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
        os.umask(request["umask"])
        for limit, (soft, hard) in request["limits"].items():
            if resource.getrlimit(int(limit)) != (soft, hard):
                resource.setrlimit(int(limit), (soft, hard))
        random.seed()
        from fwdcheck.process import worker

        os.write(status_w, b"ready\n")
        os.close(status_w)
    except BaseException:
        os._exit(70)
    try:
        worker.main([str(events_w), str(server_pid)])
    finally:
        os._exit(70)  # worker.main ends the process itself


def _write(fd: int, text: str) -> None:
    with suppress(OSError):  # OSError: the supervisor has gone, nobody reads the status
        os.write(fd, text.encode())


def main(argv: list[str]) -> None:
    sock_fd, supervisor = int(argv[0]), int(argv[1])
    sock = socket.socket(fileno=sock_fd)
    try:
        supervisor_fd = os.pidfd_open(supervisor)  # the supervisor's process, whichever of its threads started this
    except OSError:
        os._exit(0)
    if os.getppid() != supervisor:  # it ended before the pidfd was taken
        os._exit(0)
    # What every worker imports before the model's code runs (fwdcheck.process.worker.main), once, here, and what
    # fwdcheck's own checks declare (their torch-free spec modules); no plugin is imported.
    import torch

    import fwdcheck.config.registry
    import fwdcheck.process.worker  # noqa: F401
    import fwdcheck.run.runner  # noqa: F401

    fwdcheck.config.registry.read_builtin_declarations()
    if torch.cuda.is_initialized():  # a fork of this process could not use CUDA: never say ready
        os._exit(0)
    sock.send(b"ready")
    serve(sock, supervisor_fd)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
