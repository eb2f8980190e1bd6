"""shape-ledger: the shapes of ids, embeddings, hidden states, per-head q/k/v, attention weights and logits, each axis
named by its symbolic dimension (B, T, S, d, h, h_kv, d_h, V, d_ff), checked against the layout attention requires.

Names come from behaviour and position, never from a size alone (the seed's toy has T = d_h = 4; a cache may hold as
many slots as the model is wide). A second, small pass runs with other B and T, chosen to collide with no size seen:
an axis that follows B is B, one that follows T is T. The axes that stay put are named by where they sit in the layout
the tensor's role requires: in q [B, ?, T, ?] handed to attention they are the heads and the head size, whatever their
sizes. Sizes the model states (`dims:`, its config) must agree; sizes it does not state are read off the first tensor
that shows them (per attention call, so layers may differ). An axis that still has no name is shown by its size,
and that is never a finding: only a layout that contradicts its role (the sequence on another axis than attention
runs over, a head count against the stated one) is evidence of a bug.

Forward hooks give module outputs; the observation pass gives what each attention call received.
"""

from __future__ import annotations

import re
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

from fwdcheck.checks.shape_ledger_spec import SPEC
from fwdcheck.checks.shape_ledger_view import LedgerData, LedgerEntry
from fwdcheck.errors import ModelRaised, first_line
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.observe.records import Api, ModuleCall, Observation
from fwdcheck.result import Check, CheckResult, Finding, Status, grouped
from fwdcheck.run.session import Session

# Which constant a size is named after, in a tensor that fits no layout, when several share it.
NAME_PRIORITY = ("d", "V", "d_ff", "h", "h_kv", "d_h", "d_v")
# Sizes a library's config gives that a tensor may contradict without a bug: its fields mean different things per
# architecture. V is not among them (logits narrower than the vocabulary cannot score every token), nor B and T.
FREE_SIZES = frozenset({"d", "d_ff", "h", "h_kv", "d_h", "d_v", "g"})
LOOSE: list[str] = ["(sizes of its own)"]  # Namer.name's layout for a tensor that fits only with free sizes


@dataclass
class Entry:
    name: str
    role: str  # ids | embedding | hidden | q | k | v | scores_q | scores_k | scores_v | weights | ffn | logits | mha_in
    shape: tuple[int, ...]
    probe_shape: tuple[int, ...] | None = None  # the same tensor in the second pass
    module: str = ""
    softmax_dim: int | None = None
    row_sum_error: float | None = None
    nonfinite_rows: int = 0
    implied: bool = False  # weights SDPA and MHA compute internally: the shape they imply, not a tensor seen
    seq: int = 0  # forward order
    dtype: str = ""
    group: str = ""  # the attention call it belongs to: its q, k, v and weights share head count and head size
    source: str | None = None  # "path:line" of the model code that made that attention call
    cross: bool = False  # its attention call reads another sequence's keys: its queries or keys may be of any length
    learned_query: bool = False  # its call's queries are not computed from the input (a learned query, expanded)


# Expected symbolic layouts per role; alternatives are equally correct. B and T follow the inputs; S is the keys'
# length (T itself, or the slots of a cache); g the queries per kv head of a 5-D grouped layout [B, h_kv, g, T, d_h];
# * any width (an embedding's own); 1 a broadcast axis. A T axis may hold a chunk of the sequence instead (a
# prefill, one decode step) when no axis of the tensor follows T.
_QUERIES = [["B", "h", "T", "d_h"], ["B*h", "T", "d_h"], ["B", "T", "d_h"], ["B", "h_kv", "g", "T", "d_h"]]
_KEYS = [
    ["B", "h_kv", "S", "d_h"],
    ["B", "h", "S", "d_h"],
    ["B*h", "S", "d_h"],
    ["B*h_kv", "S", "d_h"],
    ["B", "S", "d_h"],
    ["B", "h_kv", "1", "S", "d_h"],
    ["B", "h_kv", "g", "S", "d_h"],
]
# Values as wide as queries and keys, or of a width of their own, d_v (multi-head latent attention: DeepSeek V3's
# v_head_dim is narrower than its qk head), stated by the config or `dims:`, else read off the first v.
_VALUES = _KEYS + [[*layout[:-1], "d_v"] for layout in _KEYS]
TEMPLATES: dict[str, list[list[str]]] = {
    "ids": [["B", "T"]],
    "embedding": [["B", "T", "d"], ["T", "B", "d"], ["B", "T", "*"], ["T", "B", "*"]],
    # [B,T,*,d]: parallel residual streams (hyper-connections: DeepSeek V4, Hunyuan V4), each of the model's width
    "hidden": [["B", "T", "d"], ["T", "B", "d"], ["B*T", "d"], ["B", "T", "*", "d"]],
    "q": _QUERIES,
    "k": _KEYS,
    "v": _VALUES,
    "mha_in": [["T", "B", "d"], ["T", "d"]],
    "scores_q": _QUERIES,
    # k^T in q @ k^T; k itself, should an einsum's operand ('bhid,bhjd->bhij') be recorded as it was written
    "scores_k": [[*k[:-2], k[-1], k[-2]] for k in _KEYS] + _KEYS,
    "scores_v": _VALUES,
    "weights": [["B", "h", "T", "S"], ["B*h", "T", "S"], ["B", "T", "S"], ["B", "h_kv", "g", "T", "S"]],
    "ffn": [["B", "T", "d_ff"], ["T", "B", "d_ff"], ["B*T", "d_ff"]],  # OPT flattens the tokens before its MLP
    "logits": [["B", "T", "V"]],
}
# The order in which the tensors of one attention call are read: what an API defines (SDPA's q, k, v; MHA's
# num_heads in its weights) before what eager code merely shows.
GROUP_ORDER = ("q", "k", "v", "weights", "scores_q", "scores_k", "scores_v", "mha_in")
HEAD_SYMBOLS = {"h", "h_kv", "B*h", "B*h_kv"}


