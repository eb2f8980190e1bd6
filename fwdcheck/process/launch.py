"""The launcher of a distributed run: the model sharded across processes, as it will train (`distributed: {nproc:
N}`, `--nproc N`).

The process that runs the checks (the worker under `fwdcheck run`) becomes the launcher: torch's elastic launcher,
the machinery behind torchrun (torch.distributed.run), starts N rank processes on this machine (forked from a server
that has imported torch, on the CPU a fork of the launcher itself: `_rank_server`), watches them, and ends them all
when one fails. Each rank (fwdcheck/process/rank.py):

  1. joins the process group (gloo on the CPU, nccl on CUDA with one GPU per rank), timeout_s being the collectives'
     timeout: a rank left waiting for a peer raises instead of hanging;
  2. builds the same model from the same seed, as training scripts do before they shard it, puts it on its device
     and dtype, and shards it (fwdcheck/run/sharding.py): the config's `parallelize` function, (model,
     device_mesh) -> model, or a Hugging Face model's own tensor-parallel plan;
  3. runs the checks on the sharded model, the sharding check first. The logits every forward returns are rank 0's,
     broadcast to all ranks, so that every rank takes the same way through the checks and calls the model as often
     as the others: the collectives inside a sharded forward need all of them;
  4. rank 0 sends its events (the model, progress, each result) to the launcher over a local socket, which passes
     them on as a single worker would; every rank returns its report.

The launcher merges the reports: rank 0's results, each finding that did not pass naming the ranks it was seen on,
and findings seen only on other ranks added under their rank. A rank that raises ends the launch (after a model
error no rank can be sure the others are at the same collective): the report keeps the checks that finished and names
the rank, and what it raised, on the check that was running. A rank that hangs is ended by the collectives' timeout,
or with the whole process group by the supervisor's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import secrets
import signal
import socket
import sys
import threading
import uuid
import warnings
from collections.abc import Callable
from multiprocessing.connection import Listener
from typing import Any, cast

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from fwdcheck.config.schema import Config
from fwdcheck.errors import Own, first_line
from fwdcheck.process import interpreter
from fwdcheck.process.events import CheckDone, ModelLoaded, Progress, decode, sent_by
from fwdcheck.process.heard import Heard, WorkerError
from fwdcheck.process.lifetime import die_with_parent
from fwdcheck.process.rank import FWDCHECK_FAILED, RankCannotRun, RankEnded, rank_main
from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Finding, Status, worst
from fwdcheck.run.runner import Run, environment_summary
from fwdcheck.run.sharding import parallelize_function, rank_device


def launch(
    run: Run,
    job,
    *,
    progress: Callable[[str], None] | None = None,
    on_model: Callable[[dict], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """The report of `job` (its config built into `run`) run on run.config.distributed.nproc ranks."""
    from torch.distributed.launcher.api import elastic_launch

    nproc = run.config.distributed.nproc
    _quiet_resource_tracker()
    # DTensor, what any sharding builds on (the parallelize function's module imports it, to validate it below): a
    # second and a half, paid once here, before a fork of this process becomes the ranks' server, not again there.
    import torch.distributed.tensor  # noqa: F401

    # The ranks' server first: a fork of this process (on the CPU) must have none of the model's modules imported and
    # no thread running, as a new interpreter would not.
    with _rank_server(run.settings.device, _models_modules(run.config)) as start_method:
        # A name that does not import, a device the ranks cannot have: the config's error, before any rank starts.
        if run.config.distributed.parallelize:
            parallelize_function(cast(Config, run.config))  # a distributed run is a whole config's
        for local_rank in range(nproc):
            rank_device(run.settings.device, local_rank)
        heard = _heard(run, job)
        authkey = secrets.token_bytes(16)
        listener = Listener(family="AF_UNIX", authkey=authkey)
        relay = threading.Thread(
            target=_relay,
            args=(listener, heard, progress, on_model, on_result),
            daemon=True,
            name="fwdcheck-rank-0-events",
        )
        relay.start()
        rank_job = _rank_job(job, run)
        try:
            with _launcher_logs_quiet(), _package_first():
                config = _launch_config(nproc, start_method)
                returned = elastic_launch(config, rank_main)(rank_job, listener.address, authkey)
        except ChildFailedError as exc:
            relay.join(timeout=5)
            cannot_run = _cannot_run(exc)
            if cannot_run is not None:  # the run cannot be made (a usage error): not a finding of any rank
                raise cannot_run from None
            rank, failure = exc.get_first_failure()
            return heard.partial_report(f"rank {rank} of {nproc} {_failure(failure)}", _failure_code(failure))
        finally:
            listener.close()
        relay.join(timeout=5)
        return merge(
            {
                rank: Report.from_dict(report, internal_errors=flags, fail_on=run.fail_on)
                for rank, (report, flags) in returned.items()
            }
        )


def _quiet_resource_tracker() -> None:
    """Ranks that end by an exception leave semaphores behind, and the resource tracker (a process of its own, started
    with this interpreter's -W options, before the ranks' server) would warn of them on stderr after the report's
    one line: its warnings are turned off here."""
    quiet_tracker = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet_tracker not in sys.warnoptions:
        sys.warnoptions.append(quiet_tracker)


def _heard(run: Run, job) -> Heard:
    """What rank 0's events will fill in, started with what this process knows: the checks and the environment,
    the distributed settings included."""
    nproc = run.config.distributed.nproc
    heard = Heard(job)
    heard.checks = [e.name for e in run.entries]
    heard.environment = {
        **environment_summary(run.settings, run.settings.device),
        "distributed": {
            "nproc": nproc,
            "parallelize": run.config.distributed.parallelize,
            "mesh": run.config.distributed.mesh or {"ranks": nproc},
        },
    }
    return heard


def _rank_job(job, run: Run) -> dict:
    """What every rank is handed to build the same run: the plan the worker was handed, and this interpreter's
    import path."""
    return {
        "config": job.config,  # what its errors name
        "plan": run.plan.to_wire(),  # the run the ranks make, as the worker was handed it
        "sys_path": [p for p in sys.path if p],
        "package_root": interpreter.package_root(),
    }


def _launch_config(nproc: int, start_method: str):
    """torch's elastic launcher for nproc ranks on this machine, restarting none."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        max_restarts=0,
        run_id=f"fwdcheck-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        # port 0: the rendezvous store binds a port the OS picks and holds it, as torchrun --standalone
        # does; a port probed free and released before the store binds it could be taken in between
        rdzv_endpoint="127.0.0.1:0",
        monitor_interval=0.1,
        start_method=start_method,
    )


