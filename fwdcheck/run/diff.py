"""`fwdcheck diff A B`: two implementations of one model, module by module.

Both configs' models are built as `fwdcheck run` builds them (runner.Run), B is given A's weights, and both run the
same token ids (drawn from A's seed, at A's batch size and length, in A's dtype on A's device) with a forward hook on
every module (fwdcheck/observe/activations.py). Corresponding outputs are compared in A's order of execution, and the
first pair that parts beyond the tolerance is where the implementations stop computing the same thing.

Weights. Each of A's parameters, renamed by the rules (fwdcheck/config/rename.py: B's config's `diff: {rename: [...]}`,
then
`--rename`), must name one of B's, and each of B's must be named: anything else is a usage error listing the names,
as a partial transfer would compare a half-random model. A 2-D weight whose shape is its counterpart's transposed is
transposed (transformers' GPT-2 Conv1D holds [in, out] where nn.Linear holds [out, in]); a square one is transposed
when the other weights of the same pair of module classes were, since its shape cannot tell. Buffers are never
transferred: each model computes its own (a causal mask, a rotary cache), and copying A's would hide a wrong one in B.

Both models run in one worker process (fwdcheck/process/supervisor.py, as `fwdcheck run`'s model does), each step after
the loads under A's timeout_s: a model that exits, crashes or hangs, or a rename rule that backtracks without end
(Python's regular expressions have no time limit of their own), is one error line, exit 1.

Pairing. A module is paired with B's module of its renamed name (and call: `name#2` with `name#2`). Between two
such pairs, the outputs left over are paired in order of execution when both models have as many of one shape there
(an activation module named `act` in one and `gelu` in the other); what is still left is listed as not paired. The
logits are always a pair.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn

from fwdcheck.config.rename import Rule, renamed
from fwdcheck.config.schema import Config
from fwdcheck.errors import UsageError, about_config
from fwdcheck.observe.activations import LOGITS, recorded_forward
from fwdcheck.run.compare import nonfinite_positions
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.plan import resolve
from fwdcheck.run.runner import Run
from fwdcheck.run.session import Session
from fwdcheck.run.tolerances import TOLERANCES

SHOWN = 4  # names an error or a note lists before "and N more"


@dataclass
class Pair:
    """Two corresponding outputs and how far apart they are: the largest |a - b| over the elements (inf where one
    is NaN or Inf and the other is not, or where the shapes differ by more than axes of size 1), against
    atol + rtol x A's largest |value|."""

    a: str
    b: str
    shape: list[int]
    shape_b: list[int]
    max_diff: float
    tolerance: float
    by_name: bool  # paired by name (after renaming); False: by order among outputs of its shape
    # which side holds values no comparison can vouch for ("A", "B", "A and B"): NaN anywhere; in the logits a
    # position with NaN, +inf or nothing but -inf (-inf beside finite entries is a masked vocabulary)
    nonfinite: str = ""

    @property
    def parts(self) -> bool:
        return not self.max_diff <= self.tolerance

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "shape": self.shape,
            "shape_b": self.shape_b,
            "max_diff": self.max_diff if math.isfinite(self.max_diff) else None,
            "tolerance": self.tolerance,
            "by_name": self.by_name,
            "parts": self.parts,
            "nonfinite": self.nonfinite,
        }


