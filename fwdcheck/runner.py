"""Run the selected checks on one model and collect a Report. Loaders build, checks judge, renderers show."""

from __future__ import annotations

import platform
import time
import traceback

from fwdcheck.errors import CheckLoadError, ModelRaised, SkipCheck
from fwdcheck.model import ModelUnderTest
from fwdcheck.registry import CheckEntry
from fwdcheck.report import Report
from fwdcheck.result import CheckResult, Finding, Status
from fwdcheck.session import Session, Settings


def run_model(model: ModelUnderTest, settings: Settings, entries: list[CheckEntry], *, config_path=None,
              fail_on: str = "fail") -> Report:
    """Every check on one session; the model is restored when this returns, however it returns."""
    import torch

    session = Session(model, settings)
    results: list[CheckResult] = []
    with session.active():
        for entry in entries:
            results.append(run_one(entry, model, session))
    parameters = sum(p.numel() for p in model.module.parameters())
    return Report(
        results=results,
        model={"label": model.label, "source": model.source, "parameters": parameters, "vocab_size": model.vocab_size,
               "max_positions": model.max_positions, "causal": model.causal, "dims": dict(model.dims)},
        environment={"torch": torch.__version__, "python": platform.python_version(), "device": str(session.device),
                     "dtype": settings.dtype, "seed": settings.seed, "batch_size": settings.batch_size,
                     "seq_len": settings.seq_len},
        notes=[*model.extra.get("notes", []), *session.notes],
        config_path=str(config_path) if config_path else None,
        fail_on=fail_on,
    )


def run_one(entry: CheckEntry, model: ModelUnderTest, session: Session) -> CheckResult:
    """One check, whatever happens: skip raised, model errors and fwdcheck's own errors become results."""
    start = time.perf_counter()
    try:
        check = entry.load()
        result = check.run(model, session)
    except SkipCheck as skip:
        result = CheckResult(entry.name, Status.SKIP, str(skip))
    except CheckLoadError as exc:
        result = CheckResult(entry.name, Status.ERROR, str(exc), [Finding("FWD001", Status.ERROR, str(exc))])
    except ModelRaised as exc:
        result = CheckResult(entry.name, Status.ERROR, str(exc), [Finding("FWD002", Status.ERROR, str(exc), exc.where)])
    except Exception as exc:  # a bug of fwdcheck's (or of a plugin's), not of the model: exit 3
        message = f"internal error in check {entry.label}: {type(exc).__name__}: {exc}"
        result = CheckResult(entry.name, Status.ERROR, message, [Finding("FWD003", Status.ERROR, message)],
                             data={"traceback": traceback.format_exc()}, internal_error=True)
    result.duration_s = time.perf_counter() - start
    return result
