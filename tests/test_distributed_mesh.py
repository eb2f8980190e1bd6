"""Distributed runs over a mesh of named dimensions (`distributed: {mesh: {dp_shard: 2, tp: 2}}`), on 4 CPU processes
with gloo, and the checks that call the model themselves (kv-cache, packing, label-shift) and the code-path matrix
on a sharded model. Each launch of 4 ranks costs several seconds: there are few of them."""

from __future__ import annotations

import time

import pytest
import yaml

from tests.test_distributed import REPO, checks, codes, gpt_config, launch

# Every launch test starts ranks (seconds each), and the config's tests name nproc: the slow tier as a whole.
pytestmark = pytest.mark.slow


def mesh_config(parallelize: str) -> dict:
    config = gpt_config(parallelize)
    config["distributed"] = {"mesh": {"dp_shard": 2, "tp": 2}, "parallelize": f"tests.distributed_models:{parallelize}"}
    return config


def test_tensor_parallel_times_fsdp2_over_a_2d_mesh_passes_every_check(tmp_path):
    """Megatron's plan over mesh["tp"], then FSDP2 over mesh["dp_shard"], on 4 ranks: the sharded model computes
    the unsharded logits, and the placements are read per mesh dimension. Context parallelism asked for too: it
    splits over a 1-D mesh, and the sharding check says it did not, judging the rest."""
    config = mesh_config("tp_fsdp")
    config["distributed"]["context_parallel"] = True
    config["checks"] = ["shape-ledger", "future-token", "mask-audit", "rope"]  # the sharded forward's own checks
    code, report, stderr = launch(tmp_path, config)
    assert code == 0, stderr
    got = checks(report)
    assert {name: c["status"] for name, c in got.items()} == {
        "sharding": "pass",
        "shape-ledger": "pass",
        "future-token": "pass",
        "mask-audit": "pass",
        "rope": "skip",
    }
    sharding = got["sharding"]
    assert sharding["data"]["rank_changes"] == [0.0] * 4
    assert sharding["data"]["mesh"] == {"dp_shard": 2, "tp": 2}
    # 2 layers: q, k, v, up by rows over tp (and FSDP2's strided rows over dp_shard); o, down by columns over tp;
    # the norms, the embedding and the head sharded by FSDP2 alone, replicated over tp; every parameter counted
    assert sharding["data"]["placements"]["counts"] == {
        "dp_shard _S(0, 2) · tp S(0)": 8,
        "dp_shard S(0) · tp S(1)": 4,
        "dp_shard S(0) · tp R": 12,
    }
    assert "dp_shard S(0) · tp S(1)" in sharding["summary"]
    assert sharding["data"]["context_parallel"] == (
        "not run: the sequence is split over a 1-D mesh of every rank; this run's mesh has 2 dimensions"
    )
    assert report["model"]["label"].endswith("[tests.distributed_models:tp_fsdp, 4 ranks: dp_shard 2 x tp 2]")
    assert report["environment"]["distributed"] == {
        "nproc": 4,
        "backend": "gloo",
        "parallelize": "tests.distributed_models:tp_fsdp",
        "mesh": {"dp_shard": 2, "tp": 2},
    }


def test_the_2d_plan_without_its_tensor_parallel_reduction_fails_at_the_first_block(tmp_path):
    code, report, _ = launch(tmp_path, mesh_config("tp_fsdp_missing_reduction"))
    assert code == 1
    sharding = checks(report)["sharding"]
    assert codes(sharding) == {"FWD981", "FWD982"}
    differ = next(f for f in sharding["findings"] if f["code"] == "FWD981")
    assert "first parts at layers.0" in differ["message"]
    # the second rank of each tensor-parallel group (ranks 1 and 3 of the mesh dp_shard x tp) keeps its partial sum
    assert next(f for f in sharding["findings"] if f["code"] == "FWD982")["where"] == "rank 1, rank 3"
    assert checks(report)["future-token"]["status"] == "pass"


