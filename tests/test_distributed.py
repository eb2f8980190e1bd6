"""Distributed runs: 2 CPU processes with gloo, through `fwdcheck run` as a CI job runs it (supervisor, worker,
ranks). Each launch costs a few seconds (the worker importing torch, a rendezvous), so there are few of them;
the models are tests/distributed_models.py and a tiny Llama sharded by transformers' own tensor-parallel plan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from fwdcheck.process import interpreter

# Every test launches ranks (a few seconds each): the slow tier.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 240


def gpt_config(parallelize: str, bug: str | None = None, **top) -> dict:
    return {
        "model": {
            "source": "python",
            "factory": "tests.distributed_models:gpt",
            "kwargs": {"bug": bug},
            "path": [str(REPO)],
        },
        "inputs": {"batch_size": 2, "seq_len": 8},
        "distributed": {"nproc": 2, "parallelize": f"tests.distributed_models:{parallelize}"},
        **top,
    }


def launch(tmp_path: Path, config: dict, *args: str, marker: str | None = None) -> tuple[int, dict, str]:
    """`fwdcheck run` of the config, as a CI job starts it: exit code, JSON report, stderr."""
    path = tmp_path / "distributed.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "FWDCHECK_TEST_MARK": marker or uuid.uuid4().hex}
    proc = subprocess.run(
        [sys.executable, "-m", "fwdcheck", "run", str(path), "--format", "json", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=REPO,
    )
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}, proc.stderr


def checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def codes(check: dict) -> set[str]:
    return {f["code"] for f in check["findings"] if f["status"] != "pass"}


def processes_marked(marker: str) -> list[int]:
    """The processes still alive that inherited the run's marker: the CLI's worker and the ranks it launched."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"FWDCHECK_TEST_MARK={marker}".encode() in (entry / "environ").read_bytes():
                    alive.append(int(entry.name))
            except OSError:
                pass
    return alive


def test_tensor_parallel_model_passes_every_check_on_two_ranks(tmp_path):
    config = gpt_config("tensor_parallel")
    config["checks"] = ["shape-ledger", "future-token", "mask-audit", "rope"]  # the sharded forward's own checks
    code, report, stderr = launch(tmp_path, config)
    assert code == 0, stderr
    got = checks(report)
    assert list(got)[0] == "sharding"  # added first, though the config names no checks
    assert {name: c["status"] for name, c in got.items()} == {
        "sharding": "pass",
        "shape-ledger": "pass",
        "future-token": "pass",
        "mask-audit": "pass",
        "rope": "skip",
    }
    sharding = got["sharding"]
    assert sharding["metrics"]["max_change"] <= sharding["metrics"]["bar"]
    assert sharding["data"]["rank_changes"] == [0.0, 0.0]
    # the ranks, their server and multiprocessing's resource tracker end with the run: nothing had to be killed
    assert not any("still running after its process ended" in note for note in report["notes"]), report["notes"]
    placements = sharding["data"]["placements"]["counts"]
    assert placements["S(0)"] == 8 and placements["S(1)"] == 4  # q, k, v, up by rows; o, down by columns (2 layers)
    assert report["environment"]["distributed"] == {
        "nproc": 2,
        "backend": "gloo",
        "parallelize": "tests.distributed_models:tensor_parallel",
        "mesh": {"ranks": 2},
    }


def test_hugging_face_llama_with_its_own_tensor_parallel_plan_passes(tmp_path):
    """The README's example, examples/distributed/llama-tp.yaml, here from --nproc, with context parallelism asked
    for: on the CPU torch has no sharding strategy for the CPU's SDPA kernel, so the split is not compared and the
    sharding check says why, judging the rest."""
    config = yaml.safe_load((REPO / "examples" / "distributed" / "llama-tp.yaml").read_text())
    config["distributed"] = {"context_parallel": True}
    config["checks"] = ["shape-ledger", "future-token", "mask-audit", "rope"]  # the sharded forward's own checks
    code, report, stderr = launch(tmp_path, config, "--nproc", "2")
    assert code == 0, stderr
    got = checks(report)
    assert {c["status"] for c in got.values()} == {"pass"}, {n: c["summary"] for n, c in got.items()}
    sharding = got["sharding"]
    assert "tensor-parallel plan" in sharding["data"]["parallelized_by"]
    assert "context_parallel_max_change" not in sharding["metrics"]
    assert "does not have a sharding strategy" in sharding["data"]["context_parallel"]
    assert "context parallelism: not run" in sharding["summary"]


