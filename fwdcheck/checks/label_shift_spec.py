"""What the label-shift check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/label_shift.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    order=54,  # after the other default built-ins, before plugins
    applies_when="causal models that compute a loss from labels (a transformers causal LM, a declared `loss:`)",
    description="the loss forward computes from labels is the mean cross-entropy of logits[:, :-1] vs ids[:, 1:]",
    codes={
        "FWD701": "labels not shifted: the loss scores each position against its own input token",
        "FWD702": "labels shifted twice: the loss scores each position against the token two ahead",
        "FWD703": "the loss changes with the order of the rows: labels cross from one row into another",
        "FWD704": "the loss is not the mean cross-entropy of the returned logits at any shift (an auxiliary term, "
        "label smoothing, another reduction, or other logits)",
        "FWD705": "positions labelled ignore_index are counted in the mean",
        "FWD706": "the loss or the logits returned with it are NaN or Inf",
    },
    explain="""\
Calls forward(input_ids, <labels>=labels) once, on the session's first rows in another order (rolled by one; rows of
random tokens for a session of one row), 8 tokens or seq_len if shorter, and reads back the loss and the logits. Some
labels are set to ignore_index (the same columns in every row, so that a mean over tokens and a mean of row means
agree). From the returned logits, in float64, it computes the mean cross-entropy for each candidate pairing:
  shift 0, 1, 2: position t scored against token t + k (Hugging Face: logits[:, :-1] vs labels[:, 1:] is shift 1);
  across rows: labels shifted once more along the flattened batch (the last position of a row reads the next row);
  ignored counted: shift 1 with the ignored positions in the denominator.
The loss must equal shift 1 within the dtype's tolerance (scaled by the larger of the loss and the largest |logit|),
and the verdict names the candidate it matches. A candidate closer than twice the tolerance to shift 1 cannot be
told apart from it and is not judged; if none can be, the check skips. The mean of per-row losses does not depend on
the rows' order, so a change with it is labels crossing rows (or rows reading each other): where the loss is shift
1's, the session's own forward, which ran the same rows in another order, gives the loss they would have (shift 1's
cross-entropy of its logits); a second call with the rows rolled by one runs where it cannot (drawn rows, a loss no
candidate explains or at a wrong shift) or where that prediction moves beyond the tolerance, and every FWD703 rests
on the two calls' losses.
Conventions: Hugging Face causal LMs (the classes AutoModelForCausalLM builds): labels = input ids, loss at .loss,
ignore_index -100. The reference model: the same, returning (logits, loss). Python models declare it in the model
section, e.g. nanoGPT (targets already shifted by the data loader, returns (logits, loss), ignore_index -1):
  loss: {argument: targets, shifted_by: caller, output: 1, ignore_index: -1}
For shifted_by: caller it passes targets[t] = token t + 1 (the last one drawn). The call goes
through the config's `forward:` adapter when it names one, as every check's does (labels as an extra, under
loss.argument; the adapter returns the loss beside the logits). Without a known or declared convention the check skips.
Why: a loss on the wrong shift trains without an error to a plausible curve; shift 0 even reaches a near-zero loss
(copying the input), shift 2 a high one.
How to fix: FWD701 -> compare logits[..., :-1, :] with labels[..., 1:] (or let the data loader shift, not both).
FWD702 -> shift once: either the collator (targets = ids[1:]) or the model, and never on the flattened batch.
FWD703 -> shift per row (labels[:, 1:]), not after flattening; pad the last position with ignore_index.
FWD705 -> divide by the number of counted labels ((labels != ignore_index).sum()), or use reduction='mean' with
ignore_index. FWD704 -> if the model adds an auxiliary loss (router load balancing, z-loss) or smooths labels, this
warning is expected; otherwise check that the returned logits are the ones the loss used.
Limits: the verdict rests on scalar losses; with weak logits in low precision (bfloat16 of an untrained model with a
0.02 initialisation) the candidates may lie within tolerance of each other and the check skips.""",
)
