"""The golden file: the numeric contract `--save-golden` writes and `--expect-golden` reads, written and read here
(the golden check's `files`).

The golden check (fwdcheck/checks/golden.py) fingerprints every module's output and every parameter
(fwdcheck/observe/activations.py) and compares them with an expected golden file; this module turns a report's
fingerprints into the file's text, and a file back into the document, refusing (one UsageError line, exit 2) any that is
not a golden file written by
--save-golden, or one made at other inputs or in another dtype than the run about to use it. It imports neither torch
nor the check: the command line validates the file before any model loads.

The file is made for review in a diff: the header, then one module output a line in the order the outputs came, then
one parameter (or buffer) a line in the model's own order; every number to 6 significant digits, so that a rerun on
the same machine writes the same bytes.

    {
      "fwdcheck_golden": 1,
      "model": "reference (rope, sdpa, 2 layers; planted bugs: none)",
      "run": {"seed": 0, "batch_size": 2, "seq_len": 8, "dtype": "float32", "device": "cpu", "torch": "2.13.0+cpu"},
      "tolerance": {"rtol": 0.0001, "atol": 1e-06},
      "outputs": [
        {"name": "wte", "shape": [2, 8, 16], "dtype": "float32", "mean": 0.0123, "std": 0.98, "absmax": 2.9, ...},
        ...
      ],
      "parameters": [
        {"name": "wte.weight", "shape": [32, 16], "dtype": "float32", ...},
        ...
      ]
    }
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from fwdcheck.config.reading import MAX_DEPTH, nesting_depth, read_json_file
from fwdcheck.config.schema import RunConfig, describe_validation_error
from fwdcheck.config.tolerance_bounds import bounded_atol, bounded_rtol
from fwdcheck.errors import UsageError

VERSION = 1
Finite = Annotated[float, Field(allow_inf_nan=False)]
Size = Annotated[int, Field(ge=0)]
# What fwdcheck.observe.activations.fingerprint writes (it imports torch; this module must not): values at SAMPLED fixed
# indices (fewer in a smaller tensor), DIGEST_ROWS digest numbers, and the logits' entry among the outputs.
# tests/test_golden_contract.py holds them equal to activations'.
SAMPLED = 4
DIGEST_ROWS = 4
LOGITS = "(logits)"


class Fingerprint(BaseModel):
    """One module output or one parameter. strict: a string where a number belongs, a null where a list belongs, are
    refused rather than coerced (an integer is a number)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1)
    shape: list[Size]
    dtype: str
    mean: Finite
    std: Finite = Field(ge=0)
    absmax: Finite = Field(ge=0)
    values: list[Finite | None]  # None: the element there is NaN or Inf
    digest: list[Finite]
    nonfinite: Size = 0

    @model_validator(mode="after")
    def _whole(self) -> Fingerprint:
        """As many numbers as a fingerprint of this shape holds: a file with values or digest cut short would
        compare fewer numbers (a model with its rows swapped could pass), so it is not a golden file."""
        elements = math.prod(self.shape)
        if len(self.digest) != DIGEST_ROWS:
            raise ValueError(f"'{self.name}': digest holds {len(self.digest)} numbers, not {DIGEST_ROWS}")
        if len(self.values) != min(SAMPLED, elements):
            raise ValueError(
                f"'{self.name}': values holds {len(self.values)} numbers; a tensor of shape {self.shape} has "
                f"{min(SAMPLED, elements)}"
            )
        if self.nonfinite > elements or sum(v is None for v in self.values) > self.nonfinite:
            raise ValueError(f"'{self.name}': more NaN or Inf than the tensor's {elements} elements, or than nonfinite")
        return self


class RunRecord(BaseModel):
    """What the fingerprints were taken at: the inputs (drawn from the seed) and the dtype must be this run's; the
    device and the torch release are said, not required."""

    model_config = ConfigDict(extra="ignore", strict=True)

    seed: int
    batch_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    dtype: str
    device: str = ""
    torch: str = ""


