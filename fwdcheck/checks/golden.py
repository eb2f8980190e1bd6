"""golden: the numeric contract. One forward of the session's inputs with a forward hook on every module, and every
module's output, the logits and every parameter and buffer fingerprinted (fwdcheck/observe/activations.py). With
--expect-golden the fingerprints are compared with the golden file's, each within the tolerance the file was made
with, and the first module, in the order the outputs came, whose output moved is named, with how far it moved.

What it answers, that no causality check can: did this change alter what the model computes, and where. A refactor
that swaps norm and residual, drops a scale, changes an init or reorders heads keeps every shape and every mask.
Parameters are compared apart from outputs: moved parameters mean the init or the loading changed; outputs that moved
over unchanged parameters mean the computation did. A changed shape or dtype is the shape contract's difference, said
as such and not compared numerically.

The check runs only when named, or when the command line's --save-golden / --expect-golden adds it; its result's
`data["golden"]` is what --save-golden writes (fwdcheck/golden.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fwdcheck.checks.golden_file import VERSION
from fwdcheck.checks.golden_view import GoldenData
from fwdcheck.checks.golden_view import Moved as MovedShown
from fwdcheck.observe.activations import LOGITS, fingerprint, recorded_forward
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.tolerances import TOLERANCES

SHOWN = 3  # names a finding lists before "and N more"
KEPT = 20  # moved outputs and parameters kept in the result's data for the detail panel


class Golden(Check):
    name = "golden"
    description = "numeric contract: every module's output and parameter fingerprinted; --expect-golden compares"
    default = False  # runs when named, or when --save-golden / --expect-golden adds it
    applies_when = "runs asked for a golden file (--save-golden, --expect-golden, or checks: [golden])"
    order = 90  # after the other built-ins: its forward is its own, and shares nothing
    codes = {
        "FWD961": "against --expect-golden: a module's output moved beyond tolerance (the first, in the order the "
        "outputs came, is named)",
        "FWD962": "against --expect-golden: parameters or buffers moved beyond tolerance (the init or the loading "
        "changed)",
        "FWD963": "against --expect-golden: parameters were added or removed, or module outputs were added or removed "
        "while other outputs or the logits moved (with every paired output and the logits within tolerance, a module "
        "added or removed is a note: a structure-only refactor)",
        "FWD964": "against --expect-golden: NaN or Inf where the golden file has finite values",
        "FWD965": "against --expect-golden: an output's or a parameter's shape or dtype changed (a shape contract "
        "difference, not compared numerically)",
    }
    explain = """\
