"""mask-audit: which keys each query may read, at every attention call, whatever encoding the mask came in.

The observation pass reduces every call to the same thing: a [L, S] set of keys each of L queries may read. SDPA's
boolean True means "may attend"; nn.MultiheadAttention's boolean True means "masked out"; float masks of either API
are added to the scores (0 keeps, -inf drops); is_causal means lower-triangular; eager code is read off the scores
that reach the softmax. That set is compared with causal: query i may read key slot j only if j <= its position p_i.
A square call is the sequence against itself (p_i = i); a call over a KV cache is judged where the positions are
known (handed to the model as input_pos / cache_position / position_ids; the L slots of an S-slot cache the call's
module just wrote, whatever the argument that indexed them is called, as gemma_pytorch's kv_write_indices, and the
position each slot then holds, which a ring buffer past its wrap writes at positions % window; or a growing cache
whose S keys are exactly the tokens written, queries last; slots written twice that no argument explains say nothing
of positions); cross-attention, and an encoder over a source other than the input, are not causal by nature. A call
that cannot be judged says so, and a run in which none could be judged skips: it measured nothing. The first row of
the batch is also observed alone, at a short length, where "single sequence" fast paths live.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import cast

import torch

from fwdcheck.checks.chunk_band import judge_chunk
from fwdcheck.checks.mask_audit_spec import SPEC
from fwdcheck.checks.mask_audit_view import CallRow, Convention, MaskAuditData
from fwdcheck.checks.short_row import short_row
from fwdcheck.checks.window_band import judge_window
from fwdcheck.errors import ModelRaised, SkipCheck
from fwdcheck.model.capabilities import ASSUMED_CAUSAL, AttentionPattern, Chunks, Windows
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.observe.records import Api, AttentionCall, Observation
from fwdcheck.result import Check, CheckResult, Finding, Status, grouped
from fwdcheck.run.code_paths import path_cells
from fwdcheck.run.compare import position_change
from fwdcheck.run.session import Session

CONVENTIONS: list[Convention] = [
    {
        "api": "F.scaled_dot_product_attention",
        "bool": "True = may attend",
        "float": "added to scores (0 keep, -inf drop)",
        "flag": "is_causal=True: lower-triangular, no attn_mask",
    },
    {
        "api": "nn.MultiheadAttention",
        "bool": "True = masked out",
        "float": "added to scores (0 keep, -inf drop)",
        "flag": "is_causal: a hint that attn_mask is causal",
    },
    {
        "api": "flex_attention",
        "bool": "mask_mod True = may attend, at every (b, h, q, kv)",
        "float": "score_mod: a score it makes -inf is dropped",
        "flag": "BlockMask built for the call's (q, kv) lengths",
    },
    {
        "api": "xformers memory_efficient_attention",
        "bool": "-",
        "float": "attn_bias tensor added to scores",
        "flag": "attn_bias object: causal top left or bottom right, window, block diagonal",
    },
    {
        "api": "eager softmax(scores)",
        "bool": "-",
        "float": "masked scores are -inf or far below the row maximum",
        "flag": "-",
    },
]


class MayRead(str, Enum):
    """The shape of an attention call's may-read set; the value is how reports name it."""

    CAUSAL = "causal"
    RESTRICTED = "causal, restricted (window or sparse)"
    BIDIRECTIONAL = "bidirectional: every key"
    INVERTED = "inverted: the future only"
    LEAKY = "leaky: some future keys"
    FULL = "bidirectional by design: every key"
    PARTIAL = "bidirectional by design, restricted (padding, window or sparse)"
    PREFIX = "prefix-LM: the prefix both ways, causal after it"
    SOURCE = "cross-attention: every source position"
    PART_OF_SOURCE = "cross-attention: part of the source only"

    @property
    def reads_future(self) -> bool:
        return self not in (
            MayRead.CAUSAL,
            MayRead.RESTRICTED,
            MayRead.FULL,
            MayRead.PARTIAL,
            MayRead.PREFIX,
            MayRead.SOURCE,
            MayRead.PART_OF_SOURCE,
        )


