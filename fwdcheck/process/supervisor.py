"""`fwdcheck run` runs the model in a worker process (fwdcheck/process/worker.py) and keeps for itself what a gate must
not let model code touch: the exit code, the report, the output files and the clock.

- The worker streams each check's result as it finishes; whatever happens to it later, those results stand.
- It prints into a pipe relayed to stderr, so a report on stdout stays valid JSON or XML.
- timeout_s is enforced twice: inside the worker (a CheckTimeout raised in Python code) and here, where a worker that
  stays silent past the limit and a grace period (a forward that swallows the timeout, or hangs in C code) is killed.
- SIGINT / SIGTERM here are passed on to the worker as one SIGINT, which ends its run with the model restored and a
  partial report; a worker that does not answer in time is killed and the streamed results are the report (130/143).
- A worker that dies (any exit code, any signal: a segfault, the out-of-memory killer) without its report is FWD005
  on the check that was running, the finished ones kept: exit 1. After the last check the run is not over: the
  model's state is compared with what it was (FWD006) and the report sent; a worker that dies or hangs there, or
  does not end cleanly after its report, is an error on the report's "(end of run)" row, exit 1.
- The worker is a new interpreter; from the second job of a process on (several configs, a script or test suite
  running the command in one interpreter), a fork of a server that has imported torch already
  (fwdcheck/process/forkserver.py).

The Python API and the pytest plugin run in-process: there the caller owns the process anyway.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress

from fwdcheck.errors import ExitCode, Own
from fwdcheck.process import interpreter
from fwdcheck.process.events import Job
from fwdcheck.process.forkserver import ForkedWorker, start_worker
from fwdcheck.process.heard import GRACE_S, Heard, WorkerError, end_of_run
from fwdcheck.report import Report

EXIT_WAIT_S = 5.0  # for a worker that sent its report to end
LEFT_ENDING_S = 1.0  # for what the worker started and leaves behind to end on its own, before it is killed


def run_supervised(job: Job, *, timeout_s: float | None, progress: Callable[[str], None] | None = None) -> Report:
    """Run `job` in a worker process and return its report (or the partial report of a worker that died, hung or
    was interrupted). Raises WorkerError when the worker could not make the run at all."""
    run, worker, ending, received, left = supervised(job, timeout_s, progress)
    if run.report is not None:
        run.report.notes += run.stranger_note() + left
        if received:  # the worker's partial report, under the signal the supervisor received
            run.report.interrupted = True
            run.report.interrupted_exit = exit_for(received[0])
        elif ending == "hung":
            run.report.results.append(
                end_of_run(f"the model process did not end within {EXIT_WAIT_S:g} s of its report and was killed")
            )
        elif worker.returncode:  # the worker ends with os._exit(0) once its report is sent
            run.report.results.append(end_of_run(f"the model process {ended(worker)} after sending its report"))
        return run.report
    if received:
        report = run.partial_report(f"interrupted by {signal.Signals(received[0]).name}", Own.PROCESS_DIED)
        report.interrupted, report.interrupted_exit = True, exit_for(received[0])
    elif run.error is not None:
        raise run.error
    elif ending == "timeout":
        limit = f"{timeout_s:g} s" if timeout_s else "its limit"
        report = run.partial_report(
            f"the model process stayed silent past timeout_s ({limit}) and was killed (a "
            "forward that ignores the time limit, or hangs in native code)",
            Own.TIMED_OUT,
        )
    else:
        report = run.partial_report(f"the model process {ended(worker)}", Own.PROCESS_DIED)
    report.notes += left
    return report


def end_process_group(worker: subprocess.Popen | ForkedWorker) -> list[str]:
    """End what is left of the worker's process group once the worker has ended: a process the model started (a
    data-loader worker, a helper it spawned, a child it forked) must not outlive the run. The group is the worker's
    own (its pid), and stays allocated while any member lives, so the signal reaches no other process. A note when
    something had to be ended; a process that left the group (setsid, a daemon) is out of reach."""
    if worker.returncode is None:  # still running: supervise() killed or reaped it in every way it returns
        return []
    # A process that is ending on its own as the worker ends (multiprocessing's resource tracker, which ends when the
    # last process holding its pipe has) gets a moment: only what stays is killed.
    deadline = time.monotonic() + LEFT_ENDING_S
    while _group_alive(worker.pid):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    else:
        return []
    with suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(worker.pid, signal.SIGKILL)
    return [
        "processes the model started were still running after its process ended (its process group); they were killed"
    ]


def _group_alive(group: int) -> bool:
    """Whether a process of the group still runs. A zombie does not (an orphan that ended, which an init that
    reaps slowly leaves in the table): it holds nothing and no signal reaches it. Without /proc, any member counts."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError, OSError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as stat:
                fields = stat.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
        except OSError:  # ended meanwhile
            continue
        if len(fields) > 2 and int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def compare_supervised(job: Job, *, timeout_s: float | None) -> dict:
    """`fwdcheck diff`'s comparison (Diff.to_dict), made in a worker process as a run is: a model that exits,
    crashes or hangs (a rename rule that backtracks without end too) is one error line, exit 1, never the
    command's own end. Raises WorkerError (its exit code the one the command ends with)."""
    run, worker, ending, received, left = supervised(job, timeout_s, None)
    if run.compared is not None:
        run.compared["notes"] = [*run.compared.get("notes", []), *run.stranger_note(), *left]
        return run.compared
    if received:
        raise WorkerError("interrupted", exit_for(received[0]))
    if run.error is not None:
        raise run.error
    during = f"during {run.current}" if run.current else "while the models loaded"
    if ending == "timeout":
        limit = f"{timeout_s:g} s" if timeout_s else "its limit"
        raise WorkerError(
            f"the models' process stayed silent past A's timeout_s ({limit}) {during} and was killed (a forward "
            "that hangs, or a rename rule that backtracks without end)",
            ExitCode.FAILED,
        )
    raise WorkerError(f"the models' process {ended(worker)} {during}", ExitCode.FAILED)


