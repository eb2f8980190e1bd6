"""xformers' attention biases as its kernels receive them: each class is declarative (a causal alignment, a local
window, sequences packed block-diagonally), and what the kernel computes from it is fixed by the class."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class AttentionBias:
    """The base of xformers' bias objects."""


class LowerTriangularMask(AttentionBias):
    """Causal, aligned top left: query i reads keys 0..i, also when there are more keys than queries."""


class LowerTriangularFromBottomRightMask(AttentionBias):
    """Causal, aligned bottom right: the queries are the last of the keys (decoding over a cache)."""


class LowerTriangularFromBottomRightLocalAttentionMask(LowerTriangularFromBottomRightMask):
    """Bottom-right causal, each query reading its own key and the window_size - 1 before it."""

    def __init__(self, window_size: int):
        self._window_size = window_size


class _SeqLenInfo:
    """Sequences packed along one axis: sequence b holds rows seqstart[b]:seqstart[b + 1]."""

    def __init__(self, seqlens: Sequence[int]):
        starts = [0]
        for n in seqlens:
            starts.append(starts[-1] + n)
        self.seqstart_py = starts
        self.seqstart = torch.tensor(starts, dtype=torch.int32)
        self.max_seqlen = max(seqlens)


class BlockDiagonalMask(AttentionBias):
    """Packed sequences, each reading only its own keys (bidirectionally)."""

    def __init__(self, q_seqinfo: _SeqLenInfo, k_seqinfo: _SeqLenInfo):
        self.q_seqinfo, self.k_seqinfo = q_seqinfo, k_seqinfo

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None):
        return cls(_SeqLenInfo(q_seqlen), _SeqLenInfo(kv_seqlen if kv_seqlen is not None else q_seqlen))


class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Packed sequences, causal within each, aligned top left."""


class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    """Packed sequences, causal within each, aligned bottom right."""