def pattern(
    allowed: torch.Tensor,
    positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    prefix: int = 0,
) -> tuple[MayRead, list[tuple[int, int]]]:
    """Name the shape of an [L, S] may-read set; also the (query position, key slot) pairs that read the future.

    positions[i] is query i's own slot on the key axis (default 0..L-1, the square case): causal reads j <= p_i.
    key_positions[j], when given, is the position key slot j holds (a ring buffer past its wrap; -1 for a slot not
    written yet): causal then reads the slots holding a position <= p_i. With a prefix of `prefix` positions (a
    prefix-LM), a query inside it may also read the rest of the prefix, and nothing after it."""
    L, S = allowed.shape
    positions = torch.arange(L) if positions is None else positions
    held = torch.arange(S) if key_positions is None else key_positions
    held = held.to(allowed.device)
    query = positions.to(allowed.device)[:, None]  # (L, 1)
    past_and_self = (held[None, :] >= 0) & (held[None, :] <= query)  # (L, S)
    if prefix:
        past_and_self |= (query < prefix) & (held[None, :] >= 0) & (held[None, :] < prefix)  # the prefix both ways
    future = allowed & ~past_and_self
    pairs = [(int(positions[q]), k) for q, k in future.nonzero().tolist()]
    if not pairs:
        return (MayRead.CAUSAL if torch.equal(allowed, past_and_self) else MayRead.RESTRICTED), []
    if bool(allowed.all()):
        return MayRead.BIDIRECTIONAL, pairs
    if not bool((allowed & past_and_self).any()):
        return MayRead.INVERTED, pairs
    return MayRead.LEAKY, pairs


@dataclass(frozen=True)
class NotJudged:
    """Why a call's may-read set is not compared with causal: a short kind (the table's cell, the summary's count)
    and the whole reason (said under the table)."""

    kind: str  # cross-attention | another sequence | query positions unknown
    reason: str

    @property
    def in_summary(self) -> str:
        return {"another sequence": "over another sequence", "encoder": "encoder over the source"}.get(
            self.kind, self.kind
        )


def not_judged(
    call: AttentionCall, input_followed: bool, design: AttentionPattern = ASSUMED_CAUSAL
) -> NotJudged | None:
    """Why the call's may-read set cannot be compared with causal, or None when it can. input_followed: the input
    ids were followed into some attention call of the pass, so a call they did not reach attends over another
    sequence (when they reached none, the following itself failed, and says nothing). An encoder-decoder's
    cross-attention is judged: it must read all of the source (FWD212)."""
    if call.cross and design.kind != "encoder-decoder":
        return NotJudged("cross-attention", "cross-attention: keys from another sequence, not judged for causality")
    if call.cross and call.keys_read_input:
        return NotJudged(
            "cross-attention",
            "cross-attention over the tokens' own streams (keys computed from the input tokens, not the source): "
            "not judged",
        )
    if call.cross:
        return None if call.unread is None else NotJudged("mask not read", f"not judged: {call.unread}")
    if input_followed and call.reads_input is False:
        if design.kind == "encoder-decoder":
            return NotJudged(
                "encoder",
                "encoder self-attention over the source held fixed: full attention by design, not judged for causality",
            )
        return NotJudged(
            "another sequence",
            "another sequence: queries not computed from the input tokens (an "
            "encoder over a fixed source), not judged for causality",
        )
    if call.unread is not None:
        kind = call.mask_values if call.api == Api.KERNEL else "mask not read"  # the kernel's name
        return NotJudged(kind, f"not judged: {call.unread}")
    if call.query_positions is None:
        return NotJudged(
            "query positions unknown",
            f"not judged: query positions unknown ({call.query_len} queries over {call.key_len} key "
            f"slots, {call.written} tokens written; no input_pos / cache_position / position_ids of "
            f"{call.query_len} positions reached the attention, and no write of {call.query_len} of its "
            f"{call.key_len} slots, each once, came before it)",
        )
    return None


