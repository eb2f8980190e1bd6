"""What the rope-precision check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/rope_precision.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    order=70,  # after the other default built-ins, before plugins
    applies_when=(
        "models with a rotary function fwdcheck can call alone and a context length "
        "(max_position_embeddings, a declared `max_positions:`)"
    ),
    description="rotary angles and the relative identity at long positions (1k-128k): run dtype vs float64",
    codes={
        "FWD901": "the rotary angles of long positions are off: computed in low precision (bfloat16/float16)",
        "FWD902": "the relative identity <R(m)q, R(n)k> = <q, R(n-m)k> fails at long positions in the run's dtype",
    },
    explain="""\
Verifies that the rotary embedding turns q and k by the right angle at long positions in the run's dtype: at 1k, 8k,
32k and 128k (capped at the model's maximum positions; a model that declares none is not judged), the rotary
function alone, in the run's dtype and in float64, on a probe whose pairs read out cos and sin (the angle per pair)
and on random q, k (the relative identity over a window of 8 positions ending there).
  FWD901: the largest angle error over the pairs at a position exceeds 0.02 rad plus what float32 arithmetic loses
    there (position x 2^-22): the angles are computed in bfloat16 or float16.
  FWD902: <R(m)q, R(n)k> differs from <q, R(n-m)k> (float64, short positions) by more than the dtype's tolerance
    plus twice that angle bar, relative to its scale.
Every position's errors are in the report (data.positions), passing or not.
Why: positions and the products m * theta in half precision lose whole radians at a few thousand tokens (float16 at
2k: cos off by up to ~1; bfloat16 cannot even hold position 257). Short inputs never show it, and the model degrades
exactly on the long contexts it was extended to.
How to fix: compute inv_freq and positions * inv_freq in float32 (transformers: `position_ids[..., None].float() *
inv_freq.float()` under torch.autocast(enabled=False)), and only cast cos and sin to the activations' dtype.
Limits: the rotary function is the one fwdcheck can call alone: the reference model's, Hugging Face's *RotaryEmbedding
with apply_rotary_pos_emb, or a config's `rotary_function`; without one the check skips. Frequencies and cos/sin
tables held in buffers are read as the run holds them: a buffer cast to bfloat16 with the model (model.to(bfloat16)
casts Hugging Face's inv_freq; from_pretrained(dtype=...) keeps it float32) is the same in both runs and not judged;
`data.buffers` lists such buffers. Scaled rotary types (yarn, longrope) are compared as computed: angles and the
identity's relative error do not depend on their scale. When the rotary function cannot run in float64, float32
is the reference (a float32 run then skips).""",
)
