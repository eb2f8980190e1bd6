"""A transformers model sharded by its own plans (its tensor-parallel and FSDP plans), as
from_pretrained(distributed_config=...) shards one: the `tensor_parallel` capability the hf source hands a model
whose class has a plan, which the sharding layer calls on each rank."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fwdcheck.errors import ModelLoadError, UsageError, first_line

# The mesh dimensions a Hugging Face model's own plans shard over, by the names transformers' DistributedConfig gives
# them (dp_shard is its fsdp_size), in the order transformers builds its mesh: (dp_replicate, fsdp, tp).
HF_MESH = {"dp_replicate": "dp_replicate_size", "dp_shard": "fsdp_size", "tp": "tp_size"}


def tensor_parallel(module: nn.Module, mesh: dict[str, int]) -> tuple[nn.Module, str]:
    """A transformers model sharded by its own plans over the mesh's dimensions {name: size}, the way
    from_pretrained(distributed_config=DistributedConfig(...)) shards a loaded model: its tensor-parallel plan (its
    config's base_model_tp_plan and the class's _tp_plan) over `tp` (over every rank for the 1-D mesh "ranks"), its
    FSDP plan over `dp_shard`, replicas over `dp_replicate`."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        raise UsageError(
            "this transformers has no tensor-parallel plans (transformers.distributed); name a "
            "distributed.parallelize function"
        ) from None
    plan = getattr(module, "tp_plan", None) or {}
    if not plan:
        raise UsageError(
            f"{type(module).__name__} has no tensor-parallel plan; name a distributed.parallelize function"
        )
    sizes = _plan_sizes(mesh)
    cls: Any = type(module)  # a transformers PreTrainedModel class
    over = (
        " x ".join(f"{name} {size}" for name, size in mesh.items())
        if list(mesh) != ["ranks"]
        else f"{sizes['tp_size']} ranks"
    )
    try:
        config, _, meshes = cls.prepare_distribute_model(
            DistributedConfig(
                tp_size=sizes["tp_size"],
                fsdp_size=sizes.get("fsdp_size"),
                dp_replicate_size=sizes.get("dp_replicate_size"),
            )
        )
        sharded = cls.maybe_distribute_model(module, config, meshes)
    except Exception as exc:  # transformers' own limits (a plan naming a tied weight): the run cannot be made
        plans = "plans" if len(sizes) > 1 else "tensor-parallel plan"
        raise ModelLoadError(
            f"transformers could not apply {cls.__name__}'s {plans} over "
            f"{over}: {type(exc).__name__}: {first_line(exc)}; name a "
            "distributed.parallelize function instead"
        ) from exc
    how = f"its tensor-parallel plan ({len(plan)} rules)"
    if sizes.get("fsdp_size", 1) > 1:
        how += f" and its FSDP plan ({len(getattr(module, 'fsdp_plan', None) or {})} rules)"
    return sharded, how


def _plan_sizes(mesh: dict[str, int]) -> dict[str, int]:
    """DistributedConfig's sizes for the mesh, or a usage error naming `parallelize` for a mesh transformers cannot
    shard over as it stands."""
    if list(mesh) == ["ranks"]:  # the 1-D mesh of every rank: tensor parallel over all of them
        return {"tp_size": mesh["ranks"]}
    unknown = [name for name in mesh if name not in HF_MESH]
    if unknown or "tp" not in mesh:
        what = f"dimension '{unknown[0]}'" if unknown else "no dimension 'tp'"
        raise UsageError(
            f"distributed.mesh: {what}: a Hugging Face model's own plans shard over 'tp' (its tensor-parallel "
            f"plan), 'dp_shard' (its FSDP plan) and 'dp_replicate'; name a distributed.parallelize function for "
            "other meshes"
        )
    order = [name for name in HF_MESH if name in mesh]
    if list(mesh) != order:
        raise UsageError(
            f"distributed.mesh: list the dimensions as transformers lays its mesh out ({', '.join(order)}), so that "
            "the ranks' groups are the ones it builds"
        )
    return {HF_MESH[name]: size for name, size in mesh.items()}