def merged_blocks(call: AttentionCall, model: ModelUnderTest) -> list[tuple[AttentionCall, str]]:
    """An encoder-decoder's decoder attending over its own tokens and its source in one call (T5Gemma 2's merged
    self- and cross-attention: keys [T + S], the source's S keys after the tokens' own) as its two blocks: the
    self block, judged as the decoder's self-attention (causal), and the source block, judged as a cross-attention
    (every source position readable; a causal mask over it is FWD212). Told by its keys: the queries are the tokens
    under test, its keys were computed from both the module's own input and the other sequence it was handed, and
    past the tokens' own T keys come exactly as many as the source fwdcheck held fixed (ProphetNet's n-gram streams,
    [T + T] keys all the tokens' own, are not). Any other call is itself alone, with no block named."""
    held = model.held
    if (
        held is None
        or model.pattern.kind != "encoder-decoder"
        or call.cross
        or not call.keys_of_both
        or call.reads_input is not True
        or call.unread is not None
        or call.key_positions is not None
        or call.allowed.is_meta
    ):
        return [(call, "")]
    L, S = call.allowed.shape
    source = int(held.draw(1, 0).shape[-1])
    if S != L + source:
        return [(call, "")]
    lead = tuple(call.weights_shape[:-2])
    own = dataclasses.replace(
        call, allowed=call.allowed[:, :L], weights_shape=(*lead, L, L), key_positions=None, positions_from="square"
    )
    if call.query_positions is None:
        own = dataclasses.replace(own, query_positions=torch.arange(L))
    read = dataclasses.replace(
        call,
        allowed=call.allowed[:, L:],
        weights_shape=(*lead, L, source),
        cross=True,
        keys_read_input=False,  # the held source's keys, told apart by their number
        query_positions=None,
        positions_from="",
        is_causal=False,  # the call's own arguments are judged once, on the self block
        dropout_p=0.0,
        empty_rows=0,
        float_01=False,
        mask_lengths=None,
    )
    return [
        (own, f"self block of a merged call: keys 0..{L - 1}, the tokens' own"),
        (read, f"source block of a merged call: keys {L}..{S - 1}, the {source} source positions held fixed"),
    ]


def _real_tokens(call: AttentionCall, pad: int) -> tuple[AttentionCall, bool]:
    """A self-attention call of a left-padded path as its real tokens see it: the queries and keys after the `pad`
    padding tokens, at positions from 0; and whether real tokens may read the padding keys."""
    reads_padding = bool(call.allowed[pad:, :pad].any())
    real = dataclasses.replace(
        call,
        allowed=call.allowed[pad:, pad:],
        empty_rows=int((~call.allowed[pad:].any(-1)).sum()),
        query_positions=torch.arange(call.query_len - pad),
        key_positions=None if call.key_positions is None else call.key_positions[pad:] - pad,
    )
    return real, reads_padding


def by_design(call: AttentionCall, design: AttentionPattern) -> tuple[MayRead, list[tuple[int, int]]]:
    """The shape of a judged call's may-read set against the model's attention pattern, and the (query position, key
    slot) pairs it may not read: an encoder-decoder's cross-attention reads every source position it was given
    (the source is held fixed, unpadded); a bidirectional model's self-attention may read every key; a prefix-LM's
    the prefix both ways and causal after it; a causal model's (and a decoder's) only its past and itself."""
    if call.cross:
        return (MayRead.SOURCE if bool(call.allowed.all()) else MayRead.PART_OF_SOURCE), []
    if design.kind == "bidirectional":
        return (MayRead.FULL if bool(call.allowed.all()) else MayRead.PARTIAL), []
    prefix = design.prefix_length or 0 if design.kind == "prefix" else 0
    shape, pairs = pattern(call.allowed, call.query_positions, call.key_positions, prefix)
    if prefix and shape is MayRead.RESTRICTED:
        plain, _ = pattern(call.allowed, call.query_positions, call.key_positions)
        if plain is MayRead.CAUSAL:  # the prefix read causally (LLaVA's image block): within the design, and causal
            return plain, pairs
    if (
        prefix
        and shape is MayRead.CAUSAL
        and call.query_positions is not None
        and bool(call.query_positions.min() < prefix)
    ):
        shape = MayRead.PREFIX
    return shape, pairs


def _row(call: AttentionCall, reason: NotJudged | None, shape: MayRead | None) -> CallRow:
    """The table row of one attention call: its mask as handed over, what it lets each query read, and whether it
    was judged (why not, when not)."""
    positions = call.query_positions
    L, S = call.allowed.shape
    return {
        "module": call.module or "model",
        "api": call.api,
        "mask": call.mask_kind,
        "mask_shape": list(call.mask_shape) if call.mask_shape else None,
        "values": call.mask_values,
        "is_causal": call.is_causal,
        "dropout_p": call.dropout_p,
        "pattern": reason.reason if reason else cast(MayRead, shape).value,
        "judged": reason is None,
        "reads_future": shape is not None and shape.reads_future,
        "not_judged": reason.kind if reason else None,
        "queries": L,
        "keys": S,
        "query_positions": positions.tolist() if positions is not None and L <= 64 else None,
        "positions_from": call.positions_from or None,
        "key_positions": call.key_positions.tolist() if call.key_positions is not None and S <= 64 else None,
        "source": call.source,
        "may_read": call.allowed.int().tolist() if call.allowed.numel() <= 64 * 64 else None,
    }


