"""packing: documents packed into one row read only themselves, at positions that restart, where the model offers a
way to isolate them.

Training on packed rows (several documents concatenated to fill the context) is correct only if each document is
computed as if it ran alone. With position_ids restarting per document but no document mask, a standard causal model
does read the earlier documents: that is what the plain causal mask means, not a bug. So the check tests only the
contract a model offers, the way it offers it:
  Hugging Face models whose mask builder is handed position_ids (transformers' masking_utils finds packed documents
    from positions that restart, when no attention_mask and no cache are given): position_ids restarting per
    document, use_cache=False;
  other Hugging Face models (without sliding-window or chunked attention): a 4-D block-diagonal causal
    attention_mask, additive (0 keep, the dtype's minimum drop), with position_ids restarting per document;
  the reference model: document_ids;
  python models: what the config declares under `packing:` (document ids or a boolean mask, with or without
    restarting position_ids).
A model that offers none skips.

Each packed row holds three documents (from the session's own rows); a second row changes every token of the first
document. Changing it must not move the later documents' logits (isolation), and each document's logits must equal
those of its tokens run alone (positions restart; the first document is the unpacked row's own prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fwdcheck.checks.packing_spec import SPEC
from fwdcheck.errors import DoesNotApply, SkipCheck
from fwdcheck.model.tested import ModelUnderTest, extract_logits
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.compare import logit_scale, nonfinite_positions, position_change
from fwdcheck.run.session import Session

Kwargs = Callable[[torch.Tensor], dict[str, Any]]  # document ids [N, T] -> forward's keyword arguments


@dataclass
class Way:
    """How the model is told where its documents are."""

    name: str  # for the report
    kwargs: Kwargs
    carries_state: str | None = None  # the model's layers whose state crosses document boundaries, if known


def positions_within(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its own document, [N, T]: 0 again at every document's first token."""
    N, T = document_ids.shape
    index = torch.arange(T, device=document_ids.device).expand(N, T)  # (N, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # (N, T) True where a document begins
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[N, 1, T, T] booleans, True = may attend: causal, and within the query's own document."""
    T = document_ids.shape[1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (N, T, T) query, key
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()  # (T, T)
    return (same & causal)[:, None]


def isolation(model, session) -> Way:
    """The way this model offers to isolate packed documents (its packing capability), or SkipCheck naming why
    there is none to test."""
    if not model.causal:
        raise DoesNotApply(f"{model.pattern.describe()}: packing is checked on causal models")
    offered = model.packing
    if offered is None:
        raise DoesNotApply(
            model.why_not(
                "packing",
                "the model offers no way to isolate packed documents that fwdcheck "
                "knows: declare one under `packing:` in the model section (document ids or a "
                "mask keyword). position_ids restarting alone do not isolate documents in a "
                "causal model, so they are not checked",
            )
        )
    lowest = torch.finfo(session.dtype).min

    def kwargs(docs: torch.Tensor) -> dict[str, Any]:
        given: dict[str, Any] = dict(offered.fixed)
        if offered.form == "document_ids":
            given[offered.argument] = docs
        elif offered.form == "mask":
            given[offered.argument] = document_mask(docs)  # (N, 1, T, T) True = may attend
        elif offered.form == "additive-mask":
            keep = document_mask(docs)
            given[offered.argument] = torch.zeros(keep.shape, dtype=session.dtype, device=docs.device).masked_fill(
                ~keep, lowest
            )  # (N, 1, T, T)
        if offered.position_ids:
            given["position_ids"] = positions_within(docs)
        return given

    return Way(offered.description, kwargs, offered.carries_state)


@dataclass
class Packed:
    """The two packed rows: three documents each, the second row's document 1 changed in every token."""

    ids: torch.Tensor  # (2, T)
    document_ids: torch.Tensor  # (2, T): 0, 1, 2 per document
    spans: dict[str, tuple[int, int]]  # document -> its positions [start, end) in the row
    documents: list[torch.Tensor]  # the first row's documents, in order
    alone_rows: dict[str, int]  # document -> the session row whose prefix it is


# Packed rows of this many tokens (at most seq_len): documents that read each other or whose positions do not restart
# show at any length, and the forward then costs little more than reading the weights once; a declared sliding window
# makes the later documents longer than it (a window over packed documents is then exercised). Each document alone is
# still a prefix of a session row, whose logits the session has.
LENGTH = 8


class Packing(Check, declared=SPEC):
    name = "packing"

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        way = isolation(model, session)
        rows = self._pack(model, session)
        packed = extract_logits(session.output(rows.ids, **way.kwargs(rows.document_ids))).float()  # (2, T, V)
        if tuple(packed.shape[:2]) != tuple(rows.ids.shape):
            raise SkipCheck(f"the packed forward returned logits {list(packed.shape)} for {list(rows.ids.shape)} ids")
        data = {"way": way.name, "documents": {name: list(span) for name, span in rows.spans.items()}}
        broken = nonfinite_positions(packed)
        if broken:
            finding = Finding(
                "FWD604",
                Status.FAIL,
                f"the packed forward gives NaN or Inf at {len(broken)} positions ({way.name})",
                where=f"row {broken[0][0]} pos {broken[0][1]}",
            )
            return CheckResult.from_findings(self.name, [finding], finding.message, data=data)
        measured, threshold = self._measure(session, rows, packed)
        metrics = {
            "leak": measured["leak"],
            "threshold": threshold,
            **{f"{name.replace(' ', '_')}_vs_alone": measured[name] for name in rows.spans},
        }
        findings = self._judge(session, way, rows, packed, measured, threshold, metrics, data)
        return self._summarise(way, measured, threshold, findings, metrics, data)

    @staticmethod
    def _pack(model: ModelUnderTest, session: Session) -> Packed:
        """Two rows of three documents from the session's rows, the second with every token of document 1
        changed; SkipCheck when seq_len is too short for three."""
        B, T = session.inputs.shape
        if T < 5:
            raise SkipCheck(f"seq_len {T} is too short: three documents need at least 5 tokens")
        window = model.windows.widest if model.windows is not None else None
        # documents 2 and 3 of window + 1 tokens each, past the band, where a declared window fits in the rows
        windowed = 2 * (window + 1) + 1 if window is not None and 2 * (window + 1) + 1 <= T else 0
        T = min(T, max(LENGTH, windowed, session.min_seq_len))
        b = (T - 1) // 2
        a = T - 2 * b  # document 1 at 0..a-1, 2 at a..a+b-1, 3 at a+b..T-1
        other = 1 % B  # the session's second row, or the first again for batch size 1
        X = session.inputs
        generator = torch.Generator().manual_seed(session.settings.inputs.seed)  # own draws: the shared ones stay put
        changed = X[0, :a].cpu() + torch.randint(1, max(model.vocab_size, 2), (a,), generator=generator)
        changed = (changed % model.vocab_size).to(X.device)  # every token of document 1 differs
        documents = [X[0, :a], X[other, :b], X[0, :b]]
        ids = torch.stack([torch.cat(documents), torch.cat([changed, *documents[1:]])])  # (2, T)
        document_ids = torch.tensor([0] * a + [1] * b + [2] * b, device=X.device).expand(2, T)  # (2, T)
        spans = {"document 1": (0, a), "document 2": (a, a + b), "document 3": (a + b, T)}
        return Packed(
            ids, document_ids, spans, documents, alone_rows={"document 1": 0, "document 2": other, "document 3": 0}
        )

    @staticmethod
    def _measure(session: Session, rows: Packed, packed: torch.Tensor) -> tuple[dict[str, float], float]:
        """(the largest change of each comparison, the threshold): documents 2 and 3 of the two rows against each
        other (the leak), and each document against the prefix of the session's row it came from, first against
        session.reference(); against the untouched baseline, with the noise floor, when something moved beyond
        the tolerance."""
        a = rows.spans["document 2"][0]

        def changes(reference: torch.Tensor) -> dict[str, float]:
            found = {"leak": float(position_change(packed[1, a:], packed[0, a:]).max())}
            for name, (start, end) in rows.spans.items():
                alone = reference[rows.alone_rows[name], : end - start]
                found[name] = float(position_change(packed[0, start:end], alone).max())
            return found

        reference = session.reference()  # (B, T, V): each document alone is a prefix of a session row
        measured = changes(reference)
        scale = logit_scale(reference)
        if session.noise_matters(max(measured.values()), scale) and not session.reference_untouched:
            reference = session.baseline()  # judged against the untouched model, not the observed pass
            measured, scale = changes(reference), logit_scale(reference)
        return measured, session.threshold(scale, *session.floors(max(measured.values()), scale))

    def _judge(
        self,
        session: Session,
        way: Way,
        rows: Packed,
        packed: torch.Tensor,
        measured: dict[str, float],
        threshold: float,
        metrics: dict,
        data: dict,
    ) -> list[Finding]:
        """FWD601 for a leak; FWD603 and FWD602 for documents that differ from their tokens run alone, confirmed
        by running them alone (which adds to the metrics and data)."""
        findings = []
        spans = rows.spans
        if measured["leak"] > threshold:
            findings.append(_leak(way, spans, measured["leak"], threshold))
        # A leak explains later documents that differ from their runs alone; without one, a difference is positions.
        differ = [name for name in spans if measured[name] > threshold and (name == "document 1" or not findings)]
        if differ:
            differ, confirmed = self._confirm(session, rows, packed, differ, threshold, metrics, data)
        for name in differ:
            if name == "document 1" or not any(f.code == "FWD602" for f in findings):
                findings.append(_differs_alone(name, spans[name], confirmed[name], threshold))
        return findings

    def _confirm(
        self,
        session: Session,
        rows: Packed,
        packed: torch.Tensor,
        differ: list[str],
        threshold: float,
        metrics: dict,
        data: dict,
    ) -> tuple[list[str], dict[str, float]]:
        """The documents that differ from the prefixes of the session's rows, run alone: the unpacked rows'
        prefixes stand for the documents alone only in a causal model. (Those that still differ, each one's change
        from its run alone), the changes added to the metrics."""
        confirmed = self._run_alone(session, packed, rows.spans, rows.documents, differ)
        metrics.update({f"{name.replace(' ', '_')}_vs_run_alone": value for name, value in confirmed.items()})
        if len([name for name in differ if confirmed[name] <= threshold]):
            data["prefixes"] = (
                "the unpacked rows' prefixes differ from the same tokens run alone (the model "
                "is not causal): those documents were judged against their runs alone"
            )
        return [name for name in differ if confirmed[name] > threshold], confirmed

    def _summarise(
        self, way: Way, measured: dict[str, float], threshold: float, findings: list[Finding], metrics: dict, data: dict
    ) -> CheckResult:
        """The first finding's message, or the leak and the largest change from a document alone."""
        if findings:
            return CheckResult.from_findings(self.name, findings, findings[0].message, metrics=metrics, data=data)
        alone = max(value for name, value in measured.items() if name != "leak")
        summary = (
            f"3 documents in a row via {way.name.split(' (')[0]}: leak {measured['leak']:.2g}, each vs alone "
            f"<= {alone:.2g} (threshold {threshold:.2g})"
        )
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def key_number(self, result: CheckResult) -> str:
        """The change the verdict rests on, over the threshold: the leak when documents read each other, a document
        against its run alone when positions are wrong, else the largest of them all (the closest call)."""
        m = result.metrics
        if "threshold" not in m:
            return ""
        found = {f.code for f in result.findings}
        run_alone = [value for name, value in m.items() if name.endswith("_vs_run_alone")]
        if "FWD601" in found or not found:
            changes = [m["leak"]] + ([] if found else [v for n, v in m.items() if n.endswith("_vs_alone")])
        else:
            changes = run_alone
        return f"{max(changes):.2g} / {m['threshold']:.2g}"

    @staticmethod
    def _run_alone(
        session, packed: torch.Tensor, spans: dict, documents: list[torch.Tensor], names: list[str]
    ) -> dict[str, float]:
        """Largest change of each named document's packed logits (row 0) from its tokens run alone, each beside the
        session's first row cut to its length (a row alone is a code path of its own)."""
        found = {}
        for name, tokens in zip(spans, documents, strict=True):
            if name in names:
                start, end = spans[name]
                alone = session.logits(torch.stack([tokens, session.inputs[0, : len(tokens)]]))[0]  # (len, V)
                found[name] = float(position_change(packed[0, start:end], alone).max())
        return found


def _leak(way: Way, spans: dict[str, tuple[int, int]], leak: float, threshold: float) -> Finding:
    """FWD601: changing document 1 moved the documents after it in the packed row."""
    a, T = spans["document 2"][0], spans["document 3"][1]
    return Finding(
        "FWD601",
        Status.FAIL,
        f"changing document 1 moves the logits of the documents "
        f"after it by {leak:.3g} (threshold {threshold:.3g}): {way.name} "
        "does not isolate them"
        + (
            f"; the state of its {way.carries_state} runs along the whole row, across the boundary"
            if way.carries_state
            else ""
        ),
        where=f"positions {a}..{T - 1}",
    )


def _differs_alone(name: str, span: tuple[int, int], confirmed: float, threshold: float) -> Finding:
    """A packed document that differs from its tokens run alone, confirmed: FWD603 for document 1 (the packed path
    computes it differently), FWD602 for a later one that no change to document 1 reaches (positions)."""
    start, end = span
    where = f"positions {start}..{end - 1}"
    if name == "document 1":
        return Finding(
            "FWD603",
            Status.FAIL,
            f"document 1 ({where}, as in the unpacked row) differs "
            f"from its tokens run alone by {confirmed:.3g} when packed (threshold "
            f"{threshold:.3g}): the packed path computes it differently",
            where=where,
        )
    return Finding(
        "FWD602",
        Status.FAIL,
        f"{name} ({where}) differs from its tokens run alone "
        f"by {confirmed:.3g} (threshold {threshold:.3g}) while changes to "
        "document 1 do not reach it: positions do not restart at the document "
        "boundary",
        where=where,
    )
