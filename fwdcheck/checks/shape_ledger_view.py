"""shape-ledger's detail view and the record its `data` holds (torch-free: the report is drawn without the check).

The check writes `LedgerData` into its result; `ledger` draws it in the terminal panel, rows that repeat across layers
folded into one.
"""

from __future__ import annotations

import re
from typing import TypedDict

from rich import box
from rich.console import Group, RenderableType
from rich.text import Text

from fwdcheck.report.layout import FitColumn, FitTable, notes
from fwdcheck.result import CheckResult


class LedgerEntry(TypedDict, total=False):
    """One tensor of the ledger."""

    name: str  # e.g. "layers.0.attn q"
    shape: list[int]
    dims: list[str]  # each axis named by its symbol (B, T, d, h, ...) or its size
    dtype: str | None
    role: str  # what the tensor is in the forward pass (ids, hidden, q, k, v, weights, logits, ...)
    expected: list[str] | None  # the layout it should have, when one is known
    ok: bool  # whether dims match expected
    implied: bool  # not observed itself: implied by what was observed


class Probe(TypedDict):
    batch_size: int
    seq_len: int


class LedgerData(TypedDict, total=False):
    entries: list[LedgerEntry]
    dims: dict[str, int]  # the symbolic dims and their sizes
    probe: Probe  # the second pass that named the axes
    softmax: list[str]  # over which axis each softmax ran
    notes: list[str]
    ledger_diff: list[str]  # with an expected ledger: each difference from it


def ledger(r: CheckResult) -> RenderableType:
    """The ledger, with rows that repeat across layers folded into one: layers.{0..11}.attn q. At a narrow width the
    expected dims give way: a mismatch is red in the dims column and named by its finding."""
    rows = []
    folded: dict[tuple, list[str]] = {}
    order = []
    for e in r.data.get("entries", []):
        match = re.search(r"\.(\d+)(\.| |$)", e["name"])
        key_name = e["name"][: match.start(1)] + "{}" + e["name"][match.end(1) :] if match else e["name"]
        key = (key_name, tuple(e["shape"]), tuple(e["dims"]), e["ok"])
        if key not in folded:
            order.append((key, e))
        folded.setdefault(key, []).append(match.group(1) if match else "")
    for key, e in order:
        layers = folded[key]
        name = key[0].format(_range(layers)) if "{}" in key[0] else key[0]
        dims = f"[{','.join(e['dims'])}]"
        expected = f"[{','.join(e['expected'])}]" if e.get("expected") else ""
        if e.get("implied"):
            name += " (implied)"
        rows.append([Text(name), Text(str(e["shape"])), Text(dims, "green" if e["ok"] else "bold red"), Text(expected)])
    columns = [
        FitColumn("tensor"),
        FitColumn("shape", whole=True),
        FitColumn("dims", whole=True),
        FitColumn("expected", whole=True, give_way=1),
    ]
    table = FitTable(columns, rows, box=box.SIMPLE, pad_edge=False, show_edge=False)
    dims = ", ".join(f"{k}={v}" for k, v in r.data.get("dims", {}).items())
    probe = r.data.get("probe", {})
    caption = Text(
        f"dims: {dims}. Axes named by a second pass at B={probe.get('batch_size')}, "
        f"T={probe.get('seq_len')}. Softmax: {'; '.join(r.data.get('softmax', []))}.",
        style="dim",
    )
    return Group(table, caption, *notes(r.data.get("notes")))


def _range(indices: list[str]) -> str:
    if len(indices) == 1:
        return indices[0]
    return f"{{{indices[0]}..{indices[-1]}}}"
