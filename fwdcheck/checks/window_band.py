"""mask-audit's width judgement: the band of keys each query of a call may read, against the sliding window its layer
declares (model.windows: a config's `window:`, transformers' sliding_window and layer_types, GPT-Neo's window_size).

A width counts the keys a query may read, itself included. A query at position p whose mask could read h earlier
keys and itself (h = p + 1 over the sequence, fewer over a ring buffer) reads min(h, W) under a window of W; the
band shows only in rows with h > W, where a correct mask reads exactly W: one key wider reads W + 1, one narrower
W - 1 (those show from h = W on). A run whose rows never reach past the window cannot tell a window from full
causal attention, nor a band one key wider: the call is "not judged" on width, with the length it would take.

A layer that declares full attention in a model whose other layers slide (or are chunked: chunk_band.py) reads every
earlier key: a band there (the sliding or chunked mask handed to every layer) is a finding too, seen in rows longer
than the widest declared window or chunk (Windows.widest).

The band is read off the call's may-read set, whatever built it: a mask tensor, is_causal, a flex BlockMask, or a
kernel's own window argument (flash-attn's window_size, xformers' attn_bias), which the observer turned into the
same set. A kernel's window argument is a measurement here, not a declaration: window_size=(W, 0) handed to
flash-attn for a config's sliding_window W reads W + 1 keys, and is exactly what this finds.
"""

from __future__ import annotations

import torch

from fwdcheck.checks.mask_audit_view import WindowRow
from fwdcheck.model.capabilities import Chunks, Windows
from fwdcheck.observe.records import AttentionCall
from fwdcheck.result import Finding, Status


def judge_window(
    call: AttentionCall, windows: Windows, layer: int | None, where: str
) -> tuple[WindowRow, Finding | None]:
    """The call's band against the window its layer declares: the row for the table and a FWD211 finding when
    they differ by a key or more."""
    declared = windows.of(layer)
    row: WindowRow = {
        "layer": layer,
        "declared": declared if isinstance(declared, int) else None,
        "measured": None,
        "judged": False,
        "note": "",
    }
    if isinstance(declared, str):
        row["note"] = f"width not judged: {declared}"
        return row, None
    if isinstance(declared, Chunks):  # no band: chunk_band.py judges a chunked layer
        row["note"] = f"width not judged: a chunked layer (chunks of {declared.size})"
        return row, None
    if call.query_positions is None or call.allowed.is_meta:
        row["note"] = "width not judged: the mask's values or the queries' positions are unknown"
        return row, None
    history, reads = _band(call)
    bound = declared if declared is not None else windows.widest
    if bound is None:  # a model declaring no window anywhere: nothing to judge the width against
        row["note"] = "no window declared"
        return row, None
    longest = int(history.max()) if history.numel() else 0
    widest = "widest declared window or chunk" if windows.chunked else "widest declared window"
    if longest <= bound:
        row["note"] = (
            f"width not judged: the longest query here reads {longest} keys at most, not more than the "
            f"{'declared window' if declared is not None else widest} of {bound}, so a band "
            f"cannot show (a sequence of {bound + 1} tokens or more can)"
        )
        return row, None
    row["judged"] = True
    if declared is not None:
        shown = history >= declared  # rows whose band is full: a correct mask reads exactly `declared` keys
        expected = torch.full_like(reads, declared)
    else:
        shown = history > bound  # full attention: every earlier key, past the widest window
        expected = history
    off = shown & (reads != expected)
    if not bool(off.any()):
        row["measured"] = declared if declared is not None else longest
        row["note"] = f"band of {declared} keys, as declared" if declared is not None else "full causal, as declared"
        return row, None
    worst = int((reads - expected)[off].abs().argmax())
    measured = int(reads[off][worst])
    row["measured"] = measured
    name = f"layer {layer}" if layer is not None else "the attention"
    if declared is not None:
        by = measured - declared
        how = (
            f"one key {'wider' if by > 0 else 'narrower'}"
            if abs(by) == 1
            else f"{abs(by)} keys {'wider' if by > 0 else 'narrower'}"
        )
        said = (
            f"{name} declares a sliding window of {declared} keys (itself included; {windows.origin}), but its mask "
            f"lets a query read {measured}: {how}"
        )
    else:
        said = (
            f"{name} declares full causal attention ({windows.origin}), but its mask lets a query with "
            f"{int(expected[off][worst])} earlier keys and itself read only {measured}: "
            f"{'a band or chunk' if windows.chunked else 'a sliding band'} where none is declared"
        )
    row["note"] = said
    return row, Finding("FWD211", Status.FAIL, said, where)


def _band(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query: how many keys at or before its position the cache holds (what a full causal mask reads, itself
    included), and how many of them its mask lets it read."""
    allowed = call.allowed.cpu()
    L, S = allowed.shape
    positions = call.query_positions
    assert positions is not None
    held = torch.arange(S) if call.key_positions is None else call.key_positions.cpu()
    past = (held[None, :] >= 0) & (held[None, :] <= positions.cpu()[:, None])  # (L, S): itself and earlier
    return past.sum(-1), (allowed & past).sum(-1)  # (L,), (L,)
