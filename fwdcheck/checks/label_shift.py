"""label-shift: the loss a model computes from labels is the mean next-token cross-entropy of its own logits.

A causal language model is trained on position t predicting token t + 1. Where that shift happens depends on the code
base: Hugging Face models take labels equal to the input ids and shift inside the loss (logits[:, :-1] against
labels[:, 1:]); nanoGPT takes targets already shifted by the data loader. Forget the shift and every position learns to
copy its own input; shift twice and it learns to predict two tokens ahead; shift a flattened batch and the last
position of each row is scored against the next row's first token. All three train without an error.

The check calls forward with labels, reads back the loss and the logits, and recomputes in float64, from those same
logits, the mean cross-entropy for the shifts 0, 1 and 2 (and for two known mistakes: labels shifted across rows, and
positions labelled ignore_index counted in the mean). The loss must equal shift 1 and be told apart from the others.
A loss of rows that do not mix cannot change with their order: the rows are the session's first rows in another
order than the session's forward ran them, and that forward's logits of the same rows give the loss they would
have; a second call with the rows in another order runs when they cannot (rows drawn for a session of one row, a
loss no candidate explains, a wrong shift, or a predicted loss that moves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fwdcheck.checks.label_shift_spec import SPEC
from fwdcheck.errors import DoesNotApply, SkipCheck
from fwdcheck.model.capabilities import Loss
from fwdcheck.model.tested import ModelUnderTest, extract_logits
from fwdcheck.result import Check, CheckResult, Finding, Status, first_per_code
from fwdcheck.run.compare import logit_scale
from fwdcheck.run.session import Session

SHIFTS = (0, 1, 2)  # how far ahead of its position each position's logits are scored; 1 is right
# Tokens per row of the call, unless seq_len is shorter or the model needs more. Where a loss shifts its labels does
# not depend on the length, and the fewer the positions, the more a row's boundary (labels crossing rows) and the
# ignored column weigh in the mean; the call then costs little more than reading the weights once.
LENGTH = 8
RIGHT = "shift 1"
# What each wrong candidate means, and the finding it makes when the loss matches it.
WRONG = {
    "shift 0": ("FWD701", "labels are not shifted: each position is scored against its own input token"),
    "shift 2": ("FWD702", "labels are shifted twice: each position is scored against the token two ahead"),
    "across rows": (
        "FWD702",
        "labels are shifted twice, the second time on the flattened batch: each position is "
        "scored two tokens ahead, and the last of each row against the next row's labels",
    ),
    "ignored counted": ("FWD705", "positions labelled ignore_index are skipped in the sum but counted in the mean"),
}


def convention(model) -> Loss:
    """The model's loss interface, or DoesNotApply when it offers none that fwdcheck can trust."""
    if not model.causal:
        raise DoesNotApply(f"{model.pattern.describe()}: its loss is not next-token prediction on every token")
    if model.loss is None:
        raise DoesNotApply(
            model.why_not(
                "loss",
                "the model declares no loss: add `loss:` to the model section (e.g. "
                "nanoGPT: {argument: targets, shifted_by: caller, output: 1, ignore_index: -1}; "
                "Hugging Face style: {argument: labels, output: loss}) so that forward can be "
                "asked for it",
            )
        )
    return model.loss


def read_loss(output, where: int | str):
    """The loss from forward's output: output[where] for an index, else the attribute or key; None when absent."""
    if isinstance(where, int):
        return output[where] if isinstance(output, (tuple, list)) and -len(output) <= where < len(output) else None
    if isinstance(output, dict) and where in output:
        return output[where]
    return getattr(output, where, None)


