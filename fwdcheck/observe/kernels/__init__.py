"""The attention kernels the observer reads, one module per family, each registering its readers (and wrappers) in
the kernel table (fwdcheck/observe/table.py) as it is imported. Importing this package fills the table; a new family
is one module here and its line below."""

from fwdcheck.observe.kernels import flash, flex, hf_registry, mha, products, sdpa, xformers

__all__ = ["flash", "flex", "hf_registry", "mha", "products", "sdpa", "xformers"]