def supervised(
    job: Job, timeout_s: float | None, progress: Callable[[str], None] | None
) -> tuple[Heard, subprocess.Popen | ForkedWorker, str, list[int], list[str]]:
    """Start a worker on `job` and supervise it to its end: what was heard, the worker (ended), how it ended
    (supervise), the signals the supervisor received meanwhile, and the notes on what had to be ended after it."""
    events_read, events_write = os.pipe()
    output_read, output_write = os.pipe()
    # From here on a SIGINT or SIGTERM is recorded, and reaches the worker once it runs: the report is still written.
    with caught_signals() as received:
        try:
            worker = start_worker(events_write, output_write, cancelled=lambda: bool(received)) or subprocess.Popen(
                interpreter.command("fwdcheck.process.worker", str(events_write), str(os.getpid())),
                stdin=subprocess.PIPE,
                stdout=output_write,
                stderr=output_write,
                pass_fds=(events_write,),
                start_new_session=True,  # a Ctrl-C in the terminal reaches the supervisor alone, which passes it on
            )
        finally:
            os.close(events_write)
            os.close(output_write)
        run = Heard(job)
        assert worker.stdin is not None  # a pipe, either way it started
        try:
            worker.stdin.write(json.dumps(job.to_wire()).encode())
            worker.stdin.close()
        except OSError:  # it died at once; what it printed says why
            pass
        ending = supervise(worker, run, events_read, output_read, timeout_s, progress, received)
    left = end_process_group(worker)
    os.close(events_read)
    os.close(output_read)
    return run, worker, ending, received, left


