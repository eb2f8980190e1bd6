"""future-token: changing later tokens must not move earlier logits, and samples of a batch must not read each other.

Behavioural: the model runs untouched (eval mode, dropout off), and only its logits are compared. Per cut position k,
one row keeps tokens < k and replaces every token >= k; the logits at positions < k must stay within tolerance of the
baseline. The cut rows, plus one unchanged copy of sample 0, run in forwards of the baseline's row count: the unchanged
copy sits beside other companions than in the baseline, so if it moves, samples read each other. A prefix pass
complements the cuts cheaply: for a causal model, the first k tokens run alone give the full run's logits at those
positions (k = 1, 2 and 16). Batch size 1 is a code path of its own in many models, so one short row also runs alone
with its later half replaced.

A pass the model refuses at some size (code that asserts T > 1, a cache sized for the batch) is a note: the findings of
the other passes stand, and the check is an error only when nothing at all could be compared.

Every change is judged against max(dtype tolerance scaled to the logits, noise_factor x the run-to-run noise floor,
4 x the model's own rounding measured against a float64 twin: fwdcheck/run/rounding.py), and NaN or Inf is never a pass.
A prefix or a row run alone reorders the forward's arithmetic, and a model whose hidden states run far above its logits
rounds by more than the dtype tolerance: that is rounding, not a leak.

What it costs, and why the shortcuts are sound. The comparisons start from the observation pass's logits of the
session's inputs (session.reference()) and no noise floor, and are first judged at the tolerance alone:
  - Observed logits ran under the observer, which can change code paths. But every comparison is of an untouched
    forward, at positions whose tokens (and all before them) are the session's own, against those logits. When all
    stay within the tolerance, each compared position of an untouched forward agrees with logits computed without the
    tokens that forward changed: what a leak would have to break. For the control row, an untouched forward of
    exactly sample 0's tokens, that agreement also says the observation computed what the untouched model does.
  - Below the tolerance nothing is a finding, whatever the noise floor: the threshold is the larger of the two.
    The noise floor's own findings (non-determinism, coarse comparisons) need noise beyond the tolerance (beyond
    10/noise_factor of it for the second), and the unchanged positions compared here are draws of that same noise,
    so it shows among them first: randomness left on in eval moves the control row.
Any change beyond that, NaN included, and the check computes the untouched baseline and the noise floor. When the
baseline is bitwise the observed logits (the observer changed nothing) the measured changes stand; otherwise every
comparison runs again against the baseline. Either way the verdict rests on the untouched model, as before.

The rows that vouch alone. When the cut rows and the control row need more than one forward, the first forward
holds sample 0 with only its last token replaced (cut T-1) and the next sample with every token but the first
replaced (cut 1). The first row's positions before its last compare every position with the last token, and, since
its companion differs from the baseline's in every other token, also show that the companion is not read: what the
control row shows, the last position aside. When nothing in that forward moves beyond the tolerance, the rest (cut
T/2, the control row) does not run; when something does, it runs, and the findings say which row moved. Cut T/2 is
then left to the prefix ladder and the single row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from fwdcheck.checks.future_token_spec import SPEC
from fwdcheck.checks.future_token_view import LeakColumn, LeakMap
from fwdcheck.checks.future_token_view import SingleRow as SingleRowShown
from fwdcheck.checks.leak_entry import attention_reading_ahead, describe, leak_entry
from fwdcheck.checks.perturbed_rows import Plan
from fwdcheck.checks.train_apart import first_module_apart, train_apart
from fwdcheck.checks.wording import span
from fwdcheck.errors import ModelRaised, first_line
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.compare import logit_scale, nonfinite_positions, position_change
from fwdcheck.run.session import Session, prefix_lengths

# The comparisons judged against the threshold: the metric holding each one's largest change, and how a summary names
# it. A comparison that ran but was not judged (the cuts of a model declared not causal) has no metric.
JUDGED = {
    "max_change_before_cut": "{cuts} cut{s}",
    "batch_max_change": "batch",
    "prefix_max_change": "prefix",
    "single_row_max_change": "single row",
    "padding_max_change": "left padding",
    "train_eval_change": "train vs eval",
}


@dataclass
class Judged:
    """What one comparison concluded: its findings, and the numbers and detail it adds to the result."""

    findings: list[Finding] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)

    def add(self, part: Judged) -> None:
        """Another comparison's conclusions after these: its findings last, its numbers and detail merged in."""
        self.findings += part.findings
        self.metrics.update(part.metrics)
        self.data.update(part.data)


@dataclass
class Prefix:
    ran: list[int] = field(default_factory=list)  # the lengths k that ran
    changes: list[torch.Tensor] = field(default_factory=list)  # (k,) per length that ran
    longest: torch.Tensor | None = None  # logits (1, L, V) of the longest prefix of two or more tokens


