"""The code a config names by reference ('package.module:callable': a factory, a forward adapter, a rotary function,
a parallelize function, a check class), imported with the config's directories on sys.path, each way the import can
fail one clear ModelLoadError line."""

from __future__ import annotations

import difflib
import pkgutil
import re
import sys
import traceback
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

from fwdcheck.errors import ModelLoadError, model_failure


def search_dirs(extra: list[Path], config_path: Path | None) -> list[Path]:
    """sys.path additions: the configured directories, then the config file's folder (or the working directory)."""
    return [*extra, config_path.parent.resolve() if config_path is not None else Path.cwd()]


_DOTTED = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*")  # what pkgutil.resolve_name accepts before the colon


def resolve_callable(reference: str, what: str, looked_in: list[Path] | None = None) -> Callable:
    """'package.module:attr' -> the object (pkgutil.resolve_name), with one clear ModelLoadError for each way that
    can go wrong. `looked_in`: the directories put on sys.path for it, named when the module is in none of them."""
    module_name, _, attr = reference.partition(":")
    try:
        obj = pkgutil.resolve_name(reference)
    except ModuleNotFoundError as exc:
        where = ""
        if looked_in is not None and exc.name is not None and module_name.split(".")[0] == exc.name.split(".")[0]:
            where = _where_looked(exc.name.split(".")[0], looked_in)
        raise ModelLoadError(f"{what} '{reference}': cannot import '{module_name}': {exc}{where}") from exc
    except ValueError as exc:
        if module_name not in sys.modules and not _DOTTED.fullmatch(module_name):  # resolve_name's "invalid format"
            raise ModelLoadError(
                f"{what} '{reference}': cannot import '{module_name}': not a dotted module name "
                "(package.module:attribute)"
            ) from exc
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ModelLoadError(f"{what} '{reference}': importing '{module_name}' raised {last}") from exc
    except AttributeError as exc:
        if module_name not in sys.modules:  # raised while importing the module, not looking up the attribute
            raise ModelLoadError(
                f"{what} '{reference}': importing '{module_name}' raised "
                f"{traceback.format_exception_only(type(exc), exc)[-1].strip()}"
            ) from exc
        module = sys.modules[module_name]
        close = difflib.get_close_matches(attr, [n for n in vars(module) if callable(getattr(module, n, None))], n=1)
        hint = f"; did you mean '{module_name}:{close[0]}'?" if close else ""
        raise ModelLoadError(f"{what} '{reference}': module '{module_name}' has no attribute '{attr}'{hint}") from exc
    except BaseException as exc:  # SystemExit too: a script that parses sys.argv or exits at import
        if not model_failure(exc):
            raise
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ModelLoadError(f"{what} '{reference}': importing '{module_name}' raised {last}") from exc
    if not callable(obj):
        raise ModelLoadError(f"{what} '{reference}' is a {type(obj).__name__}, not a callable")
    return obj


def _where_looked(top: str, looked_in: list[Path]) -> str:
    """Where a module named `top` was looked for beyond the installed packages, and the modules there whose name is
    close to it: a config beside `model.py` that says `models:build`."""
    shown = ", ".join(str(d) for d in looked_in)
    here: list[str] = []
    for directory in looked_in:
        with suppress(OSError):
            here += [p.stem if p.suffix == ".py" else p.name for p in directory.iterdir() if _importable(p)]
    close = difflib.get_close_matches(top, sorted(set(here)), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return (
        f"{hint} (looked in {shown} and the installed packages: run from the module's folder, or name that folder "
        "in the config's model.python_path)"
    )


def _importable(path: Path) -> bool:
    if path.suffix == ".py":
        return path.stem.isidentifier()
    return path.is_dir() and path.name.isidentifier() and (path / "__init__.py").is_file()


@contextmanager
def on_sys_path(directories: list[Path]):
    added = [str(d) for d in directories if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)