class MaskAudit(Check, declared=SPEC):
    name = "mask-audit"
    per_code_path = True  # its bugs hide on paths a default run never takes: run on every cell of the matrix

    def key_number(self, result: CheckResult) -> str:
        return f"{result.metrics['attention_calls']} calls" if "attention_calls" in result.metrics else ""

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        findings, rows = self.audit(session.observation(), model)
        data: MaskAuditData = {"conventions": CONVENTIONS, "calls": rows}
        if model.held is not None and model.forward_adapter is None and not session.train:
            findings += _reads_its_source(model, session, data)
        if model.image_variant == 0 and model.forward_adapter is None and not session.train:
            findings += _reads_its_image(model, session, data)
        B = session.inputs.shape[0]
        # A fast path taken only for a single sequence (a `B == 1` shortcut that forgets the mask) is a real bug class:
        # observe one row alone too, unless the code-path matrix runs batch size 1 itself. Not on the train path: a
        # single sequence is how the eval path serves and generates, which the default run observed alone, while
        # training runs batches.
        code_paths = session.settings.code_paths
        if B > 1 and not session.train and not any(c.batch_size == 1 for c in path_cells(model, code_paths, B)):
            self._batch_size_one(model, session, findings, rows, data)
        return self._summarise(findings, rows, data)

    def _batch_size_one(
        self, model: ModelUnderTest, session: Session, findings: list[Finding], rows: list[CallRow], data: MaskAuditData
    ) -> None:
        """The first row observed alone: its findings (said "at B=1") added to `findings`, the calls that differ
        there to `rows` (which data["calls"] holds); what the full batch showed stands when the model refuses the
        pass. Such a shortcut shows at any length of two tokens or more, so the row is the session's short length
        (16 tokens), not the full sequence: the short row other checks observe too (short_row.py)."""
        length = session.short_length
        try:
            single_findings, single_rows = self.audit(short_row(model, session).seen, model)
        except ModelRaised as exc:  # what the full batch showed stands
            data["batch1"] = f"the pass at B=1 was skipped: {exc}"
            return
        for f in single_findings:
            f.where = f"{f.where} at B=1"
        findings += single_findings
        # List the calls that differ at B=1, not the repeats; the row is shorter, so sizes do not count.
        seen = {_kind_of_call(r) for r in rows}
        rows += [{**r, "batch_size": 1} for r in single_rows if _kind_of_call(r) not in seen]
        data["batch1"] = "observed"
        data["batch1_length"] = length

    def _summarise(self, findings: list[Finding], rows: list[CallRow], data: MaskAuditData) -> CheckResult:
        """One finding per code, message and line of model code; the first failing code, or the patterns the calls
        showed. SkipCheck when no call was observed, or none could be judged and nothing failed."""
        if not rows and not findings:
            raise SkipCheck("no attention call observed (a custom kernel?); future-token still tests the behaviour")
        findings = _group(findings)
        bad = [f for f in findings if f.status != Status.PASS]
        judged = [r for r in rows if r["judged"]]
        if not judged and not bad:  # nothing was compared with causal: a pass would claim what was not measured
            raise SkipCheck(
                f"no attention call could be judged for causality: {len(rows)} call(s), e.g. "
                f"{rows[0]['module']} ({rows[0]['api']}) {rows[0]['pattern']}"
            )
        also = " (alike at B=1)" if data.get("batch1") == "observed" and len(rows) == len(data["calls"]) else ""
        image = data.get("image")
        reads = (
            f"; the text reads its image (another moved its logits by {image['change_with_another_image']:.3g})"
            if image is not None and image["change_with_another_image"] > image["noise_floor"]
            else ""
        )
        summary = (
            f"{len(rows)} attention call(s){also}: {_patterns(rows)}{_widths(rows)}{reads}"
            if not bad
            else f"{self.codes[bad[0].code]} ({bad[0].where})"
        )
        return CheckResult.from_findings(
            self.name, findings, summary, data=data, metrics={"attention_calls": len(rows), "judged_calls": len(judged)}
        )

    def audit(self, observation: Observation, model: ModelUnderTest) -> tuple[list[Finding], list[CallRow]]:
        """Findings and one table row per attention call of one observation pass."""
        findings: list[Finding] = []
        rows: list[CallRow] = []
        pad = model.padding  # a left-padded path view: judge real queries against real keys
        design = judged_pattern(model)
        input_followed = any(call.reads_input for call in observation.attention)
        calls = [part for call in observation.attention for part in merged_blocks(call, model)]
        for call, merged in calls:
            if pad and call.self_attention and call.unread is None:
                call, reads_padding = _real_tokens(call, pad)
                if reads_padding:
                    findings.append(
                        Finding(
                            "FWD208",
                            Status.FAIL,
                            "real tokens may read the padding keys: the attention_mask is not applied",
                            f"{call.module or 'model'} ({call.api})",
                            source=call.source,
                            module=call.module,
                        )
                    )
            reason = not_judged(call, input_followed, design)
            shape, future_pairs = (None, []) if reason else by_design(call, design)
            rows.append(_row(call, reason, shape))
            if merged:
                rows[-1]["merged"] = merged
            if shape is not None:
                findings += self.judge(call, shape, future_pairs, design.kind != "bidirectional")
            if shape is not None and model.causal and not call.cross and not shape.reads_future and model.windows:
                wrong = _declared(call, model.windows, model.layer_of(call.module), rows[-1])
                if wrong is not None:
                    wrong.source, wrong.module = call.source, call.module
                    findings.append(wrong)
        findings += [
            Finding(
                "FWD207",
                Status.FAIL,
                f"{d.api}(p={d.p:g}, training=True) with the model in eval mode: pass training=self.training",
                where=d.module or "model",
                source=d.source,
                module=d.module,
            )
            for d in observation.dropouts
            if d.training and d.p > 0
        ]
        return findings, rows

    @staticmethod
    def judge(call: AttentionCall, shape: MayRead, future_pairs, causal: bool) -> list[Finding]:
        """The findings of one judged attention call: its mask against causal (for a causal model), empty rows, a
        mask beside is_causal, dropout in eval mode. Each points at the line of model code that made the call."""
        where = f"{call.module or 'model'} ({call.api})"
        api = API_NAMES.get(call.api, call.api)
        findings = _mask_findings(call, shape, future_pairs, causal, api, where) + _argument_findings(call, api, where)
        for f in findings:  # each is about this call: it points at the line of model code that made it
            f.source, f.module = call.source, call.module
        return findings