@dataclass
class Diff:
    a: str  # the models' labels
    b: str
    dtype: str
    rtol: float
    atol: float
    pairs: list[Pair]
    unpaired_a: list[str] = field(default_factory=list)
    unpaired_b: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def first(self) -> Pair | None:
        """The first pair, in A's order of execution, that parts. A pair made by order alone counts only when the
        next pair made by name parts too: two outputs of one shape between the same neighbours need not be the same
        computation (an activation module in A where B has a dropout module and a functional GELU), and when what
        follows agrees, the models did not part there."""
        for k, p in enumerate(self.pairs):
            if p.parts and (p.by_name or self._confirmed(k)):
                return p
        return None

    @property
    def mispaired(self) -> list[Pair]:
        """Pairs made by order that part while the next pair made by name agrees: not the same computation."""
        return [p for k, p in enumerate(self.pairs) if p.parts and not p.by_name and not self._confirmed(k)]

    def _confirmed(self, k: int) -> bool:
        following = next((q for q in self.pairs[k + 1 :] if q.by_name), None)
        return following is None or following.parts

    @property
    def first_difference(self) -> Pair | None:
        """The first pair that differs at all. A small systematic difference (another GELU approximation) can stay
        within the tolerance where it arises, scaled as it is by the output's largest value, and part only a module
        or two later: this one is where to look then."""
        return next((p for p in self.pairs if p.max_diff > 0), None)

    @property
    def exit_code(self) -> int:
        return 1 if self.first is not None else 0

    def to_dict(self) -> dict:
        first = self.first
        return {
            "a": self.a,
            "b": self.b,
            "dtype": self.dtype,
            "tolerance": {"rtol": self.rtol, "atol": self.atol},
            "equal": first is None,
            "exit_code": self.exit_code,
            "first_parting": first.to_dict() if first is not None else None,
            "first_difference": self.first_difference.to_dict() if self.first_difference is not None else None,
            "pairs": [p.to_dict() for p in self.pairs],
            "unpaired_a": self.unpaired_a,
            "unpaired_b": self.unpaired_b,
            "notes": self.notes,
        }


# What a comparison does once both models are built, in order: each step is told (`progress`) as it begins, so that
# the supervisor limits each one to timeout_s (the loads get the load's own limit).
STEPS = ("weights", "forward A", "forward B", "pairing")


def compare_files(
    path_a: str, path_b: str, rename: list[str], progress: Callable[[str], None] = lambda step: None
) -> dict:
    """The comparison a `fwdcheck diff` job asks for (in the worker process): A's config, B's, B's config's rename
    rules then the command line's (validated by the command already)."""
    from fwdcheck.config.rename import parse_rule
    from fwdcheck.config.schema import load_config

    config_a, config_b = load_config(path_a), load_config(path_b)
    rules = [parse_rule(text) for text in [*config_b.diff.rename, *rename]]
    return diff_configs(config_a, config_b, rules, progress).to_dict()


def diff_configs(
    config_a: Config, config_b: Config, rules: list[Rule], progress: Callable[[str], None] = lambda step: None
) -> Diff:
    """Build both models, give B A's weights, run both on A's inputs and compare them module by module."""
    path_a, path_b = config_a.source_path, config_b.source_path
    for config, path in ((config_a, path_a), (config_b, path_b)):
        if config.meta:
            raise UsageError(f"{path}: meta: true builds no weights; fwdcheck diff compares values")
    run_a = Run.build(resolve(config_a, Overrides(checks=[])))
    run_b = Run.build(resolve(config_b, Overrides(checks=[], device=config_a.device, dtype=config_a.dtype)))
    with about_config(path_a):
        model_a = run_a.load()
    with about_config(path_b):
        model_b = run_b.load()
    notes = (
        [
            f"B runs as A does: {config_a.device} {config_a.dtype}, B={config_a.inputs.batch_size} "
            f"T={config_a.inputs.seq_len} seed={config_a.inputs.seed}"
        ]
        if (config_b.device, config_b.dtype) != (config_a.device, config_a.dtype)
        else []
    )
    progress("weights")
    notes += transfer(model_a.module, model_b.module, rules, path_b)
    # both in the config's dtype, float32 unless named: two models compared must run in one dtype
    session_a = Session(model_a, replace(run_a.settings, dtype_declared=True))
    with about_config(path_b):  # B runs A's inputs: they must fit it
        settings_b = replace(run_b.settings.with_config(inputs=run_a.settings.inputs), dtype_declared=True)
        session_b = Session(model_b, settings_b)
    with session_a.active(), session_b.active():
        progress("forward A")
        outputs_a = recorded_forward(model_a, session_a.inputs)
        progress("forward B")
        outputs_b = recorded_forward(model_b, session_a.inputs.to(session_b.device))
        progress("pairing")
        rtol, atol = TOLERANCES[session_a.dtype].golden
        pairs, unpaired_a, unpaired_b = pair(outputs_a, outputs_b, rules, rtol, atol)
    diff = Diff(
        model_a.label,
        model_b.label,
        config_a.dtype,
        rtol,
        atol,
        pairs,
        unpaired_a,
        unpaired_b,
        notes + session_a.notes + session_b.notes,
    )
    for p in diff.mispaired:
        diff.notes.append(
            f"{p.a} and {p.b}, paired by order, differ by {p.max_diff:.2g}, but the next outputs paired "
            "by name agree: not the same computation, and not counted (rename one to pair them)"
        )
    return diff


