"""shape-ledger: the shapes of ids, embeddings, hidden states, per-head q/k/v, attention weights and logits, each axis
named by its symbolic dimension (B, T, d, h, h_kv, d_h, V, d_ff), checked against the layout attention requires.

Naming must not rest on sizes being distinct (the seed's toy has T = d_h = 4), so a second, small pass runs with other
B and T (chosen to collide with no size seen): an axis that follows B is B, one that follows T is T, and only axes that
stay put are named by their size. Forward hooks give module outputs; the observation pass gives what each attention
call received.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fwdcheck.observe import Observation
from fwdcheck.result import Check, CheckResult, Finding, Status

# Which constant a size is named after when several share it and the layout does not decide.
NAME_PRIORITY = ("d", "V", "d_ff", "h", "h_kv", "d_h")


@dataclass
class Entry:
    name: str
    role: str  # ids | hidden | q | k | v | scores_q | scores_k | weights | ffn | logits | mha_in
    shape: tuple[int, ...]
    probe_shape: tuple[int, ...] | None = None  # the same tensor in the second pass
    module: str = ""
    softmax_dim: int | None = None
    row_sum_error: float | None = None
    nonfinite_rows: int = 0
    implied: bool = False  # weights SDPA and MHA compute internally: the shape they imply, not a tensor seen
    seq: int = 0  # forward order
    dtype: str = ""


# Expected symbolic layouts per role; alternatives are equally correct.
TEMPLATES: dict[str, list[list[str]]] = {
    "ids": [["B", "T"]],
    "hidden": [["B", "T", "d"], ["T", "B", "d"], ["B*T", "d"]],
    "q": [["B", "h", "T", "d_h"], ["B*h", "T", "d_h"]],
    "k": [["B", "h_kv", "T", "d_h"], ["B", "h", "T", "d_h"], ["B*h", "T", "d_h"], ["B*h_kv", "T", "d_h"]],
    "mha_in": [["T", "B", "d"]],
    "scores_q": [["B", "h", "T", "d_h"], ["B*h", "T", "d_h"]],
    "scores_k": [["B", "h", "d_h", "T"], ["B*h", "d_h", "T"]],
    "weights": [["B", "h", "T", "T"], ["B*h", "T", "T"], ["B", "T", "T"]],
    "ffn": [["B", "T", "d_ff"], ["B*T", "d_ff"]],  # OPT flattens the tokens before its feed-forward
    "logits": [["B", "T", "V"]],
}
TEMPLATES["v"] = TEMPLATES["k"]
TEMPLATES["scores_v"] = TEMPLATES["k"]


class ShapeLedger(Check):
    name = "shape-ledger"
    description = "names every axis of ids, hidden states, per-head q/k/v, attention weights and logits"
    needs_values = False  # shapes alone: runs on the meta device
    codes = {
        "FWD401": "a tensor's layout differs from the expected symbolic shape",
        "FWD402": "attention runs over an axis that is not the sequence (e.g. heads and positions swapped)",
        "FWD403": "the softmax normalises over the query axis instead of the keys being read",
        "FWD404": "attention weights do not sum to 1 over the key axis, or hold NaN/Inf",
        "FWD405": "against --expect-ledger: a tensor appeared or disappeared",
        "FWD406": "against --expect-ledger: a tensor's symbolic shape changed",
        "FWD407": "against --expect-ledger: a tensor's dtype changed",
    }
    explain = """\