def llama_context_parallel() -> dict:
    config = yaml.safe_load((REPO / "examples" / "distributed" / "llama-tp.yaml").read_text())
    config["distributed"]["context_parallel"] = True
    return config


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism needs 2 CUDA devices")
def test_context_parallelism_on_cuda_gives_the_whole_sequence_logits(tmp_path):
    config = {**llama_context_parallel(), "device": "cuda", "inputs": {"batch_size": 2, "seq_len": 32}}
    code, report, stderr = launch(tmp_path, config, "--check", "sharding")
    assert code == 0, stderr
    sharding = checks(report)["sharding"]
    assert sharding["metrics"]["context_parallel_max_change"] <= sharding["metrics"]["bar"]
    assert report["environment"]["distributed"]["backend"] == "nccl"


@pytest.mark.parametrize(
    ("parallelize", "bug", "expected"),
    [
        ("tensor_parallel", "heads-not-divided", {"FWD981"}),  # the full head count assumed on each rank's share
        ("reduction_missing", None, {"FWD981", "FWD982"}),  # each rank keeps its partial sum
    ],
)
def test_sharding_that_changes_the_output_fails_at_the_first_layer(tmp_path, parallelize, bug, expected):
    code, report, _ = launch(tmp_path, gpt_config(parallelize, bug))
    assert code == 1
    sharding = checks(report)["sharding"]
    assert codes(sharding) == expected
    assert "first parts at layers.0" in next(f for f in sharding["findings"] if f["code"] == "FWD981")["message"]
    assert checks(report)["future-token"]["status"] == "pass"  # the sharded model is wrong, and still causal


def test_row_wise_layer_declared_column_wise_fails_and_the_rest_does_not_run(tmp_path):
    code, report, _ = launch(tmp_path, gpt_config("row_layer_declared_column_wise"))
    assert code == 1
    got = checks(report)
    assert codes(got["sharding"]) == {"FWD983"}
    finding = got["sharding"]["findings"][0]
    assert "must have same reduction dim" in finding["message"]
    lines = (REPO / "tests" / "distributed_models.py").read_text().splitlines()
    call = next(n for n, line in enumerate(lines, 1) if "return self.o_proj(" in line)  # the projection that raised
    assert finding["source"].endswith(f"distributed_models.py:{call}")
    assert {got[n]["status"] for n in ("shape-ledger", "future-token", "mask-audit", "rope")} == {"skip"}


def test_a_leak_sharding_introduces_fails_future_token_on_the_sharded_model(tmp_path):
    code, report, _ = launch(tmp_path, gpt_config("tensor_parallel", "mask-dropped-when-sharded"))
    assert code == 1
    got = checks(report)
    assert "FWD101" in codes(got["future-token"]) and "FWD201" in codes(got["mask-audit"])
    # where the leak enters, read from each rank's own shards: the attention's code, which feeds the row-wise o_proj
    # (a sharded input is compared shard by shard, never taken for one that did not move)
    leak = next(f for f in got["future-token"]["findings"] if f["code"] == "FWD101")
    assert "look at the code of layers.0.attn that feeds it" in leak["message"]
    # and it comes through the attention call whose mask reads ahead: its line, as mask-audit's FWD201 names it
    assert "comes through layers.0.attn's attention, whose mask lets queries read later keys" in leak["message"]
    mask = next(f for f in got["mask-audit"]["findings"] if f["code"] == "FWD201")
    assert leak["source"] == mask["source"] and leak["source"].endswith("distributed_models.py:43")


@pytest.mark.parametrize("bug", [None, "mask-dropped-when-sharded"])
def test_grad_causality_backpropagates_through_the_shards(tmp_path, bug):
    """Every rank keeps its own graph behind rank 0's logits: the backward runs through each rank's shards and the
    sharded forward's collectives, and a mask that only the sharded path drops gets gradient from later tokens."""
    config = gpt_config("tensor_parallel", bug)
    config["checks"] = ["grad-causality"]
    code, report, stderr = launch(tmp_path, config)
    grad = checks(report)["grad-causality"]
    if bug is None:
        assert code == 0, stderr
        assert grad["status"] == "pass", grad["summary"]
        assert grad["metrics"]["max_gradient_after_cut"] == 0.0
    else:
        assert code == 1, stderr
        assert "FWD121" in codes(grad), grad["summary"]


