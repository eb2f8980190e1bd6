"""The model sharded on a rank of a distributed run: the rank's device, the device mesh, the config's parallelize
function or a Hugging Face model's own tensor-parallel plan, the forward that gives every rank rank 0's logits
(RankZeroLogits), and what the sharding check reads of the rank it runs on (RankContext, each parameter's layout).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from fwdcheck.config.callables import on_sys_path, resolve_callable, search_dirs
from fwdcheck.config.schema import Config, Distributed
from fwdcheck.errors import ModelLoadError, ModelRaised, Own, UsageError, first_line, model_failure
from fwdcheck.model.calling import call_forward
from fwdcheck.model.tested import ModelUnderTest, describe, extract_logits
from fwdcheck.run.limits import CheckTimeout
from fwdcheck.run.runner import Run
from fwdcheck.run.settings import DTYPES


@dataclass
class RankContext:
    """What the sharding check needs to know of the rank it runs on."""

    rank: int
    world: int
    device: torch.device
    parallelized_by: str  # how the model was sharded, in words
    unsharded: Callable[[], nn.Module]  # the same model built again, not sharded: rank 0's reference
    logits: RankZeroLogits
    mesh: Any  # the device mesh of every rank, its dimensions named (torch.distributed.device_mesh.DeviceMesh)
    context_parallel: bool  # the config asks for the sequence to be split across ranks too
    parameters: list[ParameterLayout]  # as sharding left them, before a forward (FSDP2 keeps the root's gathered)


@dataclass
class ParameterLayout:
    """How one parameter lies across the ranks: its DTensor placements over its mesh's named dimensions, or None
    for a plain tensor (every rank holds it whole)."""

    name: str
    placements: tuple[str, ...] | None  # str(Shard(0)) = "S(0)", one per dimension of `mesh`
    mesh: tuple[str, ...]  # the dimension names of the mesh the parameter lies on
    shape: list[int]
    local: list[int]  # this rank's share


def layout(module: nn.Module) -> list[ParameterLayout]:
    """Each parameter's layout as it is now."""
    rows = []
    for name, parameter in module.named_parameters():
        placements = getattr(parameter, "placements", None)
        if placements is None:
            rows.append(ParameterLayout(name, None, (), list(parameter.shape), list(parameter.shape)))
            continue
        mesh = tuple(parameter.device_mesh.mesh_dim_names or ())  # type: ignore[attr-defined]  # a DTensor
        local = list(parameter.to_local().shape)  # type: ignore[attr-defined]
        rows.append(ParameterLayout(name, tuple(str(p) for p in placements), mesh, list(parameter.shape), local))
    return rows


_CONTEXT: RankContext | None = None


def rank_context() -> RankContext | None:
    """The rank this process is, within a distributed run; None outside one."""
    return _CONTEXT


class RankStopped(BaseException):
    """A rank ends the launch: the model raised on it and not on every rank, so that the others may be waiting in a
    collective it will not join. A BaseException of fwdcheck's, which no check takes for the model's failure.
    `check` is the check it stopped in, `code` the finding that stopped it."""

    def __init__(self, message: str, check: str | None = None, code: str = Own.MODEL_RAISED, at: float | None = None):
        super().__init__(message)
        self.check, self.code = check, code
        self.at = at if at is not None else time.time()  # when the trouble began: the model's raise, or now


def rank_device(requested: str, local_rank: int) -> torch.device:
    """CUDA gives each rank a GPU of its own (cuda:LOCAL_RANK); on the CPU all ranks share it."""
    if requested.startswith("cuda") or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError(f"device '{requested}' requested but torch {torch.__version__} sees no CUDA device")
        if local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"distributed.nproc: {local_rank + 1} or more ranks need as many GPUs (one each); this "
                f"machine has {torch.cuda.device_count()}"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def sharded(run: Run, device: torch.device, rank: int, world: int) -> ModelUnderTest:
    """The model built on this rank and sharded as the config says, with a forward that returns rank 0's logits;
    the rank's context set for the sharding check."""
    global _CONTEXT
    spec: Distributed = run.config.distributed
    dtype = DTYPES[run.settings.dtype]

    @functools.cache  # the sharding check's comparison and its context-parallel split share one copy
    def build() -> nn.Module:  # the unsharded reference, from the same seed
        return run.load().module.to(device=device, dtype=dtype).eval()

    # The gathers of fwdcheck's own (full()) of a tensor sharded over two mesh dimensions each draw torch's advice on
    # their speed, a line per rank on stderr: about fwdcheck's comparison, not the model.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model = run.load()
    model.module.to(device=device, dtype=dtype)
    mesh = _mesh(device, world, spec)
    module, how = shard(model, cast(Config, run.config), mesh, world)
    logits = RankZeroLogits(model.forward_adapter, rank, world)
    module.register_forward_hook(logits.share_output)  # the calls checks make themselves: rank 0's output too
    takes = (
        model.forward_kwargs
        if model.forward_kwargs is not None
        else (set() if model.forward_adapter is not None else _parameters(module))
    )
    _CONTEXT = RankContext(rank, world, device, how, build, logits, mesh, spec.context_parallel, layout(module))
    # Tensor parallelism gives each rank its share of the heads: the head counts a model's config declares are the
    # whole model's, and the ledger reads each rank's off its attention calls instead.
    dims = {name: size for name, size in model.dims.items() if name not in ("h", "h_kv")}
    notes = [
        *model.extra.get("notes", []),
        "distributed: head counts (h, h_kv) are each rank's, read off its attention calls",
    ]
    return dataclasses.replace(
        model,
        module=module,
        forward_adapter=logits,
        forward_kwargs=takes,
        dims=dims,
        extra={**model.extra, "notes": notes},
        label=f"{model.label} [{how}, {world} ranks{f': {mesh_words(spec.mesh)}' if spec.mesh else ''}]",
    )


