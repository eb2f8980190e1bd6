"""One exception class per kind of failure; each carries the exit code the CLI ends with.

Expected problems (a bad config, a model that cannot be built) become one line and exit 2; a model that raises while
it is being checked makes that check `error` (exit 1); anything else escaping from fwdcheck is a bug of ours (exit 3).
"""

from __future__ import annotations

import builtins
from contextlib import contextmanager
from enum import Enum, IntEnum
from pathlib import Path

WAITED_FOR_A_RANK = "another rank did not join it"  # a time limit that struck in torch.distributed's collective


class ExitCode(IntEnum):
    """What `fwdcheck run` exits with, and how every report says it in a word."""

    OK = 0
    FAILED = 1
    USAGE = 2
    INTERNAL = 3
    NOTHING_RAN = 5
    INTERRUPTED = 130  # SIGINT (Ctrl-C)
    TERMINATED = 143  # SIGTERM (a CI runner cancelling the job)

    @property
    def verdict(self) -> str:
        return _VERDICTS[self]


_VERDICTS = {
    ExitCode.OK: "passed",
    ExitCode.FAILED: "failed",
    ExitCode.USAGE: "usage error",
    ExitCode.INTERNAL: "internal error",
    ExitCode.NOTHING_RAN: "nothing ran",
    ExitCode.INTERRUPTED: "interrupted",
    ExitCode.TERMINATED: "terminated",
}


class Own(str, Enum):
    """The finding codes of fwdcheck itself, each by what it says: the one place a core module finds them (a check's
    own codes are in its `codes`). A str, so that a finding's code is its value in every report (JSON, JUnit, text)."""

    CHECK_NOT_LOADED = "FWD001"
    MODEL_RAISED = "FWD002"
    INTERNAL_ERROR = "FWD003"
    TIMED_OUT = "FWD004"
    PROCESS_DIED = "FWD005"
    WROTE_PARAMETERS = "FWD006"

    # The code itself wherever it is written (an f-string, str()), as StrEnum (Python 3.11 on) does.
    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


# What each of fwdcheck's own codes means (`fwdcheck explain CODE` reads these and each check's `codes`).
OWN_CODES: dict[str, str] = {
    Own.CHECK_NOT_LOADED: "the check could not be loaded (its plugin does not import, or has no run method)",
    Own.MODEL_RAISED: "the model raised, or returned something the check cannot compare, while the check ran it",
    Own.INTERNAL_ERROR: "internal error: fwdcheck's (or a plugin check's) own code raised; please report it",
    Own.TIMED_OUT: "the check ran past timeout_s (the forward hangs, or ignores the time limit and was killed)",
    Own.PROCESS_DIED: "the model's process died (an exit, a segfault, the out-of-memory killer) or was interrupted",
    Own.WROTE_PARAMETERS: "the run's forwards wrote the model's parameters in place (a forward in eval mode changed "
    "its weights)",
}


class FwdcheckError(Exception):
    """Base class; its message is the one line the user sees."""

    exit_code: int = ExitCode.INTERNAL  # a member of ExitCode; a worker's error carries the number it exited with


class UsageError(FwdcheckError):
    """Bad command line or configuration: nothing was checked."""

    exit_code = ExitCode.USAGE


class ConfigError(UsageError):
    """The config file cannot be read or does not validate."""


class ModelLoadError(UsageError):
    """The model cannot be built or loaded at all (module does not import, factory raises, ...)."""


class DeviceError(UsageError):
    """The requested device or dtype is not available here."""


class CheckLoadError(FwdcheckError):
    """A registered check could not be imported or instantiated."""

    exit_code = ExitCode.FAILED


class ModelRaised(FwdcheckError):
    """The model under test raised (or returned something uncheckable) while a check ran it."""

    exit_code = ExitCode.FAILED

    def __init__(self, message: str, *, frame: tuple[str, int, str] | None = None):
        super().__init__(message)
        self.frame = frame  # (file, line, function) of the model code that raised, when it did

    @property
    def where(self) -> str | None:
        return f"{self.frame[0]}:{self.frame[1]} in {self.frame[2]}" if self.frame else None