@dataclass
class SingleRow:
    length: int
    cut: int
    against: Literal["prefix", "baseline"]
    change: torch.Tensor  # (cut,)


@dataclass
class Measured:
    """What the comparisons measured against one reference, as per-position changes."""

    cuts: torch.Tensor | None = None  # (rows, T): the plan's first rows that ran (all of them, or its screen)
    prefix: Prefix = field(default_factory=Prefix)
    single: SingleRow | None = None
    padding: torch.Tensor | None = None  # (B, T)

    def ran(self, row: int) -> bool:
        return self.cuts is not None and row < len(self.cuts)

    def anything(self) -> bool:
        return self.cuts is not None or bool(self.prefix.ran) or self.single is not None or self.padding is not None

    def largest(self, plan: Plan) -> float:
        """The largest change at a position whose tokens, and the tokens before it, were not changed: what the
        noise floor and the untouched baseline are needed for when it is beyond the tolerance. inf for NaN."""
        seen = [torch.zeros(1)]
        if self.cuts is not None:
            seen.append(torch.tensor([plan.largest_before_cut(self.cuts)]))
        seen += self.prefix.changes
        if self.single is not None:
            seen.append(self.single.change)
        if self.padding is not None:
            seen.append(self.padding.flatten())
        return float(torch.cat([c.flatten().cpu() for c in seen]).max())


class Refusals:
    """The passes the model could not run. Each is a note; the findings already made stand; a check that could
    measure nothing at all re-raises the first refusal, and ends as an error."""

    def __init__(self):
        self.notes: list[str] = []
        self.first: ModelRaised | None = None

    def attempt(self, compute, what: str, size: str):
        """compute(), or None after noting `what` and why: the model raised, at this size."""
        try:
            return compute()
        except ModelRaised as exc:
            self.first = self.first or exc
            self.notes.append(f"{what}: {_reason(exc, size)}")
            return None


@dataclass
class Evidence:
    """What the comparisons measured against the logits the verdict rests on: the observation pass's, or the
    untouched baseline's once something moved beyond the tolerance (FutureToken._gather)."""

    measured: Measured
    refusals: Refusals
    size: tuple[int, int]  # (B, T) of the reference
    scale: float  # the reference's largest |logit|
    noise: float | None = None  # the noise floor; None: not measured
    rounding: float = 0.0  # the model's own rounding (session.rounding_change); 0.0: not measured
    noise_refused: bool = False  # the noise floor was asked for and refused: no change can be judged
    reference_note: str | None = None  # why every comparison was made again against the untouched baseline
    broken_baseline: torch.Tensor | None = None  # the untouched baseline, when it holds NaN or Inf

    @property
    def measured_nothing(self) -> bool:
        """Nothing can be judged: every comparison was refused, or the noise floor the judging needs."""
        return self.noise_refused or not self.measured.anything()


