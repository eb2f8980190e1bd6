"""What the backends check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/backends.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    order=60,  # after the other default built-ins, before plugins
    applies_when=(
        "models with an attention switch (transformers' set_attn_implementation) or scaled_dot_product_attention calls"
    ),
    options="fwdcheck.checks.backends_view:Options",
    flags={"--exhaustive": "flex"},
    former_keys={"exhaustive": "flex"},  # a former release's top-level `exhaustive: true`
    description="attention implementations (eager, sdpa) and SDPA's kernels give the same logits",
    codes={
        "FWD801": "attention implementations give different logits on the same inputs",
        "FWD802": "attention implementations give different logits for the real tokens of a left-padded row",
        "FWD803": "an SDPA kernel gives another attention output than the math kernel for the same call",
    },
    explain="""\
Verifies that every way the model can compute attention gives the same result: the attention implementations it
offers (Hugging Face's attn_implementation eager vs sdpa; the reference model's `attention: sdpa|eager`; any model
with a Hugging Face-style switch, config._attn_implementation and set_attn_implementation) and the kernels behind
scaled_dot_product_attention (math, flash, efficient, cuDNN).
  implementations: the session's first row at its whole length under each implementation other than the default
    (one row: a path that breaks only past some length shows; the code-path matrix runs every implementation on
    several rows at a few tokens), against the default implementation's logits of that row: the observation pass's,
    which cost no forward, while every implementation agrees with them within the bar, else the row run alone on
    the default path, untouched;
    and, when forward takes attention_mask and position_ids, the first row's first 8 tokens left-padded by 3
    pad tokens (positions counting real tokens from 0, as generate() does) under each implementation: only the real
    tokens' logits are compared, padding is never judged.
  kernels: every SDPA call of one forward (the left-padded one when there is one, so masks are exercised) replayed
    under torch.nn.attention.sdpa_kernel with each kernel alone; the math kernel is the reference. On CPU only math
    and flash exist; a kernel that cannot run for a call (device, dtype, mask, head size) is listed as not run.
The bar is Hugging Face's own eager-vs-SDPA test bar, atol + rtol x the largest |value| (float32 1e-6 + 1e-4;
float16 5e-3 + 5e-3; bfloat16 1e-2 + 1e-2), never below the session's threshold (dtype tolerance, noise floor).
Why: the eager path is what runs when attention weights are requested (and in many fine-tuning setups); a scale, a
mask convention, a softcap or a GQA repeat written differently on one path gives a model whose outputs depend on a
flag that looks like a performance setting.
How to fix: FWD801/FWD802 -> diff the eager function against the SDPA call: the scale (1/sqrt(head_dim), not
1/head_dim), the mask (added where SDPA takes it, its sign and dtype), the key/value repeat for grouped heads, the
softmax dtype; FWD802 alone points at the padding mask or the position ids of padded rows. FWD803 -> a kernel bug
or a call outside the kernel's contract (a mask with fully masked rows, an unsupported head size): report it with
the call's shapes, or pin the math kernel.
Limits: models without a switch (torch.nn, most python models) compare SDPA kernels only. flex_attention compiles
its kernel on first use (tens of seconds on CPU); it runs only with `options: {backends: {flex: true}}` (or
--exhaustive). Fully masked query rows (pad queries) are not compared: kernels legitimately differ there.
Options (`options: {backends: {...}}`): flex.""",
)