class ObservationFailed(FwdcheckError):
    """fwdcheck's observation pass broke a forward that runs untouched: fwdcheck's failure, never the model's."""

    exit_code = ExitCode.INTERNAL


class SkipCheck(Exception):
    """Raised by a check that could not measure anything here (the run's inputs too short, a kernel this machine
    lacks, logits already NaN); the message is the reason."""


class DoesNotApply(SkipCheck):
    """Raised by a check whose subject the model does not have (no cache to decode through, no loss from labels, no
    rotary function): the report says "does not apply: <reason>", apart from a skip the run's environment caused."""


def first_line(message: object, limit: int | None = None) -> str:
    """The first line of an error's message (an exception's, a warning's), cut to `limit` characters if given:
    what a one-line report can show of it."""
    text = exception_text(message) if isinstance(message, BaseException) else str(message)
    line = (text.strip().splitlines() or [""])[0]
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


def exception_text(exc: BaseException) -> str:
    """str(exc), even for an exception whose __str__ itself raises (model code can hand us one)."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: its message cannot be shown>"


@contextmanager
def about_config(path: Path | None, key: str = ""):
    """A usage error about what the config file names (its checks, its model, its inputs) carries the file's name
    first, as the config's own validation errors do: `error: model.yaml: factory 'pkg:build' raised ...`."""
    try:
        yield
    except UsageError as exc:
        if path is not None and not str(exc).startswith(f"{path}:"):
            exc.args = (f"{path}: {key}{exc}", *exc.args[1:])
        raise


_EXCEPTION_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11 on


# BaseExceptions that are no reason to end a run when model code raises them: sys.exit() (SystemExit), a generator
# or coroutine closed inside forward (GeneratorExit, asyncio's CancelledError), a model's own BaseException subclass,
# a KeyboardInterrupt the model raised itself (no SIGINT reached the process). A Ctrl-C the run received and
# fwdcheck's own (the runner's time limit) always pass: they stop the run on purpose.
def model_failure(exc: BaseException) -> bool:
    """Whether an exception raised inside model code is the model's failure, to be reported, not propagated."""
    if isinstance(exc, Exception):
        return not isinstance(exc, ModelRaised)
    if isinstance(exc, KeyboardInterrupt):
        return _interrupts.listening and not _interrupts.heard
    if type(exc).__module__.split(".")[0] == "fwdcheck":
        return False
    if isinstance(exc, _EXCEPTION_GROUP):  # a group holding a Ctrl-C or a time limit is that, not a failure
        return all(model_failure(inner) for inner in exc.exceptions)
    return True


class Terminated(KeyboardInterrupt):
    """SIGTERM raised where the process is, as Ctrl-C raises KeyboardInterrupt (terminate_raises): every `finally`
    and cleanup on the way out runs, and the command ends with exit 143 instead of dying by the signal mid-write."""


@contextmanager
def terminate_raises():
    """While the block runs, SIGTERM raises Terminated in the main thread (elsewhere it keeps its handler)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        _interrupts.heard = True  # an interruption from outside, never the model's own error (model_failure)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class _Interrupts:
    """Whether a run listens for SIGINT (interrupts_heard) and has heard one."""

    listening = False
    heard = False


_interrupts = _Interrupts()


class _Heard:
    """The SIGINT handler while a run listens: records the signal, then handles it as `previous` would. Its repr
    names no address, so that what a model reads of its process is the same in every worker (forked or new)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, signum, frame):
        import signal

        _interrupts.heard = True
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    def __repr__(self) -> str:
        return f"<fwdcheck's SIGINT handler, recording each SIGINT before {self.previous!r}>"


@contextmanager
def interrupts_heard():
    """While the block runs, each SIGINT the process receives is recorded before it is handled as it was (the
    default handler raises KeyboardInterrupt): a KeyboardInterrupt with no SIGINT behind it was raised by model code,
    and is the model's error. Only the main thread can install the handler; elsewhere every KeyboardInterrupt stays
    an interruption."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or _interrupts.listening:
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, _Heard(previous))
    _interrupts.listening, _interrupts.heard = True, False
    try:
        yield
    finally:
        _interrupts.listening = False
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
