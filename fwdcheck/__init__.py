"""fwdcheck: forward-pass sanity checks for transformer code.

Importing the package is cheap (no torch): the CLI's --help and --version must answer instantly.
"""

__version__ = "0.1.0"
