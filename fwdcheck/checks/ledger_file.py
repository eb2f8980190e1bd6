"""The saved shape ledger: the JSON file `--save-ledger` writes and `--expect-ledger` reads, written and read here
(the shape-ledger check's `files`).

The shape-ledger check (fwdcheck/checks/shape_ledger.py) makes the ledger and compares it with an expected one; this
module turns a report's ledger into the file's text, and a file back into a ledger, refusing (one UsageError line, exit
2) any that is not a ledger written by --save-ledger.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from fwdcheck.config.reading import MAX_DEPTH, nesting_depth, read_json_file
from fwdcheck.config.schema import describe_validation_error
from fwdcheck.errors import UsageError


class LedgerEntry(BaseModel):
    """One tensor of a ledger written by --save-ledger. strict: a JSON number where a name belongs, a float (NaN)
    where a size belongs, a null where a list belongs, are refused rather than coerced."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1)
    dims: list[str]
    shape: list[Annotated[int, Field(ge=0)]] | None = None
    dtype: str | None = None


class Ledger(BaseModel):
    """The document --save-ledger writes and --expect-ledger reads. Keys it does not know are ignored (a newer
    fwdcheck may add some); the version, when given, must be one this fwdcheck reads."""

    model_config = ConfigDict(extra="ignore", strict=True)

    fwdcheck_ledger: Literal[1] = 1
    dims: dict[str, PositiveInt] = Field(default_factory=dict)
    entries: list[LedgerEntry]

    @model_validator(mode="after")
    def _consistent(self) -> Ledger:
        first: dict[str, int] = {}
        for i, entry in enumerate(self.entries):
            if entry.name in first:
                raise ValueError(
                    f"entries[{i}]: '{entry.name}' is listed twice (first as entries[{first[entry.name]}])"
                )
            first[entry.name] = i
            if entry.shape is not None and len(entry.shape) != len(entry.dims):
                raise ValueError(
                    f"entries[{i}]: '{entry.name}' has {len(entry.shape)} sizes in shape but "
                    f"{len(entry.dims)} names in dims"
                )
        return self


def ledger_text(result, report) -> str | None:
    """The --save-ledger file: the shape ledger as JSON; None when the result holds none (the check skipped or
    erred)."""
    if "entries" not in result.data:
        return None
    document = {
        "fwdcheck_ledger": 1,
        "model": report.model.get("label"),
        "dims": result.data.get("dims", {}),
        "entries": [{k: e[k] for k in ("name", "shape", "dims", "dtype")} for e in result.data["entries"]],
    }
    return json.dumps(document, indent=2) + "\n"


def read_ledger(path: Path, label: str) -> dict:
    """The --expect-ledger file, read and validated: the ledger as a plain dict."""
    # NaN and Infinity are no JSON; Python's reader accepts them unless told not to. The ledger check refuses them by
    # type (a size is an integer), which names the key.
    return ledger_from_dict(read_json_file(path, label, "ledger", "--save-ledger"), label)


def ledger_from_dict(document: Any, name: str) -> dict:
    """A parsed --expect-ledger file, validated: the ledger as a plain dict, or one UsageError line naming the key."""
    if not isinstance(document, dict) or "entries" not in document:
        raise UsageError(f"{name}: not a ledger written by --save-ledger (a JSON object with 'entries')")
    if nesting_depth(document) > MAX_DEPTH:
        raise UsageError(f"{name}: nested more than {MAX_DEPTH} levels deep; not a ledger written by --save-ledger")
    try:
        ledger = Ledger.model_validate(document)
    except ValidationError as exc:
        raise UsageError(f"{name}: not a ledger written by --save-ledger: {describe_validation_error(exc)}") from None
    return ledger.model_dump()