# The ranks are forked from one process that has imported these (multiprocessing's fork server) rather than each
# started as a new interpreter: torch is imported once a launch, not once a rank (on the CPU not even once: the
# server is a fork of the launcher, which has), and a rank that has handed in its report ends at once (os._exit)
# instead of tearing down an interpreter that holds torch (about a second). Nothing of the model's is imported there
# (its factory's and its parallelize function's modules): each rank imports it after it has its RANK, as a spawned
# rank would; a launcher that has imported one does not fork. A forked server has the checks' modules too (a
# config's own checks, installed plugins): the launcher imported them to read what they declare. torch._dynamo is
# imported by DTensor's first distribute_tensor, the start of any sharding: most of a second, once a launch instead
# of once a rank. fwdcheck.process.rank is rank_main's module (with sharding.py, which it imports).
RANK_PRELOAD = [
    "fwdcheck.process.rank_server",
    "torch",
    "torch.distributed.tensor",
    "torch._dynamo",
    "fwdcheck.process.rank",
]


def _models_modules(config) -> set[str]:
    """The modules the config names for the model's code (its factory, forward adapter, rotary function, parallelize
    function): each rank imports them once it has its RANK."""
    references = [getattr(config.model, name, None) for name in ("factory", "forward", "rotary_function")]
    return {reference.partition(":")[0] for reference in [*references, config.distributed.parallelize] if reference}


@contextlib.contextmanager
def _package_first():
    """fwdcheck's own directory first on the path while the ranks start. A rank that is a new interpreter (spawned,
    or forked by a server that is one) imports fwdcheck before any of its code runs, on the launcher's path, whose
    first entry is the working directory: a `fwdcheck/` folder there would shadow the package. Each rank takes the
    entry off again (_rank), so that the model's imports see the path they would have."""
    root = interpreter.package_root()
    sys.path.insert(0, root)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(root)  # its first occurrence: the one inserted above