class FutureToken(Check, declared=SPEC):
    name = "future-token"
    per_code_path = True  # its bugs hide on paths a default run never takes: run on every cell of the matrix
    verdict_from_logits = True  # it judges how the logits move with the tokens: a cell with a pass's logits shares it

    def key_number(self, result: CheckResult) -> str:
        """The measurement the verdict rests on (metrics['decided_by'])."""
        m = result.metrics
        decided = m.get("decided_by")
        if decided == "nonfinite":
            return f"NaN/Inf at {m['nonfinite_positions']}" if "nonfinite_positions" in m else "NaN/Inf"
        if decided == "live_dropout_calls":
            return f"dropout in {m['live_dropout_calls']} call{'s' if m['live_dropout_calls'] != 1 else ''}"
        if decided == "noise_floor":
            return f"noise {m['noise_floor']:.2g} / {m['tolerance']:.2g}"
        if "max_change" in m:
            return f"{m['max_change']:.2g} / {m['threshold']:.2g}"
        return ""

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        live_dropout = self._observe_dropout(session)
        findings = _live_dropout(live_dropout)
        broken = self._broken_reference(session)
        if broken is not None:
            return self._nonfinite_baseline(findings, broken)
        # From here on every forward is a pass the model may refuse (a length, a row count): a refusal is a note,
        # the findings already made stand, and only a check that measured nothing at all ends as an error.
        plan = Plan(model, session, exhaustive=self.options_in(session).exhaustive)
        evidence = self._gather(plan, session)
        if evidence.broken_baseline is not None:
            return self._nonfinite_baseline(findings, evidence.broken_baseline)
        if evidence.measured_nothing:
            return self._measured_nothing(findings, evidence.refusals)
        judged = self._judge(model, session, plan, evidence, live_dropout)
        return self._summarise(model, plan, findings + judged.findings, judged, evidence.refusals)

    @staticmethod
    def _broken_reference(session: Session) -> torch.Tensor | None:
        """The logits the comparisons would start from when they hold NaN or Inf, which is a verdict in itself, on
        the untouched model: observed logits that hold them give way to the baseline. None when they are finite."""
        # The observation pass's logits stand in for the baseline until a comparison moves (session.reference()); if
        # the session's own inputs cannot run, nothing can be measured.
        reference = session.reference()  # (B, T, V)
        broken = nonfinite_positions(reference)  # one read of the logits, which are as large as a forward's
        if broken and not session.reference_untouched:
            reference = session.baseline()  # NaN or Inf is a verdict on the untouched model
            broken = nonfinite_positions(reference)
        return reference if broken else None

    def _gather(self, plan: Plan, session: Session) -> Evidence:
        """Every comparison, first against the observation pass's logits (session.reference()) with no noise floor.
        When something moves beyond what can pass unexamined, it is judged against the untouched model, with the
        noise floor measured: the observed logits stand when the untouched baseline is bitwise the same (the
        observer changed no code path); otherwise every comparison is made again against the baseline."""
        reference = session.reference()  # (B, T, V)
        B, T, _ = reference.shape
        refusals = Refusals()
        measured = self._measure(plan, session, reference, refusals)
        evidence = Evidence(measured, refusals, (B, T), logit_scale(reference))
        if not session.noise_matters(measured.largest(plan), evidence.scale):
            return evidence
        if not session.reference_untouched:
            observed, reference = reference, session.baseline()
            if not torch.equal(observed, reference):
                if nonfinite_positions(reference):
                    evidence.broken_baseline = reference
                    return evidence
                refusals = Refusals()
                evidence = Evidence(
                    self._measure(plan, session, reference, refusals),
                    refusals,
                    (B, T),
                    logit_scale(reference),
                    reference_note="the observation pass's logits differ from the untouched baseline's: "
                    "every comparison was made again against the baseline",
                )
            del observed  # not held beside the noise floor's forwards
        evidence.noise = evidence.refusals.attempt(session.repeat_change, "noise floor not measured", f"B={B}, T={T}")
        evidence.noise_refused = evidence.noise is None  # without the noise floor no change can be judged
        if not evidence.noise_refused:
            evidence.rounding = session.rounding_change()
        return evidence

    def _judge(
        self,
        model: ModelUnderTest,
        session: Session,
        plan: Plan,
        evidence: Evidence,
        live_dropout: list[tuple[str, str | None]],
    ) -> Judged:
        """Every comparison judged against one threshold, max(tolerance, noise_factor x the noise floor): the noise
        floor's own findings, left padding, samples reading each other, and, for a causal model, the leaks."""
        scale, noise, measured = evidence.scale, evidence.noise, evidence.measured
        tolerance = session.tolerance(scale)
        threshold = session.threshold(scale, noise or 0.0, evidence.rounding)
        judged = Judged(metrics={"logit_scale": scale, "tolerance": tolerance, "threshold": threshold})
        if evidence.rounding:
            judged.metrics["rounding"] = evidence.rounding
        if evidence.reference_note is not None:
            judged.data["reference"] = evidence.reference_note
        if live_dropout:
            judged.metrics["live_dropout_calls"] = len(live_dropout)
        judged.add(_noise(session, noise, tolerance, threshold))
        if measured.padding is not None:
            judged.add(_padding(measured.padding, threshold))
        cuts, prefix, alone, causal = measured.cuts, measured.prefix, False, plan.causal
        if cuts is not None:
            batch = _batch(plan, cuts, threshold)
            judged.add(batch)
            if batch.findings and causal:  # mixing contaminates every batched row: judge causality one row at a time
                rerun = evidence.refusals.attempt(
                    lambda: self._one_row_at_a_time(plan, session),
                    "causal comparisons skipped: samples read each other and the rows cannot run one at a time",
                    f"B=1, T={evidence.size[1]}",
                )
                if rerun is None:
                    causal = False
                else:
                    (cuts, prefix), alone = rerun, True
                    judged.data["note"] = "samples read each other: the causal comparisons ran one row at a time"
        if causal:
            judged.add(self._leaks(plan, cuts, prefix, measured.single, alone, threshold))
            self._locate(model, session, plan, judged)
        elif not plan.causal:
            judged.data["note"] = _not_judged_by_design(model)
        if session.train:
            judged.add(self._train_against_eval(model, session))
        return judged

    @staticmethod
    def _train_against_eval(model: ModelUnderTest, session: Session) -> Judged:
        """On the train path (the code-path matrix's train cell): its logits must be the eval path's on the same
        tokens (fwdcheck/checks/train_apart.py); where they part, the first module whose output differs. Eval logits
        that hold NaN or Inf hold the train path to nothing (the default path's own run reports them)."""
        judged = Judged()
        evaluated = session.eval_logits()  # (B, T, V)
        if nonfinite_positions(evaluated):
            return judged
        scale = logit_scale(evaluated)
        trained = session.reference()  # (B, T, V): the observation pass's, while comparisons agree with them
        change = position_change(trained, evaluated)  # (B, T)
        if session.noise_matters(float(change.max()), scale) and not session.reference_untouched:
            change = position_change(session.baseline(), evaluated)  # a verdict rests on the untouched model
        row = session.inputs[:1]  # (1, T)

        def locate() -> str | None:
            def evaluate():
                with session.evaluating():
                    return session.logits(row)

            return first_module_apart(model, evaluate, lambda: session.logits(row))

        judged.findings = train_apart(
            "FWD108", model, session, change, scale, locate, judged.metrics, session.updated_state
        )
        return judged

    @staticmethod
    def _locate(model: ModelUnderTest, session: Session, plan: Plan, judged: Judged) -> None:
        """Where the first leak enters (fwdcheck/checks/leak_entry.py), told in the FWD101 finding: the first cut whose
        earlier positions moved, its row and its sample as they were, run once more with every module's output
        kept. A model that refuses those forwards keeps its finding as it is."""
        leak = next((f for f in judged.findings if f.code == "FWD101" and f.status == Status.FAIL), None)
        threshold = judged.metrics["threshold"]
        columns = judged.data.get("leak_map", {}).get("columns", [])
        moved = next((c for c in columns if any(not v <= threshold for v in c["change"])), None)
        if leak is None or moved is None:
            return
        row = next(r for r, k in plan.cut_of.items() if k == moved["k"] and plan.sources[r] == moved["sample"])
        try:
            entry = leak_entry(model, session, session.inputs[moved["sample"]], plan.rows[row], moved["k"])
        except ModelRaised:
            return
        if entry is None:
            leak.message += "; no module output fwdcheck could compare shows it before the logits"
            return
        leak.module = entry.module
        leak.source = entry.source or leak.source
        leak.message += "; " + describe(entry, moved["k"])
        call = attention_reading_ahead(entry, session.observation().attention)
        if call is not None:  # the leak comes through a mask that reads ahead: its call is the line to fix
            leak.module, leak.source = call.module, call.source
            leak.message += f"; it comes through {call.module}'s attention, whose mask lets queries read later keys"

    def _summarise(
        self, model: ModelUnderTest, plan: Plan, findings: list[Finding], judged: Judged, refusals: Refusals
    ) -> CheckResult:
        """The result: the notes of the passes refused, the largest change and what the verdict rests on, and a
        summary naming what failed, or what ran and how far it moved."""
        metrics, data, threshold = judged.metrics, judged.data, judged.metrics["threshold"]
        if refusals.notes:
            data["notes"] = refusals.notes
        leaks = [f for f in findings if f.status in (Status.FAIL, Status.WARN)]
        judged_names = [name for name in JUDGED if name in metrics]
        metrics["max_change"] = max(metrics[name] for name in judged_names) if judged_names else 0.0
        metrics["decided_by"] = _decided_by(leaks, metrics)
        if leaks:
            summary = "; ".join(sorted({self.codes[f.code].split(":")[0] for f in leaks}))
        else:
            n = len(metrics.get("cuts", plan.cuts))  # the cuts that ran: the first forward's when it vouched alone
            ran = [JUDGED[name].format(cuts=n, s="s" if n != 1 else "") for name in judged_names]
            summary = f"{' + '.join(ran)}: max change {metrics['max_change']:.2g} vs threshold {threshold:.2g}"
            if not plan.causal:
                summary += f"; {_not_judged_by_design(model)}"
            elif model.pattern.kind == "prefix":
                summary += f"; cuts from {plan.first} on: {model.pattern.describe()}"
        if refusals.notes:
            more = len(refusals.notes) - 1
            summary += f"; {refusals.notes[0]}" + (f" (+{more} more note{'s' if more > 1 else ''})" if more else "")
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def _leaks(
        self,
        plan: Plan,
        cuts: torch.Tensor | None,
        prefix: Prefix,
        single: SingleRow | None,
        alone: bool,
        threshold: float,
    ) -> Judged:
        """Part (a), the model reading the future: the cut rows, the prefix ladder and the single row, a leak that
        both the batched cuts and the single row show reported once."""
        by_cut = _causal(plan, cuts, threshold) if cuts is not None else Judged()
        by_prefix = _prefix(prefix, threshold)
        by_row = _single_row(single, plan, alone, threshold)
        leaks = Judged()
        for part in (by_cut, by_prefix, by_row):
            leaks.metrics.update(part.metrics)
            leaks.data.update(part.data)
        leaks.findings = _with_single_row(
            by_cut.findings + by_prefix.findings, by_row.findings, by_row.metrics.get("single_row_max_change")
        )
        return leaks

    def _measure(self, plan: Plan, session, reference: torch.Tensor, refusals: Refusals) -> Measured:
        """Every comparison of the default run, against `reference`, reduced to per-position changes as it comes
        back: the cut rows and the control row, the prefix ladder, the single row, left padding."""
        measured = Measured()
        B, T, _ = reference.shape
        if session.unpadded is not None:  # a left-padded path: the real tokens must not see the padding
            measured.padding = refusals.attempt(
                lambda: position_change(reference, session.logits(session.inputs, model=session.unpadded)),
                "left-padding comparison skipped",
                f"B={B}, T={T} without padding",
            )
        screen = plan.screen(session.max_rows)
        measured.cuts = self._run_rows(session, plan, range(screen), reference, refusals)  # (screen, T), or None
        if (
            measured.cuts is not None
            and screen < len(plan.rows)
            and session.noise_matters(plan.largest_before_cut(measured.cuts), logit_scale(reference))
        ):
            rest = self._run_rows(session, plan, range(screen, len(plan.rows)), reference, refusals)
            if rest is not None:
                measured.cuts = torch.cat([measured.cuts, rest])
        if plan.causal:
            measured.prefix = self._run_prefix(session, reference[:1], refusals, plan.first or 1)
            if plan.single_row_wanted:
                measured.single = self._run_single_row(plan, session, measured.prefix, reference, refusals)
        return measured

    @staticmethod
    def _one_row_at_a_time(plan: Plan, session) -> tuple[torch.Tensor, Prefix]:
        """The cut rows and the prefix ladder again, every forward one row, against each sample run alone."""
        B = session.inputs.shape[0]
        alone = [session.logits(session.inputs[s : s + 1]) for s in range(B)]  # B x (1, T, V)
        changes = torch.zeros(len(plan.rows), session.inputs.shape[1])  # (rows, T); the control row is not rerun
        for i in plan.cut_rows:
            changes[i] = position_change(session.logits(plan.rows[i][None])[0], alone[plan.sources[i]][0])
        return changes, FutureToken._run_prefix(session, alone[0], Refusals(), plan.first or 1)

    def _nonfinite_baseline(self, findings: list[Finding], baseline: torch.Tensor) -> CheckResult:
        broken = nonfinite_positions(baseline)
        findings.append(
            Finding(
                "FWD104",
                Status.FAIL,
                f"the baseline logits hold NaN or Inf at {len(broken)} (sample, position) pairs",
                where=_pairs(broken),
            )
        )
        return CheckResult.from_findings(
            self.name,
            findings,
            "NaN/Inf in the baseline logits; nothing to compare",
            metrics={"nonfinite_positions": len(broken), "decided_by": "nonfinite"},
        )

    def _measured_nothing(self, findings: list[Finding], refusals: Refusals) -> CheckResult:
        """Every pass that compares was refused. Findings made before (dropout live in eval) stand, with the notes;
        without any, the check could not run: the model's first refusal makes it an error."""
        if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
            assert refusals.first is not None  # every pass was refused: the first refusal is kept
            raise refusals.first
        return CheckResult.from_findings(self.name, findings, "; ".join(refusals.notes), data={"notes": refusals.notes})

    @staticmethod
    def _run_rows(
        session, plan: Plan, indices: range, reference: torch.Tensor, refusals: Refusals
    ) -> torch.Tensor | None:
        """The plan's rows of these indices (cut rows, the control row), each reduced to its per-position change
        from its sample's reference (rows, T), in forwards no larger than the baseline's (session.changes). A
        model that refuses one of those row counts (a cache sized for exactly the batch) gets them in forwards of
        exactly the baseline's count, which it has run, the last one filled up with baseline rows."""
        rows, sources = [plan.rows[i] for i in indices], [plan.sources[i] for i in indices]
        ids = torch.stack(rows)
        N, T = ids.shape
        B = session.inputs.shape[0]
        sizes = sorted(set(session.row_counts(N)))
        changes = refusals.attempt(
            lambda: session.changes(ids, reference, sources),
            f"{N} rows in forwards of {' and '.join(map(str, sizes))} refused",
            f"B={'/'.join(map(str, sizes))}, T={T}",
        )
        if changes is not None or sizes == [B]:
            return changes

        def in_batches() -> torch.Tensor:
            out = []
            for start in range(0, N, B):
                chunk = list(range(start, min(start + B, N)))
                filler = [session.inputs[i] for i in range(B - len(chunk))]  # dropped from the result
                logits = session.logits(torch.stack([rows[i] for i in chunk] + filler))
                out += [position_change(logits[j], reference[sources[i]]) for j, i in enumerate(chunk)]
            return torch.stack(out)

        changes = refusals.attempt(in_batches, f"cut rows skipped in forwards of {B} rows too", f"B={B}, T={T}")
        if changes is not None:
            refusals.notes[-1] += f"; they ran in forwards of {B} row{'s' if B > 1 else ''}, the baseline's count"
        return changes

    @staticmethod
    def _observe_dropout(session) -> list[tuple[str, str | None]]:
        """Where dropout is live in eval (e.g. dropout_p handed to SDPA regardless of training): a finding in itself;
        the comparisons then run with it forced to zero so they measure the mask, not the dice."""
        try:
            return session.observation().active_dropout
        except Exception:  # the observer cannot follow every model; the behavioural checks still stand
            return []

    @staticmethod
    def _run_prefix(session, reference: torch.Tensor, refusals: Refusals, first: int = 1) -> Prefix:
        """The first k tokens of sample 0 run alone, compared with reference [1, T, V] there. A length the model
        refuses (code that asserts T > 1) is a note, and the ladder goes on with the longer ones. Keeps the logits
        of the longest prefix of two or more tokens that ran, which the single-row pass compares with. A prefix-LM's
        rungs start at its prefix's length (`first`): a shorter run cuts into the prefix, which reads itself both
        ways by design."""
        T = reference.shape[1]
        prefix = Prefix()
        refused = []
        for k in [k for k in prefix_lengths(T, session.min_seq_len, session.short_length) if k >= first]:
            try:
                alone = session.prefix_logits(k)  # (1, k, V); the short length is shared with other checks
            except ModelRaised as exc:
                refused.append((k, exc))
                continue
            prefix.ran.append(k)
            prefix.changes.append(position_change(alone, reference[:, :k])[0])  # (k,)
            prefix.longest = alone if k >= 2 else prefix.longest
        for k, _ in refused:
            if prefix.ran and k < max(prefix.ran):  # a longer one ran: this length itself is what the model refuses
                session.refused_length(k)
        if refused:
            refusals.first = refusals.first or refused[0][1]
            lengths = ", ".join(str(k) for k, _ in refused)
            refusals.notes.append(f"prefix pass at k={lengths} skipped: {_reason(refused[0][1], f'T={lengths}')}")
        return prefix

    @staticmethod
    def _run_single_row(
        plan: Plan, session, prefix: Prefix, reference: torch.Tensor, refusals: Refusals
    ) -> SingleRow | None:
        """Batch size 1 is a code path of its own in many models (a "single sequence" shortcut that forgets the mask,
        another kernel), and the cuts run several rows. One row runs alone with its later half replaced and is
        compared, before the replaced half, with the longest prefix run alone: both one row of the same length,
        so only the later tokens differ. It adds one short forward; without a prefix of two or more tokens, the
        row is the full sequence and is compared with the baseline."""
        against = prefix.longest if prefix.longest is not None else reference[:1]  # (1, L, V)
        L = against.shape[1]
        cut = plan.single_cut(L)
        if cut >= L:  # a prefix-LM whose prefix fills the row: nothing after it to change
            return None
        row = plan.single_row(L)
        logits = refusals.attempt(lambda: session.row_logits(row), "single-row pass skipped", f"B=1, T={L}")
        if logits is None:
            return None
        change = position_change(logits[:, :cut], against[:, :cut])[0]  # (cut,)
        return SingleRow(L, cut, "prefix" if prefix.longest is not None else "baseline", change)


