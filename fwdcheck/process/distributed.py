"""Distributed runs: the model sharded across processes, as it will train (`distributed: {nproc: N}`, `--nproc N`).

The process that runs the checks (the worker under `fwdcheck run`) becomes the launcher: torch's elastic launcher,
the machinery behind torchrun (torch.distributed.run), starts N rank processes on this machine (forked from a server
that has imported torch, on the CPU a fork of the launcher itself: `_rank_server`), watches them, and ends them all
when one fails. Each rank:

  1. joins the process group (gloo on the CPU, nccl on CUDA with one GPU per rank), timeout_s being the collectives'
     timeout: a rank left waiting for a peer raises instead of hanging;
  2. builds the same model from the same seed, as training scripts do before they shard it, puts it on its device
     and dtype, and shards it: the config's `parallelize` function, (model, device_mesh) -> model, or a Hugging Face
     model's own tensor-parallel plan;
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
import functools
import inspect
import json
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from fwdcheck.config.callables import on_sys_path, resolve_callable, search_dirs
from fwdcheck.config.schema import Config, Distributed, config_for
from fwdcheck.errors import (
    ExitCode,
    FwdcheckError,
    ModelLoadError,
    ModelRaised,
    Own,
    UsageError,
    about_config,
    first_line,
    model_failure,
)
from fwdcheck.model.under_test import ModelUnderTest, describe, extract_logits
from fwdcheck.process import interpreter
from fwdcheck.process.events import CheckDone, Event, ModelLoaded, Progress, decode, encode, sent_by
from fwdcheck.process.heard import Heard, WorkerError
from fwdcheck.process.lifetime import die_with_parent
from fwdcheck.registry import distributed_ending_codes, distributed_openers
from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Finding, Status, worst
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.runner import CheckTimeout, Run, environment_summary, model_summary, run_model
from fwdcheck.run.settings import DTYPES

FWDCHECK_FAILED = "fwdcheck's own error on this rank"  # how a rank that stops for an internal error says so


# ---------------------------------------------------------------------------------------------------------------------
# The launcher's side


def launch(
    run: Run,
    job,
    *,
    progress: Callable[[str], None] | None = None,
    on_model: Callable[[dict], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """The report of `job` (its config built into `run`) run on run.config.distributed.nproc ranks."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = run.config.distributed.nproc
    # Ranks that end by an exception leave semaphores behind, and the resource tracker (a process of its own, started
    # with this interpreter's -W options, before the ranks' server) would warn of them on stderr after the report's
    # one line.
    quiet_tracker = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet_tracker not in sys.warnoptions:
        sys.warnoptions.append(quiet_tracker)
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
        authkey = secrets.token_bytes(16)
        listener = Listener(family="AF_UNIX", authkey=authkey)
        relay = threading.Thread(
            target=_relay,
            args=(listener, heard, progress, on_model, on_result),
            daemon=True,
            name="fwdcheck-rank-0-events",
        )
        relay.start()
        rank_job = {
            "config": job.config,
            "factory": job.factory,
            "overrides": dataclasses.asdict(job.overrides),
            "sys_path": [p for p in sys.path if p],
            "package_root": interpreter.package_root(),
        }
        try:
            with _launcher_logs_quiet(), _package_first():
                config = LaunchConfig(
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
                rank: Report.from_dict(report, internal_errors=flags, fail_on=job.overrides.fail_on)
                for rank, (report, flags) in returned.items()
            }
        )