Records the shapes of input ids, embeddings, each block's output, per-head q/k/v at every attention call, attention
weights, the feed-forward hidden state and the logits, and names each axis with a symbolic dimension:
B batch, T sequence, d model width, h query heads, h_kv key/value heads, d_h head size, V vocabulary, d_ff
feed-forward width. Names come from behaviour, not from sizes: a second small pass with other B and T shows which axes
follow them, so T = d_h = 4 in the seed's toy is no ambiguity.
Expected: ids [B,T]; hidden [B,T,d] (or sequence-first [T,B,d]); q/k/v handed to attention [B,h,T,d_h] (GQA: k/v
may have h_kv heads); weights [B,h,T,T]; feed-forward [B,T,d_ff]; logits [B,T,V]. The softmax must run along the
positions being read (the key axis, last in q @ k^T), so each row of weights sums to 1.
Why: a missing transpose(1, 2) hands SDPA [B,T,h,d_h], and attention then mixes heads instead of positions: nothing
crashes and no future leaks, only this ledger shows it. A softmax over dim=-2 normalises over queries and lets later
queries shift earlier outputs.
How to fix: the failing row names the tensor, the module and the axis; compare its dims with the expected layout."""

    def run(self, model, session) -> CheckResult:
        first = session.observation()
        B, T = session.inputs.shape
        blocks = model.layer_stack
        known = {k: v for k, v in model.dims.items() if k != "L"}
        entries = collect(first, session.inputs.shape, first_logits_shape(first), blocks, known)
        known = infer_dims(entries, known)

        sizes = {s for e in entries for s in e.shape} | set(known.values())
        B2, T2 = probe_sizes(B, T, sizes, model.max_positions)
        second = session.observe(session.random_ids((B2, T2)))
        by_name = {e.name: e for e in collect(second, (B2, T2), first_logits_shape(second), blocks, known)}
        for e in entries:
            other = by_name.get(e.name)
            e.probe_shape = other.shape if other is not None and len(other.shape) == len(e.shape) else None

        findings, rows = [], []
        for e in entries:
            dims = name_axes(e, (B, T), (B2, T2), known)
            expected = TEMPLATES.get(e.role)
            ok = expected is None or dims in expected
            rows.append({"name": e.name, "shape": list(e.shape), "dims": dims, "dtype": e.dtype, "role": e.role,
                         "expected": expected[0] if expected else None, "ok": ok, "implied": e.implied})
            findings += judge(e, dims, ok, expected)
        findings = _merge_layers(findings)
        expected_ledger = session.settings.expect_ledger
        diff = compare_ledgers(expected_ledger, rows, known) if expected_ledger else None
        if diff:
            findings += diff

        attention = [e for e in entries if e.role in ("q", "weights", "mha_in", "scores_q")]
        directions = sorted({_direction(e) for e in entries if e.role == "weights"})
        data = {"entries": rows, "dims": known, "probe": {"batch_size": B2, "seq_len": T2},
                "softmax": directions or ["no attention weights observed"]}
        if expected_ledger is not None:
            data["ledger_diff"] = [f.message for f in diff or []]
        bad = [f for f in findings if f.status != Status.PASS]
        if diff:
            summary = f"{len(diff)} difference(s) from the expected ledger; first: {diff[0].message}"
        elif bad:
            summary = f"{len(bad)} layout problem(s): {bad[0].message}"
        else:
            summary = (f"{len(rows)} tensors named ({', '.join(f'{k}={v}' for k, v in known.items())}); "
                       f"softmax {directions[0] if directions else 'not observed'}")
        if not attention:
            summary += "; no attention call observed (custom kernel?): q/k/v not in the ledger"
        return CheckResult.from_findings(self.name, findings, summary,
                                         metrics={"tensors": len(rows), "probe_batch": B2, "probe_seq_len": T2},
                                         data=data)


def first_logits_shape(observation: Observation) -> tuple[int, ...] | None:
    root = next((m for m in observation.modules if m.name == ""), None)
    return root.output_shape if root else None


def collect(obs: Observation, ids_shape, logits_shape, blocks: str | None, known: dict[str, int]) -> list[Entry]:
    """The ledger's entries in forward order, named so the same tensor gets the same name in both passes."""
    entries = [Entry("input_ids", "ids", tuple(ids_shape), dtype="int64")]
    seen_embedding = False
    for call in obs.modules:
        if call.output_shape is None or not call.name:
            continue
        if call.cls == "Embedding" and call.input_shape == tuple(ids_shape):
            label = "token embedding" if not seen_embedding else "embedding"
            entries.append(Entry(f"{label} ({call.name})", "hidden", call.output_shape, call.name, seq=call.seq,
                                 dtype=call.output_dtype))
            seen_embedding = True
        elif blocks and re.fullmatch(rf"{re.escape(blocks)}\.\d+", call.name):
            entries.append(Entry(f"{call.name} output", "hidden", call.output_shape, call.name, seq=call.seq,
                                 dtype=call.output_dtype))
        elif call.cls == "Linear" and known.get("d_ff") and call.output_shape[-1:] == (known["d_ff"],) \
                and _in_first_block(call.name, blocks):
            entries.append(Entry(f"{call.name} output", "ffn", call.output_shape, call.name, seq=call.seq,
                                 dtype=call.output_dtype))

    per_module: dict[str, int] = {}
    for call in obs.attention:
        n = per_module[call.module] = per_module.get(call.module, -1) + 1
        where = f"{call.module or 'model'}" + (f"#{n}" if n else "")
        at = dict(module=call.module, seq=call.seq, dtype=call.dtype)
        if call.api == "sdpa":
            entries += [Entry(f"{where} q", "q", call.query_shape, **at),
                        Entry(f"{where} k", "k", call.key_shape, **at),
                        Entry(f"{where} v", "v", call.value_shape, **at)]
        elif call.api == "mha":
            entries.append(Entry(f"{where} query (MHA input)", "mha_in", call.query_shape, **at))
        entries.append(Entry(f"{where} attention weights", "weights", call.weights_shape, softmax_dim=call.softmax_dim,
                             row_sum_error=call.row_sum_error, nonfinite_rows=call.nonfinite_rows,
                             implied=call.api != "softmax", **at))
    per_module = {}
    for mm in obs.matmuls:  # eager attention: q @ k^T makes the scores, weights @ v reads the values
        n = per_module[(mm.module, mm.kind)] = per_module.get((mm.module, mm.kind), -1) + 1
        where = f"{mm.module or 'model'}" + (f"#{n}" if n else "")
        at = dict(module=mm.module, seq=mm.seq)
        if mm.kind == "scores":
            entries += [Entry(f"{where} q (q @ k^T)", "scores_q", mm.a_shape, **at),
                        Entry(f"{where} k^T (q @ k^T)", "scores_k", mm.b_shape, **at)]
        else:
            entries.append(Entry(f"{where} v (weights @ v)", "scores_v", mm.b_shape, **at))
    entries.sort(key=lambda e: e.seq)
    if logits_shape:
        root = next((m for m in obs.modules if m.name == ""), None)
        entries.append(Entry("logits", "logits", tuple(logits_shape), dtype=root.output_dtype if root else ""))
    return entries


