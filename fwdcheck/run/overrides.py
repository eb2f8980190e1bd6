"""Overrides: what a caller changes on a config for one run.

Its own module, free of pydantic and torch: the command line builds one before anything heavy is imported, and
resolves its run's plan with it (plan.py), which keeps it for the report of a run that ends early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fwdcheck.config.schema import RunConfig


@dataclass(frozen=True, kw_only=True)
class Overrides:
    """What a caller changes on a config for one run: the command line's flags, the pytest plugin's options, the
    Python API's check selection. None (and False) leave the config's value."""

    checks: list[str] | None = None  # the selection, instead of the config's `checks:`
    device: str | None = None
    dtype: str | None = None
    seed: int | None = None
    options: dict[str, dict[str, Any]] | None = None  # check name -> its options set by the command line's flags
    meta: bool = False  # True turns it on; a config's `meta: true` is not turned off
    # a check's reading flag (Check.files: --expect-golden) -> the file's document, read and validated
    expected: dict[str, Any] | None = None
    fail_on: str = "fail"  # fail | warn: the lowest status that fails the run
    nproc: int | None = None  # ranks of a distributed run, instead of the config's distributed.nproc

    def applied(self, config: RunConfig) -> RunConfig:
        """The config with these overrides in it (a copy; the config itself is left alone)."""
        inputs = config.inputs if self.seed is None else config.inputs.model_copy(update={"seed": self.seed})
        distributed = (
            config.distributed if self.nproc is None else config.distributed.model_copy(update={"nproc": self.nproc})
        )
        return config.model_copy(
            update={
                "inputs": inputs,
                "distributed": distributed,
                "device": self.device or config.device,
                "checks": self.checks if self.checks is not None else config.checks,
                "meta": self.meta or config.meta,
                # only a dtype named here counts as named (Settings.dtype_declared): none keeps the model's own
                **({"dtype": self.dtype} if self.dtype else {}),
            }
        )
