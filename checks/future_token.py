"""future-token: changing later tokens must not move earlier logits, and samples of a batch must not read each other.

Behavioural: the model runs untouched (eval mode, dropout off), and only its logits are compared. Per cut position k,
one row keeps tokens < k and replaces every token >= k; the logits at positions < k must stay within tolerance of the
baseline. All cut rows, plus one unchanged copy of sample 0, run as one batch: the unchanged copy now sits beside
different companions, so if it moves, samples read each other. A prefix pass complements the cuts cheaply: for a causal
model, the first k tokens run alone give the full run's logits at those positions (k = 1, 2, 4, ...). Batch size 1 is a
code path of its own in many models, so one short row also runs alone with its later half replaced.

A pass the model refuses at some size (code that asserts T > 1, a cache sized for the batch) is a note: the findings of
the other passes stand, and the check is an error only when nothing at all could be compared.

Every change is judged against max(dtype tolerance scaled to the logits, noise_factor x the run-to-run noise floor),
and NaN or Inf is never a pass.
"""

from __future__ import annotations

import torch

from fwdcheck.errors import ModelRaised
from fwdcheck.paths import path_cells
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.session import nonfinite_positions, position_change

MAX_DEFAULT_CUTS = 4


def default_cuts(T: int) -> list[int]:
    """The first changed position of each cut row: 1, T-1, T/2 and the 2^i - 1 boundaries, at most four, spread out.
    The prefix pass adds k = 1, 2, 4, ... at little cost."""
    candidates = sorted({1, T - 1, T // 2} | {2**i - 1 for i in range(2, T.bit_length() + 1) if 2**i - 1 < T})
    candidates = [k for k in candidates if 1 <= k < T]
    if len(candidates) <= MAX_DEFAULT_CUTS:
        return candidates
    must = {1, T - 1, T // 2}
    rest = [k for k in candidates if k not in must]
    picks = MAX_DEFAULT_CUTS - len(must)
    spread = [rest[round(i * (len(rest) - 1) / (picks - 1))] for i in range(picks)] if picks > 1 else \
        [rest[len(rest) // 2]]
    return sorted(must | set(spread))


def span(positions: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    parts, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            parts.append(f"{start}" if start == p else f"{start}-{p}")
            start = None
    return ", ".join(parts)


class FutureToken(Check):
    name = "future-token"
    description = "changing later tokens must not move earlier logits; samples of a batch must not read each other"
    codes = {
        "FWD101": "logits at earlier positions moved when later tokens changed: the model reads the future",
        "FWD102": "a sample's logits moved when the other samples of its batch changed: samples read each other",
        "FWD103": "dropout or other randomness is live in eval mode: identical forwards differ",
        "FWD104": "the logits hold NaN or Inf",
        "FWD105": "the first k tokens run alone give other logits than the full run: the prefix depends on what "
        "follows it",
        "FWD106": "the run-to-run noise floor is high next to the dtype tolerance: comparisons are coarse",
        "FWD107": "left padding changes the real tokens' logits: padding is read, or shifts the positions",
    }
    explain = """\
Verifies, with the model untouched in eval mode and dropout forced to zero, that
  (a) changing the token at a cut position k and every later one leaves the logits at positions < k unchanged,
      for k = 1, T-1, T/2 and the 2^i - 1 boundaries (every k with --exhaustive, which draws the full leak map),
      and that the first k tokens run alone reproduce the full run's logits there (k = 1, 2, 4, ... up to T/4);
      batch size 1 included: one row run alone with its later half replaced must keep its earlier logits (it has
      the length of the longest prefix, and is compared with that prefix, also run alone);
  (b) a sample's logits do not move when the other samples of its batch change.
Why: a decoder that can see the future trains to a loss it can never reach at inference, and a batch whose samples
read each other makes every metric depend on batch composition. The usual causes are a dropped or inverted causal
mask, a 0/1 float mask, wrong position indexing, or a reshape that mixes the batch axis with another.
How changes are judged: a change counts when it exceeds both the dtype tolerance (atol + rtol x the largest |logit|,
defaults as torch.testing.assert_close) and noise_factor x the run-to-run noise floor measured by running the
identical input twice. NaN or Inf is reported where it appears, never passed.
How to fix: read the leak map (query position x perturbed position). A full upper triangle means no causal mask; a
band above the diagonal means a mask shifted by one; only some samples moving means a batch reshape. Then run
`fwdcheck explain mask-audit` to see which attention call received which mask. For bidirectional encoders set
`model.causal: false`: part (a) is then skipped, part (b) still runs. A leak shown only by the row run alone is a
shortcut taken for a single sequence; the code-path matrix (`paths:`) names such paths one by one.
Sizes the model refuses: a forward that raises at some length or row count is noted ("prefix pass at k=1 skipped:
the model raised AssertionError at T=1") and the other passes still judge; the prefix pass goes on with longer
lengths, and cut rows the model will not take at once run in batches of the baseline's size. Declare the shortest
sequence forward accepts as `inputs.min_seq_len` to skip the shorter prefixes without a note. The check is an error
only when the model refused every comparison."""

    def run(self, model, session) -> CheckResult:
        base = session.baseline()  # (B, T, V); if the session's own inputs cannot run, nothing can be measured
        observation_note = self._observe_dropout(session)
        B, T, _ = base.shape
        findings: list[Finding] = []
        if observation_note:
            findings.append(observation_note)
        broken = nonfinite_positions(base)
        if broken:
            findings.append(Finding("FWD104", Status.FAIL, f"the baseline logits hold NaN or Inf at "
                                    f"{len(broken)} (sample, position) pairs", where=_pairs(broken)))
            return CheckResult.from_findings(self.name, findings, "NaN/Inf in the baseline logits; nothing to compare",
                                             metrics={"nonfinite_positions": len(broken)})

        # From here on every forward is a pass the model may refuse (a length, a row count): a refusal is a note,
        # the findings already made stand, and only a check that measured nothing at all ends as an error.
        refusals = Refusals()
        scale = float(base.abs().max())
        repeat = refusals.attempt(session.repeat_change, "noise floor not measured", f"B={B}, T={T}")
        if repeat is None:  # without the noise floor no change can be judged
            return self._measured_nothing(findings, refusals)
        threshold = session.threshold(scale, repeat)
        measured = False
        if session.unpadded is not None:  # a left-padded path: the real tokens must not see the padding
            padding = refusals.attempt(lambda: self._padding(session, base, threshold),
                                       "left-padding comparison skipped", f"B={B}, T={T} without padding")
            measured = padding is not None
            findings += padding or []
        tolerance = session.tolerance(scale)
        if repeat > tolerance:
            findings.append(Finding("FWD103", Status.FAIL, f"two identical eval-mode forwards differ by {repeat:.3g} "
                                    f"(tolerance {tolerance:.3g}): the forward is not deterministic in eval mode"))
        if session.settings.noise_factor * repeat > 10 * tolerance:
            findings.append(Finding("FWD106", Status.WARN, f"noise floor {repeat:.3g} is over 10x the dtype "
                                    f"tolerance {tolerance:.3g}: only changes above {threshold:.3g} are seen"))
        metrics = {"logit_scale": scale, "tolerance": tolerance, "noise_floor": repeat, "threshold": threshold}
        data: dict = {}

        exhaustive = session.settings.exhaustive
        cuts = list(range(1, T)) if exhaustive else default_cuts(T)
        rows, sources = [], []
        for i, k in enumerate(cuts):
            sample = i % B
            row = session.inputs[sample].clone()
            if exhaustive:  # one token at a time: the map's cell (i, k) is exactly "position i reads token k"
                row[k] = session.random_ids((1,), differ_from=row[k:k + 1])[0]
            else:
                row[k:] = session.random_ids((T - k,), differ_from=row[k:])
            rows.append(row)
            sources.append(sample)
        control = len(rows)
        rows.append(session.inputs[0].clone())  # unchanged, but beside other companions than in the baseline
        logits = self._run_rows(session, rows, refusals)  # (cuts + 1, T, V), or None when no row count ran

        causal = model.causal
        alone = False  # the causal comparisons ran one row at a time
        if logits is not None:
            measured = True
            control_change = position_change(logits[control:control + 1], base[0:1])[0]  # (T,)
            batch_moved = [p for p in range(T) if control_change[p] > threshold]
            metrics["batch_max_change"] = float(control_change.max())
            if batch_moved:
                findings.append(Finding(
                    "FWD102", Status.FAIL,
                    f"sample 0 is unchanged but its logits moved by up to {float(control_change.max()):.3g} "
                    f"(threshold {threshold:.3g}) when the other rows of its batch changed: samples read each other",
                    where=f"sample 0, positions {span(batch_moved)}"))
            if batch_moved and causal:  # mixing contaminates every batched row: judge causality one row at a time
                rerun = refusals.attempt(
                    lambda: (torch.cat([session.logits(row[None]) for row in rows[:control]]),
                             torch.cat([session.logits(session.inputs[s:s + 1]) for s in range(B)])),
                    "causal comparisons skipped: samples read each other and the rows cannot run one at a time",
                    f"B=1, T={T}")
                if rerun is None:
                    causal = False
                else:
                    (logits, base), alone = rerun, True
                    data["note"] = "samples read each other: the causal comparisons ran one row at a time"

        if causal:
            if logits is not None:
                findings += self._causal(cuts, sources, logits, base, threshold, exhaustive, metrics, data)
            prefix, longest = self._prefix(session, base, threshold, metrics, refusals)
            findings += prefix
            single = self._single_row(model, session, longest, base, threshold, alone, metrics, data, refusals)
            findings = _with_single_row(findings, single)
            measured = measured or bool(metrics["prefix_lengths"]) or "single_row_max_change" in metrics
        elif not model.causal:
            data["note"] = "model.causal is false: part (a) skipped"

        if not measured:
            return self._measured_nothing(findings, refusals)
        if refusals.notes:
            data["notes"] = refusals.notes
        leaks = [f for f in findings if f.status in (Status.FAIL, Status.WARN)]
        ran = [f"{len(cuts)} cut{'s' if len(cuts) != 1 else ''} + batch"] if logits is not None else []
        ran += ["prefix"] if metrics.get("prefix_lengths") else []
        ran += ["single row"] if "single_row_max_change" in metrics else []
        summary = (f"{' + '.join(ran)}: max change before a cut "
                   f"{metrics.get('max_change_before_cut', 0):.2g} vs threshold {threshold:.2g}"
                   if not leaks else "; ".join(sorted({self.codes[f.code].split(':')[0] for f in leaks})))
        if refusals.notes:
            more = len(refusals.notes) - 1
            summary += f"; {refusals.notes[0]}" + (f" (+{more} more note{'s' if more > 1 else ''})" if more else "")
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def _measured_nothing(self, findings: list[Finding], refusals: Refusals) -> CheckResult:
        """Every pass that compares was refused. Findings made before (dropout live in eval) stand, with the notes;
        without any, the check could not run: the model's first refusal makes it an error."""
        if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
            raise refusals.first
        return CheckResult.from_findings(self.name, findings, "; ".join(refusals.notes), data={"notes": refusals.notes})

    @staticmethod
    def _run_rows(session, rows: list[torch.Tensor], refusals: Refusals) -> torch.Tensor | None:
        """All rows in one forward. A model that cannot take that many rows (a cache sized for the batch) gets them
        in forwards of the baseline's row count, which it has run, the last one filled up with baseline rows."""
        N, T = len(rows), rows[0].shape[0]
        B = session.inputs.shape[0]
        logits = refusals.attempt(lambda: session.logits(torch.stack(rows)), f"{N} rows in one forward refused",
                                  f"B={N}, T={T}")
        if logits is not None or N <= B:
            return logits

        def in_batches() -> torch.Tensor:
            out = []
            for start in range(0, N, B):
                chunk = rows[start:start + B]
                filler = [session.inputs[i] for i in range(B - len(chunk))]  # dropped from the result
                out.append(session.logits(torch.stack(chunk + filler))[:len(chunk)])
            return torch.cat(out)

        logits = refusals.attempt(in_batches, f"cut rows skipped in forwards of {B} rows too", f"B={B}, T={T}")
        if logits is not None:
            refusals.notes[-1] += f"; they ran in forwards of {B} rows, the baseline's count"
        return logits

    @staticmethod
    def _padding(session, base, threshold) -> list[Finding]:
        plain = session.logits(session.inputs, model=session.unpadded)  # the same tokens, nothing before them
        change = position_change(base, plain)  # (B, T)
        if not bool((change > threshold).any()):
            return []
        moved = sorted({p for p in (change > threshold).nonzero()[:, 1].tolist()})
        return [Finding("FWD107", Status.FAIL, f"left padding moves the real tokens' logits by up to "
                        f"{float(change.max()):.3g} (threshold {threshold:.3g}): the pads are not masked out, or "
                        "the positions count them", where=f"real positions {span(moved)}")]

    @staticmethod
    def _observe_dropout(session) -> Finding | None:
        """Dropout live in eval (e.g. dropout_p handed to SDPA regardless of training) is a finding in itself; the
        comparisons then run with it forced to zero so they measure the mask, not the dice."""
        try:
            live = session.observation().active_dropout
        except Exception:  # the observer cannot follow every model; the behavioural checks still stand
            return None
        if not live:
            return None
        return Finding("FWD103", Status.FAIL, f"dropout is live in eval mode at {len(live)} call(s); forced to zero "
                       "for the comparisons below", where="; ".join(live[:4]) + (" ..." if len(live) > 4 else ""))

    def _causal(self, cuts, sources, logits, base, threshold, exhaustive, metrics, data) -> list[Finding]:
        findings = []
        columns = []
        worst = 0.0
        leaked_pairs: list[tuple[int, int]] = []
        nan_pairs: list[tuple[int, int]] = []
        for row, (k, sample) in enumerate(zip(cuts, sources)):
            change = position_change(logits[row:row + 1, :k], base[sample:sample + 1, :k])[0]  # (k,)
            columns.append({"k": k, "sample": sample, "change": [float(c) for c in change]})
            finite = change[torch.isfinite(change)]
            worst = max(worst, float(finite.max()) if finite.numel() else 0.0)
            for p in range(k):
                if not torch.isfinite(change[p]):
                    nan_pairs.append((p, k))
                elif change[p] > threshold:
                    leaked_pairs.append((p, k))
        metrics["max_change_before_cut"] = worst
        metrics["cuts"] = cuts
        data["leak_map"] = {"kind": "token" if exhaustive else "cut", "threshold": threshold, "columns": columns}
        what = "token {k} changed" if exhaustive else "tokens >= {k} changed"
        if leaked_pairs:
            by_cut: dict[int, list[int]] = {}
            for p, k in leaked_pairs:
                by_cut.setdefault(k, []).append(p)
            first_k = min(by_cut)
            findings.append(Finding(
                "FWD101", Status.FAIL,
                f"earlier logits moved by up to {worst:.3g} (threshold {threshold:.3g}) at {len(leaked_pairs)} "
                f"(query, perturbed) pairs: the model reads the future",
                where=f"positions {span(by_cut[first_k])} when {what.format(k=first_k)}"
                + (f"; {len(by_cut) - 1} more column(s) in the leak map" if len(by_cut) > 1 else "")))
        if nan_pairs:
            p, k = nan_pairs[0]
            findings.append(Finding("FWD104", Status.FAIL, f"NaN or Inf appeared at {len(nan_pairs)} earlier "
                                    "(query, perturbed) pairs when later tokens changed",
                                    where=f"position {p} when {what.format(k=k)}"))
        return findings

    @staticmethod
    def _prefix(session, base, threshold, metrics, refusals) -> tuple[list[Finding], torch.Tensor | None]:
        """The first k tokens run alone must give the full run's logits there. A length the model refuses (code
        that asserts T > 1) is a note, and the ladder goes on with the longer ones. Returns the findings and the
        logits of the longest prefix of two or more tokens that ran, which the single-row pass compares with."""
        T = base.shape[1]
        worst, moved, ran, refused = 0.0, [], [], []
        longest = None
        for k in prefix_lengths(T, session.min_seq_len):
            try:
                alone = session.logits(session.inputs[:1, :k])  # (1, k, V)
            except ModelRaised as exc:
                refused.append((k, exc))
                continue
            ran.append(k)
            longest = alone if k >= 2 else longest
            change = position_change(alone, base[:1, :k])[0]
            worst = max(worst, float(change.max()))
            if change.max() > threshold:
                moved.append((k, [p for p in range(k) if change[p] > threshold]))
        for k, _ in refused:
            if ran and k < max(ran):  # a longer one ran: this length itself is what the model refuses
                session.refused_length(k)
        if refused:
            refusals.first = refusals.first or refused[0][1]
            lengths = ", ".join(str(k) for k, _ in refused)
            refusals.notes.append(f"prefix pass at k={lengths} skipped: {_reason(refused[0][1], f'T={lengths}')}")
        metrics["prefix_lengths"] = ran
        if ran:
            metrics["prefix_max_change"] = worst
        if not moved:
            return [], longest
        k, positions = moved[0]
        return [Finding("FWD105", Status.FAIL, f"the first k tokens run alone differ from the full run by up to "
                        f"{worst:.3g} (threshold {threshold:.3g}) for k in {[m[0] for m in moved]}",
                        where=f"sample 0, positions {span(positions)} with the first {k} tokens alone")], longest

    @staticmethod
    def _single_row(model, session, longest, base, threshold, alone, metrics, data, refusals) -> list[Finding]:
        """Batch size 1 is a code path of its own in many models (a "single sequence" shortcut that forgets the mask,
        another kernel), and the cuts run several rows. One row runs alone with its later half replaced and is
        compared, before the replaced half, with the longest prefix run alone: both one row of the same length,
        so only the later tokens differ. It adds one short forward; without a prefix of two or more tokens, the
        row is the full sequence and is compared with the baseline."""
        B, T = session.inputs.shape
        if B == 1 or alone:
            data["single_row"] = "not needed: the comparisons above already ran one row beside several"
            return []
        if any(cell.batch_size == 1 for cell in path_cells(model, session.settings.paths, B)):
            data["single_row"] = "left to the code-path matrix, whose batch-size-1 cells are named as such"
            return []
        reference = longest if longest is not None else base[:1]  # (1, L, V)
        L = reference.shape[1]
        cut = L // 2
        row = session.inputs[0, :L].clone()
        row[cut:] = session.random_ids((L - cut,), differ_from=row[cut:])
        logits = refusals.attempt(lambda: session.logits(row[None]), "single-row pass skipped", f"B=1, T={L}")
        if logits is None:
            return []
        change = position_change(logits[:, :cut], reference[:, :cut])[0]  # (cut,)
        finite = change[torch.isfinite(change)]
        metrics["single_row_max_change"] = float(finite.max()) if finite.numel() else 0.0
        data["single_row"] = {"length": L, "cut": cut, "against": "prefix" if longest is not None else "baseline",
                              "change": [float(c) for c in change]}
        nan = [p for p in range(cut) if not torch.isfinite(change[p])]
        moved = [p for p in range(cut) if torch.isfinite(change[p]) and change[p] > threshold]
        where = f"sample 0 run alone (T={L}), positions {span(moved or nan)} when tokens >= {cut} changed"
        findings = []
        if moved:
            findings.append(Finding("FWD101", Status.FAIL, f"with one row run alone (batch size 1), earlier logits "
                                    f"moved by up to {metrics['single_row_max_change']:.3g} (threshold "
                                    f"{threshold:.3g}) when later tokens changed: the single-row path reads the "
                                    "future", where=where))
        if nan:
            findings.append(Finding("FWD104", Status.FAIL, f"with one row run alone (batch size 1), NaN or Inf "
                                    f"appeared at {len(nan)} earlier positions when later tokens changed",
                                    where=where))
        return findings


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


def prefix_lengths(T: int, shortest: int = 1) -> list[int]:
    """k = 1, 2, 4, ... up to T/4 (the cuts cover T/2 and T-1), none below the shortest length the model accepts;
    when that is longer than T/4, the shortest length alone, if it is still a prefix."""
    lengths = [2**i for i in range(T.bit_length()) if shortest <= 2**i <= max(T // 4, 1)]
    return lengths or ([shortest] if shortest < T else [])


def _with_single_row(findings: list[Finding], single: list[Finding]) -> list[Finding]:
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
        batched.where = f"{batched.where}; also with one row run alone (batch size 1)"
        return findings + [f for f in single if f is not leak]
    return findings + single


def _reason(exc: ModelRaised, size: str) -> str:
    """'the model raised AssertionError at T=1 (T must be > 1)': the exception's kind, the size, its first line."""
    cause = exc.__cause__
    if cause is None:  # fwdcheck's own words: the output cannot be checked
        return f"{exc} at {size}"
    detail = (str(cause).strip().splitlines() or [""])[0]
    detail = detail if len(detail) <= 120 else detail[:117] + "..."
    return f"the model raised {type(cause).__name__} at {size}" + (f" ({detail})" if detail else "")


def _pairs(pairs: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"({s}, {p})" for s, p in pairs[:6])
    return shown + (" ..." if len(pairs) > 6 else "")
