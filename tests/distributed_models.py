"""A small GPT and the ways to shard it across processes, correct and wrong, for tests/test_distributed.py.

The GPT splits its projections into heads by their local width (`view(B, T, -1, d_h)`), as Hugging Face and
Meta's Llama do, so that a tensor-parallel plan sharding q, k and v column-wise gives each rank its own heads. The
planted bugs are the ways real sharding goes wrong: a projection sharded on the wrong axis, a reduction left out, a
head count that was not divided, a mask built for the whole model and dropped for a shard, a rank that raises,
crashes or hangs.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fwdcheck.result import Check, CheckResult, Status

V, D, HEADS, LAYERS, FF = 64, 32, 4, 2, 64


class Attention(nn.Module):
    def __init__(self, bug: str | None):
        super().__init__()
        self.bug, self.n_heads, self.head_dim = bug, HEADS, D // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, heads on this rank x d_h)
        # the planted bug: the head size read off the local width with the full head count, as code written for
        # one process does; sharded, every "head" is then half a head
        head_dim = q.shape[-1] // self.n_heads if self.bug == "heads-not-divided" else self.head_dim
        q, k, v = (t.view(B, T, -1, head_dim).transpose(1, 2) for t in (q, k, v))  # (B, h_local, T, d_h)
        sharded = q.shape[1] < self.n_heads
        causal = not (self.bug == "mask-dropped-when-sharded" and sharded)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, h_local, T, d_h)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, bug: str | None):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(bug)
        self.up, self.down = nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.down(F.gelu(self.up(self.norm_2(x))))


class GPT(nn.Module):
    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug = bug
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(bug) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.bug == "raises-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("out of memory on this rank's device")
        if self.bug == "crashes-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGSEGV)  # native code that crashes: no exception, no word from the rank
        if self.bug == "hangs-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
            if os.environ.get("FWDCHECK_TEST_HANGING"):  # where a test waits to hear that the ranks are running
                open(os.environ["FWDCHECK_TEST_HANGING"], "w").close()
            time.sleep(3600)  # a rank stuck in a collective, a deadlock, a dead device
        x = self.embed(input_ids)  # (B, T, D)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # (B, T, V)


def gpt(bug: str | None = None) -> GPT:
    return GPT(bug)


# ---------------------------------------------------------------------------------------------------------------------
# parallelize functions: (model, device_mesh) -> model


def tensor_parallel(model: GPT, mesh) -> GPT:
    """Megatron's plan: q, k, v and up column-wise (each rank its heads and its slice of the hidden layer), o and down
    row-wise (each rank's partial product, summed across the ranks)."""
    for layer in model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(),
                "up": ColwiseParallel(),
                "down": RowwiseParallel(),
            },
        )
    return model


def row_layer_declared_column_wise(model: GPT, mesh) -> GPT:
    """o_proj, which reads the heads each rank holds, declared column-wise: it expects the whole hidden state."""
    for layer in model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": ColwiseParallel(),
            },
        )
    return model


def reduction_missing(model: GPT, mesh) -> GPT:
    """The heads sharded column-wise, and o_proj cut to this rank's columns by hand, its partial product never
    summed across the ranks (the all-reduce of a row-parallel layer left out)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    for layer in model.layers:
        parallelize_module(
            layer,
            mesh,
            {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel()},
        )
        weight = layer.attn.o_proj.weight  # (D, D): this rank reads the columns of its heads
        columns = weight.shape[1] // world
        layer.attn.o_proj.weight = nn.Parameter(weight[:, rank * columns : (rank + 1) * columns].detach().clone())
    return model


def fully_sharded(model: GPT, mesh) -> GPT:
    """FSDP2: every block and the root sharded by parameter; the forward gathers them: nothing it computes changes."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tp_fsdp(model: GPT, mesh) -> GPT:
    """A 2-D plan, as torchtitan lays one out: Megatron's tensor parallelism inside each group of mesh["tp"], then
    FSDP2 over mesh["dp_shard"] (every block and the root), on the parameters tensor parallelism made DTensors."""
    from torch.distributed.fsdp import fully_shard

    tensor_parallel(model, mesh["tp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def tp_fsdp_missing_reduction(model: GPT, mesh) -> GPT:
    """The same 2-D plan with o_proj's RowwiseParallel leaving its output partial: each rank of a tensor-parallel
    group keeps its heads' share of the projection, never summed (the all-reduce of the row-parallel layer left
    out)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Partial

    for layer in model.layers:
        parallelize_module(
            layer,
            mesh["tp"],
            {
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=Partial(), use_local_output=True),
                "up": ColwiseParallel(),
                "down": RowwiseParallel(),
            },
        )
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def llama_missing_reduction(model: nn.Module, mesh) -> nn.Module:
    """A Hugging Face Llama sharded by hand as its own plan shards it, but for o_proj, whose RowwiseParallel leaves
    its output partial: each rank's logits are its own, none the unsharded model's."""
    from torch.distributed.tensor import Partial

    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Partial(), use_local_output=True),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    return model


def raises(model: GPT, mesh) -> GPT:
    raise ValueError("no plan for this model")


class Wrapped(nn.Module):
    """A sharded model handed back inside a wrapper, as DDP and FSDP1 hand it back: its blocks are `module.layers`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, input_ids):
        return self.module(input_ids)


def tensor_parallel_wrapped(model: GPT, mesh) -> Wrapped:
    return Wrapped(tensor_parallel(model, mesh))


class FailsOnRankOne(Check):
    """A check with a bug of its own on rank 1 only, after rank 0 has entered a forward every rank must join."""

    name = "fails-on-rank-1"
    description = "raises an error of fwdcheck's kind on rank 1"

    def run(self, model, session) -> CheckResult:
        if dist.get_rank() == 1:
            raise KeyError("a bug in a check")
        session.logits(session.inputs[:, :4])
        return CheckResult(self.name, Status.PASS, "rank 0 ran")


class RankServer(Check):
    """What the process this rank was forked from (the ranks' server) is: its command line and its parent's (the
    launcher's), and the launcher's descriptors above stdin, stdout and stderr whose pipe or socket it holds too."""

    name = "rank-server"
    description = "describes the process the ranks are forked from"

    def run(self, model, session) -> CheckResult:
        server = os.getppid()
        launcher = int(_proc(server, "stat").rsplit(")", 1)[1].split()[1])
        held = set(_channels(server).values())
        shared = sorted(int(fd) for fd, channel in _channels(launcher).items() if channel in held and int(fd) > 2)
        return CheckResult(
            self.name,
            Status.PASS,
            "described",
            data={
                "server": _proc(server, "cmdline").split("\0"),
                "launcher": _proc(launcher, "cmdline").split("\0"),
                "shared": shared,
            },
        )


def _proc(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/{name}") as file:
        return file.read()


def _channels(pid: int) -> dict[str, str]:
    """The pipes and sockets `pid` holds by descriptor, as the kernel names them ("pipe:[inode]")."""
    channels = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since it was listed
            continue
        if link.startswith(("pipe:", "socket:")):
            channels[fd] = link
    return channels


def unusable_on_rank_1(model: GPT, mesh) -> GPT:
    """Hands back what is not a model on rank 1 at once; rank 0 meanwhile waits for rank 1 in a collective, which
    fails when rank 1 ends, giving rank 0 an error of its own that is not where the run's failure began."""
    if dist.get_rank() == 1:
        return "not a model"
    dist.barrier()
    return model