Records, at the config's seed (its seeded initialisation, or the checkpoint's weights) and on the run's inputs, a
fingerprint of every module's output (one forward, a forward hook on each module; a module called twice is recorded
per call: name, name#2), of the logits, and of every parameter and buffer: shape, dtype, mean, std, abs-max, four
values at fixed indices and a digest (four means of the elements under fixed +-1 patterns, which a change of values
anywhere moves, a permutation included). `fwdcheck run CONFIG --save-golden golden.json` writes them (KBs for an
8-layer model, one module a line, for review in a diff); `--expect-golden golden.json` compares.
How it compares: not bitwise. Each number of a fingerprint is a mean or an extreme of the elements, so rounding that
moves every element by at most the tolerance moves each number by at most the tolerance: atol + rtol x the tensor's
abs-max, float32 rtol 1e-4 and atol 1e-6 (bfloat16 8e-2 and 1e-3, float16 1e-2 and 1e-4; fwdcheck/run/tolerances.py says
why): loose enough for another CPU, thread count or torch patch release, tight enough for any change of what the
model computes. The tolerance is stored in the
file, and a later run judges by it. A golden file made at other inputs (seed, batch_size, seq_len) or in another
dtype is a usage error: the comparison would mean nothing.
What a failure says: FWD961 names the first module, in the order the outputs came, whose output moved, by how much
(the largest change of any number of its fingerprint) against its tolerance, and how many moved; FWD962 says
"parameters changed (init or loading)" and names the first; when no parameter moved, FWD961 says that only the
computation changed. FWD963 lists modules or parameters added or removed (a block gone, a norm added), FWD965 shapes
or dtypes changed (what --expect-ledger pins), FWD964 NaN or Inf that were not there. Modules added or removed while
every output both runs have and the logits stay within tolerance (F.gelu become an nn.GELU() module) are a refactor
of structure only: a note that passes ("new h.0.mlp.act; logits unchanged"). Parameters added or removed still fail:
a state dict saved before the change no longer loads after it. The summary always says whether the logits moved.
Why: a change that swaps norm and residual, drops the 1/sqrt(d) scale, changes the init std or reorders two heads
keeps every shape and passes every causality check; Hugging Face's tests pin slices of expected logits per model for
this reason. The first moved module is where to look: everything before it computes what it did.
How to fix: if the change was meant (a new init, a fix), save the golden file again and let review see its diff.
Otherwise read the named module's code: its inputs are unchanged (the modules before it did not move), so the
difference is in it. Dropout left alive in eval is recorded with the seed's dice (mask-audit names it)."""
    detail_view = "fwdcheck.checks.golden_view:golden"
    files = {
        "--save-golden": {
            "writes": "fwdcheck.checks.golden_file:golden_text",
            "help": "write the numeric contract (JSON: every module's output and parameter fingerprinted) here; runs "
            "the golden check.",
            "selects": True,
        },
        "--expect-golden": {
            "reads": "fwdcheck.checks.golden_file:read_golden",
            "fits": "fwdcheck.checks.golden_file:refuse_other_run",
            "help": "fail (FWD961-965) naming the first module whose output moved from this golden file; runs the "
            "golden check.",
            "selects": True,
            "beside": ".golden.json",  # the pytest plugin's: gpt.golden.json beside gpt.yaml
        },
    }
    # each rank's modules hold their shards
    one_process = "a golden file records the unsharded model, and the sharding check compares the sharded one with it"

    def key_number(self, result: CheckResult) -> str:
        m = result.metrics
        if "moved_by" in m:
            return f"{m['moved_by']:.3g} / {m['tolerance']:.2g}"
        return f"{m['outputs']} outputs" if "outputs" in m else ""

    def run(self, model, session) -> CheckResult:
        document = record(model, session)
        outputs, parameters = document["outputs"], document["parameters"]
        metrics: dict[str, Any] = {"outputs": len(outputs), "parameters": len(parameters)}
        expected = self.expected_in(session)
        if expected is None:
            return CheckResult(
                self.name,
                Status.PASS,
                f"fingerprinted {len(outputs)} module outputs and "
                f"{len(parameters)} parameters and buffers in one forward (--save-golden writes them)",
                metrics=metrics,
                data={"golden": document},
            )
        made = expected["run"]
        if (made.get("device"), made.get("torch")) != (document["run"]["device"], document["run"]["torch"]):
            session.notes.append(
                f"the golden file was made on {made.get('device') or '?'} with torch "
                f"{made.get('torch') or '?'}; this run is on {document['run']['device']} with torch "
                f"{document['run']['torch']}"
            )
        tolerance = expected["tolerance"]
        output_diff = compare(expected["outputs"], outputs, tolerance)
        parameter_diff = compare(expected["parameters"], parameters, tolerance)
        findings = judge(output_diff, parameter_diff, tolerance)
        logits_moved, logits_words = logits_said(expected["outputs"], outputs, tolerance)
        for finding in findings:
            finding.module = module_of_model_code(model.module, finding.module)
        data: GoldenData = {
            "golden": document,
            "comparison": {
                "tolerance": tolerance,
                "moved": [m.shown() for m in output_diff.moved[:KEPT]],
                "moved_outputs": len(output_diff.moved),
                "moved_parameters": len(parameter_diff.moved),
                "parameters_moved": [m.shown() for m in parameter_diff.moved[:KEPT]],
            },
        }
        first = output_diff.moved[0] if output_diff.moved else parameter_diff.moved[0] if parameter_diff.moved else None
        if first is not None:
            metrics.update(moved_by=first.by, tolerance=first.tolerance)
        closest = max(output_diff.ratio, parameter_diff.ratio)
        metrics.update(
            moved_outputs=len(output_diff.moved),
            moved_parameters=len(parameter_diff.moved),
            closest=closest,
            logits_moved=logits_moved,
        )
        summary = _summary(findings, output_diff, metrics, tolerance, closest, logits_words)
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)


