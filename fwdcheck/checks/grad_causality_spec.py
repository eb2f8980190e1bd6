"""What the grad-causality check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/grad_causality.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    applies_when="causal models whose gradients can be recorded (a token embedding to hook, logits with a gradient)",
    order=56,  # after the default built-ins, before plugins
    detail_view="fwdcheck.checks.grad_causality_view:gradient_map",
    description="train path: earlier logits get exactly zero gradient from later tokens and other samples",
    codes={
        "FWD121": "an earlier position's logits have a nonzero gradient from a later position's input embedding",
        "FWD122": "a sample's logits have a nonzero gradient from another sample's input embedding",
        "FWD123": "the gradient at the input embeddings is NaN or Inf",
        "FWD126": "the train-mode logits (dropout off) differ from the eval-mode logits: the train path computes "
        "something else",
    },
    explain="""\
Verifies causality exactly, on the path that trains: the model in train() mode with every dropout forced to zero
(dropout modules at p=0, dropout_p of attention calls and F.dropout zeroed) and gradients enabled, the token
embedding's output made a leaf of the autograd graph by a forward hook. Row b of the session's inputs (cut to its
first quarter, at least 16 tokens and the model's min_seq_len) backpropagates
a random projection of its logits at positions < k (k = T-1, 1, T/2 in turn over the rows); the input embeddings at
positions >= k of that row, and every position of the other rows no loss reached, must get a gradient of exactly
0.0. There is no threshold: a causal mask's weights are exactly 0.0 (exp of -inf or finfo.min), and the backward
multiplies by them, so any nonzero bit is a path from a later token, or another sample, to an earlier output.
The train path's logits must equal the eval path's (dropout off on both) within future-token's threshold; where
they part, the first module whose output differs is named. Whether every parameter gets a gradient is grad-reach's.
Why: future-token compares logits within a tolerance in eval mode without gradients. A leak below that tolerance
(a future hidden state mixed in at 1e-7), a mask dropped only under torch.is_grad_enabled() or only when
self.training, or a kernel whose backward reads what its forward did not, passes it and still trains a model that
cheats.
How to fix: FWD121 -> the leak map shows which earlier positions (rows) get gradient from which later ones
(columns), and the finding names the first module whose output carries the leak (the leak is in it, or in the code
between it and the module that completed before it); look at what differs on the train path (`if self.training`,
`torch.is_grad_enabled()`, a fused kernel's is_causal), then at any token mixing outside the mask (a roll, a cumsum,
a norm over the sequence axis); mask-audit and future-token name the ones that show in eval. FWD122 -> something
reduces over the batch axis (a batch norm, a mean over dim 0, a reshape that merges B with T). FWD123 -> NaN in the
backward (a fully masked row's softmax, a sqrt or log at 0). FWD126 -> the module named: a branch on self.training
or torch.is_grad_enabled() (a mask, a cache, a different kernel), noise added in training (router jitter), a norm
with batch statistics (a warning: by design).
Limits: the token embedding is the model's get_input_embeddings(), else the nn.Embedding with one row per token;
a model without one, a model declared bidirectional (causal: false), and a model whose logits carry no gradient
skip, saying why. Batch reading is seen where one row's loss reaches another row's later positions (row 0 reads row
1 from position 1 on): a mix that only reads backward through the batch at the same position is left to
future-token. A NaN or Inf at an earlier position's gradient is reported as such (FWD123), never as a pass. A leak
that opens only past a quarter of the session's length is future-token's to see on the eval path, and not seen
on the train path.
Cost: one forward with gradients and one backward to the input embeddings alone, no weight's gradient, on rows of
a quarter of the session's length (about half a forward pass at any length, 2.3 uncut); where the train logits
part from the eval logits at those positions, one eval forward of the same tokens to tell; a leak adds one backward
per row, up to 32 for the map, and one forward and up to 64 partial backwards to find where it enters.""",
)
