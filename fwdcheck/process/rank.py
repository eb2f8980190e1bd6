"""A rank of a distributed run, started by fwdcheck's launcher (launch.py) or by the user's own (launched.py): it
joins the process group, builds the model and shards it (sharding.py), runs the checks on it, the sharding check
first, and ends the launch where the ranks can no longer be sure to meet at the same collectives (RankStopped).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fwdcheck.config.registry import distributed_ending_codes, distributed_openers
from fwdcheck.errors import ExitCode, FwdcheckError, Own, UsageError, about_config, first_line
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.process.events import CheckDone, Event, ModelLoaded, Progress, encode
from fwdcheck.process.lifetime import die_with_parent
from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Status
from fwdcheck.run.plan import RunPlan
from fwdcheck.run.runner import Run, environment_summary, model_summary, run_model
from fwdcheck.run.sharding import RankContext, RankStopped, RankZeroLogits, rank_context, rank_device, sharded

FWDCHECK_FAILED = "fwdcheck's own error on this rank"  # how a rank that stops for an internal error says so


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
    context = rank_context()
    return {
        "nproc": world,
        "backend": backend,
        "parallelize": context.parallelized_by if context else None,
        "mesh": dict(zip(context.mesh.mesh_dim_names, context.mesh.shape, strict=True)) if context else None,
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
    device = cast(RankContext, rank_context()).device
    settings = run.settings.with_config(device=str(device))
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
    """The run a rank makes: the plan its launcher's worker was handed, as it was handed over."""
    return Run.build(RunPlan.from_wire(job["plan"]))
