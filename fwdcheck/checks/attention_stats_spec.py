"""What the attention-stats check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/attention_stats.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    order=80,  # after the other default built-ins, before plugins
    applies_when="models whose attention calls the observation pass sees with q and k",
    description=(
        "the effective scale of q . k from the projections to the softmax (twice, none, not as declared?) and "
        "the scores' spread, entropy, saturation"
    ),
    codes={
        "FWD951": "attention scores are not scaled (scale 1): their spread is sqrt(d_h) times 1/sqrt(d_h)'s",
        "FWD952": "attention scores are scaled by 1/d_h: 1/sqrt(d_h) applied twice, the softmax sqrt(d_h) times "
        "flatter",
        "FWD953": "attention scores are scaled by neither 1/sqrt(d_h) nor what the model's config declares",
        "FWD954": "at initialisation most attention rows put more than 0.99 of their weight on one key",
        "FWD955": "the effective scale of q . k (kernel x what q and k were multiplied by after their projections) is "
        "the intended one applied twice",
        "FWD956": "the effective scale of q . k is 1: the intended scale is applied nowhere",
        "FWD957": "the effective scale of q . k is not the one the model declares",
    },
    explain="""\
Measures the effective scale of q . k - the factor between the scores that reach the softmax and q . k of the
query and key projections' outputs - at every attention call, and judges it against the scale the model declares,
or 1/sqrt(d_h) where it declares none. Reports per layer: the std of the scaled scores q . k / sqrt(d_h), the std of
the scores as the model applied them, the softmax entropy (mean over rows, and as a share of log(keys), 1 =
uniform), and the share of rows whose largest weight exceeds 0.99.
The effective scale is the kernel's times the factors q and k were multiplied by after their projections:
  the kernel's: SDPA's `scale` argument, or, for eager attention, the c among 1/sqrt(d_h), 1/d_h, 1 and a fitted one
    for which softmax(c . q . k) over the unmasked keys reproduces the model's own weights (within the dtype's
    rounding);
  the factors: every linear layer's output is kept (nn.Linear, transformers' Conv1D); each head of q (and of k) at
    the call is matched to the chunk of d_h numbers of a linear layer's output in its block whose norm it is a
    constant multiple of at every token (a rotary embedding keeps norms; a fused qkv projection, split or interleaved
    per head, is found the same way); that constant, one for all heads, is the factor.
Declared scales, first found first: the config's `scale:` (model.scale); the attention module's own `scaling`,
`softmax_scale` or `inv_norm_factor` (transformers', MPT's, Falcon's); Gemma-2's query_pre_attn_scalar^-1/2, GPT-2's
scale_attn_weights=False (1) and scale_attn_by_inverse_layer_idx (1/(sqrt(d_h) (layer + 1))), Granite's
attention_multiplier; 1 for T5-family models, which fold 1/sqrt(d_h) into their initialisation. A rotary
embedding that scales cos and sin (YaRN's attention_scaling) scales q and k both: the declared scale times its
square passes too. One observed forward of the first row (16 tokens, or seq_len if shorter) with q, k and the
linear layers' outputs kept.
  FWD955 applied twice: q . k reaches the softmax scaled by the declared scale squared (1/d_h for 1/sqrt(d_h)): q
    pre-multiplied and handed to a kernel that scales again (OPT), or `/ head_dim` for `/ sqrt(head_dim)`; attention
    nearly uniform. Apply the scale once (scaling=1.0 to the kernel after pre-scaling q, or no pre-scaling).
  FWD956 not at all: the effective scale is 1; unit-variance q and k give scores of std sqrt(d_h), the softmax
    saturates and gradients vanish. Divide q . k by sqrt(d_h) (or pass nothing as SDPA's scale). If the model folds
    the scale into its weights by design, declare `scale: 1` in the config.
  FWD957 another scale than declared: the declared one is not the one applied (a multiplier dropped or doubled).
  FWD951 / FWD952 / FWD953 (warnings): the kernel's scale, where the factors before the call could not be measured,
    is none, 1/d_h, or neither 1/sqrt(d_h) nor a declared one; FWD953 also where the whole chain is measured but
    another scale than 1/sqrt(d_h) is applied and none is declared (say so in the config if deliberate: muP's 1/d_h,
    a tuned multiplier).
  FWD954 (judged only at initialisation: the reference model, or a Hugging Face model built with random weights):
    more than half of the rows read one key. Attention at initialisation should be spread; check the q/k
    initialisation and norms.
Limits: a factor is measured only where q (k) is a constant multiple of a linear layer's output chunk at every
token: a q/k norm (Qwen3, OLMo2), a bias added to q, a per-head temperature or a projection outside the attention's
block leaves it unmeasured, and the call's row says why ("chain: not measured: ..."); then only the kernel's scale is
judged, as a warning. An eager call with a positional bias or soft-capping has no scale that reproduces its weights
and is listed as not measured; nn.MultiheadAttention's q and k are projected inside torch, and their scale is
torch's own. The statistics of a trained model are reported, not judged: concentrated attention (induction heads,
attention sinks) is learned, not a bug. Skips when no call's scale could be measured.""",
)