def _in_first_block(name: str, blocks: str | None) -> bool:
    """Only the first block's feed-forward layers go in the ledger: the rest repeat them."""
    return blocks is None or not name.startswith(f"{blocks}.") or name.startswith(f"{blocks}.0.")


def infer_dims(entries: list[Entry], known: dict[str, int]) -> dict[str, int]:
    """Fill in dimensions the model did not declare from what was observed."""
    dims = dict(known)
    for e in entries:
        if e.role == "logits":
            dims.setdefault("V", e.shape[-1])
        elif e.role == "hidden" and len(e.shape) == 3:
            dims.setdefault("d", e.shape[-1])
        elif e.role == "q" and len(e.shape) == 4:
            dims.setdefault("h", e.shape[1])
            dims.setdefault("d_h", e.shape[-1])
        elif e.role == "k" and len(e.shape) == 4:
            dims.setdefault("h_kv", e.shape[1])
    return dims


def probe_sizes(B: int, T: int, taken: set[int], max_positions: int | None) -> tuple[int, int]:
    """A second (B, T), each size distinct from every size already seen, so no axis can be named by coincidence."""
    B2 = next(n for n in range(2, 10_000) if n != B and n not in taken)
    limit = max_positions or 10_000
    T2 = next((n for n in range(3, limit + 1) if n not in taken and n not in (B, B2, T)), None)
    if T2 is None:  # max_positions is tiny and crowded: fall back to any other length
        T2 = next(n for n in range(2, limit + 1) if n != T)
    return B2, T2


def name_axes(e: Entry, first: tuple[int, int], second: tuple[int, int], known: dict[str, int]) -> list[str]:
    (B, T), (B2, T2) = first, second
    layouts = TEMPLATES.get(e.role, [[]])
    expected = next((t for t in layouts if len(t) == len(e.shape)), layouts[0])  # the layout of the same rank
    h = known.get("h")
    varying = {"B": (B, B2), "T": (T, T2), "B*T": (B * T, B2 * T2)}
    if h:
        varying["B*h"] = (B * h, B2 * h)
    if known.get("h_kv"):
        varying["B*h_kv"] = (B * known["h_kv"], B2 * known["h_kv"])
    names = []
    for axis, size in enumerate(e.shape):
        other = e.probe_shape[axis] if e.probe_shape is not None else None
        follows = next((n for n, pair in varying.items() if pair == (size, other)), None)
        if other is not None and other != size and follows:
            names.append(follows)
            continue
        # Constant, or changed without following B or T: the small pass took another code path (a sliding-window
        # model repeats its kv heads only when the window masks something). Either way the size names it.
        candidates = [n for n in NAME_PRIORITY if known.get(n) == size]
        want = expected[axis] if axis < len(expected) else None
        if want == "h_kv" and not candidates and known.get("h") and known["h"] % size == 0:
            candidates = ["h_kv"]  # fewer kv heads than the config says (multi-query read from another field)
        if other is None and size in (B, T) and want in ("B", "T"):
            candidates.insert(0, want)  # not seen in the second pass: the best guess is the layout's own
        if want in candidates:
            names.append(want)
        elif candidates:
            names.append(candidates[0])
        else:
            multiple = next((f"{m}*{n}" for n in NAME_PRIORITY for m in (2, 3, 4) if known.get(n) and
                             known[n] * m == size), None)
            names.append(multiple or str(size))
    return names


