"""future-token: changing later tokens must not move earlier logits, and samples of a batch must not read each other.

Behavioural: the model runs untouched (eval mode, dropout off), and only its logits are compared. Per cut position k,
one row keeps tokens < k and replaces every token >= k; the logits at positions < k must stay within tolerance of the
baseline. All cut rows, plus one unchanged copy of sample 0, run as one batch: the unchanged copy now sits beside
different companions, so if it moves, samples read each other. A prefix pass complements the cuts cheaply: for a causal
model, the first k tokens run alone give the full run's logits at those positions (k = 1, 2, 4, ...).

Every change is judged against max(dtype tolerance scaled to the logits, noise_factor x the run-to-run noise floor),
and NaN or Inf is never a pass.
"""

from __future__ import annotations

import torch

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
      and that the first k tokens run alone reproduce the full run's logits there (k = 1, 2, 4, ...);
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
`model.causal: false`: part (a) is then skipped, part (b) still runs."""

    def run(self, model, session) -> CheckResult:
        base = session.baseline()  # (B, T, V)
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

        scale = float(base.abs().max())
        repeat = session.repeat_change()
        if session.unpadded is not None:  # a left-padded path: the real tokens must not see the padding
            findings += self._padding(session, base, session.threshold(scale, repeat))
        tolerance = session.tolerance(scale)
        if repeat > tolerance:
            findings.append(Finding("FWD103", Status.FAIL, f"two identical eval-mode forwards differ by {repeat:.3g} "
                                    f"(tolerance {tolerance:.3g}): the forward is not deterministic in eval mode"))
        threshold = session.threshold(scale, repeat)
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
        logits = session.logits(torch.stack(rows))  # (cuts + 1, T, V)

        control_change = position_change(logits[control:control + 1], base[0:1])[0]  # (T,)
        batch_moved = [p for p in range(T) if control_change[p] > threshold]
        metrics["batch_max_change"] = float(control_change.max())
        if batch_moved:
            findings.append(Finding(
                "FWD102", Status.FAIL,
                f"sample 0 is unchanged but its logits moved by up to {float(control_change.max()):.3g} "
                f"(threshold {threshold:.3g}) when the other rows of its batch changed: samples read each other",
                where=f"sample 0, positions {span(batch_moved)}"))
            if model.causal:  # mixing contaminates every batched row: judge causality on rows run one at a time
                logits = torch.cat([session.logits(row[None]) for row in rows[:control]])
                base = torch.cat([session.logits(session.inputs[s:s + 1]) for s in range(B)])
                data["note"] = "samples read each other: the causal comparisons ran one row at a time"

        if model.causal:
            findings += self._causal(cuts, sources, logits, base, threshold, exhaustive, metrics, data)
            findings += self._prefix(session, base, threshold, metrics)
        else:
            data["note"] = "model.causal is false: part (a) skipped"

        leaks = [f for f in findings if f.status in (Status.FAIL, Status.WARN)]
        summary = (f"{len(cuts)} cut{'s' if len(cuts) != 1 else ''} + batch + prefix: max change before a cut "
                   f"{metrics.get('max_change_before_cut', 0):.2g} vs threshold {threshold:.2g}"
                   if not leaks else "; ".join(sorted({self.codes[f.code].split(':')[0] for f in leaks})))
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

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
    def _prefix(session, base, threshold, metrics) -> list[Finding]:
        T = base.shape[1]
        lengths = [2**i for i in range(T.bit_length()) if 2**i <= max(T // 4, 1)]  # the cuts cover T/2 and T-1
        worst, moved = 0.0, []
        for k in lengths:
            alone = session.logits(session.inputs[:1, :k])  # (1, k, V)
            change = position_change(alone, base[:1, :k])[0]
            worst = max(worst, float(change.max()))
            if change.max() > threshold:
                moved.append((k, [p for p in range(k) if change[p] > threshold]))
        metrics["prefix_lengths"] = lengths
        metrics["prefix_max_change"] = worst
        if not moved:
            return []
        k, positions = moved[0]
        return [Finding("FWD105", Status.FAIL, f"the first k tokens run alone differ from the full run by up to "
                        f"{worst:.3g} (threshold {threshold:.3g}) for k in {[m[0] for m in moved]}",
                        where=f"sample 0, positions {span(positions)} with the first {k} tokens alone")]


def _pairs(pairs: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"({s}, {p})" for s, p in pairs[:6])
    return shown + (" ..." if len(pairs) > 6 else "")
