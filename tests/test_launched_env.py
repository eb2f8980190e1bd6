"""Which rank a process is, read from the launcher's variables (torchrun's, SLURM's, a script's), and the signs a
rank reads of a peer that went away (fwdcheck/process/launched.py). The jobs themselves are tests/test_launched.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fwdcheck.errors import UsageError
from fwdcheck.process.launched import launched_rank, lost_peer
from tests.test_distributed import REPO

# ---------------------------------------------------------------------------------------------------------------------
# Which rank a process is: read from the launcher's variables


TORCHRUN_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node-a",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def test_a_torchrun_rank_is_read_from_its_variables_and_meets_at_the_agents_store():
    rank = launched_rank(TORCHRUN_ENV)
    assert rank is not None
    assert (rank.rank, rank.world, rank.local_rank) == (3, 4, 1)
    assert rank.node.endswith("(node 1)") and rank.launcher == "torchrun"
    assert (rank.master_addr, rank.master_port) == ("node-a", 29400)
    assert not rank.holds_store  # torchrun's agent serves it
    assert launched_rank({**TORCHRUN_ENV, "RANK": "0"}).holds_store is False  # type: ignore[union-attr]


def test_ranks_a_script_sets_meet_at_a_store_rank_0_serves():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    rank = launched_rank(env)
    assert rank is not None and rank.holds_store and rank.launcher == "the environment"
    assert launched_rank({**env, "RANK": "1"}).holds_store is False  # type: ignore[union-attr]


def test_an_srun_task_is_a_rank_and_a_batch_scripts_own_shell_is_not():
    step = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURMD_NODENAME": "gpu-07",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.4",
    }
    rank = launched_rank(step)
    assert rank is not None
    assert (rank.rank, rank.world, rank.local_rank, rank.node) == (5, 8, 1, "gpu-07 (node 2)")
    assert (rank.master_addr, rank.master_port) == ("10.0.0.4", 15000 + 3456)  # srun's node, a port from the job id
    assert launched_rank({**step, "MASTER_ADDR": "gpu-01", "MASTER_PORT": "29500"}).master_port == 29500  # type: ignore[union-attr]
    batch_shell = {k: v for k, v in step.items() if k != "SLURM_STEP_ID"}
    assert launched_rank(batch_shell) is None


@pytest.mark.parametrize(
    "env",
    [{}, {"RANK": "0", "WORLD_SIZE": "1"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}],
    ids=["no launcher", "one rank", "one srun task"],
)
def test_one_process_is_not_a_launched_rank(env):
    assert launched_rank(env) is None


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT is not set"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "not a port number"),
    ],
)
def test_a_launchers_environment_the_ranks_cannot_meet_by_is_a_usage_error(env, words):
    with pytest.raises(UsageError, match=words):
        launched_rank(env)


def test_a_collectives_error_when_a_peer_went_away_reads_as_a_lost_peer():
    assert lost_peer("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4835")
    assert lost_peer(
        "timed out after 5 s (timeout_s in the config); waiting in a collective: another rank did not join it"
    )
    assert not lost_peer("the model raised RuntimeError: out of memory on this rank's device on this rank alone")


def test_a_time_limit_that_strikes_in_a_collective_says_the_rank_waited_for_another():
    """Where the limit struck tells a rank that waited for a peer from the rank that hung: torch.distributed's code
    (reached through torch's own calls) is waiting; model code is not, whatever called it."""
    from fwdcheck.run.limits import CheckTimeout, time_limit

    def waits_in(path: Path):
        namespace: dict = {}
        exec(compile("import time\ndef wait():\n    time.sleep(5)\n", str(path), "exec"), namespace)
        with pytest.raises(CheckTimeout) as caught, time_limit(0.2):
            namespace["wait"]()
        return caught.value.in_collective

    torch_root = Path(torch.__file__).parent
    assert waits_in(torch_root / "distributed" / "distributed_c10d.py")
    assert not waits_in(torch_root / "nn" / "functional.py")  # torch, but no collective
    assert not waits_in(REPO / "tests" / "models.py")  # the model's own code