def _declared(call: AttentionCall, windows: Windows, layer: int | None, row: CallRow) -> Finding | None:
    """The call against what its layer declares: a chunk (chunk_band), else a sliding window or full attention
    (window_band); its record in the row, and the finding when the mask is otherwise."""
    where = f"{call.module or 'model'} ({call.api})"
    declared = windows.of(layer)
    if isinstance(declared, Chunks):
        row["chunk"], wrong = judge_chunk(call, declared, layer, where, windows.origin)
    else:
        row["window"], wrong = judge_window(call, windows, layer, where)
    return wrong


def _mask_findings(
    call: AttentionCall, shape: MayRead, future_pairs, causal: bool, api: str, where: str
) -> list[Finding]:
    """What one call's mask says: built for other lengths (FWD209), a 0/1 float mask (FWD203), and, for a causal
    model, keys it opens in the future or own positions it closes (FWD210)."""
    findings = []
    if call.mask_lengths is not None:
        findings.append(
            Finding(
                "FWD209",
                Status.FAIL,
                f"the BlockMask handed to {api} was built for {call.mask_lengths[0]} queries over "
                f"{call.mask_lengths[1]} keys, but the call has {call.query_len} over {call.key_len}: a mask "
                "built for another length and reused (build it for each call's lengths)",
                where,
            )
        )
    if call.float_01:
        findings.append(
            Finding(
                "FWD203",
                Status.FAIL,
                f"0/1 float mask {call.mask_values} handed to {api}: "
                "added to the scores it masks nothing (a boolean turned into float?)",
                where,
            )
        )
    elif shape is MayRead.PART_OF_SOURCE:
        findings.append(_part_of_source(call, api, where))
    elif causal and future_pairs:
        findings.append(_reads_future(call, shape, future_pairs, api, where))
    elif causal and (blind := _blind_to_themselves(call)) and (selection := _key_selection(call, blind)):
        findings.append(Finding("FWD210", Status.PASS, selection, where))
    elif causal and blind:
        findings.append(
            Finding(
                "FWD210",
                Status.FAIL,
                f"{len(blind)} queries may not read their own position, e.g. "
                f"{', '.join(map(str, blind[:4]))}: "
                + (
                    "a strict causal mask (q > kv where q >= kv is meant)"
                    if call.self_attention
                    else "a causal mask aligned top left over a cache (causal_upper_left, is_causal with fewer "
                    "queries than keys) where the queries are the last ones (causal_lower_right)"
                ),
                where,
            )
        )
    return findings