class ShapeLedger(Check, declared=SPEC):
    name = "shape-ledger"

    def key_number(self, result: CheckResult) -> str:
        return f"{result.metrics['tensors']} tensors" if "tensors" in result.metrics else ""

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        first = session.observation()
        B, T = session.inputs.shape
        blocks = model.layer_stack
        known = {k: v for k, v in model.dims.items() if k != "L"}
        entries = collect(first, session.inputs.shape, first_logits_shape(first), blocks, known)

        (B2, T2), ran, notes = naming_pass(session, entries, blocks, known, model.max_positions)
        namer = Namer((B, T), (B2, T2) if ran else None, known, model.declared_dims)
        rows, findings = self._judge(entries, namer)
        notes += namer.notes(rows)
        dims_seen = namer.dims()
        expected_ledger = self.expected_in(session)
        diff = compare_ledgers(expected_ledger, rows, dims_seen) if expected_ledger else None
        if diff:
            findings += diff
        data: LedgerData = {
            "entries": rows,
            "dims": dims_seen,
            "probe": {"batch_size": B2, "seq_len": T2},
            "softmax": sorted({_direction(e) for e in entries if e.role == "weights"})
            or ["no attention weights observed"],
            "notes": notes,
        }
        if expected_ledger is not None:
            data["ledger_diff"] = [f.message for f in diff or []]
        return self._summarise(entries, findings, diff, data)

    @staticmethod
    def _judge(entries: list[Entry], namer: Namer) -> tuple[list[LedgerEntry], list[Finding]]:
        """Each entry named and judged against the layouts its role allows: its ledger row, and the findings, one
        per bug however many layers repeat it."""
        named = namer.name_all(entries)
        elsewhere = _learned_queries_elsewhere(entries, namer)
        findings: list[Finding] = []
        rows: list[LedgerEntry] = []
        for e in entries:
            dims, layout = named[e.name]
            expected = TEMPLATES.get(e.role)
            ok = layout is not None or expected is None or e.group in elsewhere
            if layout is LOOSE:
                layout = None  # shown against the first layout of its role, by its sizes
            # The layout it fits is what it was expected to be (a repeated v [B,h,S,d_h], not the first of the
            # alternatives, [B,h_kv,S,d_h]); a tensor that fits none is shown against the first.
            rows.append(
                {
                    "name": e.name,
                    "shape": list(e.shape),
                    "dims": dims,
                    "dtype": e.dtype,
                    "role": e.role,
                    "expected": layout or (expected[0] if expected else None),
                    "ok": ok,
                    "implied": e.implied,
                }
            )
            findings += judge(e, dims, ok, expected, namer)
        return rows, _merge_layers(findings)

    def _summarise(
        self, entries: list[Entry], findings: list[Finding], diff: list[Finding] | None, data: LedgerData
    ) -> CheckResult:
        """The first difference from the expected ledger, or the first layout problem, or what was named; and what
        the ledger could not show."""
        rows, notes = data["entries"], data["notes"]
        weights_seen = any(e.role == "weights" for e in entries)  # data["softmax"] then says which way
        bad = [f for f in findings if f.status != Status.PASS]
        if diff:
            summary = f"{len(diff)} difference(s) from the expected ledger; first: {diff[0].message}"
        elif bad:
            summary = f"{len(bad)} layout problem(s): {bad[0].message}"
        else:
            summary = (
                f"{len(rows)} tensors named ({', '.join(f'{k}={v}' for k, v in data['dims'].items())}); "
                f"softmax {data['softmax'][0] if weights_seen else 'not observed'}"
            )
        if not any(e.role in ("q", "weights", "mha_in", "scores_q") for e in entries):
            summary += "; no attention call observed (custom kernel?): q/k/v not in the ledger"
        if notes:
            summary += "; note: " + "; ".join(notes)
        probe = data["probe"]
        return CheckResult.from_findings(
            self.name,
            findings,
            summary,
            metrics={"tensors": len(rows), "probe_batch": probe["batch_size"], "probe_seq_len": probe["seq_len"]},
            data=data,
        )