# -- each comparison judged against the threshold ----------------------------------------------------------------------


def _not_judged_by_design(model: ModelUnderTest) -> str:
    """Why part (a) did not run, and what was judged instead: the model's pattern lets every token (or, for a
    prefix as long as the sequence, every prefix token) read the tokens after it."""
    return (
        f"part (a) not judged: {model.pattern.describe()}, so later tokens may move earlier logits; judged instead: "
        "samples independent, deterministic forwards, left padding where the code paths add it"
    )


def _live_dropout(live_dropout: list[tuple[str, str | None]]) -> list[Finding]:
    """Dropout live in eval mode (FutureToken._observe_dropout) is a finding in itself; the comparisons run with it
    forced to zero."""
    if not live_dropout:
        return []
    spots = [spot for spot, _ in live_dropout]
    return [
        Finding(
            "FWD103",
            Status.FAIL,
            f"dropout is live in eval mode at {len(live_dropout)} call(s); forced to zero for the comparisons below",
            where="; ".join(spots[:4]) + (" ..." if len(spots) > 4 else ""),
            source=live_dropout[0][1],  # the first live call's line
        )
    ]


def _noise(session: Session, noise: float | None, tolerance: float, threshold: float) -> Judged:
    """The noise floor's own findings: identical forwards that differ in eval mode, and a floor so high that
    the comparisons are coarse. None: not measured, since nothing moved beyond the tolerance."""
    if noise is None:
        return Judged(
            data={
                "noise_floor": "not measured: nothing moved beyond the tolerance, where no noise floor can "
                "change the verdict"
            }
        )
    findings = []
    mode = "train mode (every dropout zeroed)" if session.train else "eval mode"
    if noise > tolerance:
        draws = session.random_draws()
        cause = (
            f"the model draws random numbers itself ({', '.join(name for name, _ in draws[:3])}), which no "
            "zeroing of dropout turns off"
            if draws
            else f"the forward is not deterministic in {mode}"
        )
        findings.append(
            Finding(
                "FWD103",
                Status.FAIL,
                f"two identical forwards in {mode} differ by {noise:.3g} (tolerance {tolerance:.3g}): {cause}",
                where="; ".join(f"{name} at {line}" for name, line in draws[:4] if line) or None,
                source=next((line for _, line in draws if line), None),
            )
        )
    if session.settings.tolerance.noise_factor * noise > 10 * tolerance:
        findings.append(
            Finding(
                "FWD106",
                Status.WARN,
                f"noise floor {noise:.3g} is over 10x the dtype "
                f"tolerance {tolerance:.3g}: only changes above {threshold:.3g} are seen",
            )
        )
    return Judged(findings, {"noise_floor": noise})


