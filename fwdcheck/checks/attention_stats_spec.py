"""What the attention-stats check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/attention_stats.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    default=False,
    order=80,  # after the default built-ins, before plugins
    description="the scale each attention call applies (1/sqrt(d_h)?) and its score spread, entropy, saturation",
    codes={
        "FWD951": "attention scores are not scaled (scale 1): their spread is sqrt(d_h) times 1/sqrt(d_h)'s",
        "FWD952": "attention scores are scaled by 1/d_h: 1/sqrt(d_h) applied twice, the softmax sqrt(d_h) times "
        "flatter",
        "FWD953": "attention scores are scaled by neither 1/sqrt(d_h) nor what the model's config declares",
        "FWD954": "at initialisation most attention rows put more than 0.99 of their weight on one key",
    },
    explain="""\
Warns (never fails) when an attention call applies another scale to q . k than 1/sqrt(d_h) or the one the model's
config declares, and reports per layer: the std of the scaled scores q . k / sqrt(d_h), the std of the scores as
the model applied them, the softmax entropy (mean over rows, and as a share of log(keys), 1 = uniform), and the share
of rows whose largest weight exceeds 0.99.
The scale is a measurement, independent of the weights: SDPA's `scale` argument, or, for eager attention, the c
among 1/sqrt(d_h), 1/d_h, 1 and the declared scale for which softmax(c . q . k) over the unmasked keys reproduces the
model's own weights (within the dtype's rounding). Declared scales: Gemma-2's query_pre_attn_scalar^-1/2, GPT-2's
scale_attn_weights=False (1) and scale_attn_by_inverse_layer_idx (1/(sqrt(d_h) (layer + 1))), Granite's
attention_multiplier. One observed forward of the first row (64 tokens, or seq_len if shorter) with q and k kept.
  FWD951 no scale: the scores of unit-variance q and k have std sqrt(d_h) instead of 1; the softmax saturates and
    gradients vanish. Divide q . k by sqrt(d_h) (or pass nothing as SDPA's scale).
  FWD952 1/d_h: the scale applied twice (q pre-scaled and SDPA's default, or `/ head_dim` for `/ sqrt(head_dim)`);
    attention nearly uniform. Apply 1/sqrt(d_h) once.
  FWD953 another scale: say so in the config if it is deliberate (muP's 1/d_h, a tuned multiplier); then it is the
    declared one. T5-style models fold the scale into the initialisation and apply none: a warning there is expected.
  FWD954 (judged only at initialisation: the reference model, or a Hugging Face model built with random weights):
    more than half of the rows read one key. Attention at initialisation should be spread; check the q/k
    initialisation and norms.
Limits: a scale multiplied into q or k before the attention call is indistinguishable from the weights and not
seen; an eager call with a positional bias or soft-capping has no scale that reproduces its weights and is listed
as not measured; nn.MultiheadAttention's q and k are projected inside torch, and their scale is torch's own. The
statistics of a trained model are reported, not judged: concentrated attention (induction heads, attention sinks)
is learned, not a bug. Skips when no call's scale could be measured.""",
)