def test_fully_sharded_model_passes(tmp_path):
    """FSDP2 gathers every parameter for the forward: nothing the model computes changes, and the swapped-in
    gathered parameters are no write (FWD006)."""
    code, report, stderr = launch(tmp_path, gpt_config("fully_sharded"))
    assert code == 0, stderr
    # every parameter, the root's too: read as sharding left them, before a forward gathers the root's
    assert checks(report)["sharding"]["data"]["placements"]["counts"] == {"S(0)": 24}


@pytest.mark.parametrize(
    "bug, code, how",
    [
        (
            "raises-on-rank-1",
            "FWD002",
            "rank 1 of 2 ended: the model raised RuntimeError: out of memory on this rank's device on this rank alone",
        ),
        ("crashes-on-rank-1", "FWD005", "rank 1 of 2 was killed by SIGSEGV"),
    ],
)
def test_a_rank_that_fails_ends_the_launch_naming_it(tmp_path, bug, code, how):
    """Rank 0 fails too, in the collective rank 1 left, as soon as rank 1's process ends: the rank named is the
    one where the failure began, not the lowest of those that ended."""
    marker = uuid.uuid4().hex
    exit_code, report, _ = launch(tmp_path, gpt_config("tensor_parallel", bug), marker=marker)
    assert exit_code == 1
    sharding = checks(report)["sharding"]
    assert sharding["findings"][0]["code"] == code
    assert how in sharding["summary"]
    assert {c["status"] for c in report["checks"][1:]} == {"error"}  # not run, and said so
    assert processes_marked(marker) == []


def test_a_rank_that_hangs_ends_with_the_time_limit_and_no_process_left(tmp_path):
    marker = uuid.uuid4().hex
    started = time.monotonic()
    code, report, _ = launch(tmp_path, gpt_config("tensor_parallel", "hangs-on-rank-1", timeout_s=3), marker=marker)
    assert code == 1 and time.monotonic() - started < 120
    assert "FWD004" in codes(checks(report)["sharding"])
    assert processes_marked(marker) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_command_ends_every_rank(tmp_path, signum):
    """Ctrl-C ends the run with its report (130), the ranks at once (one that has its interrupted report does not
    wait for the launcher to read it); SIGKILL leaves the command no say, and still no process of the run (worker,
    ranks, the server they were forked from) outlives it."""
    marker = uuid.uuid4().hex
    path = tmp_path / "hang.yaml"
    path.write_text(yaml.safe_dump(gpt_config("tensor_parallel", "hangs-on-rank-1", timeout_s=600)))
    hanging = tmp_path / "hanging"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fwdcheck", "run", str(path), "--format", "json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "FWDCHECK_TEST_MARK": marker, "FWDCHECK_TEST_HANGING": str(hanging)},
    )
    deadline = time.monotonic() + 60
    while not hanging.exists() and time.monotonic() < deadline:  # rank 1 in its forward, rank 0 waiting for it
        time.sleep(0.2)
    assert hanging.exists()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    if signum == signal.SIGINT:
        assert proc.returncode == 130
        assert json.loads(out)["exit_code"] == 130
        assert "torch/distributed" not in err, err  # the launcher's agent logs the signal it ends the ranks for
    else:
        assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while processes_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_marked(marker) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads the processes' descriptors in /proc")
def test_on_the_cpu_the_ranks_server_is_a_fork_of_the_launcher_before_the_models_code_and_without_its_pipes(tmp_path):
    """Not a new interpreter that imports torch again (seconds before the first rank starts). The fork is made before
    the launcher imports the parallelize function's module (to validate it), so that a model's module that reads
    RANK as it is imported sees the rank's. Of the launcher's pipes the fork holds the fork server's own: the one
    whose end tells it every rank has ended, and one a rank for its exit status; not the launcher's event pipe to
    its supervisor, whose end the supervisor waits for."""
    module = "tests.distributed_rank_at_import"
    config = gpt_config("tensor_parallel", checks=["shape-ledger", "tests.distributed_models:RankServer"])
    config["model"] = {**config["model"], "factory": f"{module}:gpt_reading_rank_at_import", "kwargs": {}}
    config["distributed"] = {**config["distributed"], "parallelize": f"{module}:parallelize"}
    code, report, stderr = launch(tmp_path, config)
    assert code == 0, stderr
    assert checks(report)["shape-ledger"]["status"] == "pass"
    server = checks(report)["rank-server"]["data"]
    # the worker's command line (fwdcheck/process/interpreter.py: `python -c ... fwdcheck.process.worker EVENTS
    # SUPERVISOR`)
    assert server["launcher"][:4] == interpreter.command("fwdcheck.process.worker"), server
    assert server["server"] == server["launcher"], server
    events = int(server["launcher"][4])  # the worker's command line names its event descriptor
    assert events not in server["shared"] and len(server["shared"]) == 1 + 2, server


