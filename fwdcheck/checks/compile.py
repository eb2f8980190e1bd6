"""compile: the model under torch.compile gives the logits it gives eagerly.

Training runs compile the model (torch.compile with inductor), and what runs there is not the Python that eager
checks read: a branch taken only while compiling (`torch.compiler.is_compiling()`), an in-place write into a view that
the compiled graph orders differently, a guard on a Python attribute that freezes a value. The check compiles the
model's forward with inductor (a C++ compiler on the CPU, Triton on a GPU), runs the session's inputs through it and
compares the logits with the eager forward's, at the bar backends uses for two attention implementations.

It is not in the default selection: compiling costs seconds to minutes, and the compiled graphs are thrown away
after (torch._dynamo.reset()), so a second run compiles again. A compile that cannot run here (no compiler, an
operator inductor does not lower, a graph torch cannot trace) is a skip with torch's reason: the eager model ran, so
that says nothing about the model's numbers.
"""

from __future__ import annotations

import dataclasses
import shutil
from typing import cast

import torch
import torch.nn as nn

from fwdcheck.checks.equivalence_bar import tolerance
from fwdcheck.errors import ModelRaised, SkipCheck, first_line
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.session import Session

BACKEND = "inductor"
COMPILERS = ("c++", "g++", "clang++", "cl")  # what inductor's CPU code generation calls


class Compile(Check):
    name = "compile"
    default = False  # a compiler run: named when wanted
    applies_when = (
        "runs asked for it (checks: [default, compile]): torch.compile's compilation costs more than "
        "every other check together"
    )
    order = 61  # after backends
    one_process = "it compiles the unsharded model's forward; compiling a sharded one is the training script's own step"
    description = "the model under torch.compile (inductor) gives the logits it gives eagerly"
    codes = {
        "FWD811": "the torch.compile'd model gives other logits than the eager model on the same inputs",
    }
    explain = """\
Verifies that the model compiled with torch.compile (backend inductor, as training scripts compile it) computes the
logits the eager model computes, on the session's inputs, in eval mode with dropout off.
How: one forward of the inputs through torch.compile(module) (dynamic=False), compared position by position with
the eager forward's logits; the bar is backends' (Hugging Face's eager-vs-SDPA bar for the dtype, never below the
session's threshold). The compiled graphs are discarded after the check.
Why: what torch.compile runs is a traced graph, not the Python that eager runs: code taken only while compiling
(torch.compiler.is_compiling()), in-place writes into views, Python state captured as a constant at trace time, or a
lowering bug make a model whose training run computes something its eager checks never saw.
How to fix: FWD811 -> bisect with torch.compile(backend="aot_eager") (traced, not lowered: a difference that remains
is in the trace, a branch or captured state) and then "eager" (dynamo alone); torch._dynamo.explain(model)(ids) lists
graph breaks; an in-place op on a view or a Python-side cache is the usual cause.
Limits: not in the default selection (compiling takes seconds to minutes). A compile that cannot run (no C++
compiler on the CPU, an untraceable model, an operator inductor cannot lower) is a skip with torch's reason. One
input shape is compiled; shapes that recompile differently are not tried."""

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        if session.device.type == "meta":
            raise SkipCheck("--meta runs no numbers: nothing to compile and compare")
        if session.device.type == "cpu" and not any(shutil.which(c) for c in COMPILERS):
            raise SkipCheck(
                f"inductor compiles CPU code with a C++ compiler, and none is on PATH ({', '.join(COMPILERS)})"
            )
        # torch.compile of a module is an OptimizedModule: the same module (its attributes, its submodules) whose
        # calls run the compiled graph.
        module = cast(nn.Module, torch.compile(model.module, backend=BACKEND, dynamic=False))
        compiled_model = dataclasses.replace(model, module=module)
        try:
            compiled = session.logits(session.inputs, model=compiled_model)  # (B, T, V)
        except ModelRaised as exc:  # the eager forward ran: what fails here is the compile
            raise SkipCheck(f"torch.compile could not run the model: {_reason(exc)}") from None
        finally:
            torch._dynamo.reset()  # the compiled graphs and their guards, not kept past this check
        change, scale = session.change_from_reference(compiled)  # (B, T)
        bar = tolerance(session, scale)
        largest = float(change.max())
        findings = []
        if not largest <= bar:  # NaN too
            row, position = divmod(int(change.flatten().argmax()), change.shape[-1])
            first = int((~(change <= bar)).nonzero()[0, 1])
            findings.append(
                Finding(
                    "FWD811",
                    Status.FAIL,
                    f"the compiled model's logits differ from the eager model's by {largest:.3g} (bar {bar:.3g}) at "
                    f"{int((~(change <= bar)).sum())} of {change.numel()} positions; largest at row {row} position "
                    f"{position}, first over the bar at position {first}",
                    where=f"torch.compile(backend={BACKEND!r})",
                )
            )
        summary = (
            self.codes["FWD811"] if findings else f"torch.compile({BACKEND}) gives the eager logits"
        ) + f": max change {largest:.3g} (bar {bar:.3g}) over {change.numel()} positions"
        return CheckResult.from_findings(
            self.name, findings, summary, metrics={"max_change": largest, "bar": bar}, data={"backend": BACKEND}
        )

    def key_number(self, result: CheckResult) -> str:
        m = result.metrics
        return f"{m['max_change']:.2g} / {m['bar']:.2g}" if "max_change" in m else ""


def _reason(exc: ModelRaised) -> str:
    """torch's own words for why the compile failed: the exception behind ModelRaised, its first line."""
    cause = exc.__cause__ or exc
    inner = getattr(cause, "inner_exception", None) or cause.__cause__  # BackendCompilerFailed wraps the backend's
    if inner is None:
        return f"{type(cause).__name__}: {first_line(cause, 300)}"
    return f"{type(cause).__name__} ({type(inner).__name__}: {first_line(inner, 300)})"
