from xformers.ops import fmha
from xformers.ops.fmha import *  # noqa: F403  (xformers.ops offers fmha's public names, as the real package does)

__all__ = fmha.__all__