def llama_with_every_check(parallelize: str | None = None) -> dict:
    """The README's tiny Llama on 2 ranks with the code-path matrix on and the checks that call the module with
    arguments of their own (a cache, document positions, labels) selected."""
    config = yaml.safe_load((REPO / "examples" / "distributed" / "llama-tp.yaml").read_text())
    config["code_paths"] = {"enabled": True}
    config["checks"] = ["shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "packing", "label-shift"]
    if parallelize:
        config["distributed"]["parallelize"] = f"tests.distributed_models:{parallelize}"
        config["timeout_s"] = 120  # a run whose ranks fall out of step would wait here, not 600 s
    return config


def test_the_checks_that_call_the_model_themselves_run_sharded_with_one_verdict(tmp_path):
    code, report, stderr = launch(tmp_path, llama_with_every_check())
    assert code == 0, stderr
    got = checks(report)
    assert {name: c["status"] for name, c in got.items()} == dict.fromkeys(
        ["sharding", "shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "packing", "label-shift"],
        "pass",
    )
    assert "25 code paths pass" in got["future-token"]["summary"]  # 24 of transformers' own and the train path
    assert got["kv-cache"]["metrics"]  # it decoded through the cache, not skipped
    assert "each vs alone" in got["packing"]["summary"] and "cross-entropy" in got["label-shift"]["summary"]


def test_ranks_whose_outputs_differ_stay_in_step_through_those_checks(tmp_path):
    """A Llama whose row-parallel o_proj is never reduced: each rank's own logits differ. Every call a check makes
    itself returns rank 0's output on every rank, so the ranks take the same way through each check (packing
    decided on each rank's own output used to send one rank into a forward the other never joined, and the run
    hung until timeout_s); the sharding bug is the sharding check's finding, not a kv-cache, packing or label-shift
    failure of one rank."""
    started = time.monotonic()
    code, report, stderr = launch(tmp_path, llama_with_every_check("llama_missing_reduction"))
    assert code == 1, stderr
    assert time.monotonic() - started < 100  # not the time limit: nothing waited at a collective
    got = checks(report)
    assert codes(got["sharding"]) == {"FWD981", "FWD982"}
    assert {got[name]["status"] for name in ("kv-cache", "packing", "label-shift")} == {"pass"}
    assert not any("FWD004" in codes(c) for c in got.values())


def test_a_hugging_face_models_own_plans_over_a_2d_mesh(tmp_path):
    """Its tensor-parallel plan over `tp`, its FSDP plan over `dp_shard`, as DistributedConfig(tp_size=2,
    fsdp_size=2) applies them; the placements named by transformers' own mesh (fsdp, tp)."""
    config = yaml.safe_load((REPO / "examples" / "distributed" / "llama-tp.yaml").read_text())
    config["distributed"] = {"mesh": {"dp_shard": 2, "tp": 2}}
    code, report, stderr = launch(tmp_path, config, "--check", "sharding")
    assert code == 0, stderr
    sharding = checks(report)["sharding"]
    assert sharding["status"] == "pass"
    assert "its tensor-parallel plan (9 rules) and its FSDP plan" in sharding["data"]["parallelized_by"]
    assert sharding["data"]["placements"]["counts"]["fsdp S(0) · tp S(1)"] == 4  # o_proj, down_proj of 2 layers


# ---------------------------------------------------------------------------------------------------------------------
# The mesh in the config: refused when it is read, one line, exit 2 (no rank starts)


@pytest.mark.parametrize(
    ("distributed", "says"),
    [
        ({"nproc": 3, "mesh": {"dp_shard": 2, "tp": 2}}, "nproc 3 but mesh dp_shard 2 x tp 2 makes 4 ranks"),
        ({"mesh": {"dp_shard": 2, "tp": 0}}, "distributed.mesh.tp: must be greater than 0"),
        ({"mesh": {"dp-shard": 2, "tp": 2}}, "mesh dimension 'dp-shard' is not a name"),
        ({"mesh": {}}, "mesh names no dimension"),
        ({"mesh": {"dp": 32, "tp": 16}}, "mesh dp 32 x tp 16 makes 512 ranks, more than 256"),
    ],
)
def test_a_mesh_that_cannot_be_built_is_a_config_error(tmp_path, distributed, says):
    config = {"model": {"source": "reference"}, "distributed": distributed}
    code, report, stderr = launch(tmp_path, config)
    assert (code, report) == (2, {}), stderr
    assert stderr.count("\n") == 1 and says in stderr and "Traceback" not in stderr, stderr


def test_a_dimension_named_twice_is_a_config_error(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("model: {source: reference}\ndistributed:\n  mesh: {tp: 2, tp: 2}\n")
    from fwdcheck.config.schema import load_config
    from fwdcheck.errors import ConfigError

    with pytest.raises(ConfigError, match="the key 'tp' is given twice"):
        load_config(path)


def test_the_mesh_gives_nproc_and_nproc_must_agree_with_it():
    from fwdcheck.config.schema import config_from_dict

    def distributed(**spec):
        return config_from_dict({"model": {"source": "reference"}, "distributed": spec}).distributed

    assert distributed(mesh={"dp_shard": 2, "tp": 2}).nproc == 4
    assert distributed(nproc=4, mesh={"dp_shard": 2, "tp": 2}).nproc == 4
    assert distributed(nproc=2).mesh is None


def test_nproc_on_the_command_line_must_agree_with_the_mesh(tmp_path):
    code, _, stderr = launch(tmp_path, mesh_config("tp_fsdp"), "--nproc", "2")
    assert code == 2 and "--nproc 2 but distributed.mesh makes 4 ranks (dp_shard 2 x tp 2)" in stderr, stderr


@pytest.mark.parametrize(
    ("mesh", "says"),
    [
        ({"dp_shard": 4}, "no dimension 'tp'"),
        ({"cp": 2, "tp": 2}, "dimension 'cp'"),
        ({"tp": 2, "dp_shard": 2}, "list the dimensions as transformers lays its mesh out (dp_shard, tp)"),
    ],
)
def test_a_hugging_face_model_needs_parallelize_for_a_mesh_its_plans_do_not_name(mesh, says):
    from fwdcheck.errors import UsageError
    from fwdcheck.model.sources.hf_parallel import _plan_sizes

    with pytest.raises(UsageError, match="distributed.mesh") as raised:
        _plan_sizes(mesh)
    assert says in str(raised.value)
    if "lays" not in says:  # a mesh they cannot shard over: the way out is a function of the user's
        assert "name a distributed.parallelize function" in str(raised.value)
    assert _plan_sizes({"dp_replicate": 2, "dp_shard": 2, "tp": 2}) == {
        "dp_replicate_size": 2,
        "fsdp_size": 2,
        "tp_size": 2,
    }
    assert _plan_sizes({"ranks": 4}) == {"tp_size": 4}


def test_placements_are_written_per_mesh_dimension():
    from fwdcheck.checks.sharding import placement_words
    from fwdcheck.run.sharding import ParameterLayout

    def words(placements, mesh, run=("dp_shard", "tp")):
        return placement_words(ParameterLayout("w", placements, mesh, [4, 4], [2, 4]), run)

    assert words(("S(0)",), ("ranks",), ("ranks",)) == "S(0)"  # the 1-D mesh of every rank, as before meshes
    assert words(("S(0)",), ("tp",), ("ranks",)) == "S(0)"  # transformers' own 1-D mesh over every rank
    assert words(("S(0)", "S(1)"), ("dp_shard", "tp")) == "dp_shard S(0) · tp S(1)"
    assert words(("S(0)",), ("tp",)) == "dp_shard R · tp S(0)"  # tensor parallel alone: replicated over dp_shard
    assert words(("S(0)",), ("fsdp",)) == "fsdp S(0)"  # a mesh of its own (transformers'): its own names
    assert words(None, ()) == "not sharded"


def test_a_call_a_check_makes_itself_gets_rank_0s_tensors_in_the_models_own_output_type():
    """The output's logits and loss are replaced (what every rank holds alike when the sharding is right); the rest
    (a cache of this rank's heads, a tuple's later items) stays the rank's own."""
    from collections import namedtuple

    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from fwdcheck.run.sharding import _output_tensors, _with_tensors

    own, shared, loss, cache = torch.zeros(1, 2, 3), torch.ones(1, 2, 3), torch.tensor(2.0), object()
    output = CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=own, past_key_values=cache)
    assert set(_output_tensors(output)) == {"logits", "loss"}
    replaced = _with_tensors(output, {"logits": shared, "loss": loss})
    assert replaced.logits is shared and replaced["logits"] is shared and replaced.loss is loss
    assert replaced.past_key_values is cache

    assert _with_tensors(own, {"output": shared}) is shared
    Pair = namedtuple("Pair", "logits cache")
    pair = _with_tensors(Pair(own, cache), {"0": shared})
    assert isinstance(pair, Pair) and pair.logits is shared and pair.cache is cache
    assert _with_tensors((own, cache), {"0": shared}) == (shared, cache)
    assert _with_tensors({"logits": own}, {"logits": shared}) == {"logits": shared}
    assert _output_tensors(("no tensor",)) == {} and _output_tensors(object()) == {}


def test_the_two_node_example_is_a_valid_config_of_four_ranks():
    from fwdcheck.config.schema import config_for

    config = config_for(REPO / "examples" / "distributed" / "llama-2d.yaml", None)
    assert config.distributed.mesh == {"dp_shard": 2, "tp": 2} and config.distributed.nproc == 4