def _mesh(device: torch.device, world: int, spec: Distributed):
    """The device mesh of every rank: the config's named dimensions (`distributed.mesh`), or one named "ranks"."""
    from torch.distributed.device_mesh import init_device_mesh

    dimensions = spec.mesh or {"ranks": world}
    if math.prod(dimensions.values()) != world:  # a launch of another size than the config's (--nproc)
        raise UsageError(
            f"distributed.mesh {mesh_words(dimensions)} makes {math.prod(dimensions.values())} ranks, "
            f"not the {world} this run has"
        )
    return init_device_mesh(device.type, tuple(dimensions.values()), mesh_dim_names=tuple(dimensions))


def mesh_words(dimensions: dict[str, int]) -> str:
    """{dp_shard: 2, tp: 2} as "dp_shard 2 x tp 2"."""
    return " x ".join(f"{name} {size}" for name, size in dimensions.items())


def parallelize_function(config: Config) -> Callable:
    """The config's parallelize function, imported as the model's factory is: the model's code paths on sys.path,
    then the config's folder."""
    assert config.distributed.parallelize is not None  # asked only of a config that names one
    code = getattr(config.model, "path", None) or getattr(config.model, "python_path", None) or []
    with on_sys_path(search_dirs(list(code), config.source_path)):
        return resolve_callable(config.distributed.parallelize, what="parallelize function")


def shard(model: ModelUnderTest, config: Config, mesh, world: int) -> tuple[nn.Module, str]:
    """The module sharded over `mesh`, and how, in words: the config's parallelize function, or a Hugging Face
    model's own tensor-parallel plan. A parallelize function may shard in place and return nothing."""
    spec = config.distributed
    if spec.parallelize:
        function = parallelize_function(config)
        try:
            returned = function(model.module, mesh)
        except BaseException as exc:
            if not model_failure(exc):
                raise
            raise ModelLoadError(
                f"parallelize function '{spec.parallelize}' raised {type(exc).__name__}: {first_line(exc)}"
            ) from exc
        module = model.module if returned is None else returned
        if not isinstance(module, nn.Module):
            raise ModelLoadError(
                f"parallelize function '{spec.parallelize}' returned {type(returned).__name__}, "
                "not the model (an nn.Module) or None"
            )
        return module, spec.parallelize
    if model.tensor_parallel is not None:  # a plan of the model's own (transformers' tp_plan)
        return model.tensor_parallel(model.module, dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)))
    raise UsageError(
        f"distributed.parallelize is needed for {model.label}: it has no tensor-parallel plan of its "
        "own; name a function (model, device_mesh) -> model that shards it"
    )


def _parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


# How long a rank whose model raised waits for the others to say whether theirs raised too: every rank raising at the
# same step (a shape that does not fit the shards) answers at once; a rank raising alone hears nothing and ends.
AGREEMENT_S = 5.0


