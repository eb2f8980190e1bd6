"""What the rope check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/rope.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    description="rotated q.k must depend only on n - m; reports the pairing and frequencies actually used",
    codes={
        "FWD301": "one of q and k is rotated by position, the other is not",
        "FWD302": "q and k are rotated with different pairings or frequencies",
        "FWD303": "rotated q.k depends on more than n - m: the relative-position identity fails",
        "FWD304": "shifting every position changes the scores or logits: an absolute offset reaches q and k "
        "differently",
        "FWD305": "the measured pairing, rotary dim or base differs from what the model declares",
        "FWD306": "q/k change with position, no pairing keeps pair norms constant and q.k depends on more than n - m",
        "FWD307": "the model declares a rotary embedding but q and k do not change with position",
        "FWD308": "the rotary function on its own breaks the identity, the norms or position 0 = identity",
        "FWD309": "a multi-axis rotary (M-RoPE) turns a section with another position axis than the declared "
        "sections give it (sections split in the wrong order, an axis read for another)",
    },
    explain="""\
Skips, with the reason, when the model has no rotary embedding: q and k do not turn with position in the probe and
nothing declares one. Absolute position encodings (a learned table such as GPT-2's wpe, sinusoids, anything added to
the residual stream) are not RoPE: the skip names what was found. When the config declares rope (`rope:`, a
`rotary_function`, a Hugging Face rope_theta) and q and k do not turn, that is FWD307, again saying what was found.
Otherwise:
  probe: one token repeated, and the hidden state entering each attention module held the same at every position
    (a learned table, sinusoids or tokens mixed with their neighbours would otherwise vary it); q and k at the call
    are then the rotation alone. fwdcheck measures which dims rotate, the pairing (half = rotate_half, dim i with
    i + r/2, as GPT-NeoX and Llama; interleaved = dim 2i with 2i+1, as GPT-J, RoFormer and complex-number RoPE), the
    frequency of each pair and the base they imply, and checks q_m . k_n depends on n - m only. With a KV cache
    longer than the input only the key slots holding the probe's positions are read (the call's query positions
    when known, else the slots the probe wrote, found by running a second token); a forward that runs attention in
    steps (a prefill, then one token at a time) is measured over its steps together. The probe runs again with
    every position shifted, from the same held input: scores must not change.
  logits: when forward takes position_ids, shifting every position by an offset must leave the logits unchanged:
    the first sample's first 16 tokens (all of a shorter sequence) run alone at positions 17.. against the same
    tokens at 0.., a forward future-token's prefix pass shares. Not measured when positions also enter absolutely
    (the held input moved with the shift) or when the model reads a KV cache kept between calls (shifted positions
    would read what the cache holds below them).
  component: for the reference model, or a `rotary_function` named in the config, the identity
    <R(m)q, R(n)k> = <q, R(n-m)k> on random q, k, norm preservation and R(0) = identity.
  axes: a multi-axis rotary embedding (M-RoPE, position_ids [3, B, T] over time, height and width; declared by a
    Hugging Face config's mrope_section, or the sections its modeling code holds) turns every pair by the same
    angle for text tokens, whose axes all hold one position: the probe runs once more per axis, that axis walking
    0..P-1 and the others held at one position. Along each axis q and k must turn alike (FWD302) and q_m . k_n
    depend on n - m alone (FWD303); each rotary pair must turn with exactly the axis the declared sections give it,
    laid out one after the other (Qwen2-VL) or interleaved (Qwen3-VL, mrope_interleaved; either when the config does
    not say), else FWD309 names the section and the axis its pairs turn with. Pairs too slow to turn visibly within
    the probe are listed as not judged; where the axes cannot be driven apart (forward takes no position_ids, or
    refuses [3, 1, P]), or the modeling code lays its sections out its own way (Ernie 4.5-VL's height, width, time
    order; HunYuan-VL's sections of the doubled table), the sections are "not judged", with the reason, and nothing
    fails.
A check that measured nothing does not pass: when no attention call can be judged (none observed, its input could
not be held and q, k do not turn as rotations, its key slots cannot be told apart) and no logits shift was measured,
it skips with the reason; a rotary function tested alone says nothing of how the model uses it.
Why: RoPE applied to q but not k, q and k paired differently or turned in opposite directions, or a position offset
that reaches only q all train without an error; the relative-position property is simply gone.
Limit: the identity compares q with k. A pairing that is consistently wrong (both q and k interleaved where the
checkpoint was trained with half) satisfies it perfectly. Only the declared settings can catch that: fwdcheck reports
the measured pairing, rotary dim and base and fails FWD305 when they differ from the config (the reference model's
`rope:`, a python model's `rope:` block). A scaled rotation (xPos) keeps no pair norm constant; it is accepted as
long as q . k depends on n - m only.
How to fix: FWD301 -> apply the rotation to both q and k. FWD302 -> use one rotate function, with the same
positions and sign, for both. FWD303 -> rotate by angles linear in the position (no wrapped or restarted
positions). FWD304 -> pass the same positions (offset included) to q and k. FWD307 -> apply the rotary embedding,
or correct the declaration. FWD309 -> split the frequencies by the declared sections, in order, each section reading
its own row of position_ids.""",
    order=40,
    detail_view="fwdcheck.checks.rope_view:rope_numbers",
)
