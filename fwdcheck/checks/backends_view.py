"""backends' options (torch-free: the command line validates them before any model loads)."""

from __future__ import annotations

from pydantic import Field

from fwdcheck.config.schema import CheckOptions


class Options(CheckOptions):
    """`options: {backends: {...}}`"""

    flex: bool = Field(
        False,
        description="also compare flex_attention where the model offers it (it compiles its "
        "kernel on first use: tens of seconds on CPU)",
    )