class Tolerance(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    """A tolerance that would excuse any change is refused, as in a config (fwdcheck/config/tolerance_bounds.py)."""

    rtol: Annotated[float, Field(ge=0), AfterValidator(bounded_rtol)]
    atol: Annotated[float, Field(ge=0), AfterValidator(bounded_atol)]


class Golden(BaseModel):
    """The document --save-golden writes and --expect-golden reads. Keys it does not know are ignored (a newer
    fwdcheck may add some); the version must be one this fwdcheck reads."""

    model_config = ConfigDict(extra="ignore", strict=True)

    fwdcheck_golden: Literal[1]
    model: str | None = None
    run: RunRecord
    tolerance: Tolerance
    outputs: list[Fingerprint]
    parameters: list[Fingerprint]

    @model_validator(mode="after")
    def _names_once(self) -> Golden:
        if LOGITS not in [entry.name for entry in self.outputs]:
            raise ValueError(f"outputs: no '{LOGITS}' entry; every golden file records the logits")
        for key in ("outputs", "parameters"):
            first: dict[str, int] = {}
            for i, entry in enumerate(getattr(self, key)):
                if entry.name in first:
                    raise ValueError(
                        f"{key}[{i}]: '{entry.name}' is listed twice (first as {key}[{first[entry.name]}])"
                    )
                first[entry.name] = i
        return self


def golden_text(result, report) -> str | None:
    """The --save-golden file: the golden check's fingerprints, one module a line; None when the result holds none
    (the check skipped or erred)."""
    document = result.data.get("golden")
    if document is None:
        return None
    head = {k: document[k] for k in ("fwdcheck_golden", "model", "run", "tolerance")}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    for key, last in (("outputs", False), ("parameters", True)):
        entries = [f"    {json.dumps(e)}" for e in document[key]]
        lines += (
            [f'  "{key}": [', ",\n".join(entries), "  ]" + ("" if last else ",")]
            if entries
            else [f'  "{key}": []' + ("" if last else ",")]
        )
    return "\n".join(lines) + "\n}\n"


def read_golden(path: Path, label: str) -> dict:
    """The --expect-golden file, read and validated: the document as a plain dict."""
    # NaN and Infinity are no JSON; Python's reader accepts them unless told not to.
    document = read_json_file(path, label, "golden file", "--save-golden", parse_constant=_no_constant)
    return golden_from_dict(document, label)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def golden_from_dict(document: Any, name: str) -> dict:
    """A parsed --expect-golden file, validated: the document as a plain dict, or one UsageError line naming the
    key."""
    if not isinstance(document, dict) or "fwdcheck_golden" not in document:
        raise UsageError(f"{name}: not a golden file written by --save-golden (a JSON object with 'fwdcheck_golden')")
    if nesting_depth(document) > MAX_DEPTH:
        raise UsageError(
            f"{name}: nested more than {MAX_DEPTH} levels deep; not a golden file written by --save-golden"
        )
    if document["fwdcheck_golden"] != VERSION:
        raise UsageError(
            f"{name}: golden file format {document['fwdcheck_golden']!r}; this fwdcheck reads format "
            f"{VERSION} (save it again with this fwdcheck)"
        )
    try:
        golden = Golden.model_validate(document)
    except ValidationError as exc:
        raise UsageError(
            f"{name}: not a golden file written by --save-golden: {describe_validation_error(exc)}"
        ) from None
    return golden.model_dump()


def refuse_other_run(document: dict, config: RunConfig, name: str) -> None:
    """A golden file is compared at the inputs and in the dtype it was made with: one made at another seed, batch
    size or length, or in another dtype, is a usage error naming what differs (the overrides applied to `config`)."""
    made = document["run"]
    now = {
        "seed": config.inputs.seed,
        "batch_size": config.inputs.batch_size,
        "seq_len": config.inputs.seq_len,
        "dtype": config.dtype,
    }
    if "dtype" not in config.model_fields_set:
        del now["dtype"]  # none named: the run keeps the model's own, known once it loads (the check compares it)
    differ = [f"{key} {made[key]} (this run: {value})" for key, value in now.items() if made[key] != value]
    if differ:
        raise UsageError(
            f"{name}: made with another config: {', '.join(differ)}; a golden file is compared at the "
            "inputs and dtype it was made with (run with those, or save it again)"
        )