def _reads_its_source(model: ModelUnderTest, session: Session, data: MaskAuditData) -> list[Finding]:
    """An encoder-decoder whose source is held fixed: the session's tokens run once more beside another source, and
    the decoder's logits must move beyond the run-to-run noise (FWD213 where they do not: the cross-attention reads
    nothing of the source, or its output is dropped). Not the dtype tolerance: a randomly initialised tiny decoder
    reads its source faintly (Marian's logits move by 2.5e-5 at a tolerance of 1e-5), while one that reads none of it
    computes the same logits bit for bit. The table's cross-attention calls say what each may read; this says that
    what they read reaches the logits."""
    held = model.held
    assert held is not None  # run() asks
    moved, noise = _moved_by_another(session, dataclasses.replace(model, source_variant=1))  # another source
    data["source"] = {"held_fixed": held.description, "change_with_another_source": moved, "noise_floor": noise}
    if moved > noise:
        return []
    return [
        Finding(
            "FWD213",
            Status.FAIL,
            f"the decoder's logits moved by {moved:.3g} (run-to-run noise {noise:.3g}) when its source was replaced "
            "by another: the cross-attention reads nothing of the source (dead, or its output dropped)",
            "the decoder's cross-attention",
        )
    ]


def _moved_by_another(session: Session, other: ModelUnderTest) -> tuple[float, float]:
    """How far the logits of the session's tokens move when the model holds another of what it holds fixed (`other`:
    the same model with another source or image), and the run-to-run noise that is the bar."""
    logits = session.logits(session.inputs)  # (B, T, V) with what is held fixed
    moved = float(position_change(logits, session.logits(session.inputs, model=other)).max())
    return moved, session.repeat_change()


def judged_pattern(model: ModelUnderTest) -> AttentionPattern:
    """The pattern the calls are judged by: the model's, or, with an image held fixed before the tokens under test
    (the image run), a prefix of the image's ids: what they read among themselves is the model's design (PaliGemma's
    and Gemma 3's image block reads itself both ways, LLaVA's is causal), they must not read the text after them, and
    the text reads them and is causal over itself (after a prefix of its own, for a model that declares one)."""
    held = model.held_prefix
    design = model.pattern
    if not held or design.kind not in ("causal", "prefix"):
        return design
    own = (design.prefix_length or 0) if design.kind == "prefix" else 0
    return AttentionPattern(
        "prefix", f"the image's {held} ids held fixed before the tokens under test; {design.describe()}", held + own
    )


def _reads_its_image(model: ModelUnderTest, session: Session, data: MaskAuditData) -> list[Finding]:
    """A vision-language model run with an image held fixed: the session's tokens run once more after another image,
    and the text's logits must move beyond the run-to-run noise (FWD215 where they do not: the image's features are
    not merged into the sequence, zeroed, or overwritten). The bar is the noise, as for an encoder-decoder's source
    (_reads_its_source): a randomly initialised tiny model reads its image faintly, one that reads none of it computes
    the same logits bit for bit."""
    image = model.image
    assert image is not None  # run() asks
    moved, noise = _moved_by_another(session, dataclasses.replace(model, image_variant=1))  # another image
    data["image"] = {"held_fixed": image.description(), "change_with_another_image": moved, "noise_floor": noise}
    if moved > noise:
        return []
    return [
        Finding(
            "FWD215",
            Status.FAIL,
            f"the text's logits moved by {moved:.3g} (run-to-run noise {noise:.3g}) when its image was replaced by "
            "another: the model reads nothing of its image (its features not merged into the sequence, zeroed, or "
            "overwritten)",
            "the image's features",
        )
    ]


