"""A stand-in for xformers on machines without CUDA (the real package needs it to install): see xformers.ops.fmha."""

__version__ = "0.0.29.standin"