def _summary(
    findings: list[Finding], output_diff: Comparison, metrics: dict, tolerance: dict, closest: float, logits_words: str
) -> str:
    """The result's one line: the first difference, the structure that changed alone, or how close everything came
    (metrics: the outputs and parameters counted)."""
    bad = [f for f in findings if f.status != Status.PASS]
    if bad:
        return f"{len(bad)} difference(s) from the golden file; first: {bad[0].message}; {logits_words}"
    if output_diff.added or output_diff.removed:
        return (
            f"structure only: {_listed('new', output_diff.added)}"
            f"{'; ' if output_diff.added and output_diff.removed else ''}{_listed('gone', output_diff.removed)}; "
            f"{logits_words}; every other module output and parameter within tolerance"
        )
    return (
        f"{metrics['outputs']} module outputs and {metrics['parameters']} parameters within tolerance of the "
        f"golden file (rtol {tolerance['rtol']:g}, atol {tolerance['atol']:g}); the closest came to "
        f"{closest:.2g} of its tolerance; {logits_words}"
    )


def record(model, session) -> dict:
    """The golden document of this run: the header, and the fingerprints of every module output (in the order they
    came), the logits, and every parameter and buffer (in the model's order)."""
    # Dropout that stays alive in eval draws from the global generator: seeded, its dice are the same on every run
    # (the session puts the generator back afterwards). mask-audit and future-token name that bug.
    torch.manual_seed(session.settings.inputs.seed)
    calls = recorded_forward(model, session.inputs)
    session.forward_tokens += session.inputs.numel()
    outputs = [{"name": name, **fingerprint(tensor)} for name, tensor in calls]
    module = model.module
    parameters = [
        {"name": name, **fingerprint(tensor)} for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    ]
    rtol, atol = TOLERANCES[session.dtype].golden
    inputs = session.settings.inputs
    return {
        "fwdcheck_golden": VERSION,
        "model": model.label,
        "run": {
            "seed": inputs.seed,
            "batch_size": inputs.batch_size,
            "seq_len": inputs.seq_len,
            "dtype": session.settings.dtype,
            "device": str(session.device),
            "torch": torch.__version__,
        },
        "tolerance": {"rtol": rtol, "atol": atol},
        "outputs": outputs,
        "parameters": parameters,
    }


@dataclass
class Moved:
    """A fingerprint that moved: by how much (the largest change of any of its numbers), against which tolerance,
    and which number moved that much."""

    name: str
    by: float
    tolerance: float
    what: str

    def shown(self) -> MovedShown:
        return {"name": self.name, "by": self.by, "tolerance": self.tolerance, "what": self.what}

    def said(self) -> str:
        return f"moved by {self.by:.3g} (tolerance {self.tolerance:.2g}; {self.what})"


@dataclass
class Comparison:
    """One list of fingerprints (outputs, or parameters) against the golden file's, each kind of difference in the
    order of this run's list."""

    added: list[str]
    removed: list[str]
    reshaped: list[str]  # "name: [2, 8, 32] float32 -> [2, 8, 64] float32"
    nonfinite: list[str]  # "name: 3 of 256 elements"
    moved: list[Moved]
    ratio: float  # the largest change of a fingerprint that did not move, as a share of its tolerance