def _padding(change: torch.Tensor, threshold: float) -> Judged:
    """change: (B, T) of the left-padded real tokens from the same tokens run without padding."""
    metrics = {"padding_max_change": float(change.max())}
    if not bool((change > threshold).any()):
        return Judged(metrics=metrics)
    moved = sorted({p for p in (change > threshold).nonzero()[:, 1].tolist()})
    finding = Finding(
        "FWD107",
        Status.FAIL,
        f"left padding moves the real tokens' logits by up to "
        f"{float(change.max()):.3g} (threshold {threshold:.3g}): the pads are not masked out, or "
        "the positions count them",
        where=f"real positions {span(moved)}",
    )
    return Judged([finding], metrics)


def _batch(plan: Plan, changes: torch.Tensor, threshold: float) -> Judged:
    """Part (b), samples reading each other: sample 0, unchanged, must keep its logits beside other companions.
    changes: (rows, T), each row's change from its sample's reference."""
    # The control row's every position, or, when the first forward vouched alone, the first row's before its
    # cut (sample 0 with its last token replaced, beside a companion replaced in all but its first token).
    control = plan.control if plan.control < len(changes) else 0
    control_change = changes[control, : plan.cut_of.get(control, changes.shape[1])].tolist()
    moved = [p for p, c in enumerate(control_change) if c > threshold]
    metrics = {"batch_max_change": max(control_change)}
    if not moved:
        return Judged(metrics=metrics)
    finding = Finding(
        "FWD102",
        Status.FAIL,
        f"sample 0 is unchanged but its logits moved by up to {max(control_change):.3g} "
        f"(threshold {threshold:.3g}) when the other rows of its batch changed: samples read "
        "each other",
        where=f"sample 0, positions {span(moved)}",
    )
    return Judged([finding], metrics)


