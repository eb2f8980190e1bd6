"""Runs under the user's own launcher (fwdcheck/process/launched.py): torchrun on one node, two torchrun agents as two
nodes of one job, and the variables SLURM's srun (or a script of the user's) sets, each `fwdcheck run` a rank. The
launches are few: each starts 4 ranks, every one a `fwdcheck run` importing torch (seconds on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

from fwdcheck.report.schema import JSON_REPORT_SCHEMA
from tests.test_distributed import REPO, checks, codes, gpt_config, processes_marked

# Every test starts a job of ranks, each a `fwdcheck run`: the slow tier.
pytestmark = pytest.mark.slow

TIMEOUT = 240
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def four_ranks(parallelize: str, bug: str | None = None, **top) -> dict:
    config = gpt_config(parallelize, bug, **top)
    del config["distributed"]["nproc"]  # the launcher says how many
    return config


# ---------------------------------------------------------------------------------------------------------------------
# Jobs: every rank a `fwdcheck run`


def ranks_as_srun_starts_them(
    tmp_path: Path,
    config: dict,
    world: int = 4,
    marker: str | None = None,
    started: int | None = None,
    args: tuple[str, ...] = (),
):
    """The `fwdcheck run` of every rank (or of the first `started`), started as srun starts a step's tasks (SLURM's
    variables, MASTER_ADDR and MASTER_PORT from the batch script): each rank's exit code, stdout and stderr."""
    path = write(tmp_path, config)
    port = free_port()
    procs = []
    for rank in range(world if started is None else started):
        env = {
            **os.environ,
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(world),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "FWDCHECK_TEST_MARK": marker or uuid.uuid4().hex,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "fwdcheck", "run", str(path), "--format", "json", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=REPO,
            )
        )
    ended = [proc.communicate(timeout=TIMEOUT) for proc in procs]
    return [proc.returncode for proc in procs], [out for out, _ in ended], [err for _, err in ended]


def test_a_rank_that_raises_under_srun_ends_the_job_naming_it_and_every_rank_exits_with_the_verdict(tmp_path):
    marker = uuid.uuid4().hex
    exits, outs, errs = ranks_as_srun_starts_them(
        tmp_path, four_ranks("tensor_parallel", "raises-on-rank-1", timeout_s=60), marker=marker
    )
    assert exits == [1, 1, 1, 1], errs
    assert outs[1:] == ["", "", ""]  # rank 0 writes the report
    report = json.loads(outs[0])
    jsonschema.validate(report, JSON_REPORT_SCHEMA)  # whole, however the run ended
    sharding = checks(report)["sharding"]
    assert sharding["status"] == "error"
    assert (
        "rank 1 of 4 on " in sharding["summary"] and "(node 0) stopped the run: the model raised" in sharding["summary"]
    )
    assert "out of memory on this rank's device" in sharding["summary"]
    assert {c["status"] for c in report["checks"][1:]} == {"error"}  # not run, and said so
    assert processes_marked(marker) == []


def test_a_rank_that_hangs_under_srun_is_named_when_the_time_limit_ends_the_job(tmp_path):
    marker = uuid.uuid4().hex
    exits, outs, errs = ranks_as_srun_starts_them(
        tmp_path, four_ranks("tensor_parallel", "hangs-on-rank-1", timeout_s=4), marker=marker
    )
    assert exits == [1, 1, 1, 1], errs
    sharding = checks(json.loads(outs[0]))["sharding"]
    assert "FWD004" in codes(sharding)
    assert "rank 1 of 4 on " in sharding["summary"] and "timed out after 4 s" in sharding["summary"]
    assert processes_marked(marker) == []


