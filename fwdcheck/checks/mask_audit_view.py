"""mask-audit's detail view and the record its `data` holds (torch-free: the report is drawn without the check).

The conventions table, what each attention call used and whether its may-read set reaches the future, and the
may-read grid of the call a reader most needs to see.
"""

from __future__ import annotations

from typing import TypedDict

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.text import Text

from fwdcheck.report.layout import FitColumn, FitTable, notes
from fwdcheck.result import CheckResult, Status

CONVENTION_CODES = {"FWD202", "FWD203", "FWD206"}  # findings a reader reads beside the conventions table
GRID_KEYS = 48  # may-read grids show at most this many key slots (two characters each), fewer on a narrow console


class Convention(TypedDict):
    api: str
    bool: str
    float: str
    flag: str


class WindowRow(TypedDict):
    """A call's band against its layer's declared window."""

    layer: int | None
    declared: int | None  # keys a query may read, itself included; None: full causal attention
    measured: int | None  # the width the mask allows in the rows that show the band (the furthest from declared)
    judged: bool
    note: str  # as declared, or what differs, or why it was not judged


class ChunkRow(TypedDict):
    """A call's may-read sets against its layer's declared attention chunk."""

    layer: int | None
    declared: int  # the chunk size: a query reads its own chunk's keys up to itself
    measured: str | None  # what the mask allows, in words ("chunks of 4", "is full causal attention, ...")
    judged: bool
    note: str  # as declared, or what differs, or why it was not judged


class CallRow(TypedDict, total=False):
    """One attention call as the audit saw it."""

    module: str
    api: str  # sdpa, mha, eager, ...
    mask: str  # the mask in its convention, or is_causal / none
    mask_shape: list[int] | None
    values: str
    is_causal: bool
    dropout_p: float
    batch_size: int
    queries: int  # L
    keys: int  # S
    query_positions: list[int] | None
    positions_from: str | None  # where the query positions came from ("square": 0..L-1 over L keys)
    key_positions: list[int] | None  # the position each key slot holds, when not its index (a ring buffer)
    pattern: str  # the verdict on the may-read set, or why it was not judged
    judged: bool
    not_judged: str | None  # the kind of reason, when not judged
    reads_future: bool
    may_read: list[list[int]] | None  # [L, S]: 1 where the query may read the key slot (None past 64 x 64)
    source: str | None
    window: WindowRow  # the band against the layer's declared window, when the model declares one
    chunk: ChunkRow  # the may-read sets against the layer's declared chunk, on a chunked-attention layer
    merged: str  # one block of a call over the tokens' own keys and the source's together: which block, which keys


class MaskAuditData(TypedDict, total=False):
    conventions: list[Convention]
    calls: list[CallRow]
    batch1: str  # "observed", or why the pass at batch size 1 did not run
    batch1_length: int
    source: SourceRead  # an encoder-decoder with its source held fixed: whether the decoder reads it
    image: ImageRead  # a vision-language model's image run: whether the text reads its image


class ImageRead(TypedDict):
    held_fixed: str  # what was held fixed
    change_with_another_image: float  # the largest change of the text's logits when the image was replaced
    noise_floor: float  # the largest change between two identical forwards


class SourceRead(TypedDict):
    held_fixed: str  # what was held fixed
    change_with_another_source: float  # the largest change of the logits when the source was replaced
    noise_floor: float  # the largest change between two identical forwards


def mask_table(r: CheckResult) -> RenderableType:
    conventions = FitTable(
        [FitColumn("API", whole=True), FitColumn("bool mask"), FitColumn("float mask"), FitColumn("flag")],
        [[Text(c[key]) for key in ("api", "bool", "float", "flag")] for c in r.data.get("conventions", [])],
        title="conventions",
        box=box.SIMPLE,
        pad_edge=False,
        show_edge=False,
    )
    # What a reader needs of each call: which call (the module's name is how it is found in the code), the mask in
    # its convention, the flags beside it (is_causal, a live dropout_p) and the verdict. At a narrow width the mask's
    # shape and values, the extent and then the API give way, in that order, before any of those is cut.
    columns = [
        FitColumn("module"),
        FitColumn("api", give_way=4),
        FitColumn("mask"),
        FitColumn("shape", whole=True, give_way=1),
        FitColumn("values", give_way=2),
        FitColumn("flags"),
        FitColumn("L x S", whole=True, give_way=3),
        FitColumn("may read"),
    ]
    rows = r.data.get("calls", [])
    cells = []
    for c in rows:
        module = c["module"] + (" at B=1" if c.get("batch_size") == 1 else "")
        cells.append(
            [
                *map(
                    Text, (module, c["api"], c["mask"], str(c["mask_shape"] or "-"), c["values"], _flags(c), _extent(c))
                ),
                _pattern(c),
            ]
        )
    calls = FitTable(columns, cells, title="what each call used", box=box.SIMPLE, pad_edge=False, show_edge=False)
    # The conventions are the story of a mask built for another API (FWD202), a 0/1 float mask (FWD203), a mask
    # beside is_causal (FWD206); beside a missing or leaky mask they are noise. A passing panel (-v) shows them.
    about_conventions = {f.code for f in r.findings if f.status != Status.PASS} & CONVENTION_CODES
    parts: list[RenderableType] = [conventions, calls] if about_conventions or r.status == Status.PASS else [calls]
    # The reasons a call was not judged are sentences: said once each under the table, not squeezed into a column.
    reasons: dict[str, int] = {}
    for c in rows:
        if not c.get("judged", True):
            reasons[c["pattern"]] = reasons.get(c["pattern"], 0) + 1
    parts += notes(reason + (f" ({n} calls)" if n > 1 else "") for reason, n in reasons.items())
    bands = [c["window"] for c in rows if c.get("window")]
    widths = sorted({b["note"] for b in bands if not b["judged"] or b["measured"] != b["declared"]})
    if bands:
        judged = sum(b["judged"] for b in bands)
        parts += notes([f"declared windows: {judged} of {len(bands)} calls judged on width", *widths])
    chunked = [c["chunk"] for c in rows if c.get("chunk")]
    if chunked:
        judged = sum(b["judged"] for b in chunked)
        off = sorted({b["note"] for b in chunked if not b["judged"] or b["measured"] != f"chunks of {b['declared']}"})
        parts += notes([f"declared chunks: {judged} of {len(chunked)} calls judged", *off])
    sources = sorted({c["positions_from"] for c in rows if c.get("positions_from") not in (None, "", "square")})
    if sources:
        parts += notes([f"query positions (L x S at ...) from: {', '.join(sources)}"])
    if isinstance(r.data.get("batch1"), str) and r.data["batch1"] != "observed":
        parts += notes([r.data["batch1"]])
    shown = _grid_call(rows)
    if shown is not None:
        parts.append(FittedGrid(shown))
    return Group(*parts)