def _causal(plan: Plan, changes: torch.Tensor, threshold: float) -> Judged:
    """changes: (rows, T), each row's change from its sample's reference; compared before each row's cut."""
    findings = []
    columns: list[LeakColumn] = []
    worst = 0.0
    leaked_pairs: list[tuple[int, int]] = []
    nan_pairs: list[tuple[int, int]] = []
    exhaustive = plan.exhaustive
    ran = [row for row in plan.cut_rows if row < len(changes)]
    cuts = [plan.cut_of[row] for row in ran]
    for row, k in zip(ran, cuts, strict=True):
        sample = plan.sources[row]
        change = changes[row, :k].tolist()  # k values: the positions before the cut
        columns.append({"k": k, "sample": sample, "change": change})
        worst = max([worst] + [c for c in change if math.isfinite(c)])
        for p, c in enumerate(change):
            if not math.isfinite(c):
                nan_pairs.append((p, k))
            elif c > threshold:
                leaked_pairs.append((p, k))
    what = "token {k} changed" if exhaustive else "tokens >= {k} changed"
    if leaked_pairs:
        by_cut: dict[int, list[int]] = {}
        for p, k in leaked_pairs:
            by_cut.setdefault(k, []).append(p)
        first_k = min(by_cut)
        findings.append(
            Finding(
                "FWD101",
                Status.FAIL,
                f"earlier logits moved by up to {worst:.3g} (threshold {threshold:.3g}) at {len(leaked_pairs)} "
                f"(query, perturbed) pairs: the model reads the future",
                where=f"positions {span(by_cut[first_k])} when {what.format(k=first_k)}"
                + (f"; {len(by_cut) - 1} more column(s) in the leak map" if len(by_cut) > 1 else ""),
            )
        )
    if nan_pairs:
        p, k = nan_pairs[0]
        findings.append(
            Finding(
                "FWD104",
                Status.FAIL,
                f"NaN or Inf appeared at {len(nan_pairs)} earlier (query, perturbed) pairs when later tokens changed",
                where=f"position {p} when {what.format(k=k)}",
            )
        )
    leak_map: LeakMap = {"kind": "token" if exhaustive else "cut", "threshold": threshold, "columns": columns}
    return Judged(findings, {"max_change_before_cut": worst, "cuts": cuts}, {"leak_map": leak_map})


