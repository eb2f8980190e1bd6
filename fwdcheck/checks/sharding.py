"""sharding: the model sharded across processes computes what the unsharded model computes.

It runs only in a distributed run (`distributed: {nproc: N}`, `--nproc N`; fwdcheck/process/launch.py), first, on
every rank: one forward of the session's inputs through the sharded model, with forward hooks on the blocks of its layer
stack, the same on every rank (the collectives inside need them all). Then:
  - every rank's own logits against rank 0's: ranks whose outputs should be replicated but are not (a reduction
    missing, a gather forgotten) disagree;
  - on rank 0, the unsharded model, built again from the same seed, runs the same inputs: the logits must agree
    within the bar of two computations of the same arithmetic in another order (Hugging Face's eager-vs-SDPA bar,
    fwdcheck/run/tolerances.py), and the first block whose output parts says where;
  - a sharded model that raises where the unsharded one runs (a layer sharded on the wrong axis: a row-wise layer
    declared column-wise, a head count not divided by the ranks) fails: that is the sharding's doing.
Rank 0's verdict is every rank's. Each parameter's placement (DTensor Shard/Replicate, or not sharded) is reported.
Context parallelism (`distributed.context_parallel`) runs on CUDA only: torch has no sharding strategy for the CPU's
SDPA kernel; on the CPU the check says so and judges the rest.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from fwdcheck.checks.sharding_spec import SPEC
from fwdcheck.errors import ModelRaised, SkipCheck, first_line, model_failure
from fwdcheck.model.tested import extract_logits, layer_stack_of
from fwdcheck.observe.frames import first_tensor
from fwdcheck.observe.locations import code_location
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.compare import logit_scale, position_change
from fwdcheck.run.sharding import ParameterLayout, full, rank_context
from fwdcheck.run.tolerances import TOLERANCES

PLACEMENTS_SHOWN = 64  # parameters listed by name in the result's data; every one is counted


class Sharding(Check, declared=SPEC):
    name = "sharding"
    ends_distributed_runs: ClassVar[str]  # FWD983, as SPEC declares: a code, never None, for this check

    def key_number(self, result: CheckResult) -> str:
        m = result.metrics
        if "max_change" in m:
            return f"{m['max_change']:.2g} / {m['bar']:.2g}"
        return ""

    def run(self, model, session) -> CheckResult:
        context = rank_context()
        if context is None:
            raise SkipCheck(
                "not a distributed run: `--nproc N` or `distributed: {nproc: N}` shards the model across N processes"
            )
        blocks = _blocks(model.module, model.layer_stack)
        try:
            sharded = _hooked(blocks, lambda: session.logits(session.inputs))
            raised = None
        except ModelRaised as exc:  # on every rank alike, or the launch would have ended
            sharded, raised = None, exc
        disagreement = self._disagreement(context, session) if raised is None else None
        split = self._context_parallel(context, session, model) if context.context_parallel and raised is None else None
        verdict = None
        if context.rank == 0:
            try:
                verdict = self._judge(context, session, model, blocks, sharded, raised, disagreement, split)
            except Exception as exc:  # fwdcheck's own failure: the other ranks still wait for the verdict
                verdict = {"failed": f"{type(exc).__name__}: {exc}"}
        shared: list[Any] = [verdict]  # filled in by the broadcast on every other rank
        dist.broadcast_object_list(shared, src=0)  # rank 0's verdict is every rank's
        if "failed" in shared[0]:
            raise RuntimeError(f"the sharding check failed on rank 0: {shared[0]['failed']}")
        result = CheckResult.from_dict(shared[0])
        if raised is not None and not any(f.code == self.ends_distributed_runs for f in result.findings):
            raise raised  # the unsharded model raises too: the model's own error, not the sharding's
        return result

    # -- what every rank does --------------------------------------------------------------------------------------

    @staticmethod
    def _disagreement(context, session) -> list[float]:
        """Each rank's largest change from rank 0's logits (its own, before rank 0's were broadcast)."""
        own = context.logits.own.float()
        reference = own.clone()
        dist.broadcast(reference, src=0)
        change = float(position_change(own, reference).max())
        changes: list = [None] * context.world
        dist.all_gather_object(changes, change)
        return changes

    @staticmethod
    def _context_parallel(context, session, model) -> torch.Tensor | str:
        """The unsharded model (every rank its own copy) run with the sequence split across the ranks by torch's
        context_parallel, its logits put back in order: the logits [B, T, V], or why they could not be computed.
        Positions go in as position_ids split the same way, since each rank holds other positions than 0..T/N-1."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        if context.mesh.ndim > 1:
            dimensions = context.mesh.ndim
            return f"the sequence is split over a 1-D mesh of every rank; this run's mesh has {dimensions} dimensions"
        if not model.accepts_position_ids:
            return "forward takes no position_ids: each rank's share of the sequence would start at position 0"
        module = context.unsharded()
        ids = session.inputs.clone()
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T).clone()
        try:
            with (
                torch.no_grad(),
                context_parallel(
                    context.mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1], no_restore_buffers={ids, positions}
                ),
            ):
                local = extract_logits(module(ids, position_ids=positions))  # (B, T / ranks, V)
            return context_parallel_unshard(context.mesh, [local.float()], [1])[0]  # (B, T, V)
        except Exception as exc:  # on every rank alike: torch cannot split this attention here
            if not model_failure(exc):
                raise
            return f"torch could not split the sequence: {type(exc).__name__}: {first_line(exc)}"

    # -- rank 0 ------------------------------------------------------------------------------------------------------

    def _judge(self, context, session, model, blocks, sharded, raised, disagreement, split) -> dict:
        """Rank 0's verdict, as the dict the broadcast carries: the unsharded model runs the same inputs, and the
        sharded model's logits and block outputs, the context-parallel logits and every rank's are compared with
        its own."""
        data: dict = {
            "parallelized_by": context.parallelized_by,
            "ranks": context.world,
            "mesh": dict(zip(context.mesh.mesh_dim_names, context.mesh.shape, strict=True)),
            "placements": placements(context.parameters, context.mesh.mesh_dim_names),
        }
        unsharded = context.unsharded()
        try:
            # the unsharded model's own stack: a parallelize function may return the model inside a wrapper
            reference = _hooked(
                _blocks(unsharded, layer_stack_of(unsharded)),
                lambda: session.logits(session.inputs, model=_unsharded_view(model, unsharded)),
            )
        except ModelRaised as exc:
            if raised is not None:  # both raise: the model's own error, which run() raises on every rank
                return CheckResult(self.name, Status.ERROR, str(raised)).to_dict()
            message = f"the unsharded model raises where the sharded one runs: {exc}"
            return CheckResult(self.name, Status.ERROR, message, [Finding("FWD002", Status.ERROR, message)]).to_dict()
        if raised is not None:
            return self._sharded_raises(context, raised, data).to_dict()

        logits, block_outputs = sharded
        reference_logits, reference_blocks = reference
        scale = logit_scale(reference_logits)
        bar = _bar(session, scale)
        change = float(position_change(logits, reference_logits).max())
        metrics: dict = {"max_change": change, "bar": bar, "logit_scale": scale, "rank_max_change": max(disagreement)}
        data["rank_changes"] = disagreement
        data["layers"] = _layer_changes(block_outputs, reference_blocks, session)
        findings = _logits_differ(model, change, bar, data["layers"])
        findings += _split_sequence_differs(context, split, reference_logits, bar, metrics, data)
        findings += _ranks_apart(disagreement, bar)
        return self._summarise(context, findings, change, bar, metrics, data).to_dict()

    def _sharded_raises(self, context, raised: ModelRaised, data: dict) -> CheckResult:
        """FWD983: the sharded model raises where the unsharded one runs, which is the sharding's doing."""
        where = raised.where or ""
        finding = Finding(
            self.ends_distributed_runs,
            Status.FAIL,
            f"the sharded model raises where the unsharded "
            f"one runs: {first_line(raised)} ({context.parallelized_by} over "
            f"{context.world} ranks)",
            where=where or None,
            source=code_location(raised.frame[0], raised.frame[1]) if raised.frame else None,
        )
        summary = f"the sharded model raises where the unsharded one runs: {first_line(raised)}"
        return CheckResult.from_findings(self.name, [finding], summary, metrics={}, data=data)

    def _summarise(
        self, context, findings: list[Finding], change: float, bar: float, metrics: dict, data: dict
    ) -> CheckResult:
        """The codes that failed, or how far the ranks are from the unsharded logits and how the parameters lie."""
        if findings:
            summary = "; ".join(self.codes[f.code] for f in findings)
        else:
            summary = (
                f"{context.world} ranks ({context.parallelized_by}) give the unsharded logits: max change "
                f"{change:.2g} vs bar {bar:.2g}; {data['placements']['summary']}"
            )
            if "context_parallel" in data:
                summary += f"; context parallelism: {data['context_parallel']}"
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)