@contextlib.contextmanager
def _rank_server(device: str, models_modules: set[str]):
    """The start method of this launch's ranks: "forkserver", a server for this launch alone (with the launcher's
    environment, working directory and sys.path) ended with it, so that no process of the run outlives the run.

    On the CPU the server is a fork of this process, which has imported torch and fwdcheck already (`_fork_server`):
    a new interpreter would spend seconds importing them again before the first rank starts. Where the ranks may use
    CUDA it is a new interpreter, as multiprocessing starts it (a process that has touched CUDA cannot fork), that
    imports RANK_PRELOAD. multiprocessing has one fork server a process and no public way to start or end it: where
    its handle is not the one CPython has had since 3.4, or a server of the process's own is running already (a
    caller's, in a process that runs fwdcheck in-process), the ranks are spawned, a new interpreter each, as torchrun
    does."""
    server: Any = getattr(multiprocessing.forkserver, "_forkserver", None)
    if (
        os.environ.get("FWDCHECK_NO_FORK_SERVER")  # refuses every fork: a new interpreter each, as torchrun starts
        or not all(hasattr(server, name) for name in ("_stop", "_forkserver_pid", "_preload_modules"))
        or server._forkserver_pid is not None
    ):
        yield "spawn"
        return
    preload = server._preload_modules
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # also for a server started anew if the fork died
    try:
        if _may_fork_server(server, device, models_modules):
            with contextlib.suppress(OSError):  # no socket or fork to be had: multiprocessing starts its own
                _fork_server(server)
        yield "forkserver"
    finally:
        if server._forkserver_pid is not None:  # its ranks have ended (the launcher waits for each), or end with it
            with contextlib.suppress(OSError):
                os.kill(server._forkserver_pid, signal.SIGKILL)  # not a second of tearing torch down
            server._stop()  # reaped, its socket removed
        multiprocessing.set_forkserver_preload(preload)


def _may_fork_server(server, device: str, models_modules: set[str]) -> bool:
    """Whether this process can fork the ranks' server: ranks on the CPU, from the main thread of a process that runs
    no other Python thread (a lock one holds would be copied held; the native pools of BLAS and OpenMP prepare for a
    fork themselves, as for a DataLoader's workers), has not initialized CUDA and has not imported a module of the
    model's (a check of the config's may live beside the model: code that reads RANK as it is imported would have
    run without it), with multiprocessing's fork server the one `_fork_server` starts,
    `main(listener_fd, alive_r, preload, main_path, sys_path)` as CPython has had it since 3.4 (another, such as one
    that authenticates its clients, gets its new interpreter)."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.backends.cuda.is_built())
    handle = all(hasattr(server, name) for name in ("_forkserver_address", "_forkserver_alive_fd"))
    main_parameters = list(inspect.signature(multiprocessing.forkserver.main).parameters)
    return (
        on_cpu
        and handle
        and main_parameters == ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
        and not torch.cuda.is_initialized()
        and threading.current_thread() is threading.main_thread()
        and threading.active_count() == 1
        and not any(name in sys.modules for name in models_modules)
    )


def _fork_server(server) -> None:
    """Start multiprocessing's fork server as a fork of this process, where ForkServer.ensure_running would start a
    new interpreter: the same listening socket and "alive" pipe, set on the handle so that the ranks' Popen finds it
    running. The fork becomes what that interpreter would be where a rank can tell: it dies with this process, has
    the signal handlers a new interpreter has, and holds no pipe or socket of this process's (the worker's events to
    its supervisor) but the server's own."""
    from multiprocessing import connection, resource_tracker, util

    resource_tracker.ensure_running()  # the ranks are handed its descriptor, as ensure_running does first
    launcher = os.getpid()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]  # not in typeshed
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # every rank holds the write end: when all have ended, the server ends
        sys.stdout.flush()  # nothing buffered here is written twice, once by a rank
        sys.stderr.flush()
        try:
            with warnings.catch_warnings():  # Python 3.12's, of the native pools' threads (see _may_fork_server)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:
            os.close(alive_r)
            os.close(alive_w)
            if not util.is_abstract_socket_namespace(address):
                os.unlink(address)
            raise
        if pid != 0:  # at once: a KeyboardInterrupt from here on finds the server on the handle, to be ended
            server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
        else:
            code = 1
            try:
                die_with_parent(launcher)  # by its pid: one that died already has left this fork to init
                _as_new_interpreter(keep={listener.fileno(), alive_r})
                multiprocessing.forkserver.main(listener.fileno(), alive_r, RANK_PRELOAD)
            except SystemExit:  # the alive pipe's end: every rank has ended
                code = 0
            finally:
                os._exit(code)  # never back into the launcher's code
        os.close(alive_r)


def _as_new_interpreter(keep: set[int]) -> None:
    """In a fork: the signal handlers of a new interpreter (Python's handlers reset to the default, SIGINT's to
    KeyboardInterrupt), and each descriptor inherited above stdin, stdout and stderr, bar `keep`, made /dev/null, as
    a new interpreter inherits none: a peer waiting for its end of a pipe or socket to close must not wait for this
    process, nor a lock held through an open file stay held by it. Made /dev/null rather than closed, so that an
    object of the parent's that owns the number cannot close a descriptor this process opens later."""
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    listing = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    for fd in sorted(int(name) for name in os.listdir(listing)):
        if fd <= 2 or fd in keep or fd == devnull:
            continue
        try:
            os.fstat(fd)
        except OSError:  # the listing's own, closed
            continue
        os.dup2(devnull, fd)
    os.close(devnull)