def _pattern(call: dict) -> Text:
    """Red only for a judged call that lets a query read past its own position. A call that was not compared with
    causal (cross-attention, an encoder over another sequence, query positions unknown) is no failure: dim, named by
    the start of its reason ('not judged: cross-attention'); the whole reason is said under the table."""
    if call.get("judged", True):
        return Text(call["pattern"], "bold red" if call.get("reads_future") else "green")
    # two short lines fit a narrow column where one long one breaks words
    return Text(f"not judged:\n{call.get('not_judged') or 'see below'}", "dim")


def _flags(call: dict) -> str:
    """is_causal beside a mask (the mask column already says it when it is the only one) and a live dropout_p: the
    arguments besides the mask that decide what a call reads."""
    flags = ["is_causal"] if call.get("is_causal") and call.get("mask") != "is_causal" else []
    flags += [f"dropout_p={call['dropout_p']:g}"] if call.get("dropout_p") else []
    return ", ".join(flags) or "-"


def _extent(call: dict) -> str:
    """'4 x 32 at 0..3': L queries over S key slots, and where the queries sit when that is not simply
    0..L-1 over L keys."""
    if "queries" not in call:
        return "-"
    extent = f"{call['queries']} x {call['keys']}"
    positions, source = call.get("query_positions"), call.get("positions_from")
    if positions and source and source != "square":
        extent += f" at {_positions(positions)}"  # where they came from is said once, under the table
    return extent


def _positions(positions: list[int]) -> str:
    """Consecutive positions as a range (0..3), a few others listed (0, 2, 5, ...)."""
    if len(positions) > 1 and positions == list(range(positions[0], positions[-1] + 1)):
        return f"{positions[0]}..{positions[-1]}"
    shown = ", ".join(map(str, positions[:4]))
    return shown + (", ..." if len(positions) > 4 else "")


def _grid_call(rows: list[dict]) -> dict | None:
    """The call whose may-read set is drawn: the first judged one that is not causal (what a reader needs to see),
    else the first judged one, else the first at all; only sets of at most 16 queries fit."""
    small = [c for c in rows if c.get("may_read") and len(c["may_read"]) <= 16]
    judged = [c for c in small if c.get("judged", True)]
    failing = [c for c in judged if c.get("reads_future")]
    return next(iter(failing or judged or small), None)


class FittedGrid:
    """A call's may-read grid with as many key slots as the width holds, two characters each."""

    def __init__(self, call: dict):
        self.call = call

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield may_read_grid(self.call, keys=min(GRID_KEYS, options.max_width // 2))


def may_read_grid(call: dict, keys: int = GRID_KEYS) -> RenderableType:
    """Rows: queries; columns: key slots; a key after the query's own position is the future. That position is
    query_positions[i] when the call has them (a KV cache, a decode step: query 0 of a decode step may sit at
    position 37), else i. A call that was not judged has no future to colour: its set is drawn plain. At most
    `keys` key slots are drawn."""
    may_read = call["may_read"]
    judged = call.get("judged", True)
    positions = call.get("query_positions")
    if not positions or len(positions) != len(may_read):
        positions = list(range(len(may_read)))  # the square case: query i sits at position i
    slots = len(may_read[0]) if may_read else 0
    # A long cache would wrap the grid into noise: a window of slots is drawn, ending a little after the last query's
    # own position, so that the boundary between past and future is in it.
    width = min(slots, keys)
    end = min(slots, max(width, max(positions, default=0) + 1 + keys // 4))
    start = end - width
    where = (
        f" at {_positions(positions)} ({call['positions_from']})"
        if call.get("positions_from") not in (None, "", "square") and call.get("query_positions")
        else ""
    )
    shown = f"{slots} key slots" + (f", {start}..{end - 1} shown" if width < slots else "")
    caption = Text(
        f"may-read set of {call['module']}{' at B=1' if call.get('batch_size') == 1 else ''} "
        f"(rows: queries{where}; columns: {shown})" + ("" if judged else ": not judged, drawn plain"),
        style="dim",
    )
    lines = []
    for i, row in enumerate(may_read):
        line = Text()
        for j, v in enumerate(row[start:end], start):
            if not v:
                line.append("· ", "dim")
            elif not judged:
                line.append("■ ")
            else:
                line.append("■ ", "red" if j > positions[i] else "green")
        lines.append(line)
    return Group(caption, *lines)