def compare(before: list[dict], after: list[dict], tolerance: dict) -> Comparison:
    """This run's fingerprints against the golden file's, matched by name."""
    expected = {e["name"]: e for e in before}
    current = {e["name"]: e for e in after}
    diff = Comparison(
        added=[n for n in current if n not in expected],
        removed=[n for n in expected if n not in current],
        reshaped=[],
        nonfinite=[],
        moved=[],
        ratio=0.0,
    )
    for name, now in current.items():
        then = expected.get(name)
        if then is None:
            continue
        if (then["shape"], then["dtype"]) != (now["shape"], now["dtype"]):
            diff.reshaped.append(f"{name}: {then['shape']} {then['dtype']} -> {now['shape']} {now['dtype']}")
            continue
        if now.get("nonfinite", 0) and not then.get("nonfinite", 0):
            diff.nonfinite.append(f"{name}: {now['nonfinite']} of {math.prod(now['shape'])} elements")
            continue
        change, limit, what = largest_change(then, now, tolerance)
        if change > limit:
            diff.moved.append(Moved(name, change, limit, what))
        else:
            diff.ratio = max(diff.ratio, change / limit if limit else 0.0)
    return diff


def largest_change(then: dict, now: dict, tolerance: dict) -> tuple[float, float, str]:
    """The largest |change| of any number of a fingerprint, the tolerance it is held to (atol + rtol x the golden
    abs-max), and which number it is ("values[1] 0.05 -> 0.24"). A number that turned NaN or Inf, or came back,
    is an infinite change."""
    limit = tolerance["atol"] + tolerance["rtol"] * then["absmax"]
    pairs = [("non-finite elements", then.get("nonfinite", 0), now.get("nonfinite", 0))]
    pairs += [(key, then[key], now[key]) for key in ("mean", "std", "absmax")]
    pairs += [
        (f"{key}[{i}]", a, b)
        for key in ("values", "digest")
        for i, (a, b) in enumerate(zip(then[key], now[key], strict=True))  # one shape: one count (golden_file)
    ]
    largest, what = 0.0, "no change"
    for label, a, b in pairs:
        change = float("inf") if (a is None) != (b is None) else 0.0 if a is None else abs(b - a)
        if change > largest:
            largest, what = change, f"{label} {_shown(a)} -> {_shown(b)}"
    return largest, limit, what


def judge(outputs: Comparison, parameters: Comparison, tolerance: dict) -> list[Finding]:
    """The findings of both comparisons, the answer first: the first module output that moved and whether the
    parameters did; then the NaN that appeared, and what was reshaped, added or removed."""
    findings = []
    if outputs.moved:
        first = outputs.moved[0]
        cause = (
            "parameters changed too (FWD962)"
            if parameters.moved
            else "only the computation changed: every parameter both runs have is within tolerance"
        )
        findings.append(
            Finding(
                "FWD961",
                Status.FAIL,
                f"{first.name}: output {first.said()}, the first of "
                f"{len(outputs.moved)} module outputs that moved; {cause}",
                where=first.name,
                module=_module(first.name),
            )
        )
    if parameters.moved:
        first = parameters.moved[0]
        findings.append(
            Finding(
                "FWD962",
                Status.FAIL,
                f"parameters changed (init or loading): first {first.name}, "
                f"{first.said()}; {len(parameters.moved)} moved",
                where=first.name,
                module=first.name.rpartition(".")[0] or None,
            )
        )
    for kind, diff in (("module outputs", outputs), ("parameters", parameters)):
        findings += _not_compared(kind, diff)
    if _structure_only(outputs):
        # every output both runs have, the logits among them, is within tolerance: the modules added or removed
        # changed how the model is cut into modules, not what it computes (F.gelu become an nn.GELU() module)
        for finding in findings:
            if finding.code == "FWD963" and finding.message.startswith("module outputs"):
                finding.status = Status.PASS
                finding.message += "; every output both runs have and the logits are within tolerance"
    if not findings:
        findings.append(
            Finding(
                "FWD961",
                Status.PASS,
                f"every output and parameter within tolerance (rtol {tolerance['rtol']:g}, atol {tolerance['atol']:g})",
            )
        )
    return findings


