"""What the golden check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/golden.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    description="numeric contract: every module's output and parameter fingerprinted; --expect-golden compares",
    default=False,  # runs when named, or when --save-golden / --expect-golden adds it
    applies_when="runs asked for a golden file (--save-golden, --expect-golden, or checks: [golden])",
    order=90,  # after the other built-ins: its forward is its own, and shares nothing
    codes={
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
    },
    explain="""\
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
difference is in it. Dropout left alive in eval is recorded with the seed's dice (mask-audit names it).""",
    detail_view="fwdcheck.checks.golden_view:golden",
    files={
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
    },
    # each rank's modules hold their shards
    one_process="a golden file records the unsharded model, and the sharding check compares the sharded one with it",
)