def judge(e: Entry, dims: list[str], ok: bool, expected: list[list[str]] | None) -> list[Finding]:
    findings = []
    shown = f"[{','.join(dims)}]"
    if e.role in ("q", "k", "v", "scores_q") and len(dims) >= 3 and dims[-2] != "T":
        findings.append(Finding("FWD402", Status.FAIL, f"{e.name} is {shown}: attention runs over axis -2, which is "
                                f"{dims[-2]} here, not the sequence T (a missing transpose(1, 2)?)", where=e.module))
    elif not ok and expected:
        status = Status.WARN if e.role == "hidden" else Status.FAIL
        findings.append(Finding("FWD401", status, f"{e.name} is {shown}, expected "
                                f"{' or '.join('[' + ','.join(x) + ']' for x in expected)}", where=e.module or None))
    if e.role == "weights" and e.softmax_dim is not None and e.softmax_dim != -1:
        findings.append(Finding("FWD403", Status.FAIL, f"softmax over dim {e.softmax_dim} of the [..,T,T] scores: "
                                "it normalises over the queries, not the keys each query reads", where=e.module))
    elif e.role == "weights" and (e.nonfinite_rows or (e.row_sum_error or 0) > 1e-2):
        findings.append(Finding("FWD404", Status.FAIL, f"{e.name}: {e.nonfinite_rows} rows hold NaN/Inf; largest "
                                f"|sum over keys - 1| is {e.row_sum_error:.3g}", where=e.module))
    return findings


def compare_ledgers(expected: dict, current: list[dict], dims: dict[str, int]) -> list[Finding]:
    """A saved ledger against this run's: tensors added or gone, symbolic shapes, the sizes of the architecture's
    dimensions (h, h_kv, d_h, ...) and dtypes changed. B and T follow the inputs and are not compared."""
    before = {e["name"]: e for e in expected["entries"]}
    after = {e["name"]: e for e in current}
    findings = []
    for symbol, size in (expected.get("dims") or {}).items():
        if symbol in dims and dims[symbol] != size:
            findings.append(Finding("FWD406", Status.FAIL, f"dimension {symbol}: {size} -> {dims[symbol]}",
                                    where=symbol))
    for name in [n for n in after if n not in before]:
        findings.append(Finding("FWD405", Status.FAIL, f"new tensor {name} {_dims(after[name])}", where=name))
    for name in [n for n in before if n not in after]:
        findings.append(Finding("FWD405", Status.FAIL, f"tensor {name} {_dims(before[name])} is gone", where=name))
    for name in [n for n in after if n in before]:
        if before[name]["dims"] != after[name]["dims"]:
            findings.append(Finding("FWD406", Status.FAIL, f"{name}: {_dims(before[name])} -> {_dims(after[name])}",
                                    where=name))
        if before[name].get("dtype") and before[name].get("dtype") != after[name].get("dtype"):
            findings.append(Finding("FWD407", Status.FAIL, f"{name}: dtype {before[name]['dtype']} -> "
                                    f"{after[name].get('dtype')}", where=name))
    return findings


def _dims(entry: dict) -> str:
    return "[" + ",".join(entry["dims"]) + "]"


def _direction(e: Entry) -> str:
    if e.implied:
        return "over the keys (last axis), as the attention API defines"
    return "over the keys (dim -1), observed" if e.softmax_dim == -1 else f"over dim {e.softmax_dim}, observed"


def _merge_layers(findings: list[Finding]) -> list[Finding]:
    """One finding per problem, not one per layer: 'layers.0.attn q' and 'layers.1.attn q' become one."""
    merged: dict[tuple[str, str], Finding] = {}
    counts: dict[tuple[str, str], int] = {}
    for f in findings:
        key = (f.code, re.sub(r"\.\d+\.", ".*.", f.message))
        if key not in merged:
            merged[key] = f
        counts[key] = counts.get(key, 0) + 1
    for key, f in merged.items():
        if counts[key] > 1:
            f.where = f"{f.where} and {counts[key] - 1} more like it" if f.where else f"{counts[key]} places"
    return list(merged.values())
