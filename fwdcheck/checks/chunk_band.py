"""mask-audit's chunk judgement: the keys each query of a call on a chunked-attention layer may read, against the
chunk its layer declares (model.windows: Llama 4's attention_chunk_size on its "chunked_attention" layers, a
config's `chunk:`).

Chunked attention cuts the sequence into chunks of C tokens from its first: a query at position p reads exactly the
keys at positions C * (p // C) .. p, itself included, and none of an earlier chunk. Unlike a sliding band, what a
query reads is not a count (the first query of a chunk reads only itself, the last all C), so each row's may-read
set is compared with its chunk's key by key, over the keys at or before the query (a key after it is FWD204's).
A mask that differs is named by what it is where that can be read off it (full causal attention, chunks of another
size, chunk boundaries at other positions, a sliding band), and by the first query that reads otherwise.

A run whose queries never cross a chunk boundary (every key they hold lies in their own chunk: T <= C) cannot tell
chunked attention from full causal: the call is "not judged" on chunks, with the length it would take. A mask that
reads less than its chunk there is a finding all the same: a boundary where none is declared.
"""

from __future__ import annotations

import torch

from fwdcheck.checks.mask_audit_view import ChunkRow
from fwdcheck.checks.wording import span
from fwdcheck.model.capabilities import Chunks
from fwdcheck.observe.records import AttentionCall
from fwdcheck.result import Finding, Status

SHOWN = 4  # chunk boundaries a finding lists


def judge_chunk(
    call: AttentionCall, chunk: Chunks, layer: int | None, where: str, origin: str
) -> tuple[ChunkRow, Finding | None]:
    """The call's may-read sets against the chunk its layer declares: the row for the table and a FWD214 finding
    when a query reads otherwise."""
    size = chunk.size
    row: ChunkRow = {"layer": layer, "declared": size, "measured": None, "judged": False, "note": ""}
    if call.query_positions is None or call.allowed.is_meta:
        row["note"] = "chunks not judged: the mask's values or the queries' positions are unknown"
        return row, None
    positions, held, past, reads = _reads(call)
    starts = torch.div(positions, size, rounding_mode="floor") * size  # (L,): the first position of each chunk
    own = past & (held[None, :] >= starts[:, None])  # (L, S): its chunk's keys, up to itself
    off = (reads != own).any(-1)  # (L,)
    if not bool(off.any()):
        if not bool((past & ~own).any()):  # no query holds a key of an earlier chunk
            longest = int(past.sum(-1).max()) if past.numel() else 0
            row["note"] = (
                f"chunks not judged: every query here reads within its own chunk of {size} (the longest holds "
                f"{longest} keys), so a chunk boundary cannot show (a sequence of {size + 1} tokens or more "
                "crosses one)"
            )
            return row, None
        row["judged"], row["measured"], row["note"] = True, f"chunks of {size}", f"chunks of {size}, as declared"
        return row, None
    measured = _what_it_reads(positions, held, past, reads, size)
    first = int(off.nonzero()[0, 0])
    p, s = int(positions[first]), int(starts[first])
    read = sorted(int(k) for k in held[reads[first]])
    name = f"layer {layer}" if layer is not None else "the attention"
    said = (
        f"{name} declares chunked attention in chunks of {size} tokens (a query reads its own chunk's keys up to "
        f"itself; {origin}), but its mask {measured}: the query at position {p} reads {_positions(read)} where "
        f"its chunk holds {_positions(list(range(s, p + 1)))}"
    )
    row["judged"], row["measured"], row["note"] = True, measured, said
    return row, Finding("FWD214", Status.FAIL, said, where)


def _reads(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries' positions (L,), the position each key slot holds (S,; -1 where none was written), the keys at or
    before each query's position (L, S) and those of them its mask lets it read (L, S)."""
    allowed = call.allowed.cpu()
    L, S = allowed.shape
    assert call.query_positions is not None
    positions = call.query_positions.cpu().long()
    held = torch.arange(S) if call.key_positions is None else call.key_positions.cpu().long()
    past = (held[None, :] >= 0) & (held[None, :] <= positions[:, None])  # (L, S): itself and earlier
    return positions, held, past, allowed & past


def _what_it_reads(
    positions: torch.Tensor, held: torch.Tensor, past: torch.Tensor, reads: torch.Tensor, size: int
) -> str:
    """What a mask that is not the declared chunk is, in words: full causal attention, chunks of another size or
    with boundaries elsewhere, a sliding band; else that it reads otherwise than its chunk."""
    if bool((reads == past).all()):
        return "is full causal attention, across every chunk boundary"
    earliest: list[int] = []  # per query, the first position it reads, when it reads every held key from there on
    for q in range(len(positions)):
        read = held[reads[q]]
        if not read.numel() or not bool((reads[q] == (past[q] & (held >= read.min()))).all()):
            return "reads otherwise than its chunk"
        earliest.append(int(read.min()))
    at = [int(p) for p in positions]
    if at != list(range(len(at))):  # not the sequence from its first token: too few rows to name a pattern by
        return "reads otherwise than its chunk"
    boundaries = sorted(set(earliest))
    if all(e == max(b for b in boundaries if b <= p) for p, e in zip(at, earliest, strict=True)):
        return _chunked_as(boundaries, size, max(at))
    spans = [p - e + 1 for p, e in zip(at, earliest, strict=True)]
    width = max(spans)
    history = [int(h) for h in past.sum(-1)]
    if all(s == min(width, h) for s, h in zip(spans, history, strict=True)):
        return f"is a sliding band of {width} keys, not chunks"
    return "reads otherwise than its chunk"


def _chunked_as(boundaries: list[int], size: int, last: int) -> str:
    """A chunked pattern whose chunks start at `boundaries` (the queries' earliest keys), named against the
    declared chunks of `size` up to position `last`."""
    inner = [b for b in boundaries if b > 0]
    declared = list(range(size, last + 1, size))
    step = inner[0] if inner else 0
    if inner and inner == list(range(step, last + 1, step)):
        return f"cuts chunks of {step} (boundaries at {_listed(inner)}, not {_listed(declared) or 'none'})"
    return f"puts the chunk boundaries at {_listed(inner) or 'none'}, not at {_listed(declared)}"


def _positions(positions: list[int]) -> str:
    """'position 3', 'positions 0-4, 6', or 'no key'."""
    if not positions:
        return "no key"
    return f"position{'s' if len(positions) > 1 else ''} {span(positions)}"


def _listed(positions: list[int]) -> str:
    """The first few positions, comma-separated."""
    shown = ", ".join(map(str, positions[:SHOWN]))
    return shown + (", ..." if len(positions) > SHOWN else "")