def naming_pass(
    session, entries: list[Entry], blocks: str | None, known: dict[str, int], max_positions: int | None
) -> tuple[tuple[int, int], bool, list[str]]:
    """Run the second, small pass and give each entry its shape there (probe_shape). Returns the pass's (B, T),
    whether it ran, and notes. A model that refuses the pass is not failed for it: what the first pass showed still
    counts, only the naming is poorer."""
    B, T = session.inputs.shape
    sizes = {s for e in entries for s in e.shape} | set(known.values())
    B2, T2 = probe_sizes(B, T, sizes, max_positions, session.min_seq_len)
    second, refused = None, []
    for batch in (B2, B):  # a model may fix its batch size (caches allocated for max_batch_size): then keep B
        try:
            second, B2 = session.observe(session.random_ids((batch, T2))), batch
            break
        except ModelRaised as exc:
            refused.append(f"B={batch}, T={T2} ({first_line(exc)})")
    if second is None:
        return (
            (B2, T2),
            False,
            [
                f"the naming pass raised at {' and at '.join(refused)}: axes are named by position "
                "and size only, which cannot tell a missing transpose from a chunk of the sequence"
            ],
        )
    notes = (
        [f"the naming pass raised at {refused[0]}; it ran at B={B}: batch axes are named by position"]
        if refused
        else []
    )
    by_name = {e.name: e for e in collect(second, (B2, T2), first_logits_shape(second), blocks, known)}
    for e in entries:
        other = by_name.get(e.name)
        e.probe_shape = other.shape if other is not None and len(other.shape) == len(e.shape) else None
    # A call the shorter pass did not repeat (the fifth decode step of five) behaves as the same module's call of the
    # same role and shape that it did repeat.
    seen = {(e.role, e.module, e.shape): e.probe_shape for e in entries if e.probe_shape is not None}
    for e in entries:
        if e.probe_shape is None and e.module:
            e.probe_shape = seen.get((e.role, e.module, e.shape))
    return (B2, T2), True, notes


def first_logits_shape(observation: Observation) -> tuple[int, ...] | None:
    root = next((m for m in observation.modules if m.name == ""), None)
    return root.output_shape if root else None


def collect(obs: Observation, ids_shape, logits_shape, blocks: str | None, known: dict[str, int]) -> list[Entry]:
    """The ledger's entries in forward order, named so the same tensor gets the same name in both passes."""
    entries = [Entry("input_ids", "ids", tuple(ids_shape), dtype="int64")]
    entries += _module_entries(obs, ids_shape[0], blocks, known)
    attention, calls_at = _attention_entries(obs)
    entries += attention
    entries += _matmul_entries(obs, calls_at)
    entries.sort(key=lambda e: e.seq)
    if logits_shape:
        # The logits the checks read are [B, T, width]: the model's face verified B and T, also where a forward
        # adapter calls the model several times (a prefill, then decode steps) and joins the pieces.
        root = next((m for m in obs.modules if m.name == ""), None)
        entries.append(
            Entry("logits", "logits", (*ids_shape, logits_shape[-1]), dtype=root.output_dtype if root else "")
        )
    return entries


def _module_entries(obs: Observation, batch: int, blocks: str | None, known: dict[str, int]) -> list[Entry]:
    """The outputs of the modules whose role the ledger knows: the embeddings of the ids, each block of the layer
    stack, and the first block's feed-forward hidden layers."""
    entries: list[Entry] = []
    attending = {c.module for c in obs.attention if c.module} | {m.module for m in obs.matmuls if m.module}
    token = _token_embedding(obs, batch, known.get("d"))
    calls: dict[str, int] = {}  # a module run more than once per forward (decode steps, shared layers): #1, #2, ...
    for i, call in enumerate(obs.modules):
        if call.output_shape is None or not call.name:
            continue
        if _embeds_ids(call, batch):
            role, label = "embedding", f"{'token embedding' if call.name == token else 'embedding'} ({call.name})"
        elif (
            blocks
            and re.fullmatch(rf"{re.escape(blocks)}\.\d+", call.name)
            and call.input_shape in (None, call.output_shape)
        ):
            # A transformer block maps the residual stream to itself; a list item that changes the shape (one
            # attention head of a per-head ModuleList, a projection) is not a block, and not a hidden state.
            role, label = "hidden", f"{call.name} output"
        elif (
            call.cls == "Linear"
            and known.get("d_ff")
            and _in_first_block(call.name, blocks)
            and not any(call.name.startswith(f"{m}.") for m in attending)
            and _hidden_layer(obs.modules, i)
            and call.output_shape[-1:] == (known["d_ff"],)
        ):
            # The MLP's hidden layer (up, gate) by what it does, its width only confirming it: not a fused q/k/v
            # projection, nor the down projection or an lm head that happen to be as wide.
            role, label = "ffn", f"{call.name} output"
        else:
            continue
        n = calls[label] = calls.get(label, -1) + 1
        entries.append(
            Entry(
                label + (f" #{n}" if n else ""),
                role,
                call.output_shape,
                module=call.name,
                seq=call.seq,
                dtype=call.output_dtype,
            )
        )
    return entries