def _prefix(prefix: Prefix, threshold: float) -> Judged:
    """The first k tokens run alone must give the full run's logits there."""
    worst, moved = 0.0, []
    for k, change in zip(prefix.ran, prefix.changes, strict=True):
        values = change.tolist()  # k values, inf for NaN
        worst = max([worst, *values])
        if max(values) > threshold:
            moved.append((k, [p for p, c in enumerate(values) if c > threshold]))
    metrics = {"prefix_lengths": prefix.ran, **({"prefix_max_change": worst} if prefix.ran else {})}
    if not moved:
        return Judged(metrics=metrics)
    k, positions = moved[0]
    return Judged(
        [
            Finding(
                "FWD105",
                Status.FAIL,
                f"the first k tokens run alone differ from the full run by up "
                f"to {worst:.3g} (threshold {threshold:.3g}) for k in {[m[0] for m in moved]}",
                where=f"sample 0, positions {span(positions)} with the first {k} tokens alone",
            )
        ],
        metrics,
    )


def _single_row(single: SingleRow | None, plan: Plan, alone: bool, threshold: float) -> Judged:
    """One row run alone (batch size 1) must keep its logits before its cut: FWD101, FWD104 for NaN or Inf. Not
    judged when the plan skipped it or the comparisons already ran one row at a time."""
    if plan.single_row_skipped or alone:
        return Judged(
            data={
                "single_row": plan.single_row_skipped
                or "not needed: the comparisons above already ran one row beside several"
            }
        )
    if single is None:  # refused: a note says so
        return Judged()
    L, cut, change = single.length, single.cut, single.change.tolist()
    largest = max([0.0] + [c for c in change if math.isfinite(c)])
    nan = [p for p, c in enumerate(change) if not math.isfinite(c)]
    moved = [p for p, c in enumerate(change) if math.isfinite(c) and c > threshold]
    where = f"sample 0 run alone (T={L}), positions {span(moved or nan)} when tokens >= {cut} changed"
    findings = []
    if moved:
        findings.append(
            Finding(
                "FWD101",
                Status.FAIL,
                f"with one row run alone (batch size 1), earlier logits "
                f"moved by up to {largest:.3g} (threshold {threshold:.3g}) when later tokens "
                "changed: the single-row path reads the future",
                where=where,
            )
        )
    if nan:
        findings.append(
            Finding(
                "FWD104",
                Status.FAIL,
                f"with one row run alone (batch size 1), NaN or Inf "
                f"appeared at {len(nan)} earlier positions when later tokens changed",
                where=where,
            )
        )
    shown: SingleRowShown = {"length": L, "cut": cut, "against": single.against, "change": change}
    return Judged(findings, {"single_row_max_change": largest}, {"single_row": shown})