def candidate_losses(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, caller_shifts: int
) -> dict[str, float]:
    """The mean cross-entropy of logits [N, T, V] against labels [N, T] under each candidate pairing, summed in
    float64 (the log-probabilities in the logits' float32: no second copy of them in double).

    "shift k": position t scored against token t + k, that is labels[t + k - caller_shifts], per row.
    "across rows": the right positions, but labels taken one step further along the flattened batch.
    "ignored counted": shift 1, the ignored positions counted in the mean."""
    N, T, V = logits.shape
    log_probs = logits.float().log_softmax(-1)  # (N, T, V)

    def nll(scored: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair negative log-likelihood of scored [..., V] at targets [...], and which pairs count."""
        counted = targets != ignore_index
        picked = scored.gather(-1, targets.clamp(0, V - 1)[..., None])[..., 0]  # ignored pairs picked, then dropped
        return -picked.double(), counted

    found = {}
    for k in SHIFTS:
        offset = k - caller_shifts  # logits[:, t] pairs with labels[:, t + offset]
        first, end = max(0, -offset), min(T, T - offset)
        loss, counted = nll(log_probs[:, first:end], labels[:, first + offset : end + offset])
        found[f"shift {k}"] = float(loss[counted].mean())
        if k == 1:
            found["ignored counted"] = float(loss[counted].sum() / counted.numel())
    # The right positions of each row (t < T - 1 when the model shifts, every t when the caller did), scored against
    # the flattened batch's labels one step further on: the next row's first labels reach each row's last positions.
    scored_positions = T - 1 + caller_shifts
    flat = torch.cat([labels.flatten(), labels.new_full((2,), ignore_index)])  # (N*T + 2,)
    index = torch.arange(N, device=labels.device)[:, None] * T + torch.arange(scored_positions, device=labels.device)
    targets = flat[index + 2 - caller_shifts]  # (N, scored_positions)
    loss, counted = nll(log_probs[:, :scored_positions], targets)
    found["across rows"] = float(loss[counted].mean())
    return found


def telling_labels(logits: torch.Tensor, labels: torch.Tensor, caller_shifts: int) -> torch.Tensor:
    """Labels [N, T] that make the shifts easy to tell apart: at each label slot, the token the position that should
    score it (shift 1) finds most likely relative to the positions that would score it under shift 0 or 2. Slots of
    ignore_index stay ignored; a slot no position scores under shift 1 keeps its label."""
    N, T, V = logits.shape
    log_probs = logits.float().log_softmax(-1)  # (N, T, V)
    # Label slot j is scored by position j - k + caller_shifts under shift k; pad so that every slot has all three.
    padded = torch.nn.functional.pad(log_probs, (0, 0, 2, 2), value=float("-inf"))  # (N, T + 4, V)

    def scorer(k: int) -> torch.Tensor:  # (N, T, V): row j is the position scoring slot j under shift k
        start = 2 - k + caller_shifts
        return padded[:, start : start + T]

    preference = scorer(1) - torch.maximum(scorer(0), scorer(2))  # (N, T, V); -inf where no position scores it
    chosen = preference.argmax(-1)  # (N, T)
    keep = ~torch.isfinite(scorer(1).amax(-1)) | (labels < 0)  # no right position, or ignored
    return torch.where(keep, labels, chosen)


@dataclass
class Look:
    """One call with labels: the loss forward returned and the candidates recomputed from its logits."""

    labels: str  # which labels: "drawn" or "chosen"
    loss: float
    candidates: dict[str, float]

    def verdict(self, threshold: float) -> tuple[str, set[str]]:
        """(what the loss is, the wrong candidates told apart from shift 1): the matched candidate's name, or
        "unexplained" when it is none of them."""
        distance = {name: abs(self.loss - value) for name, value in self.candidates.items()}
        apart = {name for name in WRONG if abs(self.candidates[name] - self.candidates[RIGHT]) > 2 * threshold}
        matched = min(distance, key=distance.__getitem__)
        if distance[matched] > threshold:
            return "unexplained", apart
        if matched != RIGHT and matched not in apart and distance[RIGHT] <= threshold:
            matched = RIGHT  # as close to shift 1 as to a candidate this loss cannot tell from it
        return matched, apart


@dataclass
class Rows:
    """The rows the call runs: input ids [N, T], the labels for them in the model's convention, and, when they are
    the session's rows, the session's logits of them [N, T, V] (its forward ran them in another order)."""

    input_ids: torch.Tensor  # (N, T)
    labels: torch.Tensor  # (N, T)
    shared: torch.Tensor | None = None  # (N, T, V)


@dataclass
class Measured:
    """What the calls with labels returned: a Look per labelling, the loss of the rows rolled by one, and the
    threshold they are judged against."""

    looks: list[Look]  # the drawn labels first; then labels chosen from the logits, when drawn ones told too little
    rolled_loss: float
    threshold: float
    order: str  # how the loss of the rows in another order was had: "predicted" or "run"

    @property
    def loss(self) -> float:
        """The loss forward returned for the drawn labels."""
        return self.looks[0].loss

    @property
    def order_change(self) -> float:
        """How far the loss moved when the rows ran in another order."""
        return abs(self.rolled_loss - self.loss)


class NonFinite(Exception):
    """A call with labels returned NaN or Inf: nothing to compare, and a finding of its own (FWD706)."""


class LabelShift(Check, declared=SPEC):
    name = "label-shift"

    def run(self, model, session) -> CheckResult:
        try:
            return self._run(model, session)
        except NonFinite as exc:
            finding = Finding("FWD706", Status.FAIL, str(exc), where=f"forward({convention(model).argument}=...)")
            return CheckResult.from_findings(self.name, [finding], finding.message)

    def _run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        way = convention(model)
        rows = self._rows(model, session, way)
        measured = self._measure(session, way, rows)
        findings, told, matched = self._judge(measured, where=f"forward({way.argument}=...)")
        return self._summarise(session, way, rows, measured, findings, told, matched)

    @staticmethod
    def _rows(model: ModelUnderTest, session: Session, way: Loss) -> Rows:
        """The session's first rows in another order (rolled by one), cut to the check's length, or, for a session
        with fewer rows than a call takes, rows of random tokens drawn from the check's own generator; labels in the
        model's convention with one column of ignore_index. SkipCheck when too short, or the vocabulary too small,
        to tell the shifts apart."""
        T = min(session.inputs.shape[1], max(LENGTH, session.min_seq_len))
        if T < 4:
            raise SkipCheck(f"seq_len {T} is too short: shifts 0-2 need at least 4 tokens to be told apart")
        if model.vocab_size < 2:
            raise SkipCheck("a vocabulary of one token makes every shift score the same")
        N = session.max_rows  # at least 2: rows beside each other are what a label crossing rows needs
        # Own draws: the session's shared generator stays where the other checks expect it.
        generator = torch.Generator().manual_seed(session.settings.inputs.seed)
        drawn = torch.randint(0, model.vocab_size, (N, T + 1), generator=generator).to(session.device)  # (N, T+1)
        shared = None
        if N >= 2 and session.inputs.shape[0] >= N:
            # each row beside another neighbour than in the session's forward, whose logits of them stand for a
            # call with the rows in that other order
            order = torch.arange(N, device=session.device).roll(1)  # (N,)
            input_ids = session.inputs[order, :T]  # (N, T)
            shared = session.reference()[order, :T]  # (N, T, V)
            following = torch.cat([input_ids[:, 1:], drawn[:, T:]], dim=1)  # (N, T): the next token, one drawn last
        else:
            input_ids, following = drawn[:, :T], drawn[:, 1:]  # (N, T) each
        labels = (following if way.caller_shifts else input_ids).clone()  # (N, T)
        labels[:, T // 2] = way.ignore_index  # a counted column in every candidate, the same in every row
        return Rows(input_ids, labels, shared)

    def _measure(self, session: Session, way: Loss, rows: Rows) -> Measured:
        """The call with labels; the loss of the same rows in another order, predicted or run; and, when the drawn
        labels leave some shift too close to call, a call with labels chosen from the logits; the threshold, with
        the noise floor measured where it can change the verdict."""
        input_ids, labels = rows.input_ids, rows.labels
        loss, logits = self._forward(session, way, input_ids, labels)
        looks = [Look("drawn", loss, candidate_losses(logits, labels, way.ignore_index, way.caller_shifts))]
        scale = max(abs(loss), logit_scale(logits))
        threshold = session.tolerance(scale)
        matched, apart = looks[0].verdict(threshold)
        # The same rows in another order: each row gets another neighbour; the mean over per-row terms stays the
        # same. Where the loss is shift 1's cross-entropy, the session's logits of these rows (run in another order)
        # give the loss forward would return for them: a row whose logits depend on its neighbour moves it. A call
        # with the rows rolled by one runs where no prediction can be made or it moves (a shortcut only ever makes a
        # pass cheaper), and where the loss is wrong, so that every finding rests on what forward returned.
        rolled_loss, order = None, "run"
        if rows.shared is not None and matched == RIGHT:
            predicted = candidate_losses(rows.shared, labels, way.ignore_index, way.caller_shifts)[RIGHT]
            if not session.noise_matters(abs(predicted - loss), scale):
                rolled_loss, order = predicted, "predicted"
        if rolled_loss is None:
            rolled_loss, _ = self._forward(session, way, input_ids.roll(1, 0), labels.roll(1, 0))
        order_change = abs(rolled_loss - loss)
        scale = max(scale, abs(rolled_loss))
        if apart != set(WRONG):
            # Drawn labels left some shift too close to call (weak logits, low precision): a third call with labels
            # chosen from these logits, which the right shift scores far better than the wrong ones.
            chosen = telling_labels(logits, labels, way.caller_shifts)
            chosen_loss, chosen_logits = self._forward(session, way, input_ids, chosen)
            looks.append(
                Look(
                    "chosen", chosen_loss, candidate_losses(chosen_logits, chosen, way.ignore_index, way.caller_shifts)
                )
            )
            scale = max(scale, abs(chosen_loss), logit_scale(chosen_logits))
        largest = max([order_change] + [abs(look.loss - look.candidates[RIGHT]) for look in looks])
        # The run-to-run noise and the model's rounding of its logits bound the loss's too.
        return Measured(looks, rolled_loss, session.threshold(scale, *session.floors(largest, scale)), order)

    @staticmethod
    def _judge(measured: Measured, where: str) -> tuple[list[Finding], set[str], str]:
        """(one finding per code, the wrong candidates told apart from shift 1, what the last call's loss matched):
        the loss must not change with the rows' order, and must equal shift 1's cross-entropy."""
        threshold, loss, rolled_loss = measured.threshold, measured.loss, measured.rolled_loss
        findings = []
        if measured.order_change > threshold:
            findings.append(
                Finding(
                    "FWD703",
                    Status.FAIL,
                    f"rolling the rows by one changes the loss from {loss:.6g} "
                    f"to {rolled_loss:.6g} (threshold {threshold:.3g}): labels cross from one row "
                    "into another",
                    where=where,
                )
            )
        told: set[str] = set()
        matched = RIGHT
        for look in measured.looks:
            matched, apart = look.verdict(threshold)
            right = look.candidates[RIGHT]
            if matched == RIGHT:
                told |= apart
            elif matched == "unexplained":
                findings.append(
                    Finding(
                        "FWD704",
                        Status.WARN,
                        f"the loss {look.loss:.6g} ({look.labels} labels) is "
                        f"none of the cross-entropies of the returned logits (shift 1: {right:.6g}; "
                        f"threshold {threshold:.3g})",
                        where=where,
                    )
                )
            else:
                code, meaning = WRONG[matched]
                findings.append(
                    Finding(
                        code,
                        Status.FAIL,
                        f"the loss {look.loss:.6g} equals the {matched} "
                        f"cross-entropy {look.candidates[matched]:.6g}, not shift 1's {right:.6g}: "
                        f"{meaning}",
                        where=where,
                    )
                )
                if matched == "across rows":
                    findings.append(
                        Finding(
                            "FWD703",
                            Status.FAIL,
                            "the last position of each row is scored against the next row's labels",
                            where=where,
                        )
                    )
        return first_per_code(findings), told, matched

    def _summarise(
        self,
        session: Session,
        way: Loss,
        rows: Rows,
        measured: Measured,
        findings: list[Finding],
        told: set[str],
        matched: str,
    ) -> CheckResult:
        """The result: the first failing finding's message, or what the loss equals and which candidates were told
        apart; SkipCheck when none could be."""
        looks, threshold = measured.looks, measured.threshold
        N, T = rows.input_ids.shape
        metrics = {
            "loss": measured.loss,
            "shift_1": looks[0].candidates[RIGHT],
            "loss_vs_shift_1": max(abs(look.loss - look.candidates[RIGHT]) for look in looks),
            "threshold": threshold,
            "rolled_rows_loss": measured.rolled_loss,
            "matched": matched,
        }
        data = {
            "convention": way.origin,
            "argument": way.argument,
            "shifted_by": way.shifted_by,
            "rows": N,
            "seq_len": T,
            "row_source": "the session's first rows, rolled by one" if rows.shared is not None else "drawn",
            "other_order": (
                "predicted from the session's logits of the same rows, which ran in another order"
                if measured.order == "predicted"
                else "a call with the rows rolled by one"
            ),
            "looks": [{"labels": look.labels, "loss": look.loss, "candidates": look.candidates} for look in looks],
            "told_apart": sorted(told),
        }
        if findings:
            bad = next((f for f in findings if f.status == Status.FAIL), findings[0])
            return CheckResult.from_findings(self.name, findings, bad.message, metrics=metrics, data=data)
        if not told:
            raise SkipCheck(
                f"every candidate loss lies within twice the threshold ({2 * threshold:.3g}) of shift "
                f"1's: these logits cannot tell the shifts apart in {session.settings.dtype}"
            )
        untold = sorted(set(WRONG) - told)
        summary = (
            f"loss {measured.loss:.4g} = shift 1 cross-entropy {looks[0].candidates[RIGHT]:.4g} (threshold "
            f"{threshold:.2g}); rows in any order"
        )
        if untold:
            summary += f"; not told apart: {', '.join(untold)}"
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def key_number(self, result: CheckResult) -> str:
        """What the loss matched when it is wrong; how far it is from shift 1's cross-entropy when it is right."""
        m = result.metrics
        if "matched" not in m:
            return ""
        if result.status == Status.FAIL and m["matched"] != RIGHT:
            return m["matched"]
        return f"{m['loss_vs_shift_1']:.2g} / {m['threshold']:.2g}"

    def _forward(self, session, way: Loss, input_ids, labels) -> tuple[float, torch.Tensor]:
        """(loss, logits [N, T, V]) of one call with labels; NonFinite when either holds NaN or Inf."""
        output = session.output(input_ids, **{way.argument: labels})
        loss = read_loss(output, way.output)
        if not isinstance(loss, torch.Tensor):
            raise SkipCheck(
                f"forward({way.argument}=labels) returned no loss at {way.output!r} "
                f"({type(output).__name__}); declare where it is with `loss: {{output: ...}}`"
            )
        if loss.numel() != 1:
            raise SkipCheck(
                f"the loss at {way.output!r} has shape {list(loss.shape)}, not one number: a loss "
                "without its mean (reduction='none') is not compared"
            )
        logits = extract_logits(output).float()
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
            raise SkipCheck(
                f"forward({way.argument}=labels) returned logits {list(logits.shape)} for input_ids "
                f"{list(input_ids.shape)}: the loss cannot be recomputed from every position"
            )
        value = float(loss)
        if not (torch.isfinite(logits).all() and torch.isfinite(loss)):
            raise NonFinite(
                f"with labels, forward returned a loss of {value} and "
                f"{int((~torch.isfinite(logits)).sum())} non-finite logits"
            )
        return value, logits
