"""Settings: how one run checks the model (the config's run section with the caller's Overrides and each check's
validated options), and the device and dtype it runs on."""

from __future__ import annotations

from typing import Any

import torch

from fwdcheck.config.registry import check_options, selected
from fwdcheck.config.schema import RunConfig
from fwdcheck.errors import DeviceError
from fwdcheck.run.overrides import Overrides

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Settings(RunConfig):
    """How one run checks the model: the config's run section with the caller's Overrides applied, and what only a
    run knows. The command line's worker, the pytest plugin and the Python API build it the same way
    (fwdcheck.run.runner.Run); a cell of the code-path matrix derives its own from it (code_paths.cell_settings)."""

    expected: dict[str, Any] = {}  # a check's reading flag -> the file's document (Check.expected_in)
    max_rows: int | None = None  # rows per forward; default the baseline's batch size (at least 2)
    check_options: dict[str, Any] = {}  # check name -> its options, validated (Check.options_in)
    # whether the config or the command line named the dtype; if not, the run keeps the model's own (own_dtype)
    dtype_declared: bool = True

    @classmethod
    def from_config(cls, config: RunConfig, overrides: Overrides | None = None) -> Settings:
        overrides = overrides or Overrides()
        run = overrides.applied(config)
        entries = selected(run.checks, run.distributed.nproc)
        return cls(
            **{name: getattr(run, name) for name in RunConfig.model_fields},
            expected=overrides.expected or {},
            check_options=check_options(run.options, overrides.options or {}, entries),
            dtype_declared="dtype" in config.model_fields_set or overrides.dtype is not None,
        )

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
        return self.model_copy(update={"dtype": own}), (
            f"no dtype in the config: run in the model's own {own}, as it was handed over (dtype: float32 casts it)"
        )

    @property
    def ignored(self) -> dict[str, str]:
        """Finding code -> the config's reason for ignoring it."""
        return {i.code: i.reason for i in self.ignore}


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