def test_torchrun_on_one_node_runs_the_checks_on_every_rank_and_rank_0_reports(tmp_path):
    config = four_ranks("tensor_parallel")
    config["distributed"]["nproc"] = 2  # the launcher's count is the job's, and the report says so
    config["checks"] = ["shape-ledger", "future-token", "mask-audit", "rope"]  # the sharded forward's own checks
    path = write(tmp_path, config)
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [*TORCHRUN, "--nproc-per-node", "4", "--standalone", "-m", "fwdcheck", "run", str(path)]
        + ["--format", "json", "--json", str(report_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('"schema_version"') == 1  # one report, rank 0's, on the job's stdout
    report = json.loads(report_path.read_text())
    assert {c["status"] for c in report["checks"] if c["name"] != "rope"} == {"pass"}
    assert report["environment"]["distributed"] == {
        "nproc": 4,
        "backend": "gloo",
        "parallelize": "tests.distributed_models:tensor_parallel",
        "mesh": {"ranks": 4},
        "launcher": "torchrun",
        "nodes": 1,
    }
    assert checks(report)["sharding"]["data"]["rank_changes"] == [0.0] * 4
    assert "distributed.nproc 2 in the config is not read under a launcher: torchrun started 4 ranks" in report["notes"]


def two_nodes(tmp_path: Path, config: dict, marker: str) -> list[subprocess.Popen]:
    """Two torchrun agents on this machine, as two nodes of one job would run them (c10d rendezvous), 2 ranks each."""
    path = write(tmp_path, config)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = []
    for node in range(2):
        command = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node)]
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", marker]
        command += ["-m", "fwdcheck", "run", str(path), "--format", "json"]
        agents.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "1", "FWDCHECK_TEST_MARK": marker},
                start_new_session=True,  # its own process group: a terminal's Ctrl-C reaches all of it
            )
        )
    return agents


@pytest.mark.parametrize(
    ("parallelize", "exit_code"),
    [("tp_fsdp", 0), ("tp_fsdp_missing_reduction", 1)],
    ids=["correct 2-D plan", "no tensor-parallel reduction"],
)
def test_two_torchrun_agents_as_two_nodes_make_one_job_with_one_verdict(tmp_path, parallelize, exit_code):
    """A 2-D plan over both nodes (FSDP2 over dp_shard, tensor parallel over tp), as a job of 2 nodes x 2 GPUs lays
    one out: the correct plan passes; without its row-parallel reduction it fails at the first block."""
    marker = uuid.uuid4().hex
    config = four_ranks(parallelize)
    config["distributed"]["mesh"] = {"dp_shard": 2, "tp": 2}
    agents = two_nodes(tmp_path, config, marker)
    ended = [agent.communicate(timeout=TIMEOUT) for agent in agents]
    assert [agent.returncode for agent in agents] == [exit_code, exit_code], [err[-2000:] for _, err in ended]
    reports = [json.loads(out) for out, _ in ended if out.strip()]
    assert len(reports) == 1  # rank 0's node writes it
    report = reports[0]
    assert report["environment"]["distributed"]["nodes"] == 2
    assert report["environment"]["distributed"]["mesh"] == {"dp_shard": 2, "tp": 2}
    assert "distributed: 4 ranks on 2 nodes, started by torchrun" in report["notes"]
    sharding = checks(report)["sharding"]
    if exit_code == 0:
        assert sharding["status"] == "pass"
        assert sharding["data"]["rank_changes"] == [0.0] * 4
    else:
        assert {"FWD981", "FWD982"} <= codes(sharding)
        first = next(f for f in sharding["findings"] if f["code"] == "FWD981")
        assert "first parts at layers.0" in first["message"]  # the first block whose output parts
        # the second rank of each tensor-parallel group keeps its partial sum: one on each node
        assert next(f for f in sharding["findings"] if f["code"] == "FWD982")["where"] == "rank 1, rank 3"
    assert processes_marked(marker) == []


def test_ctrl_c_of_the_launcher_ends_every_rank_of_both_nodes(tmp_path):
    marker = uuid.uuid4().hex
    hanging = tmp_path / "hanging"
    os.environ["FWDCHECK_TEST_HANGING"] = str(hanging)
    try:
        agents = two_nodes(tmp_path, four_ranks("tensor_parallel", "hangs-on-rank-1", timeout_s=600), marker)
    finally:
        del os.environ["FWDCHECK_TEST_HANGING"]
    deadline = time.monotonic() + 120
    while not hanging.exists() and time.monotonic() < deadline:  # rank 1 in its forward, the others waiting for it
        time.sleep(0.2)
    assert hanging.exists()
    for agent in agents:
        os.killpg(agent.pid, signal.SIGINT)  # Ctrl-C in each node's terminal
    for agent in agents:
        agent.communicate(timeout=90)
        assert agent.returncode != 0
    deadline = time.monotonic() + 30
    while processes_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_marked(marker) == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl and context parallelism need 2 CUDA devices")