def _part_of_source(call: AttentionCall, api: str, where: str) -> Finding:
    """An encoder-decoder's cross-attention that keeps some decoder positions from some of the source they were
    given: a causal mask handed to cross-attention (decoder position i reads source positions <= i), or a source
    truncated or padded out by a mask built for another length."""
    L, S = call.allowed.shape
    closed = ~call.allowed  # (L, S)
    rows = int(closed.any(-1).sum())
    lower = bool(torch.equal(call.allowed, torch.ones_like(call.allowed).tril(diagonal=max(S - L, 0))))
    upper = bool(torch.equal(call.allowed, torch.ones_like(call.allowed).tril())) if L <= S else False
    how = (
        "a causal mask handed to cross-attention (decoder position i reads source positions <= i)"
        if lower or upper
        else f"{int(closed.all(0).sum())} source position(s) closed to every decoder position"
        if bool(closed.all(0).any())
        else "a mask that closes some source positions to some decoder positions"
    )
    return Finding(
        "FWD212",
        Status.FAIL,
        f"cross-attention ({api}) keeps {rows} of {L} decoder positions from part of the {S} source positions they "
        f"were given: {how}; the decoder must read all of its source",
        where,
    )


def _argument_findings(call: AttentionCall, api: str, where: str) -> list[Finding]:
    """What one call's other arguments say: rows with every key masked (FWD205), a mask beside is_causal (FWD206),
    dropout handed over in eval mode (FWD207)."""
    findings = []
    if call.empty_rows:
        findings.append(
            Finding(
                "FWD205",
                Status.WARN,
                "(batch, head, query) rows with every key masked: their attention output is NaN or zero",
                f"{where}: {call.empty_rows} rows",
            )
        )
    if call.api == Api.SDPA and call.is_causal and call.mask_kind not in ("none", "is_causal"):
        findings.append(
            Finding(
                "FWD206",
                Status.FAIL,
                "attn_mask passed together with is_causal=True: backends disagree on which wins; pass one of them",
                where,
            )
        )
    if call.dropout_p > 0:
        findings.append(
            Finding(
                "FWD207",
                Status.FAIL,
                f"dropout_p={call.dropout_p:g} handed to {api} with the "
                "model in eval mode: pass dropout_p=p if self.training else 0.0",
                where,
            )
        )
    return findings


def _blind_to_themselves(call: AttentionCall) -> list[int]:
    """The positions of the queries whose own key slot the mask closes, over keys that hold their own index (a
    ring buffer past its wrap is left alone). A causal mask off by one into the past (q > kv) closes every one: the
    first token reads nothing and every other one misses itself."""
    positions = call.query_positions
    if positions is None or call.key_positions is not None or call.allowed.is_meta:
        return []
    L, S = call.allowed.shape
    inside = positions < S
    rows = torch.arange(L)[inside]
    closed = ~call.allowed[rows, positions[inside].to(call.allowed.device)].cpu()
    return positions[inside][closed].tolist()


def _key_selection(call: AttentionCall, blind: list[int]) -> str | None:
    """What a call whose queries miss their own key reads, when that is a key selection within the causal bound
    (DeepSeek V3.2's sparse attention: an indexer keeps the k best-scoring keys at or before each query, its own not
    always among them), said as a passing note; None when the mask is not one. The caller has found no key after
    its query; a selection also lets the first token read itself (its only key: any selection keeps it) and every
    query read some key. A strict causal mask (q > kv) fails that: its first query reads nothing. So does a causal
    mask aligned top left over a cache: its queries are the last ones, none at position 0, and each misses itself."""
    positions = call.query_positions
    if positions is None or call.allowed.shape[1] == 0:
        return None
    allowed = call.allowed.cpu()  # (L, S)
    first = (positions == 0).nonzero().flatten().tolist()
    if not first or not bool(allowed[first[0], 0]) or not bool(allowed.any(dim=-1).all()):
        return None
    return (
        "a key selection within the causal bound: every key a query reads is at or before it, the first reads "
        f"itself and every query reads some key; {len(blind)} queries (e.g. {', '.join(map(str, blind[:4]))}) "
        "did not select their own key, the selection's choice (a sparse-attention indexer's top-k), not a strict "
        "causal mask"
    )


API_NAMES: dict[str, str] = {
    Api.SDPA: "scaled_dot_product_attention",
    Api.MHA: "nn.MultiheadAttention",
    Api.SOFTMAX: "eager softmax",
    Api.FLEX: "flex_attention",
    Api.FLASH: "flash-attn",
    Api.XFORMERS: "xformers memory_efficient_attention",
}


