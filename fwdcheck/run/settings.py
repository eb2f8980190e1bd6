"""Settings: how one run checks the model (its plan's config, each check's validated options, the files they
compare with), and the device and dtype it runs on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fwdcheck.config.schema import CodePaths, Distributed, Ignore, Inputs, RunConfig, Tolerance
from fwdcheck.errors import DeviceError
from fwdcheck.run.overrides import Overrides
from fwdcheck.run.plan import RunPlan, resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Settings:
    """How one run checks the model: its plan's config, held as it is, and what only a run knows. Run.build makes
    them of the plan; a cell of the code-path matrix (code_paths.cell_settings), a rank and a model kept in its own
    dtype derive theirs with `dataclasses.replace`.

    The config's keys (but `model:`) read as the settings' own (`settings.inputs.seed`, `settings.tolerance`): the
    checks, a plugin's too, read them so (docs/writing-checks.md)."""

    config: RunConfig  # the caller's overrides in it
    check_options: Mapping[str, Any] = field(default_factory=dict)  # check name -> its options (Check.options_in)
    expected: Mapping[str, Any] = field(default_factory=dict)  # a check's reading flag -> the file's document
    # whether the config or the command line named the dtype; if not, the run keeps the model's own (own_dtype)
    dtype_declared: bool = True
    max_rows: int | None = None  # rows per forward; default the baseline's batch size (at least 2)

    @classmethod
    def of(cls, plan: RunPlan) -> Settings:
        return cls(plan.config, plan.options, plan.expected, plan.dtype_declared)

    @classmethod
    def from_config(cls, config: RunConfig, overrides: Overrides | None = None) -> Settings:
        """The settings of `config` run with `overrides`, its plan resolved here (a run made outside the three ways
        in: a test's, a benchmark's)."""
        return cls.of(resolve(config, overrides))

    def with_config(self, **keys: Any) -> Settings:
        """These settings with some of the config's keys changed (a cell's inputs, a rank's device)."""
        return replace(self, config=self.config.model_copy(update=keys))

    def in_own_dtype(self, module: torch.nn.Module) -> tuple[Settings, str | None]:
        """These settings in the model's own dtype when no dtype was named, and the note that says so (None when
        nothing changes): a model handed over in bfloat16 runs in bfloat16, as torchinfo and transformers run it,
        instead of cast to float32, which would round nothing back but its precomputed tables (rotary cos/sin built
        in bfloat16 and now compared in float32). With parameters in several dtypes, the least precise one sets the
        tolerances and nothing is cast."""
        if self.dtype_declared or self.meta:
            return self, None
        own = own_dtype(module)
        if own is None or own == self.dtype:
            return self, None
        return self.with_config(dtype=own), (
            f"no dtype in the config: run in the model's own {own}, as it was handed over (dtype: float32 casts it)"
        )

    @property
    def ignored(self) -> dict[str, str]:
        """Finding code -> the config's reason for ignoring it."""
        return {i.code: i.reason for i in self.ignore}

    # The config's keys, read through: one property each, so that every read is typed.
    @property
    def inputs(self) -> Inputs:
        return self.config.inputs

    @property
    def device(self) -> str:
        return self.config.device

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @property
    def checks(self) -> list[str] | None:
        return self.config.checks

    @property
    def tolerance(self) -> Tolerance:
        return self.config.tolerance

    @property
    def options(self) -> dict[str, dict[str, Any] | None]:
        return self.config.options

    @property
    def code_paths(self) -> CodePaths:
        return self.config.code_paths

    @property
    def meta(self) -> bool:
        return self.config.meta

    @property
    def ignore(self) -> list[Ignore]:
        return self.config.ignore

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

    @property
    def distributed(self) -> Distributed:
        return self.config.distributed


def own_dtype(module: torch.nn.Module) -> str | None:
    """The dtype the model's parameters are in, by its DTYPES name: the least precise of them when they are in
    several; None when a parameter is in a dtype fwdcheck does not run in (float64), or there is none."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    found = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if not found or not found <= set(names):
        return None
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # least precise first
        if dtype in found:
            return names[dtype]
    return None


def resolve_device(requested: str) -> tuple[torch.device, str | None]:
    """The device to run on, and a note when the choice was not literally what was asked."""
    if requested == "meta":
        return torch.device("meta"), "meta device: shapes only, no weights allocated"
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "device auto: CUDA is available, using cuda"
        return torch.device("cpu"), "device auto: no CUDA device found, using cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(
            f"device '{requested}' requested but torch {torch.__version__} sees no CUDA device; "
            "use `--device cpu` or `--device auto`"
        )
    try:
        return torch.device(requested), None
    except RuntimeError as exc:
        raise DeviceError(f"device '{requested}' is not a valid torch device ({exc})") from None
