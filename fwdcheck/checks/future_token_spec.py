"""What the future-token check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/future_token.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    description="changing later tokens must not move earlier logits; samples of a batch must not read each other",
    codes={
        "FWD101": "logits at earlier positions moved when later tokens changed: the model reads the future",
        "FWD102": "a sample's logits moved when the other samples of its batch changed: samples read each other",
        "FWD103": "identical forwards differ: dropout or other randomness is live in eval mode, or (on the train "
        "path, every dropout zeroed) the model draws random numbers itself",
        "FWD104": "the logits hold NaN or Inf",
        "FWD105": "the first k tokens run alone give other logits than the full run: the prefix depends on what "
        "follows it",
        "FWD106": "the run-to-run noise floor is high next to the dtype tolerance: comparisons are coarse",
        "FWD107": "left padding changes the real tokens' logits: padding is read, or shifts the positions",
        "FWD108": "on the train path (train mode, dropout off, gradients on) the logits differ from the eval-mode "
        "logits: training computes something the eval checks never saw",
    },
    explain="""\
Verifies, with the model untouched in eval mode and dropout forced to zero, that
  (a) changing the token at a cut position k and every later one leaves the logits at positions < k unchanged,
      for k = 1, T/2 and T-1 (every k with --exhaustive, which draws the full leak map),
      and that the first k tokens run alone reproduce the full run's logits there (k = 1, 2 and 16, up to T/4);
      batch size 1 included: one row run alone with its later half replaced must keep its earlier logits (it has
      the length of the longest prefix, and is compared with that prefix, also run alone);
  (b) a sample's logits do not move when the other samples of its batch change.
Why: a decoder that can see the future trains to a loss it can never reach at inference, and a batch whose samples
read each other makes every metric depend on batch composition. The usual causes are a dropped or inverted causal
mask, a 0/1 float mask, wrong position indexing, or a reshape that mixes the batch axis with another.
How changes are judged: a change counts when it exceeds both the dtype tolerance (atol + rtol x the largest |logit|,
defaults as torch.testing.assert_close), noise_factor x the run-to-run noise floor measured by running the
identical input twice, and 4 x the model's own rounding, measured against a float64 copy of the model: a prefix or a
row run alone reorders the arithmetic, which moves the logits of a model whose hidden states run far above them by
more than the dtype tolerance. NaN or Inf is reported where it appears, never passed; a masked vocabulary (-inf
on entries the model never emits) is no broken logit: -inf where both sides hold -inf is equal, and the finite
entries are compared.
What it runs: the comparisons start from the logits the observation pass already computed, with no noise floor.
Only when some change exceeds the tolerance (where the noise floor could matter) does it run the untouched model on
the session's inputs, and again for the noise floor, and judge against those; a pass rests on every untouched forward
agreeing, within the tolerance, with logits computed without the tokens it changed. The cut rows run in forwards of
the baseline's row count, each reduced to its per-position change as it comes back, so a run needs little more
memory than the model's own forward. On the code-path matrix, a cell whose logits are, within the tolerance, those of
a cell where this check passed on the same tokens (SDPA against eager, left padding against none, batch size 1
against the larger batch's first row) takes that pass, its summary naming the cell; a path that computes other logits
runs every comparison itself, and a failure is never taken over this way.
The train path: the code-path matrix's train cell (every source) runs these comparisons with the model in train()
mode, every dropout zeroed (dropout modules, nn.RNN/LSTM/GRU's `dropout`, every functional form) and gradients on,
the state a train-mode forward updates (running statistics, spectral norm's vectors, a step counter) put back after
each forward, so that only randomness the model draws itself (torch.rand_like in its forward, named) is FWD103 there;
and holds its logits to the eval-mode logits of the same tokens at the
same threshold (FWD108), naming the first module whose output differs. FWD108 -> a branch on self.training or
torch.is_grad_enabled() (a mask, a cache, another kernel), a train-only scaling or noise; a norm with batch
statistics is a warning, by design.
Where it enters: on FWD101, one row of the first leaking cut runs again as it was and as changed, keeping every
module's input and output; the finding names the first module (in the order modules complete) whose output at an
earlier position moved, and its file:line: the module's own forward when its input had not moved, else the code of
the module that called it (a roll, a reshape or a norm over the sequence after the attention call).
How to fix: read the leak map (query position x perturbed position). A full upper triangle means no causal mask; a
band above the diagonal means a mask shifted by one; only some samples moving means a batch reshape. Then run
`fwdcheck explain mask-audit` to see which attention call received which mask.
The attention pattern by design: a bidirectional encoder (read off a transformers model's is_causal flags or masked-LM
class, or declared `model.attention: {pattern: bidirectional}`, formerly `causal: false`) reads the future by
design: part (a) is not judged, and the summary says so; part (b), determinism and left padding still are. A
prefix-LM (`attention: {pattern: prefix, prefix_length: P}`) is cut only at k >= P: the prefix must be blind to the
suffix (the cut at P) and the suffix causal (the later cuts); the prefix ladder starts at P. An encoder-decoder's
tokens under test are its decoder's, causal. A leak shown only by the row run alone is a
shortcut taken for a single sequence; the code-path matrix (`code_paths:`) names such paths one by one.
Sizes the model refuses: a forward that raises at some length or row count is noted ("prefix pass at k=1 skipped:
the model raised AssertionError at T=1") and the other passes still judge; the prefix pass goes on with longer
lengths, and cut rows the model will not take run in forwards of exactly the baseline's row count. Declare the shortest
sequence forward accepts as `inputs.min_seq_len` to skip the shorter prefixes without a note. The check is an error
only when the model refused every comparison.""",
    order=20,
    detail_view="fwdcheck.checks.future_token_view:leak_map",
    options="fwdcheck.checks.future_token_view:Options",
    flags={"--exhaustive": "exhaustive"},
    former_keys={"exhaustive": "exhaustive"},  # a former release's top-level `exhaustive: true`
)
