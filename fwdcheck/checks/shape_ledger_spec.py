"""What the shape-ledger check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/shape_ledger.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    description="names every axis of ids, hidden states, per-head q/k/v, attention weights and logits",
    needs_values=False,  # shapes alone: runs on the meta device
    codes={
        "FWD401": "a tensor's layout contradicts its role (an axis where another belongs, a size against the "
        "declared one)",
        "FWD402": "attention runs over an axis that is not the sequence (e.g. heads and positions swapped)",
        "FWD403": "the softmax normalises over the query axis instead of the keys being read",
        "FWD404": "attention weights do not sum to 1 over the key axis, or hold NaN/Inf",
        "FWD405": "against --expect-ledger: a tensor appeared or disappeared",
        "FWD406": "against --expect-ledger: a tensor's symbolic shape changed",
        "FWD407": "against --expect-ledger: a tensor's dtype changed",
    },
    explain="""\
Records the shapes of input ids, embeddings, each block's output, per-head q/k/v at every attention call (SDPA,
nn.MultiheadAttention, eager q @ k^T), attention weights, the feed-forward hidden state and the logits, and names each
axis with a symbolic dimension: B batch, T sequence, S keys (T, or a KV cache's slots), d model width, h query heads,
h_kv key/value heads, d_h head size, d_v value head size (where it differs: MLA), V vocabulary, d_ff feed-forward
width.
How axes are named: by behaviour and position, not by size. A second small pass with other B and T shows which axes
follow them (so T = d_h = 4 in the seed's toy is no ambiguity); the other axes are named by where they sit in the
layout the tensor's role requires. Roles come from what a tensor is, not from its width: the feed-forward state is
the output of an MLP layer another layer of the same module follows (up, gate), never the down projection or the lm
head, however wide; the operands of an eager q @ k^T and weights @ v hold the query heads h when they have as many
(kv heads repeated), the kv heads h_kv when fewer. Sizes the model states (`dims:` in the config,
`check_model(dims=...)`, or its config object) must agree; sizes it does not state are read off the tensors: the head
count off the q handed to SDPA, the operands of q @ k^T, nn.MultiheadAttention's num_heads. An axis that cannot be named
is shown by its size (a prefill chunk of 4, a decode step of 1, a value embedding's width): that is never a finding. A
model that refuses the naming pass's batch size (a cache allocated for max_batch_size) is named at its own; one that
refuses the pass altogether is named by position and size, with a note saying what that cannot tell.
Expected: ids [B,T]; hidden [B,T,d] (or sequence-first [T,B,d]); q handed to attention [B,h,T,d_h]; k/v
[B,h_kv,S,d_h] (GQA: h_kv heads; a cache: S slots; v may be [B,h_kv,S,d_v], narrower than q and k as multi-head
latent attention makes them: v_head_dim in the config or `dims: {d_v: ...}`, else read off the first v); weights
[B,h,T,S]; feed-forward [B,T,d_ff]; logits [B,T,V].
Logits wider than the vocabulary are a padded vocabulary (V_pad, a note); narrower ones are a fail. The softmax must
run along the keys (the last axis of q @ k^T), so each row of weights sums to 1.
Why: a missing transpose(1, 2) hands SDPA [B,T,h,d_h], and attention then mixes heads instead of positions: nothing
crashes and no future leaks, only this ledger shows it (FWD402: the sequence sits on another axis than attention runs
over). A softmax over dim=-2 normalises over queries and lets later queries shift earlier outputs.
How to fix: the failing row names the tensor, the module and the axis; compare its dims with the expected layout.
If a size is named wrongly because the model's config says something else, declare it: `model.dims: {h: 12}`.""",
    order=10,  # first: its observation pass is the one the other checks share
    detail_view="fwdcheck.checks.shape_ledger_view:ledger",
    files={
        "--save-ledger": {
            "writes": "fwdcheck.checks.ledger_file:ledger_text",
            "help": "write the shape ledger (JSON) here, to pin the architecture in review.",
        },
        "--expect-ledger": {
            "reads": "fwdcheck.checks.ledger_file:read_ledger",
            "help": "fail (FWD405-407) when the ledger differs from this saved one.",
        },
    },
)