def _attention_entries(obs: Observation) -> tuple[list[Entry], list[str]]:
    """Each attention call's q, k and v as SDPA takes them (nn.MultiheadAttention's input), and its weights; with
    each call's name, by its index."""
    entries: list[Entry] = []
    per_module: dict[str, int] = {}
    calls_at: list[str] = []
    for attn in obs.attention:
        if attn.api == Api.KERNEL:  # a kernel fwdcheck does not know: its arguments' layout is its own
            continue
        n = per_module[attn.module] = per_module.get(attn.module, -1) + 1
        where = f"{attn.module or 'model'}" + (f"#{n}" if n else "")
        calls_at.append(where)
        at: dict[str, Any] = dict(
            module=attn.module,
            seq=attn.seq,
            dtype=attn.dtype,
            group=where,
            source=attn.source,
            cross=attn.cross,
            learned_query=attn.reads_input is False,
        )
        if attn.api in (Api.SDPA, Api.FLEX):  # both take q, k, v as (B, h, T, d_h)
            assert attn.key_shape is not None and attn.value_shape is not None  # their k and v are always seen
            entries += [
                Entry(f"{where} q", "q", attn.query_shape, **at),
                Entry(f"{where} k", "k", attn.key_shape, **at),
                Entry(f"{where} v", "v", attn.value_shape, **at),
            ]
        elif attn.api == Api.MHA:
            entries.append(Entry(f"{where} query (MHA input)", "mha_in", attn.query_shape, **at))
        entries.append(
            Entry(
                f"{where} attention weights",
                "weights",
                attn.weights_shape,
                softmax_dim=attn.softmax_dim,
                row_sum_error=attn.row_sum_error,
                nonfinite_rows=attn.nonfinite_rows,
                implied=attn.api != Api.SOFTMAX,
                **at,
            )
        )
    return entries, calls_at


def _matmul_entries(obs: Observation, calls_at: list[str]) -> list[Entry]:
    """Eager attention's operands: q @ k^T makes the scores, weights @ v reads the values. calls_at: each attention
    call's name, by its index, which the products of that call share."""
    entries: list[Entry] = []
    per_kind: dict[tuple[str, str], int] = {}
    for mm in obs.matmuls:
        n = per_kind[(mm.module, mm.kind)] = per_kind.get((mm.module, mm.kind), -1) + 1
        where = f"{mm.module or 'model'}" + (f"#{n}" if n else "")
        # The softmax it belongs to, where the observation links them; else the module's n-th product of its kind.
        index = mm.call if mm.call is not None and mm.call < len(calls_at) else None
        where = calls_at[index] if index is not None else where
        call = obs.attention[index] if index is not None else None
        at: dict[str, Any] = dict(
            module=mm.module,
            seq=mm.seq,
            group=where,
            source=call.source if call is not None else None,
            cross=call.cross if call is not None else False,
            learned_query=call is not None and call.reads_input is False,
        )
        if mm.kind == "scores":
            entries += [
                Entry(f"{where} q (q @ k^T)", "scores_q", mm.a_shape, **at),
                Entry(f"{where} k^T (q @ k^T)", "scores_k", mm.b_shape, **at),
            ]
        else:
            entries.append(Entry(f"{where} v (weights @ v)", "scores_v", mm.b_shape, **at))
    return entries


def _embeds_ids(call, batch: int) -> bool:
    """An nn.Embedding of token ids: a [B, T] input (or a [B, t] chunk of it, when forward decodes step by step)."""
    return (
        call.cls == "Embedding"
        and call.input_shape is not None
        and len(call.input_shape) == 2
        and call.input_shape[0] == batch
    )


def _token_embedding(obs: Observation, batch: int, d: int | None) -> str | None:
    """The token embedding among the embeddings of the ids: the first as wide as the model (a value embedding of
    another width is not it), else the first."""
    embeddings = [c.name for c in obs.modules if c.output_shape and _embeds_ids(c, batch)]
    as_wide = [c.name for c in obs.modules if c.output_shape and _embeds_ids(c, batch) and c.output_shape[-1] == d]
    return next(iter(as_wide or embeddings), None)


def _hidden_layer(modules: list[ModuleCall], i: int) -> bool:
    """Whether another Linear of the same parent runs after Linear call i, within the same call of the parent: then
    its output feeds the parent's further layers (an MLP's up and gate projections), where the parent's last Linear
    (the down projection, an lm head) hands its output back."""
    parent = modules[i].name.rpartition(".")[0]
    enclosing = next((m for m in reversed(modules[:i]) if m.name == parent), None)
    if enclosing is None:
        return False
    for later in modules[i + 1 :]:  # in the order calls started; those inside the parent's call end before it does
        if later.seq > enclosing.seq:
            return False
        if later.cls == "Linear" and later.name.rpartition(".")[0] == parent:
            return True
    return False


def _in_first_block(name: str, blocks: str | None) -> bool:
    """Only the first block's feed-forward layers go in the ledger: the rest repeat them, and a layer outside the
    blocks is none of them."""
    return blocks is None or name.startswith(f"{blocks}.0.")


def probe_sizes(B: int, T: int, taken: set[int], max_positions: int | None, shortest: int = 1) -> tuple[int, int]:
    """A second (B, T), each size distinct from every size already seen, so no axis can be named by coincidence;
    T no shorter than the model accepts."""
    B2 = next(n for n in range(2, 10_000) if n != B and n not in taken)
    limit = max_positions or 10_000
    T2 = next((n for n in range(max(3, shortest), limit + 1) if n not in taken and n not in (B, B2, T)), None)
    if T2 is None:  # max_positions is tiny and crowded: fall back to any other length
        T2 = next(n for n in range(2, limit + 1) if n != T)
    return B2, T2


