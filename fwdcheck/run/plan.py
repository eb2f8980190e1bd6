"""RunPlan: one run resolved once, in the process that validates it, and handed on as it is.

The command line resolves it before torch loads (fwdcheck/run_command.py), the Python API and the pytest plugin in
the caller's process; the worker, a distributed run's ranks and the code-path matrix's cells take it as it was made
and re-read nothing. Its module imports neither torch nor pydantic: the supervisor's Job carries one.
"""

from __future__ import annotations

import base64
import os
import pickle
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fwdcheck.run.overrides import Overrides

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fwdcheck.config.registry import CheckEntry
    from fwdcheck.config.schema import RunConfig


@dataclass(frozen=True)
class RunPlan:
    """What one run does, resolved: the config with the caller's overrides in it, the checks it runs in order, each
    check's options validated, the files the checks compare with read and validated. Made by `resolve` (or `made`,
    where the caller has selected the checks itself), never changed: a variant is a `dataclasses.replace`."""

    # the config (a whole Config from a file, with its `model:`; the RunConfig the API makes) with the overrides in it
    config: RunConfig
    entries: tuple[CheckEntry, ...]  # the selected checks, in the order they run
    options: Mapping[str, BaseModel] = field(default_factory=dict)  # check name -> its options, validated
    # the overrides as the caller gave them: what the report of a run that ends before the model loads says it asked
    overrides: Overrides = field(default_factory=Overrides)

    @property
    def expected(self) -> Mapping[str, Any]:
        """A check's reading flag (--expect-golden) -> the file's document, read and validated (Check.expected_in)."""
        return self.overrides.expected or {}

    @property
    def fail_on(self) -> str:
        return self.overrides.fail_on

    @property
    def dtype_declared(self) -> bool:
        """Whether the config or the caller named the dtype (Overrides.applied marks a dtype it sets as named); if
        not, the run keeps the model's own (Settings.in_own_dtype)."""
        return "dtype" in self.config.model_fields_set

    @classmethod
    def made(cls, config: RunConfig, entries: list[CheckEntry], overrides: Overrides) -> RunPlan:
        """The plan of `config` (the overrides applied already) running `entries`: each check's options validated,
        the config's `options:` with the overrides' flags on top (a UsageError naming the option)."""
        from fwdcheck.config.registry import check_options

        options = check_options(config.options, overrides.options or {}, entries)
        return cls(config, tuple(entries), options, overrides)

    def to_wire(self) -> str:
        """The plan as it travels to a worker or a rank (text, for the Job's JSON): pickled, so that it arrives as
        it is, its validated models not validated again."""
        return base64.b64encode(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")

    @classmethod
    def from_wire(cls, text: str) -> RunPlan:
        """The plan to_wire sent. A check named as module:Class may have its options model in a module of the working
        directory, where the check itself is imported from (registry.CheckEntry.load): it is looked for there when
        the import path does not have it."""
        data = base64.b64decode(text)
        try:
            plan = pickle.loads(data)
        except ModuleNotFoundError:
            sys.path.insert(0, os.getcwd())
            try:
                plan = pickle.loads(data)
            finally:
                sys.path.remove(os.getcwd())
        if not isinstance(plan, cls):
            raise TypeError(f"not a run's plan: {type(plan).__name__}")
        return plan


def resolve(config: RunConfig, overrides: Overrides | None = None) -> RunPlan:
    """The plan of `config` run with `overrides`: the overrides applied, the checks selected (in a distributed run
    those that open one first: registry.selected), each check's options validated."""
    from fwdcheck.config.registry import selected

    overrides = overrides or Overrides()
    config = overrides.applied(config)
    return RunPlan.made(config, selected(config.checks, config.distributed.nproc), overrides)
