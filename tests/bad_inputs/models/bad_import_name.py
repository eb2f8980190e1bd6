"""A module that does not import: it asks an installed package for a name the package does not have."""

from torch.nn import MultiHeadLatentAttention  # noqa: F401  (no such class in torch.nn)


def build():  # never reached
    pass