def _logits_differ(model, change: float, bar: float, layers: list[dict]) -> list[Finding]:
    """FWD981: the sharded model's logits beyond the bar, saying at which block the outputs first part."""
    if not change > bar:
        return []
    first = next((row for row in layers if row["change"] > row["bar"]), None)
    at = (
        f"first parts at {model.layer_stack}.{first['block']} (output changed by {first['change']:.3g})"
        if first
        else "no block output parts beyond its bar: the head or the final norm"
    )
    return [
        Finding(
            "FWD981",
            Status.FAIL,
            f"the sharded model's logits differ from the unsharded model's by {change:.3g} (bar {bar:.3g}); {at}",
            where=f"{model.layer_stack}.{first['block']}" if first else None,
            module=f"{model.layer_stack}.{first['block']}" if first else None,
        )
    ]


def _split_sequence_differs(
    context, split: torch.Tensor | str | None, reference: torch.Tensor, bar: float, metrics: dict, data: dict
) -> list[Finding]:
    """FWD984: with the sequence split across the ranks (context parallelism), logits beyond the bar; split is
    those logits, why they could not be computed, or None when context parallelism was not asked for."""
    if isinstance(split, str):
        data["context_parallel"] = f"not run: {split}"
        return []
    if split is None:
        return []
    split_change = float(position_change(split, reference).max())
    metrics["context_parallel_max_change"] = split_change
    data["context_parallel"] = f"the sequence split across {context.world} ranks: max change {split_change:.3g}"
    if split_change <= bar:
        return []
    return [
        Finding(
            "FWD984",
            Status.FAIL,
            f"with the sequence split across {context.world} ranks "
            f"(context_parallel) the logits differ from the whole sequence's by "
            f"{split_change:.3g} (bar {bar:.3g}): the attention of a rank's chunk is "
            "masked or positioned as if it were the whole sequence",
        )
    ]