def supervise(
    worker: subprocess.Popen | ForkedWorker,
    run: Heard,
    events_fd: int,
    output_fd: int,
    timeout_s: float | None,
    progress,
    received: list[int],
) -> str:
    """Relay the worker's output, hear its events, and end it when it must end: 'done', 'timeout', 'signal', or
    'hung' (killed for not ending after its report)."""
    buffer = b""
    open_fds = [events_fd, output_fd]
    deadline = time.monotonic() + run.step_limit(timeout_s) if timeout_s else None
    signalled_at: float | None = None
    while open_fds:
        if received and signalled_at is None:
            signalled_at = time.monotonic()
            _signal(worker, signal.SIGINT)
        if received and (len(received) > 1 or signalled_at is not None and time.monotonic() - signalled_at > GRACE_S):
            _signal(worker, signal.SIGKILL)
        if deadline is not None and time.monotonic() > deadline and not received:
            _signal(worker, signal.SIGKILL)
            worker.wait()
            return "timeout"
        ready, _, _ = select.select(open_fds, [], [], 0.2)
        for fd in ready:
            chunk = _read(fd)
            if not chunk:
                open_fds.remove(fd)
            elif fd == output_fd:
                relay(chunk)
            else:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    run.hear_message(json.loads(line), worker.pid, progress)
                if timeout_s:
                    deadline = time.monotonic() + run.step_limit(timeout_s)
        if run.finished:
            break
        if worker.poll() is not None and not ready:  # ended, and its pipes are empty (a child may hold them open)
            break
    try:
        worker.wait(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:  # something holds the process past its report (it ends with os._exit)
        _signal(worker, signal.SIGKILL)
        worker.wait()
        _drain(output_fd)
        return "signal" if received else "hung"
    _drain(output_fd)
    return "signal" if received else "done"


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def _drain(fd: int) -> None:
    """What the worker printed last, after its final event."""
    while select.select([fd], [], [], 0)[0]:
        chunk = _read(fd)
        if not chunk:
            return
        relay(chunk)


def relay(chunk: bytes) -> None:
    """The worker's prints onto the supervisor's stderr (a closed one drops them)."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(chunk.decode("utf-8", errors="replace"))
        stream.flush()
    except (OSError, ValueError):
        pass


def _signal(worker: subprocess.Popen | ForkedWorker, signum: int) -> None:
    """The signal to the worker's whole process group (it leads one of its own): the ranks of a distributed run are
    in it too, and end with it."""
    try:
        if isinstance(worker, ForkedWorker):  # not its own child: signalled only while it has not ended
            worker.signal_group(signum)
            return
        os.killpg(worker.pid, signum)
    except (ProcessLookupError, PermissionError, OSError):  # it has ended already (or leads no group of its own)
        with suppress(ProcessLookupError, OSError):
            worker.send_signal(signum)


@contextmanager
def caught_signals():
    """SIGINT and SIGTERM recorded (in the list yielded) instead of raised, so the supervisor can end the worker
    and still write the report. Only the main thread can install handlers; elsewhere signals keep their default."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {
        s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_for(signum: int) -> int:
    return ExitCode.TERMINATED if signum == signal.SIGTERM else ExitCode.INTERRUPTED


def ended(worker: subprocess.Popen | ForkedWorker) -> str:
    """How a worker that sent no report ended, in words: a forked one may have ended with its server."""
    if isinstance(worker, ForkedWorker) and worker.lost_with_server:
        return "ended with the fork server it was forked from (the server was killed)"
    assert worker.returncode is not None  # it has ended
    return died(worker.returncode)


def died(returncode: int) -> str:
    """How a worker that sent no report ended, in words."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        why = {
            "SIGKILL": " (the out-of-memory killer sends this)",
            "SIGSEGV": " (a segmentation fault)",
            "SIGABRT": " (an abort in native code)",
            "SIGBUS": " (a bus error)",
        }.get(name, "")
        return f"was killed by {name}{why}"
    return f"exited with code {returncode} (sys.exit or os._exit in model code)"