# -- weights ----------------------------------------------------------------------------------------------------------


def transfer(a: nn.Module, b: nn.Module, rules: list[Rule], path_b: Path | None) -> list[str]:
    """Copy A's parameters into B's, renamed and transposed where needed; notes on what was transposed and on the
    buffers each keeps. A UsageError (exit 2) when the names do not match one to one or a shape fits no rule."""
    params_a = dict(a.named_parameters(remove_duplicate=False))  # tied weights under each of their names
    params_b = dict(b.named_parameters(remove_duplicate=False))
    source = _counterparts(params_a, params_b, rules, path_b)  # B's name -> A's
    modules_a, modules_b = dict(a.named_modules()), dict(b.named_modules())

    def classes(name_b: str) -> tuple[str, str]:
        owner_a, owner_b = source[name_b].rpartition(".")[0], name_b.rpartition(".")[0]
        return type(modules_a[owner_a]).__name__, type(modules_b[owner_b]).__name__

    values, transposed = _laid_out(params_a, params_b, source, classes)
    _refuse_broken_ties(params_b, values, source)
    with torch.no_grad():
        for name_b, param_b in params_b.items():
            param_b.copy_(values[name_b])
    notes = []
    if transposed:
        pairs = sorted({f"{ca} -> {cb}" for ca, cb in map(classes, transposed)})
        notes.append(
            f"{len(transposed)} weights transposed ({', '.join(pairs)}: one holds [in, out] where the other "
            f"holds [out, in]; square ones as the others of their modules' classes): {_listed(transposed)}"
        )
    buffers_a, buffers_b = [n for n, _ in a.named_buffers()], [n for n, _ in b.named_buffers()]
    if buffers_a or buffers_b:
        notes.append(
            "buffers are each model's own, not transferred (a causal mask, a rotary cache: copying A's "
            f"would hide a wrong one in B): A {_listed(buffers_a) or 'none'}; "
            f"B {_listed(buffers_b) or 'none'}"
        )
    return notes


def _counterparts(
    params_a: dict[str, nn.Parameter], params_b: dict[str, nn.Parameter], rules: list[Rule], path_b: Path | None
) -> dict[str, str]:
    """B's name -> A's, for every parameter, A's renamed by the rules; a UsageError when they do not match one to
    one."""
    source: dict[str, str] = {}
    for name in params_a:
        target = renamed(name, rules)
        if target in source:
            raise UsageError(
                f"the rename rules map two of A's parameters to one of B's: {source[target]} and "
                f"{name} both become {target}"
            )
        source[target] = name
    missing = [
        f"{name} (as {target})" if name != target else name for target, name in source.items() if target not in params_b
    ]
    extra = [name for name in params_b if name not in source]
    if missing or extra:
        said = "; ".join(
            part
            for part in (
                f"{len(missing)} of A's parameters have no counterpart in B: {_listed(missing)}" if missing else "",
                f"{len(extra)} of B's have none in A: {_listed(extra)}" if extra else "",
            )
            if part
        )
        raise UsageError(
            f"the two models' parameters do not match one to one after renaming: {said}; rename them "
            f"(`diff: {{rename: ['PATTERN -> REPLACEMENT']}}` in {path_b or 'the second config'}, or "
            "--rename)"
        )
    return source