@dataclass(frozen=True)
class Axis:
    """One axis of a tensor, and what it did between the two passes."""

    size: int
    follows: str | None = None  # B, T or B*T: it changed exactly as that input size did
    per_batch: int | None = None  # it followed B times this constant: batch and heads flattened (B*h)
    unseen: bool = False  # the naming pass did not show this tensor: only its size is known
    pooled: int | None = None  # it was T / k, rounded up, in both passes: the sequence pooled by k (Funnel's queries)

    @property
    def constant(self) -> bool:
        """Not tied to the inputs. An axis that changed without following them counts too: the naming pass took
        another code path there (a sliding window wider than it), or the axis is a chunk of the sequence. A pooled
        sequence is tied to T: never a head count or a width."""
        return self.follows is None and self.per_batch is None and self.pooled is None

    @property
    def pooled_name(self) -> str | None:
        return f"T/{self.pooled}" if self.pooled else None


class Namer:
    """Names every axis by behaviour and position, reading the sizes the model does not state off its tensors."""

    def __init__(
        self,
        first: tuple[int, int],
        second: tuple[int, int] | None,
        known: dict[str, int],
        declared: set[str] | None = None,
    ):
        (self.B, self.T), self.second = first, second
        # Sizes the user declared (None: every known one). The others were read off a library's config, whose fields
        # mean different things per architecture (an MLA config's head_dim is the rotated part only, a per-layer
        # head count is one number): they name the axes they match, and a tensor that fits its role's layout only
        # with other sizes there is a number in the ledger, never a finding.
        self.free = {s for s in FREE_SIZES if declared is not None and s not in declared}
        self.loosened = False  # fitting with the free sizes ignored
        self.batch_varied = second is not None and second[0] != self.B  # else batch axes are told by position
        self.stated = dict(known)
        # d_h = d / h and h_kv = h are what a config implies when it says no more, not what it states: Gemma's head
        # size is not d / h, and a config may name its kv heads in a way fwdcheck does not read. A layout that shows
        # its heads (q [B,h,T,d_h]) says what they are; a per-head [B,T,d_h] still has to agree.
        self.defaults = {
            s
            for s, derived in (("d_h", _ratio(known, "d", "h")), ("h_kv", known.get("h")))
            if s in known and known[s] == derived
        }
        self.shared: dict[str, int] = {}  # read off tensors outside attention calls (d, from the blocks)
        self.groups: dict[str, dict[str, int]] = {}  # read off each attention call's tensors (h, h_kv, d_h, S)
        self.padded: tuple[int, int | None] | None = None  # (logits width, vocabulary) when the vocabulary is padded
        self.unnamed: list[str] = []  # tensors that fit their role only with sizes other than the config's
        self.elsewhere: list[str] = []  # attention calls over an axis that is not the sequence and has no name
        self.cross = False  # the tensor being named belongs to cross-attention

    # -- reading what each axis did -------------------------------------------------------------------------------

    def axes(self, e: Entry) -> list[Axis]:
        if self.second is None or e.probe_shape is None:
            return [Axis(s, unseen=True) for s in e.shape]
        (B, T), (B2, T2) = (self.B, self.T), self.second
        axes = []
        for size, other in zip(e.shape, e.probe_shape, strict=True):
            if (size, other) == (B, B2) and B != B2:
                axes.append(Axis(size, follows="B"))
            elif (size, other) == (T, T2):
                axes.append(Axis(size, follows="T"))
            elif (size, other) == (B * T, B2 * T2):
                axes.append(Axis(size, follows="B*T"))
            elif size != other and size % B == 0 and other % B2 == 0 and size // B == other // B2 > 1:
                axes.append(Axis(size, per_batch=size // B))
            else:
                axes.append(Axis(size, pooled=_pooled(size, other, T, T2)))
        return axes

    def is_sequence(self, axis: Axis, strict: bool = False) -> bool:
        """Whether the axis is the sequence: it followed T; without a naming pass, it is T's size (strict: a size
        that nothing else stated shares, so that it is evidence)."""
        if axis.follows == "T":
            return True
        if not axis.unseen or axis.size != self.T:
            return False
        read = {size for scope in (self.shared, *self.groups.values()) for size in scope.values()}
        return not strict or self.T not in {self.B, *self.stated.values(), *read}

    # -- naming -----------------------------------------------------------------------------------------------------

    def name_all(self, entries: list[Entry]) -> dict[str, tuple[list[str], list[str] | None]]:
        """name -> (dims, the layout of its role they fit or None). Sizes are read in an order that lets the clearest
        evidence speak first: the blocks' residual stream before embeddings (a value embedding has its own width),
        each attention call's API-defined tensors before eager operands, and the logits last."""
        named = {}

        def run(group: list[Entry], scope: ChainMap):
            for e in group:
                named[e.name] = self.name(e, scope)

        order = {"hidden": 0, "embedding": 1}
        run(
            sorted((e for e in entries if e.role in order), key=lambda e: (order[e.role], e.seq)), ChainMap(self.shared)
        )
        for key in dict.fromkeys(e.group for e in entries if e.group):
            scope = ChainMap(self.groups.setdefault(key, {}), self.shared)
            run(sorted((e for e in entries if e.group == key), key=lambda e: GROUP_ORDER.index(e.role)), scope)
        run([e for e in entries if e.role not in order and not e.group], ChainMap(self.shared))
        return named

    def name(self, e: Entry, scope: ChainMap) -> tuple[list[str], list[str] | None]:
        """The axes' names, and the layout of the tensor's role they fit (None: it fits none)."""
        axes = self.axes(e)
        self.cross = e.cross
        layouts = TEMPLATES.get(e.role, [])
        if "h_kv" not in self.stated or e.role in ("scores_k", "scores_v"):
            # Keys with as many heads as the queries have h heads: whether fewer kv heads were repeated or there
            # are no fewer, nothing tells, and no h_kv is claimed. Fewer heads than h are h_kv. The operands of
            # q @ k^T and weights @ v pair head by head with the queries, so this holds for them whatever the model
            # states: as many heads as the queries are the query heads (kv heads repeated, or h_kv = h).
            layouts = sorted(layouts, key=lambda t: "h_kv" in t or "B*h_kv" in t)
        for layout in layouts:
            fitted = self.fit(layout, axes, scope)
            if fitted is not None:
                names, read = fitted
                scope.update(read)
                if "V_pad" in names:
                    self.padded = (e.shape[names.index("V_pad")], self.value("V", scope))
                return names, layout
        if self.free and any(self.fits_loosely(layout, axes) for layout in layouts):
            self.unnamed.append(e.name)
            return self.describe(e, axes, scope), LOOSE
        return self.describe(e, axes, scope), None

    def fits_loosely(self, layout: list[str], axes: list[Axis]) -> bool:
        """Whether the tensor fits the layout with every free size (not declared by the user) allowed any value:
        its batch and sequence axes sit where its role wants them, only sizes fwdcheck read off a config differ."""
        self.loosened = True
        try:
            return self.fit(layout, axes, ChainMap({})) is not None
        finally:
            self.loosened = False

    def fit(self, layout: list[str], axes: list[Axis], scope: ChainMap) -> tuple[list[str], dict] | None:
        """The axes' names if the tensor fits this layout, and the sizes it reads off; None if it does not."""
        if len(layout) != len(axes):
            return None
        chunk = not any(a.follows in ("T", "B*T") for a in axes)
        heads_shown = bool(HEAD_SYMBOLS & set(layout))
        read: dict[str, int] = {}
        names = []
        for symbol, axis in zip(layout, axes, strict=True):
            name = self._slot(symbol, axis, scope, read, chunk, heads_shown)
            if name is None:
                return None
            names.append(name)
        if (
            "g" in layout and not self.loosened
        ):  # [B, h_kv, g, ...]: the groups times their size must be the query heads
            h, h_kv, g = (read.get(s, self.value(s, scope)) for s in ("h", "h_kv", "g"))
            if h and h_kv and g and h_kv * g != h:
                return None
        return names, read

    def _slot(self, symbol: str, axis: Axis, scope, read: dict, chunk: bool, heads_shown: bool) -> str | None:
        size = axis.size
        if symbol in ("T", "S") and axis.pooled:
            # The sequence pooled by the model's design (Funnel's queries, pool_q_only: [B, h, T/2, T] weights):
            # T / k in both passes, where queries or keys go. Anywhere else it is no head count and no width.
            return axis.pooled_name
        if self.cross and symbol in ("T", "S") and axis.follows != "T" and axis.per_batch is None:
            # Cross-attention: one side is another sequence (patches read by bytes, bytes by patches), of its own
            # length, which need not follow the input's: named by its size.
            return str(size) if axis.follows is None else None
        if symbol in ("B", "T", "B*T"):
            if axis.follows == symbol:
                return symbol
            if symbol == "B" and not self.batch_varied and axis.constant and size == self.B:
                return symbol
            if axis.unseen:  # no naming pass to tell: the size and the position are all there is
                if size == {"B": self.B, "T": self.T, "B*T": self.B * self.T}[symbol]:
                    return symbol
                return str(size) if symbol == "T" else None
            if symbol == "T" and chunk and axis.constant:
                return str(size)  # a chunk of the sequence (a prefill, one decode step): named by its size
            return None
        if symbol == "S":  # the keys read: the sequence itself, or the slots of a cache
            if self.is_sequence(axis):
                return "T"
            return "S" if axis.constant else None
        if symbol.startswith("B*"):  # B*h, B*h_kv: batch and heads flattened into one axis
            told_by_size = axis.unseen or (not self.batch_varied and axis.constant)
            factor = axis.per_batch or (size // self.B if told_by_size and size % self.B == 0 else None)
            return symbol if factor and self._agrees(symbol[2:], factor, scope, read, heads_shown) else None
        if not axis.constant and not (axis.pooled and self.value(symbol, scope) == size):
            # An axis tied to the inputs is no head count or width; one that only fell as T / k in both passes is,
            # where its size is the one the model states for the symbol: the second pass took another code path (kv
            # heads repeated at one length only) and the sizes fell so by chance.
            return None
        if symbol == "*":
            return str(size)
        if symbol == "1":
            return "1" if size == 1 else None
        if symbol == "V" and size > (self.value("V", scope) or size):
            return "V_pad"  # logits wider than the vocabulary: padded (to a multiple of 64, say), a note
        return symbol if self._agrees(symbol, size, scope, read, heads_shown) else None

    def _agrees(self, symbol: str, size: int, scope, read: dict, heads_shown: bool) -> bool:
        """Whether the size can be this symbol: it is the size stated or already read, or the symbol is still free
        (then this tensor says what it is)."""
        if self.loosened and symbol in self.free:
            return True
        if symbol in read:
            return read[symbol] == size
        if symbol in scope:
            return scope[symbol] == size
        if symbol in self.stated and not (heads_shown and symbol in self.defaults):
            return self.stated[symbol] == size
        if symbol == "h_kv":  # kv heads serve whole groups of query heads
            h = read.get("h", self.value("h", scope))
            if h and h % size:
                return False
        read[symbol] = size
        return True

    def value(self, symbol: str, scope) -> int | None:
        return scope.get(symbol, self.stated.get(symbol))

    def describe(self, e: Entry, axes: list[Axis], scope) -> list[str]:
        """Names for a tensor that fits no layout of its role: what each axis followed, else a stated size's name,
        the layout's own choice first when several share it."""
        layouts = TEMPLATES.get(e.role, [[]])
        expected = next((t for t in layouts if len(t) == len(axes)), layouts[0])
        names = []
        for i, axis in enumerate(axes):
            want = expected[i] if i < len(expected) else None
            if axis.follows or axis.pooled:
                names.append(axis.follows or str(axis.pooled_name))
            elif axis.per_batch:
                names.append(
                    "B*"
                    + next((s for s in ("h", "h_kv") if self.value(s, scope) == axis.per_batch), str(axis.per_batch))
                )
            elif axis.unseen and want in ("B", "T") and axis.size == (self.B if want == "B" else self.T):
                names.append(want)
            else:
                candidates = [s for s in NAME_PRIORITY if self.value(s, scope) == axis.size]
                names.append(want if want in candidates else candidates[0] if candidates else str(axis.size))
        return names

    # -- what the report says -------------------------------------------------------------------------------------

    def dims(self) -> dict[str, int]:
        """The sizes of the architecture: as stated, a default replaced by what the tensors showed, then what was
        read off them (the first attention call's, where layers differ)."""
        dims = dict(self.stated)
        for scope in (self.shared, *self.groups.values()):
            for symbol, size in scope.items():
                if symbol in ("g", "S"):
                    continue
                if symbol not in dims or (symbol in self.defaults and dims[symbol] == self.stated.get(symbol)):
                    dims[symbol] = size
        return dims

    def notes(self, rows: list[LedgerEntry]) -> list[str]:
        notes = []
        if self.padded:
            width, vocab = self.padded
            notes.append(f"logits are {width} wide for a vocabulary of {vocab} (V_pad): a padded output vocabulary")
        if self.unnamed:
            notes.append(
                f"{len(self.unnamed)} tensor(s) fit their role only with sizes other than the config's (first: "
                f"{self.unnamed[0]}; a config field that means something else here, heads that differ per layer); "
                "shown by their sizes, no finding"
            )
        if self.elsewhere:
            notes.append(
                f"{len(self.elsewhere)} attention call(s) of learned queries, not computed from the tokens, attend "
                f"over an axis that is not the sequence (first: {self.elsewhere[0]}; reading across layers or "
                "blocks): no missing transpose, so shown by their sizes, no finding"
            )
        unnamed = sorted({int(d) for r in rows if r["ok"] for d in r["dims"] if d.isdigit()})
        if unnamed:
            notes.append(
                f"axes of size {', '.join(map(str, unnamed))} are shown by their size (fwdcheck has no name "
                "for them: a chunk of the sequence, an embedding's own width); that is no finding"
            )
        return notes


def _pooled(size: int, other: int, T: int, T2: int) -> int | None:
    """k where an axis was T / k rounded up in the first pass and T2 / k in the second (k > 1, the smallest that
    fits both): the sequence pooled by a fixed factor, as a model designed to pool it does at any length; None for
    an axis that changed otherwise, or stayed put."""
    if size == other or size >= T or other >= T2:
        return None
    return next((k for k in range(2, T + 1) if -(-T // k) == size and -(-T2 // k) == other), None)


def _ratio(known: dict[str, int], a: str, b: str) -> int | None:
    return known[a] // known[b] if known.get(a) and known.get(b) and known[a] % known[b] == 0 else None


def judge(e: Entry, dims: list[str], ok: bool, expected: list[list[str]] | None, namer: Namer) -> list[Finding]:
    findings = []
    shown = f"[{','.join(dims)}]"
    misplaced = None if ok else _sequence_misplaced(e, namer)
    if misplaced is not None:
        over = -1 if e.role == "scores_k" else -2
        findings.append(
            Finding(
                "FWD402",
                Status.FAIL,
                f"{e.name} is {shown}: the sequence T is axis {misplaced}, "
                f"but attention runs over axis {over}, which is {dims[over]} here (a missing "
                "transpose(1, 2)?)",
                where=e.module,
                module=e.module,
            )
        )
    elif not ok and expected:
        status = Status.WARN if e.role in ("hidden", "embedding") else Status.FAIL
        findings.append(
            Finding(
                "FWD401",
                status,
                f"{e.name} is {shown}, expected {' or '.join('[' + ','.join(x) + ']' for x in expected)}",
                where=e.module or None,
                module=e.module or None,
            )
        )
    if e.role == "weights" and e.softmax_dim is not None and e.softmax_dim != -1:
        findings.append(
            Finding(
                "FWD403",
                Status.FAIL,
                f"softmax over dim {e.softmax_dim} of the [..,T,S] scores: "
                "it normalises over the queries, not the keys each query reads",
                where=e.module,
                module=e.module,
            )
        )
    elif e.role == "weights" and (e.nonfinite_rows or (e.row_sum_error or 0) > 1e-2):
        findings.append(
            Finding(
                "FWD404",
                Status.FAIL,
                f"{e.name}: {e.nonfinite_rows} rows hold NaN/Inf; largest |sum over keys - 1| is {e.row_sum_error:.3g}",
                where=e.module,
                module=e.module,
            )
        )
    for f in findings:  # a tensor of an attention call points at the line that made the call
        f.source = e.source
    return findings


def _learned_queries_elsewhere(entries: list[Entry], namer: Namer) -> set[str]:
    """The attention calls whose queries are learned, not computed from the input, and attend over another axis
    than the sequence: a learned query reading across layers, blocks or experts at every position (Inkling 2's block
    attention residuals). Nothing there is evidence of a swapped layout, so their tensors are shown by their sizes;
    queries computed from the tokens that attend over another axis are the missing transpose FWD402 names."""
    calls = set()
    for e in entries:
        queries = e.role in ("q", "scores_q") and e.group and e.learned_query
        if queries and _sequence_misplaced(e, namer) is not None:
            calls.add(e.group)
            namer.elsewhere.append(f"{e.module}'s {e.shape[-2]} queries at every position")
    return calls


def _sequence_misplaced(e: Entry, namer: Namer) -> int | None:
    """The axis holding the sequence, when a tensor handed to attention holds it somewhere other than the axis
    attention runs over (-2; -1 or -2 for k^T). A KV cache or a decode step holds no axis that follows T at all:
    that is no evidence."""
    if e.role not in ("q", "k", "v", "scores_q", "scores_k", "scores_v") or len(e.shape) < 3:
        return None
    axes = namer.axes(e)
    allowed = {len(axes) - 2, len(axes) - 1} if e.role == "scores_k" else {len(axes) - 2}
    found = [i for i, a in enumerate(axes) if namer.is_sequence(a, strict=True)]
    if not found or any(i in allowed for i in found):
        return None
    return found[0]


def compare_ledgers(expected: dict, current: list[LedgerEntry], dims: dict[str, int]) -> list[Finding]:
    """A saved ledger against this run's: tensors added or gone, symbolic shapes, the sizes of the architecture's
    dimensions (h, h_kv, d_h, ...) and dtypes changed. B and T follow the inputs and are not compared."""
    before = {e["name"]: e for e in expected["entries"]}
    after = {e["name"]: e for e in current}
    findings = []
    for symbol, size in (expected.get("dims") or {}).items():
        if symbol in dims and dims[symbol] != size:
            findings.append(
                Finding("FWD406", Status.FAIL, f"dimension {symbol}: {size} -> {dims[symbol]}", where=symbol)
            )
    for name in [n for n in after if n not in before]:
        findings.append(Finding("FWD405", Status.FAIL, f"new tensor {name} {_dims(after[name])}", where=name))
    for name in [n for n in before if n not in after]:
        findings.append(Finding("FWD405", Status.FAIL, f"tensor {name} {_dims(before[name])} is gone", where=name))
    for name in [n for n in after if n in before]:
        if before[name]["dims"] != after[name]["dims"]:
            findings.append(
                Finding("FWD406", Status.FAIL, f"{name}: {_dims(before[name])} -> {_dims(after[name])}", where=name)
            )
        if before[name].get("dtype") and before[name].get("dtype") != after[name].get("dtype"):
            findings.append(
                Finding(
                    "FWD407",
                    Status.FAIL,
                    f"{name}: dtype {before[name]['dtype']} -> {after[name].get('dtype')}",
                    where=name,
                )
            )
    return findings


def _dims(entry: LedgerEntry) -> str:
    return "[" + ",".join(entry["dims"]) + "]"


def _direction(e: Entry) -> str:
    if e.implied:
        return "over the keys (last axis), as the attention API defines"
    return "over the keys (dim -1), observed" if e.softmax_dim == -1 else f"over dim {e.softmax_dim}, observed"


def _merge_layers(findings: list[Finding]) -> list[Finding]:
    """One finding per problem, not one per layer: 'layers.0.attn q' and 'layers.1.attn q' become one."""
    merged = []
    for first, members in grouped(findings, key=lambda f: (f.code, re.sub(r"\.\d+\.", ".*.", f.message))):
        if len(members) > 1:
            first.where = (
                f"{first.where} and {len(members) - 1} more like it" if first.where else f"{len(members)} places"
            )
        merged.append(first)
    return merged
