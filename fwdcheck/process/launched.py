"""Runs under the user's own launcher: `torchrun ... -m fwdcheck run config.yaml`, `srun python -m fwdcheck run ...`.

The launcher has started one `fwdcheck run` per rank, on every node of the job, and said which rank each is in the
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; SLURM's SLURM_PROCID, SLURM_NTASKS and
SLURM_LOCALID). fwdcheck starts no rank of its own then: each process is a rank, and runs as `--nproc` ranks do
(fwdcheck/process/rank.py: the same model from the same seed, sharded, the sharding check first, rank 0's logits
on every rank), in its supervised worker as any run.

What the job says, one store says it. The ranks meet at the launcher's store (torchrun's agent holds one at
MASTER_ADDR:MASTER_PORT; under SLURM or a launcher of the user's own, rank 0's `fwdcheck run` holds it there), under
keys of this run alone. Each rank's supervisor, once its worker has ended, however it ended (a report, a rank that
stopped, a worker that died or hung and was killed, a run that could not be made), writes the rank's outcome there.
Rank 0 reads every rank's, makes the one report (the ranks' reports merged, as one machine's launcher merges them;
or, when a rank stopped the run, the checks that finished and the rank that stopped it, named with its node), writes
the report and the output files, and writes the run's exit code for the other ranks, which exit with it: the
scheduler sees the run's verdict on every rank. Every wait is bounded, so no rank outlives a rank that died.

Which rank stopped the run. When one rank stops (its model raised alone, it ran past timeout_s, its process died),
the others fail soon after inside a collective that rank will not join; they say that they lost a peer. The rank
that stopped the run is the first, by the time its trouble began, whose outcome is not a lost peer; a rank that wrote
no outcome at all within the wait is named as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fwdcheck.errors import WAITED_FOR_A_RANK, ExitCode, FwdcheckError, Own, UsageError, about_config

if TYPE_CHECKING:
    from fwdcheck.report import Report
    from fwdcheck.run.runner import Run

SLURM_PORT_BASE = 15000  # MASTER_PORT under SLURM when the batch script sets none: this plus the job id's last 4 digits
POLL_S = 0.1  # how often a wait looks at the store again: a Ctrl-C is heard between looks
PEER_WAIT_FLOOR_S = 30.0  # the least time rank 0 waits for the other ranks' outcomes once it has its own
ABSENT_WAIT_S = 5.0  # how long rank 0 waits still for ranks that did not come to join within timeout_s

# What the error of a collective whose peer went away says (gloo, NCCL, the store): a rank that met it lost a peer.
LOST_PEER_MARKS = (
    WAITED_FOR_A_RANK,  # fwdcheck's time limit, struck in a collective
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "pair closure",
    "gloo/transport",
    "ProcessGroupNCCL",
    "NCCL error",
    "DistBackendError",
    "DistNetworkError",
    "Socket Timeout",
    "Broken pipe",
)


@dataclass(frozen=True)
class LaunchedRank:
    """The rank this process is in a job an outside launcher started."""

    rank: int
    world: int
    local_rank: int
    node: str  # the host, and its node rank where the launcher says it: "gpu-07 (node 1)"
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "SLURM", or "the environment" (RANK and WORLD_SIZE set by a script)
    run_id: str  # this job's name for its keys in the store
    holds_store: bool  # this process serves the store (rank 0 where no launcher agent serves one)

    def named(self, rank: int, node: str | None) -> str:
        return f"rank {rank} of {self.world}" + (f" on {node}" if node else "")


def launched_rank(environ: Mapping[str, str] | None = None) -> LaunchedRank | None:
    """The rank this process is when a launcher started it as one of several (WORLD_SIZE or SLURM_NTASKS above 1);
    None otherwise. A launcher's environment without a way to meet the others is a usage error."""
    env = os.environ if environ is None else environ
    host = socket.gethostname()
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _integer(env, "RANK"), _integer(env, "WORLD_SIZE")
        if world <= 1:
            return None
        torchrun = "TORCHELASTIC_RUN_ID" in env
        node_rank = env.get("GROUP_RANK")
        address, port = _master(env, None, None)
        return LaunchedRank(
            rank=rank,
            world=world,
            local_rank=_integer(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank,
            node=f"{host} (node {node_rank})" if node_rank is not None else host,
            master_addr=address,
            master_port=port,
            launcher="torchrun" if torchrun else "the environment",
            run_id=(
                f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
                if torchrun
                else f"env.{port}"
            ),
            # torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE); with none, rank 0 does, as
            # init_process_group's env:// would
            holds_store=rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true",
        )
    # srun starts a step's tasks with SLURM_STEP_ID set; a batch script's own shell, which runs one task of its job,
    # has SLURM_NTASKS and SLURM_PROCID too, but no step
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        rank, world = _integer(env, "SLURM_PROCID"), _integer(env, "SLURM_NTASKS")
        if world <= 1:
            return None
        job = env.get("SLURM_JOB_ID", "")
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
        default_port = SLURM_PORT_BASE + int(job[-4:]) if job[-4:].isdigit() else None
        address, port = _master(env, env.get("SLURM_LAUNCH_NODE_IPADDR"), default_port)
        node_rank = env.get("SLURM_NODEID")
        node = env.get("SLURMD_NODENAME", host)
        return LaunchedRank(
            rank=rank,
            world=world,
            local_rank=_integer(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            node=f"{node} (node {node_rank})" if node_rank is not None else node,
            master_addr=address,
            master_port=port,
            launcher="SLURM",
            run_id=f"slurm.{job}.{step}",
            holds_store=rank == 0,
        )
    return None


def _integer(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    if not value.strip().isdigit():
        raise UsageError(f"the launcher's {name}={value!r} is not a whole number")
    return int(value)


def _master(env: Mapping[str, str], address: str | None, port: int | None) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, where the ranks meet; SLURM's defaults where the script sets none."""
    address = env.get("MASTER_ADDR", address)
    raw_port = env.get("MASTER_PORT")
    if raw_port is not None:
        if not raw_port.strip().isdigit() or not 0 < int(raw_port) < 65536:
            raise UsageError(f"the launcher's MASTER_PORT={raw_port!r} is not a port number")
        port = int(raw_port)
    if not address or port is None:
        missing = " and ".join(name for name, value in (("MASTER_ADDR", address), ("MASTER_PORT", port)) if not value)
        raise UsageError(
            f"a launcher started this process as one of several ranks, but {missing} is not set: the ranks cannot "
            "meet (set it in the job script, e.g. MASTER_ADDR to the first node's host name)"
        )
    return address, port


# ---------------------------------------------------------------------------------------------------------------------
# Each rank's `fwdcheck run`: the store, the outcome, the exit code


def run_store(launched: LaunchedRank, index: int, timeout_s: float, serve: bool = False):
    """The keys of this run (the index-th config of the command) in the job's store, at MASTER_ADDR:MASTER_PORT;
    `serve`: this process serves the store there."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        launched.master_addr,
        launched.master_port,
        launched.world,
        is_master=serve,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"fwdcheck/{launched.run_id}/{index}/", store)


class Coordinator:
    """This run's keys in the job's store. Every wait polls, so that a signal is heard while it waits."""

    def __init__(self, launched: LaunchedRank, index: int, timeout_s: float):
        self.launched = launched
        self.store = run_store(launched, index, max(timeout_s, PEER_WAIT_FLOOR_S), serve=launched.holds_store)
        self.store.set(f"node/{launched.rank}", launched.node)

    def publish(self, outcome: dict) -> None:
        self.store.set(f"outcome/{self.launched.rank}", json.dumps(outcome, default=str))

    def outcomes(self, wait_s: float) -> dict[int, dict]:
        """Every rank's outcome written within wait_s (all of them, or those there when the wait ends)."""
        deadline = time.monotonic() + wait_s
        keys = {rank: f"outcome/{rank}" for rank in range(self.launched.world)}
        while True:
            present = {rank for rank, key in keys.items() if self.store.check([key])}
            if len(present) == len(keys) or time.monotonic() > deadline:
                return {rank: json.loads(self.store.get(keys[rank])) for rank in sorted(present)}
            time.sleep(POLL_S)

    def node(self, rank: int) -> str | None:
        key = f"node/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def publish_exit(self, code: int, ranks: list[int]) -> None:
        """The run's exit code for `ranks`, the others that wrote an outcome. Where this process serves the store,
        it stays until each has read the code (bounded): the store ends with it."""
        self.store.set("exit", str(int(code)))
        if not self.launched.holds_store:
            return
        deadline = time.monotonic() + PEER_WAIT_FLOOR_S
        waiting = [f"read/{rank}" for rank in ranks if rank != self.launched.rank]
        while waiting and time.monotonic() <= deadline:
            waiting = [key for key in waiting if not self.store.check([key])]
            time.sleep(POLL_S)

    def wait_exit(self, wait_s: float) -> int | None:
        """The run's exit code, as rank 0 writes it; None when it does not within wait_s, or its store is gone."""
        deadline = time.monotonic() + wait_s
        try:
            while time.monotonic() <= deadline:
                if self.store.check(["exit"]):
                    code = int(self.store.get("exit"))
                    self.store.set(f"read/{self.launched.rank}", "1")
                    return code
                time.sleep(POLL_S)
        except RuntimeError:  # the store's server is gone (torch's DistStoreError and its kin)
            pass
        return None


def across_ranks(
    launched: LaunchedRank, index: int, timeout_s: float, run: Callable[[], Report]
) -> tuple[Report | None, int]:
    """Run this rank's part of the job (`run`: its supervised worker) and conclude it with the others: rank 0 gets the
    job's report and exit code, every other rank no report and the same exit code. A run that could not be made
    raises its error on rank 0 (naming the rank, where not every rank met it) and on the ranks that met it."""
    coordinator = Coordinator(launched, index, timeout_s)  # rank 0's serves the store before its worker joins it
    error: FwdcheckError | None = None
    report: Report | None = None
    try:
        report = run()
    except FwdcheckError as exc:
        error = exc
        own: dict[str, Any] = {"error": {"message": str(exc), "exit_code": int(exc.exit_code)}, "at": time.time()}
    else:
        if report.interrupted:  # a signal: this rank ends now, as it was told; rank 0 tells the others it did
            if launched.rank == 0:
                with contextlib.suppress(RuntimeError):  # its store may be gone with the job
                    coordinator.publish_exit(report.exit_code, [])  # the others are ending too: none waited for
            return report if launched.rank == 0 else None, report.exit_code
        own = {
            "report": report.to_dict(),
            "internal": [r.internal_error for r in report.results],
            "stopped": _stop(report, timeout_s),
        }
    coordinator.publish(own)
    if launched.rank != 0:
        code = coordinator.wait_exit(2 * timeout_s + PEER_WAIT_FLOOR_S)
        if error is not None and code in (None, int(error.exit_code)):  # its own line, and the run's code
            raise error
        if code is None:  # rank 0 is gone: this rank's own verdict, never better than a failure
            assert report is not None
            own_code = report.exit_code
            return None, own_code if own_code not in (ExitCode.OK, ExitCode.NOTHING_RAN) else ExitCode.FAILED
        return None, code
    # the others end within a step of this rank; but ranks that never came to join have had timeout_s already
    never_came = bool(own.get("stopped") and own["stopped"].get("never_came"))
    outcomes = coordinator.outcomes(ABSENT_WAIT_S if never_came else timeout_s + PEER_WAIT_FLOOR_S)
    try:
        concluded = _concluded(launched, coordinator, outcomes, fail_on=report.fail_on if report else None)
    except FwdcheckError as exc:
        coordinator.publish_exit(int(exc.exit_code), list(outcomes))
        raise
    if report is not None:
        concluded.config_path = report.config_path
    coordinator.publish_exit(concluded.exit_code, list(outcomes))
    return concluded, concluded.exit_code


def _stop(report: Report, timeout_s: float) -> dict | None:
    """How this rank's run stopped before its end, if it did: the check, the finding's code, what happened, when it
    began, and whether it was a peer's doing (a collective that failed because another rank went away)."""
    from fwdcheck.process.heard import grace

    stopped = report.environment.get("distributed", {}).get("stopped")
    if stopped is not None:  # a rank that stopped the run, as join() tells it
        return stopped
    for result in report.results:  # a worker that died or hung: the supervisor's partial report
        for finding in result.findings:
            if finding.code in (Own.TIMED_OUT, Own.PROCESS_DIED) and finding.message.startswith("while this check ran"):
                how = finding.message.removeprefix("while this check ran, ")
                # a worker killed for its silence: its trouble began when its time limit passed, the grace before
                at = time.time() - (grace(timeout_s) if finding.code == Own.TIMED_OUT else 0.0)
                return {"check": result.name, "code": finding.code, "how": how, "at": at, "peer": False}
    return None


def lost_peer(text: str) -> bool:
    """Whether an error's text is a collective's whose peer went away."""
    return any(mark in text for mark in LOST_PEER_MARKS)


def _concluded(launched: LaunchedRank, coordinator: Coordinator, outcomes: dict[int, dict], fail_on) -> Report:
    """The job's report, made on rank 0 from every rank's outcome."""
    from fwdcheck.process.heard import WorkerError
    from fwdcheck.report import Report

    reports = {
        rank: Report.from_dict(o["report"], internal_errors=o["internal"], fail_on=fail_on)
        for rank, o in outcomes.items()
        if "report" in o
    }
    stops = {rank: o["stopped"] for rank, o in outcomes.items() if o.get("stopped")}
    errors = {rank: o for rank, o in outcomes.items() if "error" in o}
    if errors and len(errors) == launched.world and len({json.dumps(o["error"]) for o in errors.values()}) == 1:
        raise WorkerError(errors[0]["error"]["message"], errors[0]["error"]["exit_code"])  # every rank's, alike
    missing = [rank for rank in range(launched.world) if rank not in outcomes]
    if not stops and not errors and not missing:
        return _every_rank_finished(reports, launched, coordinator)
    # The rank that stopped the run: the first whose trouble was its own (not a lost peer), by when it began.
    own_trouble = _own_trouble(stops, errors)
    if own_trouble and min(own_trouble)[2] == "error":  # the run could not be made on that rank: its error line
        _, rank, _, message, _ = min(own_trouble)
        raise WorkerError(
            f"{launched.named(rank, coordinator.node(rank))}: {message}", errors[rank]["error"]["exit_code"]
        )
    if own_trouble:
        _, rank, code, how, check = min(own_trouble)
        what = f"{launched.named(rank, coordinator.node(rank))} stopped the run: {how}"
    elif missing:
        rank, code, check = missing[0], Own.TIMED_OUT, None
        node = coordinator.node(rank)
        what = f"{launched.named(rank, node)} " + (
            "sent no outcome within the wait (its fwdcheck run died, or hangs outside the model)"
            if node is not None
            else "never came (its fwdcheck run did not start, or ended before its run began)"
        )
    elif stops:
        _, rank, code, how, check = min((s["at"], r, s["code"], s["how"], s["check"]) for r, s in stops.items())
        what = f"{launched.named(rank, coordinator.node(rank))} stopped the run: {how}"
    else:  # only errors of ranks that lost a peer: the first of them
        rank = min(errors, key=lambda r: errors[r]["at"])
        raise WorkerError(
            f"{launched.named(rank, coordinator.node(rank))}: {errors[rank]['error']['message']}",
            errors[rank]["error"]["exit_code"],
        )
    return _partial(reports, check, what, code, launched)


def _every_rank_finished(reports: dict[int, Report], launched: LaunchedRank, coordinator: Coordinator) -> Report:
    """The ranks' reports merged, saying how many ranks ran on how many nodes and what started them."""
    from fwdcheck.process.launch import merge

    report = merge(reports)
    distributed = report.environment.setdefault("distributed", {})
    nodes = {coordinator.node(rank) for rank in range(launched.world)}
    distributed.update({"launcher": launched.launcher, "nodes": len(nodes)})
    started = f"{launched.world} ranks on {len(nodes)} node{'s' if len(nodes) > 1 else ''}"
    report.notes.append(f"distributed: {started}, started by {launched.launcher}")
    return report


def _own_trouble(stops: dict[int, dict], errors: dict[int, dict]) -> list[tuple]:
    """(when it began, rank, code, how, check) of each rank whose trouble was its own, not a lost peer's."""
    own_trouble = [
        (stop["at"], rank, stop["code"], stop["how"], stop["check"])
        for rank, stop in stops.items()
        if not stop.get("peer")
    ]
    own_trouble += [
        (o["at"], rank, "error", o["error"]["message"], None)
        for rank, o in errors.items()
        if not lost_peer(o["error"]["message"])
    ]
    return own_trouble


def _partial(reports: dict[int, Report], check: str | None, what: str, code: str, launched: LaunchedRank) -> Report:
    """Rank 0's report (or the lowest rank's that has one) up to the check the run stopped in, merged with the
    other ranks' where they finished it too; that check an error saying which rank stopped the run and how, the
    checks after it not run."""
    from fwdcheck.process.launch import merge
    from fwdcheck.report import Report
    from fwdcheck.result import CheckResult, Finding, Status

    if not reports:
        raise _NoReport(what)
    base = reports[min(reports)]
    names = [r.name for r in base.results if r.name != "(end of run)"]
    cut = (
        names.index(check)
        if check in names
        else next((i for i, r in enumerate(base.results) if r.status == Status.ERROR), len(names))
    )
    kept = {
        rank: dataclasses.replace(report, results=report.results[:cut])
        for rank, report in reports.items()
        if [r.name for r in report.results[:cut]] == names[:cut]
    }
    merged = merge(kept) if 0 in kept else kept[min(reports)]  # merge() reads the others against rank 0's
    results = list(merged.results)
    for i, name in enumerate(names[cut:]):
        message = f"while this check ran, {what}" if i == 0 else f"not run: {what} before this check began"
        results.append(CheckResult(name, Status.ERROR, message, [Finding(code, Status.ERROR, message)]))
    report = Report(
        results=results,
        model=base.model,
        environment=base.environment,
        notes=[*base.notes, what],
        config_path=base.config_path,
        fail_on=base.fail_on,
    )
    report.environment.setdefault("distributed", {})["launcher"] = launched.launcher
    return report


class _NoReport(FwdcheckError):
    exit_code = ExitCode.FAILED


# ---------------------------------------------------------------------------------------------------------------------
# The worker of a rank


def join(run: Run, job, launched: dict, *, progress, on_model, on_result) -> Report:
    """This rank's run, in its worker: the job's process group joined through the launcher's store, the model built
    and sharded, the checks run. A rank that must stop the run (its model raised alone, a check ran past timeout_s,
    a peer was lost) returns the checks that finished and, on the check it stopped in, how it stopped, with when
    its trouble began; it leaves the process group at once, so that peers waiting for it fail now, not at their
    timeout."""
    from pathlib import Path

    import torch.distributed as dist

    from fwdcheck.process.heard import Heard
    from fwdcheck.process.rank import checks_on_rank, in_rank_order, join_and_shard, ran_as
    from fwdcheck.run.runner import environment_summary
    from fwdcheck.run.sharding import RankStopped, rank_device

    rank = LaunchedRank(**launched["rank"])
    this_run = run_store(rank, launched["index"], run.settings.timeout_s)
    heard = Heard(job)
    heard.checks = [e.name for e in in_rank_order(run.entries)]
    with about_config(Path(job.config) if job.config is not None else None):
        rank_device(run.settings.device, rank.local_rank)  # this rank's own usage error, before it waits
        missing = _every_rank_here(this_run, rank, run.settings.timeout_s)
        if missing:
            how, never_came = missing
            partial = heard.partial_report(f"{how}; this rank did not join the process group", Own.TIMED_OUT)
            partial.environment = {
                **environment_summary(run.settings, run.settings.device),
                "distributed": {"stopped": {**_peer_stop(None, how), "never_came": never_came}},
            }
            return partial
        group_store = dist.PrefixStore("group/", this_run)
        model, backend = join_and_shard(run, rank.rank, rank.world, rank.local_rank, group_store)

    def result_done(result) -> None:
        heard.results[result.name] = result
        if on_result is not None:  # None in-process (--in-process): nobody listens
            on_result(result)

    def model_loaded(summary: dict) -> None:
        heard.model = summary
        if on_model is not None:
            on_model(summary)

    try:
        report = checks_on_rank(run, model, progress=progress, on_model=model_loaded, on_result=result_done)
    except RankStopped as exc:
        dist.destroy_process_group()  # peers waiting for this rank at a collective fail now
        return _stopped(run, heard, rank, exc)
    report.environment["distributed"] = ran_as(rank.world, backend)
    dist.destroy_process_group()
    return report


def _stopped(run: Run, heard, rank: LaunchedRank, exc) -> Report:
    """The report of a rank that stopped the run (exc, a RankStopped): the checks that finished, the one it stopped
    in left to the job's report, and how and when it stopped, for rank 0 to tell which rank's trouble came first."""
    from fwdcheck.run.runner import environment_summary
    from fwdcheck.run.sharding import rank_context

    peer = lost_peer(str(exc))
    check = exc.check or next((name for name in heard.checks if name not in heard.results), None)
    heard.results.pop(check or "", None)  # its result stopped the run: the job's report says how
    heard.current = check
    how = str(exc).removeprefix(f"{check}: ") if check else str(exc)
    partial = heard.partial_report(f"{rank.named(rank.rank, rank.node)} stopped: {how}", exc.code)
    partial.environment = {
        **environment_summary(run.settings, str(rank_context().device)),  # type: ignore[union-attr]
        "distributed": {
            "stopped": {"check": check, "code": exc.code, "how": how, "at": exc.at, "peer": peer},
        },
    }
    return partial


def _every_rank_here(store, rank: LaunchedRank, timeout_s: float) -> tuple[str, bool] | None:
    """Wait, polling, until every rank's worker is here to join the process group: None then. Sooner, a rank that
    wrote its outcome already (it could not make the run) or, after timeout_s, the ranks that never came: in words,
    and whether some never came. init_process_group would wait for them its whole timeout, deaf to the others'
    news."""
    store.set(f"here/{rank.rank}", "1")
    deadline = time.monotonic() + timeout_s
    waiting = list(range(rank.world))
    while True:
        waiting = [r for r in waiting if not store.check([f"here/{r}"])]
        if not waiting:
            return None
        ended = [r for r in range(rank.world) if r != rank.rank and store.check([f"outcome/{r}"])]
        if ended:
            return f"rank {ended[0]} ended before every rank was here", False
        if time.monotonic() > deadline:
            ranks = ", ".join(map(str, waiting))
            return (
                f"rank{'s' if len(waiting) > 1 else ''} {ranks} did not come within timeout_s ({timeout_s:g} s)",
                True,
            )
        time.sleep(POLL_S)


def _peer_stop(check: str | None, how: str) -> dict:
    """A stop that was another rank's doing: never the rank named."""
    return {"check": check, "code": Own.TIMED_OUT, "how": how, "at": time.time(), "peer": True}


def job_fields(launched: LaunchedRank, index: int) -> dict:
    """What the worker of a launched rank is handed in its job."""
    return {"rank": dataclasses.asdict(launched), "index": index}