def _ranks_apart(disagreement: list[float], bar: float) -> list[Finding]:
    """FWD982: ranks whose logits differ from rank 0's beyond the bar, where they should be replicated."""
    apart = [rank for rank, c in enumerate(disagreement) if not c <= bar]
    if not apart:
        return []
    who = f"rank {apart[0]} returns" if len(apart) == 1 else f"ranks {', '.join(map(str, apart))} return"
    return [
        Finding(
            "FWD982",
            Status.FAIL,
            f"{who} other logits than rank 0 (by up to "
            f"{max(disagreement):.3g}, bar {bar:.3g}): an output that should be replicated is "
            "partial or sharded (a reduction or a gather missing)",
            where=", ".join(f"rank {rank}" for rank in apart),
        )
    ]


def _bar(session, scale: float) -> float:
    """The same arithmetic in another order: Hugging Face's eager-vs-SDPA bar, never below the session's."""
    rtol, atol = TOLERANCES[session.dtype].backends
    return max(atol + rtol * scale, session.threshold(scale, 0.0))


def _blocks(module: nn.Module, stack: str | None) -> list[nn.Module]:
    if not stack:
        return []
    blocks = module.get_submodule(stack)  # a ModuleList, or a ModuleDict keyed by layer number
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(cast(Iterable[nn.Module], blocks))


