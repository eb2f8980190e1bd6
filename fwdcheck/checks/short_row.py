"""The short row several checks observe: the session's first sample, its first session.short_length tokens, run alone
under the observer once per session, with q and k kept, SDPA's own arguments recorded and every linear layer's output
kept. mask-audit judges its masks at batch size 1 on it, attention-stats measures each call's scale on it, and
backends replays its SDPA calls under every kernel: one forward where each ran its own.

Sixteen tokens are enough for each of them: a `B == 1` shortcut that forgets the mask shows at any length of two
tokens, a scale at any length, a kernel that misreads a mask within a few keys; and a short row costs a fraction of a
forward of long inputs, whose fixed part, reading every weight, each forward pays again.

What is kept is bounded by those 16 tokens: where the module sees more than the row (a code-path cell's held image of
up to 1,024 tokens before it, or its pads), only the observation is kept, which is all mask-audit reads there:
attention-stats and backends run on the default path alone, and q, k, SDPA's arguments and every linear layer's
output of a thousand tokens would weigh gigabytes on a large model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fwdcheck.checks.scale_chain import keep_projections
from fwdcheck.checks.sdpa_calls import RecordSdpa, SdpaCall
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.observe.records import Observation
from fwdcheck.run.session import Session


@dataclass
class ShortRow:
    """What the observed short row showed."""

    seen: Observation  # q and k of every attention call kept
    sdpa: list[SdpaCall]  # SDPA's own arguments (scale, mask), in the order the observer saw the calls
    projections: dict[str, torch.Tensor]  # the output of every linear layer but the output head (scale_chain.py)


def short_row(model: ModelUnderTest, session: Session) -> ShortRow:
    """The short row, observed once per session; what the model raised on it is raised again to every check asking."""
    return session.shared("short row", lambda: _observe(model, session))


def _observe(model: ModelUnderTest, session: Session) -> ShortRow:
    ids = session.inputs[:1, : session.short_length]  # (1, L)
    if model.held_prefix or model.padding:  # the module sees more than the row: the observation alone (see above)
        return ShortRow(session.observe(ids), [], {})
    recorder = RecordSdpa()
    projections, handles = keep_projections(model.module, model.vocab_size)
    try:
        seen = session.observe(ids, keep_tensors=True, under=recorder)
    finally:
        for handle in handles:
            handle.remove()
    return ShortRow(seen, recorder.calls, projections)
