"""q and k of every self-attention call an observed forward kept, in the order they ran (rope's probe reads its
rotations from them): a forward that runs attention in steps (a prefill, then one token at a time through a KV cache)
merged into one call per module, and, where a call reads more key slots than it has queries, which slots hold the
probe's positions.
"""

from __future__ import annotations

import torch

from fwdcheck.observe.records import Api


def attention_qk(observation) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """(where, q (.., L, d_h), k (.., S, d_h), the call's query positions and its key slots' positions when known)
    of every self-attention call whose q and k were kept, in the order they ran. Cross-attention reads keys of
    another sequence: nothing for RoPE's relative identity to hold between."""
    calls = observation.attention
    found = []
    for call in calls:
        if call.query is None or call.key is None or call.query.dim() < 2 or getattr(call, "cross", False):
            continue
        q, k = call.query, call.key
        if call.api == Api.MHA:  # the functional form is sequence-first: (L, N, E) -> (N, L, E)
            q, k = (q.transpose(0, 1), k.transpose(0, 1)) if q.dim() == 3 else (q[None], k[None])
        found.append((call.seq, call.module, q, k, call.query_positions, call.key_positions))
    for mm in observation.matmuls:
        if mm.kind != "scores" or mm.a is None or mm.b is None or mm.a.dim() < 2:
            continue
        call = calls[mm.call] if getattr(mm, "call", None) is not None else None
        if getattr(call, "cross", False):
            continue
        # Kept in matmul layout whatever the product (an einsum's operands are permuted so): b is k^T (.., d_h, S).
        found.append(
            (
                mm.seq,
                mm.module,
                mm.a,
                mm.b.transpose(-1, -2),
                getattr(call, "query_positions", None),
                getattr(call, "key_positions", None),
            )
        )
    return [f[1:] for f in sorted(found, key=lambda f: f[0])]


def merge_steps(raw, written, P: int) -> list[tuple]:
    """(where, q, k, query positions, written slots) per attention computation of the probe.

    A forward that runs attention in steps (a prefill, then one token at a time through a KV cache) calls each
    attention module several times with fewer queries than the probe has positions. Such a module's steps, in order,
    become one call whose keys are its last step's: by then its cache holds every position. A cache of fewer slots
    than the probe has positions (a ring buffer past its wrap) holds each position only for a while: its key is read
    from a step that held it, by the positions the slots held."""
    steps: dict[str, list[int]] = {}
    for i, (where, q, *_) in enumerate(raw):
        if q.shape[-2] < P:
            steps.setdefault(where, []).append(i)
    groups = {
        idx[-1]: idx
        for idx in steps.values()
        if sum(raw[i][1].shape[-2] for i in idx) == P and len({raw[i][1].shape[:-2] for i in idx}) == 1
    }
    folded = {i for idx in groups.values() for i in idx[:-1]}
    merged = []
    for i, (where, q, k, positions, _) in enumerate(raw):
        if i in folded:
            continue
        if i in groups:
            q = torch.cat([raw[j][1] for j in groups[i]], dim=-2)  # (.., P, d_h): the steps' queries in order
            known = [raw[j][3] for j in groups[i]]
            positions = torch.cat([p.flatten() for p in known]) if all(p is not None for p in known) else None
            assembled = keys_while_held([raw[j] for j in groups[i]], positions) if k.shape[-2] < P else None
            k = k if assembled is None else assembled
        merged.append((where, q, k, positions, written[i]))
    return merged


def keys_while_held(steps: list[tuple], positions: torch.Tensor | None) -> torch.Tensor | None:
    """k (.., P, d_h) of every probe position from the steps of one attention module over a cache of fewer slots:
    each position's key from a step whose slots held it (the step that wrote it, before a later one took its slot).
    None when a position was held by no step's slots as far as they are known."""
    if positions is None:
        return None
    held = {}
    for _, _, k, _, slot_positions in steps:
        slots = torch.arange(k.shape[-2]) if slot_positions is None else slot_positions.flatten().cpu()
        for slot, position in enumerate(slots.tolist()):
            if position >= 0:
                held[position] = k[..., slot, :]  # (.., d_h): a later step holding it again holds the same key
    wanted = [int(p) for p in positions.tolist()]
    if not all(p in held for p in wanted):
        return None
    return torch.stack([held[p] for p in wanted], dim=-2)  # (.., P, d_h)


def written_slots(k: torch.Tensor, k_other: torch.Tensor) -> list[int] | None:
    """The key slots (.., S, d_h) that differ between two probes of different tokens at the same positions: the slots
    the probe wrote. Slots neither wrote keep whatever they held, bit for bit."""
    if k.shape != k_other.shape:
        return None
    changed = (k - k_other).abs().reshape(-1, *k.shape[-2:]).amax(dim=(0, 2)) > 0  # (S,)
    return changed.nonzero().flatten().tolist()


def key_slots(P: int, S: int, query_positions: torch.Tensor | None, written: list[int] | None) -> list[int] | None:
    """Which of S key slots hold the probe's P positions, in the order of the queries: the call's query positions
    when they index a cache of S slots and agree with what the probe wrote, else the slots it wrote."""
    if query_positions is not None:
        positions = [int(p) for p in query_positions.flatten()[-P:].tolist()]
        if (
            len(positions) == P
            and 0 <= min(positions)
            and max(positions) < S
            and (written is None or sorted(positions) == written)
        ):
            return positions
    if written is not None and len(written) == P:
        return written
    return None