def test_a_launcher_that_has_imported_the_models_module_does_not_fork_the_ranks_server(tmp_path):
    """A check of the config's that lives in the model's module: the launcher imports it (to read what the check
    declares), RANK unset. The ranks' server is then the new interpreter multiprocessing starts, which has not, so
    the rank's import of the model's module still sees its RANK."""
    module = "tests.distributed_rank_at_import"
    config = gpt_config("tensor_parallel", checks=["shape-ledger", f"{module}:RankServer"])
    config["model"] = {**config["model"], "factory": f"{module}:gpt_reading_rank_at_import", "kwargs": {}}
    code, report, stderr = launch(tmp_path, config)
    assert code == 0, stderr
    server = checks(report)["rank-server"]["data"]
    assert server["launcher"][:4] == interpreter.command("fwdcheck.process.worker"), server
    assert "from multiprocessing.forkserver import main" in " ".join(server["server"]), server


def test_the_fork_has_the_signal_handlers_and_descriptors_of_a_new_interpreter(tmp_path):
    """A handler the launcher installed is not the ranks': the fork has the default, SIGINT KeyboardInterrupt. A file
    the launcher holds open (and locked) is not held by the fork: its descriptor is /dev/null there."""
    import fcntl

    from fwdcheck.process.launch import _as_new_interpreter

    def handler(signum, frame):
        pass

    previous = {s: signal.signal(s, handler) for s in (signal.SIGUSR1, signal.SIGINT)}
    locked = open(tmp_path / "lock", "w")  # noqa: SIM115 -- held open and locked across the fork; closed below
    fcntl.flock(locked, fcntl.LOCK_EX)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                _as_new_interpreter(keep={write})
                os.write(
                    write,
                    json.dumps(
                        [
                            signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
                            signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                            os.path.realpath(f"/dev/fd/{locked.fileno()}"),
                        ]
                    ).encode(),
                )
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as reader:
            assert json.loads(reader.read()) == [True, True, os.devnull]
        os.waitpid(pid, 0)
    finally:
        locked.close()
        for s, h in previous.items():
            signal.signal(s, h)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts the descriptors in /proc")
def test_a_fork_that_cannot_be_made_leaves_the_server_to_multiprocessing(monkeypatch):
    """No process to be had (EAGAIN): the ranks still get a fork server, the one multiprocessing starts as a new
    interpreter on the first rank's start, and nothing of the failed fork is left open or on disk."""
    import errno
    import multiprocessing.forkserver
    from multiprocessing import resource_tracker, util

    from fwdcheck.process import launch as distributed

    def cannot_fork():
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    resource_tracker.ensure_running()  # its descriptor stays open, as the launch leaves it
    open_before, files_before = set(os.listdir("/proc/self/fd")), set(os.listdir(util.get_temp_dir()))
    monkeypatch.setattr(distributed, "_may_fork_server", lambda server, device, models_modules: True)
    monkeypatch.setattr(os, "fork", cannot_fork)
    with distributed._rank_server("cpu", set()) as start_method:
        assert start_method == "forkserver"
        assert multiprocessing.forkserver._forkserver._forkserver_pid is None  # started by the ranks' first Popen
    assert set(os.listdir("/proc/self/fd")) == open_before
    assert set(os.listdir(util.get_temp_dir())) == files_before  # the listening socket's file


def test_a_non_hugging_face_model_needs_a_parallelize_function(tmp_path):
    config = gpt_config("tensor_parallel")
    del config["distributed"]["parallelize"]
    code, _, stderr = launch(tmp_path, config)
    assert code == 2 and "distributed.parallelize is needed" in stderr and "Traceback" not in stderr