def _laid_out(
    params_a: dict[str, nn.Parameter],
    params_b: dict[str, nn.Parameter],
    source: dict[str, str],
    classes: Callable[[str], tuple[str, str]],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A's value for each of B's parameters, transposed where B holds it [out, in] and A [in, out]; and the names of
    those transposed. A UsageError for a shape that is neither."""
    # What each pair of module classes does with its non-square 2-D weights decides its square ones.
    layouts: dict[tuple[str, str], set[bool]] = defaultdict(set)
    for name_b, param_b in params_b.items():
        shape_a, shape_b = tuple(params_a[source[name_b]].shape), tuple(param_b.shape)
        if len(shape_a) == 2 and shape_a[0] != shape_a[1] and shape_b in (shape_a, shape_a[::-1]):
            layouts[classes(name_b)].add(shape_b != shape_a)
    values: dict[str, torch.Tensor] = {}
    transposed: list[str] = []
    for name_b, param_b in params_b.items():
        value = params_a[source[name_b]].detach()
        square = value.dim() == 2 and value.shape[0] == value.shape[1]
        if (
            value.dim() == 2
            and tuple(param_b.shape) == tuple(value.shape)[::-1]
            and (not square or layouts.get(classes(name_b)) == {True})
        ):
            value = value.t()
            transposed.append(name_b)
        elif param_b.shape != value.shape:
            raise UsageError(
                f"A's {source[name_b]} {list(value.shape)} and B's {name_b} {list(param_b.shape)} differ "
                "in shape (not a transpose either): the two models are not the same architecture"
            )
        values[name_b] = value
    return values, transposed


def _refuse_broken_ties(
    params_b: dict[str, nn.Parameter], values: dict[str, torch.Tensor], source: dict[str, str]
) -> None:
    """B's tied weights (one tensor under several names) must get one value: A may tie them too, or hold equal
    values apart; different values would leave B with whichever was copied last."""
    tied: dict[int, list[str]] = defaultdict(list)
    for name, param in params_b.items():
        tied[id(param)].append(name)
    for names in tied.values():
        if any(not torch.equal(values[names[0]], values[other]) for other in names[1:]):
            raise UsageError(
                f"B ties {' and '.join(names)} (one tensor), but A's "
                f"{' and '.join(source[n] for n in names)} hold different values"
            )


def _listed(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


# -- pairing and comparing --------------------------------------------------------------------------------------------


def renamed_call(name: str, rules: list[Rule]) -> str:
    """A's call name as B's would be: the module's name renamed, the call number kept; the logits as they are."""
    if name == LOGITS:
        return name
    module, sep, call = name.partition("#")
    return renamed(module, rules) + sep + call


def pair(
    outputs_a: list[tuple[str, torch.Tensor]],
    outputs_b: list[tuple[str, torch.Tensor]],
    rules: list[Rule],
    rtol: float,
    atol: float,
) -> tuple[list[Pair], list[str], list[str]]:
    """The pairs in A's order of execution, and the names of A's and B's outputs left without a partner."""
    index_b = {name: j for j, (name, _) in enumerate(outputs_b)}
    matched: dict[int, int] = {}  # A's position -> B's, paired by name
    for i, (name, _) in enumerate(outputs_a):
        j = index_b.get(renamed_call(name, rules))
        if j is not None:
            matched[i] = j
    # The outputs between two name pairs, by the number of name pairs before them in each model's own order.
    anchors_a = sorted(matched)
    anchors_b = sorted(matched.values())
    gaps: dict[tuple[int, tuple], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for i, (_, tensor) in enumerate(outputs_a):
        if i not in matched:
            gaps[_before(anchors_a, i), tuple(tensor.shape)][0].append(i)
    paired_b = set(matched.values())
    for j, (_, tensor) in enumerate(outputs_b):
        if j not in paired_b:
            gaps[_before(anchors_b, j), tuple(tensor.shape)][1].append(j)
    by_order: dict[int, int] = {}
    for in_a, in_b in gaps.values():
        if len(in_a) == len(in_b):
            by_order.update(zip(in_a, in_b, strict=True))
    pairs = []
    for i, (name, tensor) in enumerate(outputs_a):
        j = matched.get(i, by_order.get(i))
        if j is not None:
            name_b, tensor_b = outputs_b[j]
            max_diff, tolerance, nonfinite = difference(tensor, tensor_b, rtol, atol, logits=name == LOGITS)
            shapes = list(tensor.shape), list(tensor_b.shape)
            pairs.append(Pair(name, name_b, *shapes, max_diff, tolerance, by_name=i in matched, nonfinite=nonfinite))
    unpaired_a = [name for i, (name, _) in enumerate(outputs_a) if i not in matched and i not in by_order]
    partnered = set(matched.values()) | set(by_order.values())
    unpaired_b = [name for j, (name, _) in enumerate(outputs_b) if j not in partnered]
    return pairs, unpaired_a, unpaired_b


def _before(anchors: list[int], position: int) -> int:
    """How many of the sorted anchor positions come before `position`."""
    return sum(1 for anchor in anchors if anchor < position)


def difference(
    a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float, logits: bool = False
) -> tuple[float, float, str]:
    """(largest |a - b|, the tolerance: atol + rtol x A's largest finite |value|, the sides holding what no
    comparison vouches for), in float64. Shapes that differ only by axes of size 1 ([1, T, d] positions against
    [T, d]) hold the same elements and are compared as such; others are an infinite difference.

    NaN is never equal to anything, NaN included: two models that both give NaN are not shown to compute the same
    thing, so a NaN on either side is an infinite difference. An Inf equal in both is equal (a float mask's -inf
    is an exact value). The logits follow future-token's rule (fwdcheck/run/compare.py): -inf where both sides hold
    -inf is a masked vocabulary entry, equal, and the finite entries are compared; a position holding NaN or +inf, or
    nothing but -inf, is a side no comparison vouches for, so the verdict "equal" is never given over logits that
    hold no numbers. -inf on one side only is a difference as large as they come."""
    a64, b64 = a.double(), b.double()
    finite = a64[a64.isfinite()]
    tolerance = atol + rtol * (float(finite.abs().max()) if finite.numel() else 0.0)
    unverifiable = _broken_logits if logits else (lambda t: bool(t.isnan().any()))
    sides = " and ".join(side for side, t in (("A", a64), ("B", b64)) if unverifiable(t))
    if a64.shape != b64.shape:
        if [s for s in a64.shape if s != 1] != [s for s in b64.shape if s != 1]:
            return math.inf, tolerance, sides
        b64 = b64.reshape(a64.shape)
    if sides:
        return math.inf, tolerance, sides
    if not a64.numel():
        return 0.0, tolerance, ""
    same = a64 == b64  # the same Inf in both is the same value
    change = torch.where(same, 0.0, (a64 - b64).abs().nan_to_num(nan=math.inf, posinf=math.inf))
    return float(change.max()), tolerance, ""


def _broken_logits(logits: torch.Tensor) -> bool:
    """Whether logits hold a position no comparison vouches for: NaN or +inf anywhere, or every entry -inf. -inf
    beside finite entries is a masked vocabulary (compare.nonfinite_positions), not a broken logit."""
    if not logits.numel():
        return False
    if logits.dim() == 0:
        return not bool(logits.isfinite())
    return bool(nonfinite_positions(logits.reshape(-1, 1, logits.shape[-1])))
