"""What the sharding check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/sharding.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    default=False,  # a distributed run adds it, first; elsewhere there is nothing to shard
    applies_when=(
        "distributed runs (--nproc N, or a launcher's ranks), which add it first: one process has nothing to shard"
    ),
    order=95,  # after the other built-ins; a distributed run puts it first (registry.selected)
    opens_distributed_runs=True,
    # A sharded model that raises where the unsharded one runs: the other checks would only meet the same error
    ends_distributed_runs="FWD983",
    description="the model sharded across processes gives the unsharded model's logits, on every rank",
    codes={
        "FWD981": "the sharded model's logits differ from the unsharded model's",
        "FWD982": "the ranks' logits differ from each other where they should be the same (replicated)",
        "FWD983": "the sharded model raises where the unsharded model runs",  # ends_distributed_runs
        "FWD984": "with the sequence split across the ranks (context parallelism) the logits differ",
    },
    explain="""\
Verifies, in a distributed run (`distributed: {nproc: N}` or `--nproc N`), that sharding the model changed nothing
it computes. Every rank builds the same model from the same seed and shards it (the config's parallelize function,
or a Hugging Face model's own tensor-parallel plan); one forward of the session's inputs runs on every rank, with
hooks on each block of the layer stack. Each rank's logits are compared with rank 0's (FWD982), and on rank 0 the
unsharded model, built again from the same seed, runs the same inputs: its logits and each block's output are
compared with the sharded model's (FWD981), within the bar for the same arithmetic in another order (float32
1e-6 + 1e-4 x the largest |value|; float16 5e-3, bfloat16 1e-2 likewise; never below the session's threshold). A
sharded model that raises where the unsharded one runs fails (FWD983), and the other checks do not run on it.
Every parameter's placement (Shard(dim), Replicate(), or a plain tensor; per mesh dimension) is listed.
Why: a model that is causal and correct on one process can be wrong once sharded: a layer declared column-wise that
should be row-wise, a missing all-reduce, heads split where the code assumes the full head count, a gather left
out. Training runs on such a model without an error, to a worse loss.
How to fix: FWD981 -> the first block that parts holds the wrong layer: compare its parallel styles with the
layer's role (the projection into heads column-wise, the projection out of them row-wise with its all-reduce;
embeddings row-wise over the vocabulary). FWD982 -> an output that should be replicated is still partial or
sharded: a RowwiseParallel without its reduction, a ColwiseParallel whose output is never gathered. FWD983 -> read
the error: a shape mismatch in a projection is a layer sharded on the wrong axis; a view into heads that fails, or
runs with the wrong size, is a head count that was not divided by the number of ranks.
Limits: one forward of the session's inputs; the model is sharded as the config says, over the config's mesh
(`distributed.mesh`, placements listed per dimension) or a 1-D mesh of all ranks. Context parallelism runs on
CUDA only, over a 1-D mesh. The other checks then run on the sharded model, every rank seeing
rank 0's logits, also from the calls the kv-cache, packing and label-shift checks make themselves (their logits and
loss): ranks that disagree are this check's finding, not theirs.""",
)