def test_torchrun_with_two_gpus_shards_over_nccl_and_splits_the_sequence(tmp_path):
    """The GPU path: each rank on cuda:LOCAL_RANK, nccl, the sequence split across the ranks (context parallelism),
    which the CPU cannot run."""
    config = yaml.safe_load((REPO / "examples" / "distributed" / "llama-tp.yaml").read_text())
    config["distributed"] = {"context_parallel": True}
    config["device"] = "cuda"
    config["inputs"] = {"batch_size": 2, "seq_len": 32}
    path = write(tmp_path, config)
    proc = subprocess.run(
        [*TORCHRUN, "--nproc-per-node", "2", "--standalone", "-m", "fwdcheck", "run", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["environment"]["distributed"]["backend"] == "nccl"
    sharding = checks(report)["sharding"]
    assert sharding["metrics"]["context_parallel_max_change"] <= sharding["metrics"]["bar"]


def test_a_run_that_one_rank_cannot_make_is_that_ranks_error_line_on_rank_0_and_its_code_everywhere(tmp_path):
    """Rank 1's parallelize hands back no model (exit 2); rank 0, waiting for it in a collective, fails with a lost
    peer of its own. Rank 0 prints rank 1's error naming it, rank 1 its own line; both exit 2."""
    config = four_ranks("unusable_on_rank_1")
    exits, outs, errs = ranks_as_srun_starts_them(tmp_path, config, world=2)
    assert exits == [2, 2], errs
    assert outs == ["", ""]
    returned_str = "parallelize function 'tests.distributed_models:unusable_on_rank_1' returned str, not the model"
    assert errs[0].startswith("error: rank 1 of 2 on ") and returned_str in errs[0], errs[0]
    assert len(errs[0].strip().splitlines()) == 1
    assert returned_str in errs[1]


def test_a_rank_that_never_comes_is_named_once_the_others_have_waited_timeout_s(tmp_path):
    """A task of 3 that never started (its node failed): the two that did wait timeout_s to join, not the process
    group's own timeout, and rank 0 names the absent rank."""
    exits, outs, errs = ranks_as_srun_starts_them(
        tmp_path, four_ranks("tensor_parallel", timeout_s=3), world=3, started=2
    )
    assert exits == [1, 1], errs
    report = json.loads(outs[0])
    jsonschema.validate(report, JSON_REPORT_SCHEMA)  # whole, however the run ended
    assert (
        report["notes"][-1] == "rank 2 of 3 never came (its fwdcheck run did not start, or ended before its run began)"
    )
    assert {c["status"] for c in report["checks"]} == {"error"}


def test_nproc_under_a_launcher_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    path = write(tmp_path, four_ranks("tensor_parallel"))
    proc = subprocess.run(
        [sys.executable, "-m", "fwdcheck", "run", str(path), "--nproc", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--nproc starts ranks, but the environment started this process as rank 0 of 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_in_process_ranks_of_a_launcher_run_the_job_as_supervised_ones_do(tmp_path):
    """--in-process (for a debugger or profiler) under a launcher: each rank runs its model in its own `fwdcheck run`,
    and rank 0 still reports for the job."""
    exits, outs, errs = ranks_as_srun_starts_them(
        tmp_path, four_ranks("tensor_parallel"), world=2, args=("--in-process",)
    )
    assert exits == [0, 0], errs
    report = json.loads(outs[0])
    jsonschema.validate(report, JSON_REPORT_SCHEMA)  # whole, however the run ended
    assert checks(report)["sharding"]["status"] == "pass" and outs[1] == ""