def test_a_usage_error_on_one_rank_is_the_runs_error_whatever_its_end_does_to_the_others(tmp_path):
    """Rank 1 cannot make the run; its end fails rank 0 inside a collective with an error of rank 0's own. The run
    ends with rank 1's usage error (exit 2, its one line), not rank 0's, nor a report of a failed rank (exit 1)."""
    code, report, stderr = launch(tmp_path, gpt_config("unusable_on_rank_1"))
    assert (code, report) == (2, {}), (code, stderr)
    assert stderr.strip().splitlines() == [
        f"error: {tmp_path / 'distributed.yaml'}: parallelize function 'tests.distributed_models:unusable_on_rank_1' "
        "returned str, not the model (an nn.Module) or None"
    ], stderr


def test_a_model_handed_back_in_a_wrapper_passes(tmp_path):
    """parallelize may return the sharded model inside a module of its own (as DDP does): the blocks compared are
    the wrapper's `module.layers` against the unsharded model's `layers`."""
    code, report, stderr = launch(tmp_path, gpt_config("tensor_parallel_wrapped"))
    assert code == 0, stderr
    assert len(checks(report)["sharding"]["data"]["layers"]) == 2


def test_a_check_failing_on_one_rank_ends_the_launch_instead_of_hanging(tmp_path):
    marker = uuid.uuid4().hex
    started = time.monotonic()
    config = gpt_config("tensor_parallel", checks=["shape-ledger", "tests.distributed_models:FailsOnRankOne"])
    code, report, _ = launch(tmp_path, config, marker=marker)
    assert time.monotonic() - started < 120  # not timeout_s (600 s) waiting at a collective
    assert code != 0
    failed = checks(report)["tests.distributed_models:FailsOnRankOne"]
    assert failed["status"] == "error" and "rank 1 of 2 ended" in failed["summary"]
    assert failed["findings"][0]["code"] == "FWD003"
    assert processes_marked(marker) == []


def test_golden_and_meta_runs_are_made_on_one_process(tmp_path):
    code, _, stderr = launch(tmp_path, gpt_config("tensor_parallel"), "--save-golden", str(tmp_path / "golden.json"))
    assert code == 2 and "golden check runs on one process" in stderr and "Traceback" not in stderr
    code, _, stderr = launch(tmp_path, {**gpt_config("tensor_parallel"), "checks": ["default", "golden"]})
    assert code == 2 and "golden check runs on one process" in stderr
    assert not (tmp_path / "golden.json").exists()
    code, _, stderr = launch(tmp_path, gpt_config("tensor_parallel"), "--meta")
    assert code == 2 and "--meta and a distributed run" in stderr


def test_sharding_skips_outside_a_distributed_run():
    from tests.conftest import run_checks

    result = run_checks({"source": "reference"}, ["sharding"]).result("sharding")
    assert result.status.value == "skip" and "not a distributed run" in result.summary


def test_the_python_api_refuses_a_distributed_run():
    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.errors import UsageError
    from fwdcheck.run.plan import resolve
    from fwdcheck.run.runner import Run

    run = Run.build(resolve(config_from_dict({"model": {"source": "reference"}, "distributed": {"nproc": 2}})))
    assert [e.name for e in run.entries][0] == "sharding"
    with pytest.raises(UsageError, match="starts processes of its own"):
        run.check(run.load())


def test_a_fwdcheck_folder_where_the_command_runs_does_not_shadow_the_package_in_the_ranks(tmp_path):
    """Ranks started as new interpreters (FWDCHECK_NO_FORK_SERVER=1: no fork, as with CUDA ranks or spawned ones)
    from a directory whose `fwdcheck/` folder is a project's own: each rank imports fwdcheck from where the
    command's own lives, then the model's code from the path the user gave."""
    (tmp_path / "fwdcheck").mkdir()
    (tmp_path / "fwdcheck" / "__init__.py").write_text("raise ImportError('the project folder, not the package')\n")
    path = tmp_path / "distributed.yaml"
    path.write_text(yaml.safe_dump(gpt_config("tensor_parallel"), sort_keys=False))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "fwdcheck"), "run", path.name, "--format", "json", "-c", "future-token"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "FWDCHECK_NO_FORK_SERVER": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = checks(json.loads(proc.stdout))
    assert got["sharding"]["status"] == "pass" and got["future-token"]["status"] == "pass"