def _reads_future(call: AttentionCall, shape: MayRead, future_pairs, api: str, where: str) -> Finding:
    """What lets a call of a causal model read the future, said by the shape of its may-read set: no restriction at
    all (FWD201), a mask in the other API's convention (FWD202), or some future keys (FWD204)."""
    L, S = call.allowed.shape
    if shape is MayRead.BIDIRECTIONAL:
        how = {
            "none": "no block_mask or score_mod" if call.api == Api.FLEX else "no attn_mask and is_causal=False",
            "scores": "no score is masked",
        }.get(call.mask_kind, f"the {call.mask_kind} mask {call.mask_values} masks nothing")
        every = (
            f"every query of {L} reads every key"
            if L == S
            else f"each of {L} queries reads all {S} key slots, those after its own position included"
        )
        return Finding("FWD201", Status.FAIL, f"no causal restriction: {how}; {every}", where)
    if shape is MayRead.INVERTED and call.mask_kind.startswith("bool"):
        convention = (
            "True = may attend, but this mask is True on the future (nn.MultiheadAttention's convention)"
            if call.api == Api.SDPA
            else "True = masked out, but this mask is True on the past (SDPA's convention)"
        )
        return Finding(
            "FWD202", Status.FAIL, f"boolean mask in the other convention: for {api} {convention}; pass ~mask", where
        )
    if shape is MayRead.INVERTED and call.mask_kind.startswith("float"):
        # nn.MultiheadAttention and nn.TransformerEncoder turn a boolean mask into 0/-inf before the call,
        # so an SDPA-convention mask (tril, True = may attend) arrives here as -inf on the past.
        return Finding(
            "FWD202",
            Status.FAIL,
            f"the mask handed to {api} blocks the past and opens "
            "the future: a mask built for the other convention (e.g. tril(...).bool(), "
            "SDPA's 'True = may attend', where True means masked out); pass ~mask",
            where,
        )
    shown = ", ".join(f"({q},{k})" for q, k in future_pairs[:4])
    # Over a cache, a slot after the query's own position holds a future token or nothing written yet:
    # a correct mask closes both, so both are read here as the future.
    what = (
        "future keys"
        if call.self_attention
        else "key slots after their own position (future tokens, or cache slots not yet written)"
    )
    return Finding(
        "FWD204",
        Status.FAIL,
        f"the mask lets queries read {what} ({shape.value}), (query position, key) e.g. {shown}",
        where,
    )


def _kind_of_call(row: CallRow) -> tuple:
    """What makes two calls alike in the table: where, how, what mask, what it allows (at whatever length: the
    batch-size-1 pass runs a shorter row). A cached call (more keys than queries) stays apart from a square one."""
    return row["module"], row["api"], row["mask"], row["pattern"], row["keys"] > row["queries"]


def _patterns(rows: list[CallRow]) -> str:
    """The judged patterns, then how many calls were not judged and why, in short."""
    judged = sorted({r["pattern"] for r in rows if r["judged"]})
    counts: dict[str, int] = {}
    for r in rows:
        if not r["judged"]:
            why = NotJudged(r["not_judged"] or "", r["pattern"]).in_summary
            counts[why] = counts.get(why, 0) + 1
    return ", ".join(judged + [f"{n} not judged: {why}" for why, n in counts.items()])


def _widths(rows: list[CallRow]) -> str:
    """What the declared windows and chunks showed, when the model declares any: how many calls were judged on
    width and on chunks, and why the others were not (the first reason)."""
    bands = [r["window"] for r in rows if r.get("window")]
    chunks = [r["chunk"] for r in rows if r.get("chunk")]
    sliding = any(b["declared"] for b in bands if b["judged"])  # else only full layers beside chunked ones
    said = ""
    for records, as_declared, not_judged in (
        (bands, "sliding windows as declared" if sliding else "full attention as declared", "width not judged"),
        (chunks, "chunks as declared", "chunks not judged"),
    ):
        judged = [r for r in records if r["judged"]]
        waiting = [r["note"] for r in records if not r["judged"] and r["note"].startswith(not_judged)]
        said += f"; {as_declared} at {len(judged)} call(s)" if judged else ""
        said += f"; {len(waiting)} call(s) {waiting[0]}" if waiting else ""
    return said


def _group(findings: list[Finding]) -> list[Finding]:
    """One finding per code, message shape and line of model code, listing every call it applies to (the layers
    share their attention's line); a module called more than once in the forward (decode steps through a cache) is
    listed once, with its count."""
    merged = []
    for first, members in grouped(findings, key=lambda f: (f.code, f.message, f.source)):
        counts = Counter(f.where or "" for f in members)  # in the order first seen; every finding here says where
        where = ", ".join(w if n == 1 else f"{w} x{n}" for w, n in counts.items())
        merged.append(Finding(first.code, first.status, first.message, where, source=first.source, module=first.module))
    return merged