class RankZeroLogits:
    """The forward of a sharded model as the checks see it: the model's own forward (or the config's adapter) on this
    rank, then rank 0's logits on every rank. Each rank's own logits of the last forward are kept (`own`): the
    sharding check compares them across ranks.

    A forward that raises is the model's error, as on one process, when it raised on every rank: the ranks are still
    in step, and the checks go on. Raised on some ranks only, the others may be waiting in a collective of the forward
    that will never complete: the rank ends the launch (RankStopped). The ranks tell each other over a process group
    of their own, which a collective left pending on the default group does not block."""

    def __init__(self, adapter: Callable | None, rank: int, world: int):
        self.adapter, self.rank, self.world = adapter, rank, world
        self.own: torch.Tensor | None = None
        self.raised_at: float | None = None  # when the last forward that raised did
        self.agreed_raises = 0  # forwards that raised on every rank at once, since take_agreed_raises()
        self.agreement = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREEMENT_S))
        self.forwarding = False

    def share_output(self, module: nn.Module, args, output):
        """A forward hook on the sharded model's root: what a call that does not come through the forward above
        returns (the kv-cache, packing and label-shift checks call the module with arguments of their own), with
        rank 0's tensors in place of each rank's own: its logits and loss, gathered whole where they are DTensors.
        Every rank then judges rank 0's output and takes the same way through the check, calling the model as often
        as the others: a check that decides on its own rank's output (a sharded model whose ranks disagree, FWD982)
        would send one rank into a forward the others never join, and the run would hang there. The rest of the
        output (a cache of this rank's heads) stays the rank's. A call with gradients keeps its own output: the
        check differentiates it."""
        if self.forwarding or torch.is_grad_enabled():
            return None
        fields = _output_tensors(output)
        shapes: list = [None] * self.world
        dist.all_gather_object(shapes, [(name, tuple(t.shape), str(t.dtype)) for name, t in fields.items()])
        if any(shape != shapes[0] for shape in shapes):  # every rank knows it: every rank raises here, in step
            raise ModelRaised(
                "the ranks return outputs of different shapes: "
                + ", ".join(f"rank {r} {s}" for r, s in enumerate(shapes))
            )
        shared = {}
        for name, tensor in fields.items():
            shared[name] = full(tensor).detach().clone()  # a copy: the broadcast writes into it
            dist.broadcast(shared[name], src=0)
        return _with_tensors(output, shared)

    def __call__(self, module: nn.Module, input_ids: torch.Tensor, **_kwargs) -> torch.Tensor:
        # A logits adapter (fwdcheck/model/calling.py): `**_kwargs` says it returns the logits alone, so a check's
        # call with extras of its own (labels, document ids) goes to the module, whose output share_output shares.
        self.forwarding = True  # the module's own output, for the broadcast below: share_output leaves it alone
        try:
            output = call_forward(module, self.adapter, input_ids, **_kwargs)  # the one call convention
        except BaseException as exc:
            if not model_failure(exc):
                raise
            self.raised_at = time.time()  # before the agreement's wait: when this rank's trouble began
            try:
                everywhere = self._raised_everywhere()
            except CheckTimeout:  # the check's time ran out while the others were asked: this rank's model raised
                everywhere = False
            if not everywhere:
                raise RankStopped(
                    f"the model raised {first_line(describe(exc))} on this rank alone", at=self.raised_at
                ) from exc
            self.agreed_raises += 1
            raise
        finally:
            self.forwarding = False
        graph = full(extract_logits(output, keep_graph=True))  # its autograd graph, when run with gradients
        logits = graph.detach()
        shapes: list = [None] * self.world
        dist.all_gather_object(shapes, tuple(logits.shape))
        if len(set(shapes)) > 1:  # every rank knows it: every rank raises here, and they stay in step
            raise ModelRaised(
                "the ranks return logits of different shapes: "
                + ", ".join(f"rank {r} {list(s)}" for r, s in enumerate(shapes))
            )
        self.own = logits
        shared = logits.float().clone()  # a copy: the broadcast writes into it, and `own` stays this rank's
        dist.broadcast(shared, src=0)
        if graph.requires_grad:
            # A forward with gradients (grad-causality, grad-reach): rank 0's values, as every forward gives, with
            # this rank's own graph behind them, so that a backward runs through this rank's shards and the
            # collectives of the sharded forward, on every rank alike.
            return graph.float() + (shared - graph.float()).detach()
        return shared

    def take_agreed_raises(self) -> int:
        """How many forwards raised on every rank at once since the last call."""
        taken, self.agreed_raises = self.agreed_raises, 0
        return taken

    def _raised_everywhere(self) -> bool:
        """Whether every rank's forward raised at this step (each that did asks the others)."""
        raised: list = [None] * self.world
        try:
            dist.all_gather_object(raised, True, group=self.agreement)
        except RuntimeError:  # some rank did not answer in time: it is still in the forward
            return False
        return all(raised)


def _output_tensors(output) -> dict[str, torch.Tensor]:
    """The tensors of a forward's output that every rank holds alike when the sharding is right: the output itself
    (a tensor), its logits and loss (an object or mapping, as transformers' outputs), or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return {"output": output}
    if isinstance(output, (tuple, list)):
        return {"0": output[0]} if output and isinstance(output[0], torch.Tensor) else {}
    fields = {}
    for name in ("logits", "loss"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            fields[name] = value
    return fields


def _with_tensors(output, shared: dict[str, torch.Tensor]):
    """The output with the tensors _output_tensors found replaced by `shared`."""
    if isinstance(output, torch.Tensor):
        return shared["output"]
    if isinstance(output, (tuple, list)):
        if not shared:
            return output
        items = [shared["0"], *output[1:]]
        if isinstance(output, list):
            return items
        return type(output)(*items) if hasattr(output, "_fields") else tuple(items)  # a named tuple, or a plain one
    for name, tensor in shared.items():
        if isinstance(output, dict):
            output[name] = tensor  # transformers' ModelOutput sets the attribute too
        else:
            setattr(output, name, tensor)
    return output


def full(tensor):
    """A DTensor gathered into the whole tensor (a collective: every rank calls it); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