def _structure_only(outputs: Comparison) -> bool:
    """Module outputs were added or removed, and every output both runs have (the logits among them) is within
    tolerance, finite, and of the shape and dtype it had."""
    paired_unchanged = not (outputs.moved or outputs.nonfinite or outputs.reshaped)
    return bool(outputs.added or outputs.removed) and paired_unchanged and LOGITS not in outputs.removed


def logits_said(before: list[dict], after: list[dict], tolerance: dict) -> tuple[bool, str]:
    """Whether the logits moved beyond tolerance, and the words that say so, for every comparison's summary."""
    then = next((e for e in before if e["name"] == LOGITS), None)
    now = next((e for e in after if e["name"] == LOGITS), None)
    if then is None or now is None:
        return True, "the golden file has no logits to compare"
    if (then["shape"], then["dtype"]) != (now["shape"], now["dtype"]):
        return True, f"logits changed shape or dtype ({then['shape']} {then['dtype']} -> {now['shape']} {now['dtype']})"
    if now.get("nonfinite", 0) and not then.get("nonfinite", 0):
        return True, "logits turned NaN or Inf"
    change, limit, what = largest_change(then, now, tolerance)
    if change > limit:
        return True, f"logits moved by {change:.3g} (tolerance {limit:.2g}; {what})"
    return False, f"logits unchanged ({change / limit if limit else 0.0:.2g} of their tolerance)"


def _not_compared(kind: str, diff: Comparison) -> list[Finding]:
    """What one comparison could not compare numerically: NaN or Inf that appeared (FWD964), tensors reshaped or
    recast (FWD965), tensors added or removed (FWD963)."""
    findings = []
    if diff.nonfinite:
        findings.append(
            Finding(
                "FWD964",
                Status.FAIL,
                f"NaN or Inf where the golden file has finite values, first in {_listed('', diff.nonfinite)}",
                where=diff.nonfinite[0].split(":")[0],
                module=_module(diff.nonfinite[0].split(":")[0]),
            )
        )
    if diff.reshaped:
        findings.append(
            Finding(
                "FWD965",
                Status.FAIL,
                f"{kind} changed shape or dtype (a shape contract "
                f"difference, not compared numerically): {_listed('', diff.reshaped)}",
                where=diff.reshaped[0].split(":")[0],
            )
        )
    if diff.added or diff.removed:
        said = "; ".join(part for part in (_listed("new", diff.added), _listed("gone", diff.removed)) if part)
        findings.append(
            Finding("FWD963", Status.FAIL, f"{kind} added or removed: {said}", where=(diff.added or diff.removed)[0])
        )
    return findings


def module_of_model_code(module: torch.nn.Module, name: str | None) -> str | None:
    """The innermost module around `name` (itself included) whose class is the model's code, not torch's: what a
    finding points at. An nn.Linear's output moved because its parent's forward handed it another input, and that
    forward is the code to read."""
    modules = dict(module.named_modules())
    while name:
        if name in modules and not type(modules[name]).__module__.startswith("torch."):
            return name
        name = name.rpartition(".")[0]
    return None


def _shown(value: float | None) -> str:
    return "NaN/Inf" if value is None else f"{value:g}"


def _module(name: str) -> str | None:
    """The module a recorded call belongs to ('layers.0.attn#2' is a call of layers.0.attn); None for the logits."""
    return None if name == LOGITS else name.split("#")[0]


def _listed(label: str, names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return f"{label} {shown}".strip()