# The ranks are forked from one process that has imported these (multiprocessing's fork server) rather than each
# started as a new interpreter: torch is imported once a launch, not once a rank (on the CPU not even once: the
# server is a fork of the launcher, which has), and a rank that has handed in its report ends at once (os._exit)
# instead of tearing down an interpreter that holds torch (about a second). Nothing of the model's is imported there
# (its factory's and its parallelize function's modules): each rank imports it after it has its RANK, as a spawned
# rank would; a launcher that has imported one does not fork. A forked server has the checks' modules too (a
# config's own checks, installed plugins): the launcher imported them to read what they declare. torch._dynamo is
# imported by DTensor's first distribute_tensor, the start of any sharding: most of a second, once a launch instead
# of once a rank.
RANK_PRELOAD = [
    "fwdcheck.process.rank_server",
    "torch",
    "torch.distributed.tensor",
    "torch._dynamo",
    "fwdcheck.process.distributed",
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


# ---------------------------------------------------------------------------------------------------------------------
# A rank's side


@dataclass
class RankContext:
    """What the sharding check needs to know of the rank it runs on."""

    rank: int
    world: int
    device: torch.device
    parallelized_by: str  # how the model was sharded, in words
    unsharded: Callable[[], nn.Module]  # the same model built again, not sharded: rank 0's reference
    logits: RankZeroLogits
    mesh: Any  # the device mesh of every rank, its dimensions named (torch.distributed.device_mesh.DeviceMesh)
    context_parallel: bool  # the config asks for the sequence to be split across ranks too
    parameters: list[ParameterLayout]  # as sharding left them, before a forward (FSDP2 keeps the root's gathered)


@dataclass
class ParameterLayout:
    """How one parameter lies across the ranks: its DTensor placements over its mesh's named dimensions, or None
    for a plain tensor (every rank holds it whole)."""

    name: str
    placements: tuple[str, ...] | None  # str(Shard(0)) = "S(0)", one per dimension of `mesh`
    mesh: tuple[str, ...]  # the dimension names of the mesh the parameter lies on
    shape: list[int]
    local: list[int]  # this rank's share


def layout(module: nn.Module) -> list[ParameterLayout]:
    """Each parameter's layout as it is now."""
    rows = []
    for name, parameter in module.named_parameters():
        placements = getattr(parameter, "placements", None)
        if placements is None:
            rows.append(ParameterLayout(name, None, (), list(parameter.shape), list(parameter.shape)))
            continue
        mesh = tuple(parameter.device_mesh.mesh_dim_names or ())  # type: ignore[attr-defined]  # a DTensor
        local = list(parameter.to_local().shape)  # type: ignore[attr-defined]
        rows.append(ParameterLayout(name, tuple(str(p) for p in placements), mesh, list(parameter.shape), local))
    return rows


_CONTEXT: RankContext | None = None


def rank_context() -> RankContext | None:
    """The rank this process is, within a distributed run; None outside one."""
    return _CONTEXT


class _ShardedModelRaises(BaseException):
    """The sharding check found that the sharded model raises where the unsharded one runs: the run stops there.
    `check` is the check that found it, `code` the code it declares for it (Check.ends_distributed_runs)."""

    def __init__(self, check: str, code: str):
        super().__init__(check, code)
        self.check, self.code = check, code


class RankEnded(Exception):
    """What a rank that stopped raises out of rank_main, where the launcher's error file records it."""


class RankCannotRun(Exception):
    """What a rank that could not make the run (a usage error, the same on every rank) raises out of rank_main: the
    error's exit code and message as JSON, which the launcher's record of the rank keeps."""


class RankStopped(BaseException):
    """A rank ends the launch: the model raised on it and not on every rank, so that the others may be waiting in a
    collective it will not join. A BaseException of fwdcheck's, which no check takes for the model's failure.
    `check` is the check it stopped in, `code` the finding that stopped it."""

    def __init__(self, message: str, check: str | None = None, code: str = Own.MODEL_RAISED, at: float | None = None):
        super().__init__(message)
        self.check, self.code = check, code
        self.at = at if at is not None else time.time()  # when the trouble began: the model's raise, or now


# How long a rank that fails stays before it ends. torch's launcher names the first rank it finds ended (it looks
# every monitor_interval), the lowest when it finds several; a rank's failure makes its peers' pending collectives
# fail as soon as its process ends, and ranks forked from the fork server end at once. Staying this long, a failed
# rank is found before the peers its end fails, and the report names the rank where the failure began.
FAILED_RANK_STAYS_S = 0.5


@record
def rank_main(job: dict, address, authkey: bytes) -> tuple[dict, list[bool]]:
    """One rank of a distributed run: its report as a dict, and which results are fwdcheck's own errors."""
    try:
        return _rank(job, address, authkey)
    except BaseException:  # a usage error too: its peers may meet it inside a collective, and must meet it as theirs
        time.sleep(FAILED_RANK_STAYS_S)
        raise


def _rank(job: dict, address, authkey: bytes) -> tuple[dict, list[bool]]:
    die_with_parent(os.getppid())  # the fork server (or the launcher), which may be killed with SIGKILL
    if sys.path[:1] == [job["package_root"]] and job["package_root"] not in job["sys_path"]:
        del sys.path[0]  # put first only to import fwdcheck itself (_package_first)
    for entry in reversed(job["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    events = Client(address, authkey=authkey) if rank == 0 else None

    def send(event: Event) -> None:
        if events is not None:
            events.send(encode(event))

    try:
        with about_config(Path(job["config"]) if job["config"] is not None else None):  # the error names the file
            run = _build(job)
            model, backend = join_and_shard(run, rank, world, int(os.environ.get("LOCAL_RANK", rank)), None)
    except FwdcheckError as exc:  # the same on every rank; the launch ends with the one a rank met first
        # Any rank may meet it first, and its end can fail a slower peer inside a collective before that peer meets
        # the error itself (with another message, or none fwdcheck's): the launcher's record of this rank keeps it.
        raise RankCannotRun(
            json.dumps({"exit_code": int(exc.exit_code), "message": str(exc), "at": time.time()})
        ) from exc
    try:
        report = checks_on_rank(
            run,
            model,
            progress=lambda description: send(Progress(description)),
            on_model=lambda summary: send(ModelLoaded(summary)),
            on_result=lambda result: send(CheckDone(result.to_dict(), result.internal_error)),
        )
    except RankStopped as exc:  # an Exception the launcher's record of this rank's failure keeps
        raise RankEnded(str(exc)) from exc
    if report.interrupted:  # a signal to the run's process group: the launcher, ending the launch, reads no report,
        sys.stdout.flush()  # and would leave a rank that returned one waiting for it to be read (30 s)
        sys.stderr.flush()
        os._exit(ExitCode.INTERRUPTED)
    report.environment["distributed"] = ran_as(world, backend)
    # Only after a run every rank finished: a rank that raises leaves with its group as it is (tearing it down with
    # a collective pending would abort the process before its error is written down for the launcher).
    dist.destroy_process_group()
    return report.to_dict(), [r.internal_error for r in report.results]


def ran_as(world: int, backend: str) -> dict:
    """How this rank's run was distributed, for its report's environment."""
    return {
        "nproc": world,
        "backend": backend,
        "parallelize": _CONTEXT.parallelized_by if _CONTEXT else None,
        "mesh": dict(zip(_CONTEXT.mesh.mesh_dim_names, _CONTEXT.mesh.shape, strict=True)) if _CONTEXT else None,
    }


def in_rank_order(entries: list) -> list:
    """The checks in the order a rank runs them: those that open a distributed run (the sharding check) first."""
    opening = distributed_openers()
    return sorted(entries, key=lambda e: e not in opening)


def join_and_shard(run: Run, rank: int, world: int, local_rank: int, store) -> tuple[ModelUnderTest, str]:
    """This rank in the job's process group (through `store`, or the launcher's environment without one), and the
    model built and sharded on it; the backend joined. A usage error leaves no group behind."""
    device = rank_device(run.settings.device, local_rank)
    spec = run.config.distributed
    backend = spec.backend if spec.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    try:
        try:
            device_id: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
            joined: dict[str, Any] = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
            dist.init_process_group(backend, timeout=timedelta(seconds=run.settings.timeout_s), **device_id, **joined)
        except (RuntimeError, ValueError) as exc:  # a backend this torch or device lacks (nccl on the CPU)
            raise UsageError(f"distributed.backend {backend} on {device.type}: {first_line(exc)}") from exc
        return sharded(run, device, rank, world), backend
    except FwdcheckError:
        if dist.is_initialized():  # no collective is pending: leaving with the group up aborts the process
            dist.destroy_process_group()
        raise


def checks_on_rank(run: Run, model: ModelUnderTest, *, progress, on_model, on_result) -> Report:
    """The checks run on this rank's sharded model, the sharding check first: the rank's own report. Raises
    RankStopped where the ranks can no longer be sure to meet at the same collectives."""
    on_model(model_summary(model))
    device = cast(RankContext, _CONTEXT).device
    settings = run.settings.model_copy(update={"device": str(device)})
    entries = in_rank_order(run.entries)
    ending_codes = distributed_ending_codes(entries)  # Check.ends_distributed_runs: the sharding check's
    finished: list[CheckResult] = []

    def finish(result: CheckResult) -> None:
        on_result(result)
        finished.append(result)
        # The model raised outside the forward the ranks share (a forward that raised on every rank at once keeps
        # them in step: its error is the model's, as on one process), a check ran past timeout_s (a rank waiting for
        # another that hangs), or fwdcheck failed on this rank: the ranks can no longer be sure to meet at the same
        # collectives.
        agreed = cast(RankZeroLogits, model.forward_adapter).take_agreed_raises()  # as sharded() made it
        stopped = next(
            (f for f in result.findings if f.code == Own.TIMED_OUT or (f.code == Own.MODEL_RAISED and not agreed)), None
        )
        if stopped is not None:
            raise RankStopped(f"{result.name}: {stopped.message}", check=result.name, code=stopped.code)
        if result.internal_error:
            raise RankStopped(
                f"{result.name}: {FWDCHECK_FAILED} ({result.summary})", check=result.name, code=Own.INTERNAL_ERROR
            )
        ending = ending_codes.get(result.name)
        if ending is not None and any(f.code == ending and f.status == Status.FAIL for f in result.findings):
            raise _ShardedModelRaises(result.name, ending)

    try:
        return run_model(model, settings, entries, progress=progress, on_result=finish)
    except _ShardedModelRaises as ended:  # every other check would only meet the same error: they do not run
        rest = [
            CheckResult(
                e.name,
                Status.SKIP,
                f"not run: the sharded model raises where the unsharded one runs ({ended.check} {ended.code})",
            )
            for e in entries[len(finished) :]
        ]
        for result in rest:
            on_result(result)
        return Report(
            results=finished + rest,
            model=model_summary(model),
            environment=environment_summary(settings, str(device)),
            fail_on=run.fail_on,
        )


def _build(job: dict) -> Run:
    """The run a rank makes: the config read as the worker read it, with the command line's overrides."""
    return Run.build(config_for(job["config"], job["factory"]), Overrides(**job["overrides"]))


def rank_device(requested: str, local_rank: int) -> torch.device:
    """CUDA gives each rank a GPU of its own (cuda:LOCAL_RANK); on the CPU all ranks share it."""
    if requested.startswith("cuda") or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError(f"device '{requested}' requested but torch {torch.__version__} sees no CUDA device")
        if local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"distributed.nproc: {local_rank + 1} or more ranks need as many GPUs (one each); this "
                f"machine has {torch.cuda.device_count()}"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def sharded(run: Run, device: torch.device, rank: int, world: int) -> ModelUnderTest:
    """The model built on this rank and sharded as the config says, with a forward that returns rank 0's logits;
    the rank's context set for the sharding check."""
    global _CONTEXT
    spec: Distributed = run.config.distributed
    dtype = DTYPES[run.settings.dtype]

    @functools.cache  # the sharding check's comparison and its context-parallel split share one copy
    def build() -> nn.Module:  # the unsharded reference, from the same seed
        return run.load().module.to(device=device, dtype=dtype).eval()

    # The gathers of fwdcheck's own (full()) of a tensor sharded over two mesh dimensions each draw torch's advice on
    # their speed, a line per rank on stderr: about fwdcheck's comparison, not the model.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model = run.load()
    model.module.to(device=device, dtype=dtype)
    mesh = _mesh(device, world, spec)
    module, how = shard(model, cast(Config, run.config), mesh, world)
    logits = RankZeroLogits(model.forward_adapter, rank, world)
    module.register_forward_hook(logits.share_output)  # the calls checks make themselves: rank 0's output too
    takes = (
        model.forward_kwargs
        if model.forward_kwargs is not None
        else (set() if model.forward_adapter is not None else _parameters(module))
    )
    _CONTEXT = RankContext(rank, world, device, how, build, logits, mesh, spec.context_parallel, layout(module))
    # Tensor parallelism gives each rank its share of the heads: the head counts a model's config declares are the
    # whole model's, and the ledger reads each rank's off its attention calls instead.
    dims = {name: size for name, size in model.dims.items() if name not in ("h", "h_kv")}
    notes = [
        *model.extra.get("notes", []),
        "distributed: head counts (h, h_kv) are each rank's, read off its attention calls",
    ]
    return dataclasses.replace(
        model,
        module=module,
        forward_adapter=logits,
        forward_kwargs=takes,
        dims=dims,
        extra={**model.extra, "notes": notes},
        label=f"{model.label} [{how}, {world} ranks{f': {mesh_words(spec.mesh)}' if spec.mesh else ''}]",
    )


def _mesh(device: torch.device, world: int, spec: Distributed):
    """The device mesh of every rank: the config's named dimensions (`distributed.mesh`), or one named "ranks"."""
    from torch.distributed.device_mesh import init_device_mesh

    dimensions = spec.mesh or {"ranks": world}
    if math.prod(dimensions.values()) != world:  # a launch of another size than the config's (--nproc)
        raise UsageError(
            f"distributed.mesh {mesh_words(dimensions)} makes {math.prod(dimensions.values())} ranks, "
            f"not the {world} this run has"
        )
    return init_device_mesh(device.type, tuple(dimensions.values()), mesh_dim_names=tuple(dimensions))


def mesh_words(dimensions: dict[str, int]) -> str:
    """{dp_shard: 2, tp: 2} as "dp_shard 2 x tp 2"."""
    return " x ".join(f"{name} {size}" for name, size in dimensions.items())


def parallelize_function(config: Config) -> Callable:
    """The config's parallelize function, imported as the model's factory is: the model's code paths on sys.path,
    then the config's folder."""
    assert config.distributed.parallelize is not None  # asked only of a config that names one
    code = getattr(config.model, "path", None) or getattr(config.model, "python_path", None) or []
    with on_sys_path(search_dirs(list(code), config.source_path)):
        return resolve_callable(config.distributed.parallelize, what="parallelize function")


def shard(model: ModelUnderTest, config: Config, mesh, world: int) -> tuple[nn.Module, str]:
    """The module sharded over `mesh`, and how, in words: the config's parallelize function, or a Hugging Face
    model's own tensor-parallel plan. A parallelize function may shard in place and return nothing."""
    spec = config.distributed
    if spec.parallelize:
        function = parallelize_function(config)
        try:
            returned = function(model.module, mesh)
        except BaseException as exc:
            if not model_failure(exc):
                raise
            raise ModelLoadError(
                f"parallelize function '{spec.parallelize}' raised {type(exc).__name__}: {first_line(exc)}"
            ) from exc
        module = model.module if returned is None else returned
        if not isinstance(module, nn.Module):
            raise ModelLoadError(
                f"parallelize function '{spec.parallelize}' returned {type(returned).__name__}, "
                "not the model (an nn.Module) or None"
            )
        return module, spec.parallelize
    if model.tensor_parallel is not None:  # a plan of the model's own (transformers' tp_plan)
        return model.tensor_parallel(model.module, dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)))
    raise UsageError(
        f"distributed.parallelize is needed for {model.label}: it has no tensor-parallel plan of its "
        "own; name a function (model, device_mesh) -> model that shards it"
    )


def _parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


# How long a rank whose model raised waits for the others to say whether theirs raised too: every rank raising at the
# same step (a shape that does not fit the shards) answers at once; a rank raising alone hears nothing and ends.
AGREEMENT_S = 5.0


class RankZeroLogits:
    """The forward of a sharded model as the checks see it: the model's own forward (or the config's adapter) on this
    rank, then rank 0's logits on every rank. Each rank's own logits of the last forward are kept (`own`): the
    sharding check compares them across ranks.

    A forward that raises is the model's error, as on one process, when it raised on every rank: the ranks are still
    in step, and the checks go on. Raised on some ranks only, the others may be waiting in a collective of the forward
    that will never complete: the rank ends the launch (RankStopped). The ranks tell each other over a process group
    of their own, which a collective left pending on the default group does not block."""

    def __init__(self, adapter: Callable | None, rank: int, world: int):
        self.adapter, self.rank, self.world = adapter, rank, world
        self.own: torch.Tensor | None = None
        self.raised_at: float | None = None  # when the last forward that raised did
        self.agreed_raises = 0  # forwards that raised on every rank at once, since take_agreed_raises()
        self.agreement = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREEMENT_S))
        self.forwarding = False

    def share_output(self, module: nn.Module, args, output):
        """A forward hook on the sharded model's root: what a call that does not come through the forward above
        returns (the kv-cache, packing and label-shift checks call the module with arguments of their own), with
        rank 0's tensors in place of each rank's own: its logits and loss, gathered whole where they are DTensors.
        Every rank then judges rank 0's output and takes the same way through the check, calling the model as often
        as the others: a check that decides on its own rank's output (a sharded model whose ranks disagree, FWD982)
        would send one rank into a forward the others never join, and the run would hang there. The rest of the
        output (a cache of this rank's heads) stays the rank's. A call with gradients keeps its own output: the
        check differentiates it."""
        if self.forwarding or torch.is_grad_enabled():
            return None
        fields = _output_tensors(output)
        shapes: list = [None] * self.world
        dist.all_gather_object(shapes, [(name, tuple(t.shape), str(t.dtype)) for name, t in fields.items()])
        if any(shape != shapes[0] for shape in shapes):  # every rank knows it: every rank raises here, in step
            raise ModelRaised(
                "the ranks return outputs of different shapes: "
                + ", ".join(f"rank {r} {s}" for r, s in enumerate(shapes))
            )
        shared = {}
        for name, tensor in fields.items():
            shared[name] = full(tensor).detach().clone()  # a copy: the broadcast writes into it
            dist.broadcast(shared[name], src=0)
        return _with_tensors(output, shared)

    def __call__(self, module: nn.Module, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        self.forwarding = True  # the module's own output, for the broadcast below: share_output leaves it alone
        try:
            output = (
                self.adapter(module, input_ids, **kwargs) if self.adapter is not None else module(input_ids, **kwargs)
            )
        except BaseException as exc:
            if not model_failure(exc):
                raise
            self.raised_at = time.time()  # before the agreement's wait: when this rank's trouble began
            try:
                everywhere = self._raised_everywhere()
            except CheckTimeout:  # the check's time ran out while the others were asked: this rank's model raised
                everywhere = False
            if not everywhere:
                raise RankStopped(
                    f"the model raised {first_line(describe(exc))} on this rank alone", at=self.raised_at
                ) from exc
            self.agreed_raises += 1
            raise
        finally:
            self.forwarding = False
        logits = full(extract_logits(output)).detach()
        shapes: list = [None] * self.world
        dist.all_gather_object(shapes, tuple(logits.shape))
        if len(set(shapes)) > 1:  # every rank knows it: every rank raises here, and they stay in step
            raise ModelRaised(
                "the ranks return logits of different shapes: "
                + ", ".join(f"rank {r} {list(s)}" for r, s in enumerate(shapes))
            )
        self.own = logits
        shared = logits.float().clone()  # a copy: the broadcast writes into it, and `own` stays this rank's
        dist.broadcast(shared, src=0)
        return shared

    def take_agreed_raises(self) -> int:
        """How many forwards raised on every rank at once since the last call."""
        taken, self.agreed_raises = self.agreed_raises, 0
        return taken

    def _raised_everywhere(self) -> bool:
        """Whether every rank's forward raised at this step (each that did asks the others)."""
        raised: list = [None] * self.world
        try:
            dist.all_gather_object(raised, True, group=self.agreement)
        except RuntimeError:  # some rank did not answer in time: it is still in the forward
            return False
        return all(raised)


def _output_tensors(output) -> dict[str, torch.Tensor]:
    """The tensors of a forward's output that every rank holds alike when the sharding is right: the output itself
    (a tensor), its logits and loss (an object or mapping, as transformers' outputs), or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return {"output": output}
    if isinstance(output, (tuple, list)):
        return {"0": output[0]} if output and isinstance(output[0], torch.Tensor) else {}
    fields = {}
    for name in ("logits", "loss"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            fields[name] = value
    return fields


def _with_tensors(output, shared: dict[str, torch.Tensor]):
    """The output with the tensors _output_tensors found replaced by `shared`."""
    if isinstance(output, torch.Tensor):
        return shared["output"]
    if isinstance(output, (tuple, list)):
        if not shared:
            return output
        items = [shared["0"], *output[1:]]
        if isinstance(output, list):
            return items
        return type(output)(*items) if hasattr(output, "_fields") else tuple(items)  # a named tuple, or a plain one
    for name, tensor in shared.items():
        if isinstance(output, dict):
            output[name] = tensor  # transformers' ModelOutput sets the attribute too
        else:
            setattr(output, name, tensor)
    return output


def full(tensor):
    """A DTensor gathered into the whole tensor (a collective: every rank calls it); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
