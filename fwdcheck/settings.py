"""Settings: how one run checks the model (the config's run section with the caller's Overrides and each check's
validated options), and the device and dtype it runs on."""

from __future__ import annotations

from typing import Any

import torch

from fwdcheck.config import RunConfig
from fwdcheck.errors import DeviceError
from fwdcheck.overrides import Overrides
from fwdcheck.registry import check_options, selected

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Settings(RunConfig):
    """How one run checks the model: the config's run section with the caller's Overrides applied, and what only a
    run knows. The command line's worker, the pytest plugin and the Python API build it the same way
    (fwdcheck.runner.Run); a cell of the code-path matrix derives its own from it (code_paths.cell_settings)."""

    expected: dict[str, Any] = {}  # a check's reading flag -> the file's document (Check.expected_in)
    max_rows: int | None = None  # rows per forward; default the baseline's batch size (at least 2)
    check_options: dict[str, Any] = {}  # check name -> its options, validated (Check.options_in)

    @classmethod
    def from_config(cls, config: RunConfig, overrides: Overrides | None = None) -> Settings:
        overrides = overrides or Overrides()
        run = overrides.applied(config)
        entries = selected(run.checks, run.distributed.nproc)
        return cls(
            **{name: getattr(run, name) for name in RunConfig.model_fields},
            expected=overrides.expected or {},
            check_options=check_options(run.options, overrides.options or {}, entries),
        )

    @property
    def ignored(self) -> dict[str, str]:
        """Finding code -> the config's reason for ignoring it."""
        return {i.code: i.reason for i in self.ignore}


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