def _hooked(blocks: list[nn.Module], run: Callable[[], torch.Tensor]):
    """run()'s logits, and each block's hidden-state output (gathered when it is a DTensor: on every rank alike)."""
    outputs: list[torch.Tensor | None] = [None] * len(blocks)

    def keep(i):
        def hook(module, args, output):
            hidden = first_tensor(output)
            if hidden is not None and outputs[i] is None:
                outputs[i] = full(hidden).detach().float().clone()

        return hook

    handles = [block.register_forward_hook(keep(i)) for i, block in enumerate(blocks)]
    try:
        return run(), outputs
    finally:
        for handle in handles:
            handle.remove()


def _layer_changes(sharded: list, reference: list, session) -> list[dict]:
    """Per block, the largest change of its output from the unsharded block's, against the bar at its scale."""
    rows = []
    for i, (got, expected) in enumerate(zip(sharded, reference, strict=False)):
        if got is None or expected is None or got.shape != expected.shape:
            rows.append(
                {
                    "block": i,
                    "change": float("inf") if got is not None else 0.0,
                    "bar": 0.0,
                    "note": "no output"
                    if got is None or expected is None
                    else f"shape {list(got.shape)} vs {list(expected.shape)}",
                }
            )
            continue
        scale = float(expected.abs().max())
        change = float((got - expected).abs().max())
        rows.append({"block": i, "change": change if change == change else float("inf"), "bar": _bar(session, scale)})
    return rows


def _unsharded_view(model, module: nn.Module):
    """The ModelUnderTest of the unsharded module: the model's own forward adapter, not the ranks' broadcast."""
    return dataclasses.replace(model, module=module, forward_adapter=getattr(model.forward_adapter, "adapter", None))


def placements(layouts: list[ParameterLayout], mesh_dims: tuple[str, ...]) -> dict:
    """How the parameters are laid out across the ranks (as sharding left them: FSDP2 keeps the root's parameters
    gathered after a forward), counted by placement per dimension of the run's mesh (`mesh_dims`)."""
    rows: list[dict] = []
    counts: Counter[str] = Counter()
    for parameter in layouts:
        shown = placement_words(parameter, mesh_dims)
        counts[shown] += 1
        if len(rows) < PLACEMENTS_SHOWN:
            rows.append(
                {"name": parameter.name, "placement": shown, "shape": parameter.shape, "local": parameter.local}
            )
    summary = ", ".join(f"{n} {placement}" for placement, n in counts.most_common())
    return {
        "summary": f"parameters: {summary}",
        "counts": dict(counts),
        "shown": rows,
        "more": max(0, sum(counts.values()) - len(rows)),
    }


def placement_words(parameter: ParameterLayout, mesh_dims: tuple[str, ...]) -> str:
    """A parameter's placement in words, per mesh dimension: "S(0)" over the 1-D mesh of every rank, "dp_shard S(0) ·
    tp S(1)" over a mesh of named dimensions, "not sharded" for a plain tensor. A parameter sharded over a part of
    the run's mesh (tensor parallel over mesh["tp"]) is replicated over the rest, and says so ("dp_shard R ·
    tp S(0)"); one on a mesh of its own (transformers builds one) is named by that mesh's dimensions."""
    if parameter.placements is None:
        return "not sharded"
    if len(parameter.mesh) <= 1 and tuple(mesh_dims) == ("ranks",):  # one dimension, over every rank
        return ", ".join(parameter.placements)
    by_dimension = dict(zip(parameter.mesh, parameter.placements, strict=True))
    order = mesh_dims if set(parameter.mesh) <= set(mesh_dims) else parameter.mesh
    return " · ".join(f"{dim} {by_dimension.get(dim, 'R')}" for dim in order)
