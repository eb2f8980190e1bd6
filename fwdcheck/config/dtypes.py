"""The ways a dtype is written (mixed-precision flags, torch's names), by the name fwdcheck takes: one table for the
config's `dtype:` and the command line's `--dtype`. Light: the command line reads it before anything heavy loads."""

from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_SPELLINGS = {
    **{spelling: "float32" for spelling in ("fp32", "f32", "float", "torch.float32", "torch.float")},
    **{spelling: "bfloat16" for spelling in ("bf16", "torch.bfloat16")},
    **{spelling: "float16" for spelling in ("fp16", "f16", "half", "torch.float16", "torch.half")},
}


def dtype_named(value: str) -> str:
    """The dtype `value` names (bf16 -> bfloat16), or ValueError saying what is taken."""
    name = DTYPE_SPELLINGS.get(value, value)
    if name not in DTYPES:
        raise ValueError(f"'{value}' is no dtype fwdcheck runs in: {', '.join(DTYPES)} (or bf16, fp16, fp32, half)")
    return name