def _with_single_row(findings: list[Finding], single: list[Finding], single_change: float | None) -> list[Finding]:
    """A leak the batched cuts found too is one finding that says it also shows on one row; a leak only one row
    shows is its own finding. A prefix mismatch is then explained: the prefixes also run one row at a time."""
    leak = next((f for f in single if f.code == "FWD101"), None)
    if leak is None:
        return findings + single
    for f in findings:
        if f.code == "FWD105":
            f.message += "; the prefixes run one row alone too, and a row run alone reads the future (FWD101)"
    batched = next((f for f in findings if f.code == "FWD101"), None)
    if batched is not None:
        by = f", by up to {single_change:.3g}" if single_change is not None else ""
        batched.where = f"{batched.where}; also with one row run alone (batch size 1{by})"
        return findings + [f for f in single if f is not leak]
    return findings + single


def _decided_by(leaks: list[Finding], metrics: dict) -> str:
    """The measurement the verdict rests on, which a report shows as the check's key number: the largest change
    when a change beyond the threshold decided it, or when nothing did (it then stayed below); otherwise NaN/Inf
    ('nonfinite'), the noise floor, or the dropout calls seen live in eval."""
    codes = {f.code for f in leaks}
    if not codes or metrics["max_change"] > metrics["threshold"]:
        return "max_change"
    if "FWD104" in codes:
        return "nonfinite"
    if "FWD106" in codes or metrics.get("noise_floor", 0.0) > metrics["tolerance"]:
        return "noise_floor"
    if "live_dropout_calls" in metrics:
        return "live_dropout_calls"
    return "max_change"


def _reason(exc: ModelRaised, size: str) -> str:
    """'the model raised AssertionError at T=1 (T must be > 1)': the exception's kind, the size, its first line."""
    cause = exc.__cause__
    if cause is None:  # fwdcheck's own words: the output cannot be checked
        return f"{exc} at {size}"
    detail = first_line(cause, limit=120)
    return f"the model raised {type(cause).__name__} at {size}" + (f" ({detail})" if detail else "")


def _pairs(pairs: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"({s}, {p})" for s, p in pairs[:6])
    return shown + (" ..." if len(pairs) > 6 else "")
