"""Output files that never harm what the user owns: every output checked before the model loads (writable, not a file
the run reads, not another output's file), and written whole or not at all (a temporary file renamed over a regular
file; a device, a FIFO or the process's own stream written in place). Free of torch: the command line's own.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fwdcheck.errors import UsageError, exception_text


def why_not(exc: OSError | ValueError) -> str:
    """Why a write failed, in words: the OS's reason, 'disk full' said plainly."""
    reason = getattr(exc, "strerror", None) or exception_text(exc)
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full: {reason}"
    return reason


@dataclass
class Target:
    """Where an output's bytes go. `path`: the file itself, with symbolic links followed (the link stays, its target
    is replaced). `direct`: written in place, not through a temporary file: a device (/dev/null, /dev/full), a FIFO,
    or one of the process's own streams (/dev/stdout, /dev/fd/N); replacing one of those would put a regular file
    where it was, or leave the reader of the stream with nothing."""

    path: Path
    direct: bool


OWN_STREAM = re.compile(r"^/(dev|proc/[^/]+)/fd/\d+$|^/dev/std(out|err)$")


def own_stream(path: Path) -> bool:
    """Whether the path reaches its file through /proc's descriptor links (/dev/stdout -> /proc/self/fd/1): the
    file behind them is whatever the shell opened, which only a write through the link itself reaches."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if OWN_STREAM.match(current):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    return False


def output_target(path: Path, label: str) -> Target:
    """Where `path` writes, or one UsageError line saying why nothing can be written there."""
    path = Path(path)
    if own_stream(path):
        return Target(path, direct=True)
    try:
        mode = os.stat(path).st_mode  # follows links
    except FileNotFoundError:
        mode = None  # a new file, or a link to one
    except OSError as exc:  # a file where a directory should be, a loop of links, no permission to look
        raise UsageError(f"{label}: cannot write there ({why_not(exc)})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(f"{label} is a directory")
    if mode is not None and not stat.S_ISREG(mode):
        return Target(path, direct=True)
    real = Path(os.path.realpath(path))
    if not real.parent.is_dir():
        raise UsageError(f"{label}: directory {real.parent} does not exist")
    return Target(real, direct=False)


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # one of them does not exist: not the same file
        return False


def check_outputs(
    outputs: list[tuple[str, Path]],
    inputs: list[tuple[str, Path]],
    to_stdout: bool,
    code_dirs: list[Path] | tuple[Path, ...] = (),
) -> None:
    """Before the model loads: each output can be written, none is a file the run reads (nor Python code in a
    directory the model's code is imported from), no two are one file. Found at the end instead, an unwritable
    output would fail after the whole run, and an output naming the config would have replaced it with the report."""
    if to_stdout and sys.stdout is None:
        raise UsageError("stdout is closed: the report has nowhere to go (give --output FILE)")
    seen: list[tuple[str, Target]] = []
    for option, path in outputs:
        label = f"{option} {path}"
        target = output_target(path, label)
        for name, input_path in inputs:
            if same_file(target.path, input_path):
                raise UsageError(f"{label} is {name}; fwdcheck does not write a report over a file the run reads")
        where = _code_dir_holding(target, code_dirs)
        if where is not None:
            raise UsageError(
                f"{label} is Python code in {where}, where the model's code is imported from; fwdcheck does not "
                "write a report over a file the run may read"
            )
        for other, earlier in seen:
            if (earlier.path == target.path or same_file(earlier.path, target.path)) and not (
                target.direct and earlier.direct
            ):  # two reports into one stream (/dev/null) is fine
                raise UsageError(f"{label} is also the file of {other}; give each report its own file")
        seen.append((option, target))
        if target.direct:
            if not os.path.exists(target.path):  # /dev/fd/N of a descriptor this process does not have open
                raise UsageError(f"{label}: cannot write there (no such file or open descriptor)")
            if not os.access(target.path, os.W_OK):
                raise UsageError(f"{label}: cannot write there (permission denied)")
        else:
            probe_directory(target.path.parent, label)


def check_appended(label: str, path: Path, outputs: list[tuple[str, Path]], inputs: list[tuple[str, Path]]) -> None:
    """A file the run appends to (GitHub's job summary) is no other output's file and no file the run reads: markdown
    appended into the JSON report would leave neither whole."""
    for option, output in outputs:
        if same_file(path, output) or os.path.realpath(path) == os.path.realpath(output):
            raise UsageError(f"{label} is also the file of {option}; give each report its own file")
    for name, input_path in inputs:
        if same_file(path, input_path):
            raise UsageError(f"{label} is {name}; fwdcheck does not write into a file the run reads")


def _code_dir_holding(target: Target, code_dirs) -> Path | None:
    """The directory of model code that holds the target, when the target is an existing Python file there (what an
    import from that directory may read): anything a factory imports is the model's code too."""
    if target.direct or target.path.suffix not in (".py", ".pyc", ".pyi") or not target.path.exists():
        return None
    for directory in code_dirs:
        if target.path.is_relative_to(os.path.realpath(directory)):
            return Path(directory)
    return None


def model_code_files(config, config_path: Path | None) -> tuple[list[tuple[str, Path]], list[Path]]:
    """The Python files of the model's code the config names (the factory's module, the forward adapter's, the rotary
    function's, the parallelize function's), found as an import would find them but importing nothing; and the
    directories its imports search (the config's paths, and its folder: with --model, the working directory)."""
    dirs = [*config.model.code_dirs(), config_path.parent.resolve() if config_path is not None else Path.cwd()]
    named = [*config.model.code()]
    if config.distributed.parallelize:
        named.append(("the parallelize function", config.distributed.parallelize))
    files = []
    for what, reference in named:
        module = reference.partition(":")[0]
        found = module_file(module, [*map(str, dirs), *(entry or os.getcwd() for entry in sys.path)])
        if found is not None:
            files.append((f"the module of {what} ({module})", found))
    return files, dirs


def module_file(name: str, search: list[str]) -> Path | None:
    """The file `import name` would load from the directories `search`, found by the import system's own finder
    without importing anything (not even the parent packages, whose __init__ is the model's code)."""
    from importlib.machinery import PathFinder

    parts = name.split(".")
    locations: list[str] | None = search
    spec = None
    for depth in range(1, len(parts) + 1):
        if locations is None:
            return None  # a module is no package: nothing below it
        spec = PathFinder.find_spec(".".join(parts[:depth]), locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
    if spec is None or not spec.has_location or not spec.origin:
        return None
    return Path(spec.origin)


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held (blocked, not lost) while a temporary file exists beside an output: one that
    arrives then is delivered when the block ends, the temporary file removed or renamed by then, so an interruption
    never leaves one behind (a handler that raises between creating the file and the `try` that removes it would).
    Where signals cannot be held (no pthread_sigmask), the block's own cleanup is all there is."""
    import signal

    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - every POSIX Python has it
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def probe_directory(directory: Path, label: str) -> None:
    """Create and remove a temporary file where the output will be written: the one test that holds for every
    reason a write can fail (permissions, a read-only file system, root or not)."""
    with signals_held():
        try:
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".fwdcheck-probe.", suffix=".tmp")
        except OSError as exc:
            raise UsageError(f"{label}: cannot write there ({why_not(exc)})") from None
        try:
            os.close(fd)
        finally:
            Path(probe).unlink(missing_ok=True)


def isatty(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # a closed stream
        return False


def write_stdout(write) -> None:
    """write(stream) with the report, then a flush: a closed stdout, a reader gone (a broken pipe) or a full disk
    becomes one UsageError line, not a traceback after the run."""
    stream = sys.stdout
    if stream is None:  # Python's stand-in for a closed descriptor 1
        raise UsageError("stdout is closed: the report has nowhere to go (give --output FILE)")
    try:
        write(stream)
        stream.flush()
    except BrokenPipeError:  # the reader had what it wanted (`| head`): not an error, the exit code stands
        silence_stdout()
    except (OSError, ValueError) as exc:  # ValueError: a closed file object
        silence_stdout()
        raise UsageError(f"cannot write the report to stdout ({why_not(exc)}); give --output FILE") from None


def silence_stdout() -> None:
    """Point descriptor 1 at /dev/null once a write to it failed: Python flushes stdout again on the way out, and
    would print its own traceback for the same failure."""
    try:
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (AttributeError, OSError, ValueError):  # no descriptor behind it (a test runner's buffer)
        pass


def write_whole(path: Path, text: str, what: str = "--output") -> None:
    """Write a report where `path` says, whole or not at all.

    A regular file (new, or the target of a symbolic link, which stays a link) is written to a temporary file beside
    it and renamed over it. A device, a FIFO or one of the process's own streams is written directly (see Target).
    `what` names the target in error messages ("--output PATH", or the bare path for `init`). A target that cannot
    be written is a usage error, exit 2."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    target = output_target(path, label)
    if target.direct:
        try:
            # append: never truncate what the shell set up (`>> log` behind /dev/stdout); devices and FIFOs ignore it
            with open(target.path, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            raise UsageError(f"{label}: cannot write there ({why_not(exc)})") from None
        return
    with signals_held():  # an interruption lands before the temporary file exists or after it is renamed
        try:
            fd, tmp = tempfile.mkstemp(dir=target.path.parent, prefix=f".{target.path.name}.", suffix=".tmp")
        except OSError as exc:
            raise UsageError(f"{label}: cannot write there ({why_not(exc)})") from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            # mkstemp creates the file 0600; give it the mode an ordinary open() would (umask), or the replaced
            # file's.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, target.path.stat().st_mode & 0o7777 if target.path.exists() else 0o666 & ~umask)
            os.replace(tmp, target.path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise UsageError(f"{label}: cannot write there ({why_not(exc)})") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
