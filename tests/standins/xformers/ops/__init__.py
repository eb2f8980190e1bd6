from xformers.ops.fmha import (
    AttentionBias,
    BlockDiagonalCausalFromBottomRightMask,
    BlockDiagonalCausalMask,
    BlockDiagonalMask,
    LowerTriangularFromBottomRightLocalAttentionMask,
    LowerTriangularFromBottomRightMask,
    LowerTriangularMask,
    memory_efficient_attention,
)

__all__ = [
    "AttentionBias",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularMask",
    "memory_efficient_attention",
]