def _relay(listener: Listener, heard: Heard, progress, on_model, on_result) -> None:
    """Rank 0's events, heard (for the report of a launch that fails) and passed on as the worker's own."""
    try:
        connection = listener.accept()
    except OSError:  # closed before rank 0 connected: the launch failed first
        return
    rank_0: int | None = None  # the process that connected: its first event says which
    with connection:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                return
            rank_0 = rank_0 if rank_0 is not None else sent_by(message)
            heard.hear_message(message, rank_0, None)
            if sent_by(message) != rank_0:
                continue
            event = decode(message)
            if isinstance(event, Progress) and progress:
                progress(event.description)
            elif isinstance(event, ModelLoaded) and on_model:
                on_model(event.model)
            elif isinstance(event, CheckDone) and on_result:
                on_result(heard.results[event.result["name"]])


class _launcher_logs_quiet:
    """The elastic launcher logs every failed rank's traceback at ERROR, its agent a signal it ends the ranks for
    and torch's process starter each rank it ends at WARNING; the report says it in one line. torch gives each module
    of the launcher a logger with a level of its own (LOGLEVEL), so each is quieted, not only their parents."""

    LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")

    def __enter__(self):
        names = [
            name
            for name in [*logging.root.manager.loggerDict, *self.LOGGERS]
            if name in self.LOGGERS or name.startswith(tuple(f"{parent}." for parent in self.LOGGERS))
        ]
        self.levels = {name: logging.getLogger(name).level for name in names}
        for name in names:
            logging.getLogger(name).setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)


def _cannot_run(exc: ChildFailedError) -> WorkerError | None:
    """The usage error that a failed rank met first (RankCannotRun), if any did: by the time each raised it, since a
    peer's end can give a slower rank a usage error of its own (the launcher's record keeps whole seconds only)."""
    prefix = f"{RankCannotRun.__name__}: "
    messages = [_recorded(failure) for failure in exc.failures.values()]
    errors = [json.loads(m.removeprefix(prefix)) for m in messages if m.startswith(prefix)]
    if not errors:
        return None
    first = min(errors, key=lambda error: error["at"])
    return WorkerError(first["message"], first["exit_code"])


def _recorded(failure) -> str:
    """What the rank raised, as the error file that @record writes keeps it ("Type: message"), or "" without one."""
    return str(failure.message.get("message", "")) if isinstance(failure.message, dict) else ""


def _failure(failure) -> str:
    """How a rank ended, in words: what it raised (its first line), or the signal that killed it."""
    message = failure.message
    if isinstance(message, dict):  # the error file that @record writes: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    text = first_line(str(message or "")).removeprefix(f"{RankEnded.__name__}: ")
    return f"ended: {text or f'exit code {failure.exitcode}'}"


def _failure_code(failure) -> str:
    """FWD003 for a rank where fwdcheck failed, FWD002 for one whose model raised; FWD005 for one that died
    otherwise (a signal, an exit)."""
    message = _recorded(failure)
    if RankEnded.__name__ not in message:
        return Own.PROCESS_DIED
    return Own.INTERNAL_ERROR if FWDCHECK_FAILED in message else Own.MODEL_RAISED


def merge(reports: dict[int, Report]) -> Report:
    """Rank 0's report, each finding that did not pass and that not every rank saw naming the ranks that did, and
    findings only other ranks saw added under their rank; a check's status is the worst any rank gave it."""
    base = reports[0]
    ranks = sorted(reports)
    for i, result in enumerate(base.results):
        others = {rank: reports[rank].results[i] for rank in ranks[1:]}
        seen = {rank: {_key(f) for f in r.findings if f.status != Status.PASS} for rank, r in others.items()}
        for finding in result.findings:
            if finding.status == Status.PASS:
                continue
            missing = [rank for rank in others if _key(finding) not in seen[rank]]
            if missing:
                also = [0] + [rank for rank in others if rank not in missing]
                finding.where = "; ".join(filter(None, [finding.where, f"ranks {', '.join(map(str, also))}"]))
        known = {_key(f) for f in result.findings}
        for rank, other in others.items():
            for finding in other.findings:
                if finding.status != Status.PASS and _key(finding) not in known:
                    known.add(_key(finding))
                    result.findings.append(
                        dataclasses.replace(finding, where="; ".join(filter(None, [finding.where, f"rank {rank}"])))
                    )
        result.status = worst([result.status, *(r.status for r in others.values())])
    base.notes.append(f"distributed: {len(ranks)} ranks; a finding that not every rank saw names the ranks that did")
    return base


def _key(finding: Finding) -> tuple[str, str]:
    return finding.code, finding.message
