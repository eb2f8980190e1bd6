"""One exception class per kind of failure; each carries the exit code the CLI ends with.

Expected problems (a bad config, a model that cannot be built) become one line and exit 2; a model that raises while
it is being checked makes that check `error` (exit 1); anything else escaping from fwdcheck is a bug of ours (exit 3).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C)
EXIT_TERMINATED = 143  # SIGTERM (a CI runner cancelling the job)
EXIT_NOTHING_RAN = 5


# The finding codes of fwdcheck itself (a check's own codes are in its `codes`; `fwdcheck explain CODE` reads both).
OWN_CODES = {
    "FWD001": "the check could not be loaded (its plugin does not import, or has no run method)",
    "FWD002": "the model raised, or returned something the check cannot compare, while the check ran it",
    "FWD003": "internal error: fwdcheck's (or a plugin check's) own code raised; please report it",
    "FWD004": "the check ran past timeout_s (the forward hangs, or ignores the time limit and was killed)",
    "FWD005": "the model's process died (an exit, a segfault, the out-of-memory killer) or was interrupted",
    "FWD006": "the run's forwards wrote the model's parameters in place (a forward in eval mode changed its weights)",
}


class FwdcheckError(Exception):
    """Base class; its message is the one line the user sees."""

    exit_code = EXIT_INTERNAL


class UsageError(FwdcheckError):
    """Bad command line or configuration: nothing was checked."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """The config file cannot be read or does not validate."""


class ModelLoadError(UsageError):
    """The model cannot be built or loaded at all (module does not import, factory raises, ...)."""


class DeviceError(UsageError):
    """The requested device or dtype is not available here."""


class CheckLoadError(FwdcheckError):
    """A registered check could not be imported or instantiated."""

    exit_code = EXIT_FAILED


class ModelRaised(FwdcheckError):
    """The model under test raised (or returned something uncheckable) while a check ran it."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, where: str | None = None):
        super().__init__(message)
        self.where = where


class SkipCheck(Exception):
    """Raised by a check that does not apply to this model; the message is the reason."""


def exception_text(exc: BaseException) -> str:
    """str(exc), even for an exception whose __str__ itself raises (model code can hand us one)."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: its message cannot be shown>"
