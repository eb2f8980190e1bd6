"""What the compile check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/compile.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    default=False,  # a compiler run: named when wanted
    applies_when=(
        "runs asked for it (checks: [default, compile]): torch.compile's compilation costs more than "
        "every other check together"
    ),
    order=61,  # after backends
    one_process="it compiles the unsharded model's forward; compiling a sharded one is the training script's own step",
    description="the model under torch.compile (inductor) gives the logits it gives eagerly",
    codes={
        "FWD811": "the torch.compile'd model gives other logits than the eager model on the same inputs",
    },
    explain="""\
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
input shape is compiled; shapes that recompile differently are not tried.""",
)
