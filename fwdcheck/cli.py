"""The command line: `fwdcheck run | list | explain | init`.

Nothing heavy is imported at module level: `fwdcheck --help` and `--version` answer without importing torch.
Expected problems print one red line and exit with their documented code; a traceback only with --debug.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import stat
import sys
import tempfile
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fwdcheck import __version__
from fwdcheck.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE, FwdcheckError, UsageError

EXIT_CODES = """\
Exit codes: 0 every selected check passed (warnings allowed unless --fail-on warn) ·
1 a check failed, or errored because the model raised while being checked ·
2 usage or configuration error, including a model that cannot be built or loaded ·
3 internal error of fwdcheck (please report it, with --debug output) ·
5 nothing ran (every check skipped) · 130 interrupted."""

app = typer.Typer(
    name="fwdcheck",
    help="Forward-pass sanity checks for transformer code: causal leaks, mask conventions, RoPE, shapes.",
    epilog=EXIT_CODES,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
# soft_wrap: an error is one line even when stderr is a file or a pipe (rich would wrap it at 80 columns there).
err = Console(stderr=True, highlight=False, soft_wrap=True)


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    auto = "auto"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Format(str, Enum):
    rich = "rich"
    json = "json"
    junit = "junit"
    github = "github"
    markdown = "markdown"


class FailOn(str, Enum):
    fail = "fail"
    warn = "warn"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fwdcheck {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Forward-pass sanity checks for transformer code."""


@app.command(epilog=EXIT_CODES)
def run(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config (see `fwdcheck init`).", show_default=False)] = None,
    check: Annotated[Optional[list[str]], typer.Option("--check", "-c", help="Run only this check (repeatable); "
                                                       "narrows the config's selection.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="'pkg.module:factory' returning an nn.Module, "
                                                 "instead of a config.")] = None,
    device: Annotated[Optional[Device], typer.Option(help="Override the config's device.")] = None,
    dtype: Annotated[Optional[DType], typer.Option(help="Override the config's dtype.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Override the config's input seed.", min=-(2**63),
                                                max=2**64 - 1)] = None,
    output_format: Annotated[Format, typer.Option("--format", help="Report format on stdout (or --output).")] = Format.rich,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file "
                                                   "(whole or not at all) instead of stdout.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the JSON report here.")] = None,
    junit_path: Annotated[Optional[Path], typer.Option("--junit", help="Also write JUnit XML here.")] = None,
    markdown_path: Annotated[Optional[Path], typer.Option("--markdown", help="Also write a markdown report here.")] = None,
    html_path: Annotated[Optional[Path], typer.Option("--html", help="Also export the terminal report as HTML.")] = None,
    svg_path: Annotated[Optional[Path], typer.Option("--svg", help="Also export the terminal report as SVG.")] = None,
    save_ledger: Annotated[Optional[Path], typer.Option("--save-ledger", help="Write the shape ledger (JSON) here, "
                                                        "to pin the architecture in review.")] = None,
    expect_ledger: Annotated[Optional[Path], typer.Option("--expect-ledger", help="Fail (FWD405-407) when the "
                                                          "ledger differs from this saved one.")] = None,
    fail_on: Annotated[FailOn, typer.Option(help="Lowest status that makes the exit code 1.")] = FailOn.fail,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="future-token: perturb every position and draw "
                                             "the full leak map.")] = False,
    meta: Annotated[bool, typer.Option("--meta", help="Build on the meta device: the shape ledger of a model too "
                                       "big for this machine, no weights allocated.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Check a model's forward pass and exit with a code CI can gate on."""
    options = RunOptions(config, check, model, device, dtype, seed, output_format, output, json_path, junit_path,
                         markdown_path, html_path, svg_path, save_ledger, expect_ledger, fail_on, exhaustive, meta,
                         debug)
    raise typer.Exit(_guarded(lambda: _run(options), debug))


@dataclass
class RunOptions:
    config: Path | None
    checks: list[str] | None
    model: str | None
    device: Device | None
    dtype: DType | None
    seed: int | None
    format: Format
    output: Path | None
    json: Path | None
    junit: Path | None
    markdown: Path | None
    html: Path | None
    svg: Path | None
    save_ledger: Path | None
    expect_ledger: Path | None
    fail_on: FailOn
    exhaustive: bool
    meta: bool
    debug: bool


def _run(o: RunOptions) -> int:
    from fwdcheck.config import config_from_dict, load_config
    from fwdcheck.model import load_model
    from fwdcheck.registry import select
    from fwdcheck.runner import run_model
    from fwdcheck.session import Settings

    if o.config is not None and o.model is not None:
        raise UsageError("give either a config file or --model, not both")
    if o.config is None and o.model is None:
        raise UsageError("give a config file (`fwdcheck init` writes one) or --model pkg.module:factory")
    if o.config is not None:
        config = load_config(o.config)
    else:
        config = config_from_dict({"model": {"source": "python", "factory": o.model}})
    selection = o.checks if o.checks else config.checks
    if o.checks:
        select(o.checks)  # an unknown name is reported as unknown (with the known ones), not as outside the config
    if o.checks and config.checks:
        outside = [c for c in o.checks if c not in config.checks and ":" not in c]  # module:Class is explicit
        if outside:
            raise UsageError(f"--check {outside[0]} is not among the config's checks ({', '.join(config.checks)})")
    with about_config(o.config if config.checks and not o.checks else None, "checks: "):
        entries = select(selection)
    if (o.save_ledger or o.expect_ledger) and "shape-ledger" not in [e.name for e in entries]:
        raise UsageError("--save-ledger and --expect-ledger need the shape-ledger check in the selection")
    config.meta = o.meta or config.meta
    settings = Settings.from_config(config)
    settings.device = o.device.value if o.device else settings.device
    settings.dtype = o.dtype.value if o.dtype else settings.dtype
    settings.seed = o.seed if o.seed is not None else settings.seed
    settings.exhaustive = o.exhaustive or settings.exhaustive
    settings.expect_ledger = read_ledger(o.expect_ledger) if o.expect_ledger else None
    check_outputs(o, run_inputs(o, config))  # before the model loads: an unwritable report fails in a second
    # Warnings (torch's, a model's own) would land on stderr ahead of the report or of the one error line; they go
    # into the report's notes instead (shown with --debug on an error).
    with warnings.catch_warnings(record=True) as caught:
        try:
            with about_config(o.config):
                loaded = load_model(config)
            with about_config(o.config), progress_display(enabled=o.format == Format.rich and o.output is None
                                                          and _isatty(sys.stdout)) as progress:
                report = run_model(loaded, settings, entries, config_path=o.config, fail_on=o.fail_on.value,
                                   progress=progress)
        except BaseException:
            if o.debug:
                for line in warning_notes(caught):
                    err.print(escape(line), style="dim")
            raise
    report.notes += [n for n in warning_notes(caught) if n not in report.notes]
    write_reports(report, o)
    return report.exit_code


def warning_notes(caught: list[warnings.WarningMessage]) -> list[str]:
    """Each distinct warning once, as one line: `warning: UserWarning: ... (torch/serialization.py:2221)`."""
    notes: list[str] = []
    for w in caught:
        text = (exception_text(w.message).strip().splitlines() or [""])[0]
        note = f"warning: {w.category.__name__}: {text} ({Path(w.filename).name}:{w.lineno})"
        if note not in notes:
            notes.append(note)
    return notes


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


def write_reports(report, o: RunOptions) -> None:
    """The main report on stdout (or --output), then every extra file asked for; each file whole or not at all.

    One output that cannot be written does not keep the others from being written; the first failure is the error
    line (exit 2) once all were tried. The job summary ($GITHUB_STEP_SUMMARY) is an extra: it only warns."""
    from fwdcheck.report.terminal import render

    failures: list[UsageError] = []

    def attempt(write, *args, **kwargs) -> None:
        try:
            write(*args, **kwargs)
        except UsageError as exc:
            failures.append(exc)

    if o.format == Format.rich:
        if o.output is None:
            attempt(write_stdout, lambda stream: render(report, Console(file=stream, width=None if _isatty(stream)
                                                                        else 120), debug=o.debug))
        else:  # into the file only, as --output promises: "instead of stdout"
            attempt(write_whole, o.output, recorded(report, o.debug).export_text(styles=False))
    else:
        text = render_text(report, o.format)
        if o.output is None:
            attempt(write_stdout, lambda stream: stream.write(text))
        else:
            attempt(write_whole, o.output, text)
    for path, fmt in ((o.json, Format.json), (o.junit, Format.junit), (o.markdown, Format.markdown)):
        if path is not None:
            attempt(write_whole, path, render_text(report, fmt), what=f"--{fmt.value}")
    if o.html is not None or o.svg is not None:
        console = recorded(report, o.debug)
        if o.html is not None:
            attempt(write_whole, o.html, console.export_html(clear=False), what="--html")
        if o.svg is not None:
            attempt(write_whole, o.svg, console.export_svg(title="fwdcheck", clear=False), what="--svg")
    if o.save_ledger is not None:
        ledger = next((r for r in report.results if r.name == "shape-ledger"), None)
        if ledger is None or "entries" not in ledger.data:
            why = ledger.summary if ledger is not None else "not selected"
            failures.append(UsageError(f"--save-ledger {o.save_ledger}: the shape ledger did not run ({why})"))
        else:
            document = {"fwdcheck_ledger": 1, "model": report.model.get("label"), "dims": ledger.data.get("dims", {}),
                        "entries": [{k: e[k] for k in ("name", "shape", "dims", "dtype")}
                                    for e in ledger.data["entries"]]}
            attempt(write_whole, o.save_ledger, json.dumps(document, indent=2) + "\n", what="--save-ledger")
    if o.format == Format.github:
        append_job_summary(report)
    if failures:
        more = len(failures) - 1
        first = failures[0]
        raise UsageError(f"{first}" + (f" (and {more} more output{'s' if more > 1 else ''} not written)"
                                       if more else ""))


def append_job_summary(report) -> None:
    """GitHub's job summary is a courtesy on top of the reports: a file there that cannot be appended to (read-only,
    a directory, a full disk) is a warning line on stderr, never the run's exit code."""
    from fwdcheck.report.github import append_step_summary

    try:
        append_step_summary(report)
    except (OSError, ValueError) as exc:
        target = os.environ.get("GITHUB_STEP_SUMMARY", "")
        line = f"$GITHUB_STEP_SUMMARY {target}: cannot append the job summary ({why_not(exc)}); the reports are written"
        err.print(f"[bold yellow]warning:[/] {escape(line)}")


def render_text(report, fmt: Format) -> str:
    if fmt == Format.json:
        return json.dumps(report.to_dict(), indent=2, default=str) + "\n"
    if fmt == Format.junit:
        from fwdcheck.report.junit import to_junit

        return to_junit(report)
    if fmt == Format.github:
        from fwdcheck.report.github import to_github

        return to_github(report)
    from fwdcheck.report.markdown import to_markdown

    return to_markdown(report)


def recorded(report, debug: bool) -> Console:
    """The terminal report rendered into a recording console, for text, HTML and SVG export."""
    from fwdcheck.report.terminal import render

    console = Console(file=io.StringIO(), record=True, width=120, force_terminal=True, color_system="truecolor")
    render(report, console, debug=debug)
    return console


def read_ledger(path: Path) -> dict:
    from fwdcheck.config import ledger_from_dict, regular_file

    label = f"--expect-ledger {path}"
    regular_file(Path(path), label, UsageError, what="ledger")
    try:
        # NaN and Infinity are no JSON; Python's reader accepts them unless told not to. The ledger check refuses
        # them by type (a size is an integer), which names the key.
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{label}: no such file (write one with --save-ledger)") from None
    except RecursionError:
        raise UsageError(f"{label}: nested too deeply; not a ledger written by --save-ledger") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{label}: not a readable JSON ledger ({exc})") from None
    return ledger_from_dict(document, label)


@contextmanager
def progress_display(enabled: bool):
    """A transient progress line on a terminal; nothing when the output is a file, a pipe or a CI log."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True,
                  console=err) as bar:
        task = bar.add_task("loading", total=None)
        yield lambda description: bar.update(task, description=description)


def _guarded(action, debug: bool) -> int:
    """Expected errors: one line and their code. Ctrl-C: 130. Anything else is ours: exit 3."""
    try:
        return action()
    except FwdcheckError as exc:
        if debug:
            err.print(traceback.format_exc(), style="dim")
        err.print(f"[bold red]error:[/] {escape(one_line(exception_text(exc)))}")  # paths, names: not markup
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug of fwdcheck's
        if debug:
            err.print(traceback.format_exc(), style="dim")
        message = escape(one_line(exception_text(exc)))
        err.print(f"[bold magenta]internal error:[/] {type(exc).__name__}: {message} — this is a bug in fwdcheck; "
                  "please report it with the output of --debug")
        return EXIT_INTERNAL


def one_line(message: str) -> str:
    """An error stays one line even when the exception's message does not (torch's C++ errors append their stack,
    a factory may raise a paragraph): the first line, and how much --debug would add."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message.strip()
    return f"{lines[0]} [{len(lines) - 1} more line{'s' if len(lines) > 2 else ''}: --debug shows them]"


def exception_text(exc: BaseException) -> str:
    """str(exc), even for an exception whose __str__ itself raises (model code can hand us one)."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: its message cannot be shown>"


def why_not(exc: OSError | ValueError) -> str:
    """Why a write failed, in words: the OS's reason, 'disk full' said plainly."""
    reason = getattr(exc, "strerror", None) or exception_text(exc)
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full: {reason}"
    return reason


# The outputs a run writes, as (option, RunOptions field): checked before the model loads, written after the run.
OUTPUTS = (("--output", "output"), ("--json", "json"), ("--junit", "junit"), ("--markdown", "markdown"),
           ("--html", "html"), ("--svg", "svg"), ("--save-ledger", "save_ledger"))


@dataclass
class Target:
    """Where an output's bytes go. `path`: the file itself, with symbolic links followed (the link stays, its target
    is replaced). `direct`: written in place, not through a temporary file: a device (/dev/null, /dev/full), a FIFO,
    or one of the process's own streams (/dev/stdout, /dev/fd/N); replacing one of those would put a regular file
    where it was, or leave the reader of the stream with nothing."""

    path: Path
    direct: bool


_OWN_STREAM = re.compile(r"^/(dev|proc/[^/]+)/fd/\d+$|^/dev/std(out|err)$")


def _own_stream(path: Path) -> bool:
    """Whether the path reaches its file through /proc's descriptor links (/dev/stdout -> /proc/self/fd/1): the
    file behind them is whatever the shell opened, which only a write through the link itself reaches."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if _OWN_STREAM.match(current):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    return False


def output_target(path: Path, label: str) -> Target:
    """Where `path` writes, or one UsageError line saying why nothing can be written there."""
    path = Path(path)
    if _own_stream(path):
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


def run_inputs(o: RunOptions, config) -> list[tuple[str, Path]]:
    """The files a run reads, named as an error would name them: no output may be written over one."""
    from fwdcheck.config import CheckpointModel, HFModel

    inputs: list[tuple[str, Path]] = []
    if o.config is not None:
        inputs.append(("the config file", Path(o.config)))
    if o.expect_ledger is not None:
        inputs.append(("the --expect-ledger file", Path(o.expect_ledger)))
    model = config.model
    if isinstance(model, CheckpointModel):
        inputs.append(("the checkpoint", model.path))
        inputs += [("a checkpoint shard", shard) for shard in _shards(model.path)]
    elif isinstance(model, HFModel) and model.path is not None:
        from fwdcheck.hf import WEIGHT_FILES

        for name in ("config.json", *WEIGHT_FILES):
            inputs.append((f"the model's {name}", model.path / name))
            inputs += [("a weights shard of the model", shard) for shard in _shards(model.path / name)]
    return inputs


def _shards(index: Path) -> list[Path]:
    """The files a sharded checkpoint's index (*.index.json) names; nothing for any other file, or a broken one
    (the loader reports that)."""
    if not index.name.endswith(".index.json") or not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        return [index.parent / name for name in set(weight_map.values()) if isinstance(name, str)]
    except (OSError, ValueError, AttributeError, RecursionError):
        return []


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # one of them does not exist: not the same file
        return False


def check_outputs(o: RunOptions, inputs: list[tuple[str, Path]]) -> None:
    """Before the model loads: each output can be written, none is a file the run reads, no two are one file.
    Found at the end instead, an unwritable output would fail after the whole run, and an output naming the config
    would have replaced it with the report."""
    if o.output is None and sys.stdout is None:
        raise UsageError("stdout is closed: the report has nowhere to go (give --output FILE)")
    seen: list[tuple[str, Target]] = []
    for option, field in OUTPUTS:
        path = getattr(o, field)
        if path is None:
            continue
        label = f"{option} {path}"
        target = output_target(path, label)
        for name, input_path in inputs:
            if _same_file(target.path, input_path):
                raise UsageError(f"{label} is {name}; fwdcheck does not write a report over a file the run reads")
        for other, earlier in seen:
            if earlier.path == target.path or _same_file(earlier.path, target.path):
                if not (target.direct and earlier.direct):  # two reports into one stream (/dev/null) is fine
                    raise UsageError(f"{label} is also the file of {other}; give each report its own file")
        seen.append((option, target))
        if target.direct:
            if not os.path.exists(target.path):  # /dev/fd/N of a descriptor this process does not have open
                raise UsageError(f"{label}: cannot write there (no such file or open descriptor)")
            if not os.access(target.path, os.W_OK):
                raise UsageError(f"{label}: cannot write there (permission denied)")
        else:
            probe_directory(target.path.parent, label)


def probe_directory(directory: Path, label: str) -> None:
    """Create and remove a temporary file where the output will be written: the one test that holds for every
    reason a write can fail (permissions, a read-only file system, root or not)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".fwdcheck-probe.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"{label}: cannot write there ({why_not(exc)})") from None
    os.close(fd)
    Path(probe).unlink(missing_ok=True)


def _isatty(stream) -> bool:
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
    try:
        fd, tmp = tempfile.mkstemp(dir=target.path.parent, prefix=f".{target.path.name}.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"{label}: cannot write there ({why_not(exc)})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        # mkstemp creates the file 0600; give it the mode an ordinary open() would (umask), or the replaced file's.
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


@app.command("list")
def list_checks() -> None:
    """List the registered checks: name, where each comes from, what it verifies."""
    from rich.table import Table

    def action():
        from fwdcheck.registry import available

        table = Table(box=None, pad_edge=False)
        for column in ("check", "from", "what it verifies"):
            table.add_column(column)
        for entry in available().values():
            try:
                description = escape(entry.load().description)
            except FwdcheckError as exc:
                description = f"[red]{escape(str(exc))}[/red]"
            # escaped: a label such as fwdcheck[rope] is text, not a rich markup tag
            table.add_row(escape(entry.name), escape(entry.label), description)
        Console().print(table)
        return 0

    raise typer.Exit(_guarded(action, False))


@app.command()
def explain(check: Annotated[str, typer.Argument(help="A check name from `fwdcheck list`.")]) -> None:
    """What a check verifies, why it matters, what each finding code means, how to fix it."""
    from rich.table import Table

    def action():
        from fwdcheck.registry import select

        entry = select([check])[0]
        loaded = entry.load()
        console = Console()
        console.print(f"[bold]{escape(entry.name)}[/bold] ({escape(entry.label)}) — {escape(loaded.description)}\n")
        console.print(loaded.explain, highlight=False, markup=False)
        table = Table(box=None, pad_edge=False, title="finding codes", title_justify="left")
        table.add_column("code")
        table.add_column("meaning")
        for code, meaning in loaded.codes.items():
            table.add_row(escape(code), escape(meaning))
        console.print(table)
        return 0

    raise typer.Exit(_guarded(action, False))


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="Where to write the starter config.")] = Path("fwdcheck.yaml"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented starter config."""

    def action():
        from fwdcheck.config import STARTER_CONFIG

        if path.exists() and not force:
            raise UsageError(f"{path} exists; pass --force to overwrite it")
        write_whole(path, STARTER_CONFIG.format(name=path), what="")
        Console().print(escape(f"wrote {path}; run it with `fwdcheck run {path}`"))
        return 0

    raise typer.Exit(_guarded(action, False))


@app.command(epilog="Exit codes: 0 written · 2 usage error (a python or checkpoint source, an existing output without "
             "--force, a config transformers cannot build) · 3 internal error of fwdcheck.")
def shrink(
    config: Annotated[Path, typer.Argument(help="YAML config with source hf or reference, e.g. the real config of "
                                           "the model you are about to train.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where to write the shrunk config; "
                                                   "default: CONFIG's stem + .shrunk.yaml beside it.",
                                                   show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Write a config of the same architecture with 2 layers and small widths, so every check runs in seconds.

    For a model too big for this machine: `fwdcheck run --meta` checks its shapes, the shrunk config everything else.

    Kept: the query heads per kv head, RoPE settings, the sliding window (cut to 3), tied embeddings, planted bugs.

    Cut: depth (2), head size (16), widths, vocabulary (512), learned position tables (256). Weights are not carried.
    """
    from rich.table import Table

    def action():
        from fwdcheck.shrink import default_output, shrink_file

        target = output if output is not None else default_output(config)
        if target.exists() and target.resolve() == config.resolve():
            raise UsageError(f"{target} is the config being shrunk; give another --output")
        if target.exists() and not force:
            raise UsageError(f"{target} exists; pass --force to overwrite it")
        shrunk = shrink_file(config, target)
        write_whole(target, shrunk.text)
        console = Console()
        table = Table(box=None, pad_edge=False, title=f"shrunk {escape(str(config))}", title_justify="left")
        table.add_column("key", no_wrap=True)
        table.add_column("old")
        table.add_column("new")
        for key, old, new in shrunk.changes:
            table.add_row(escape(key), escape(_shown(old)), escape(_shown(new)))
        console.print(table)
        for note in shrunk.notes:  # soft_wrap: paths stay whole, to copy
            console.print(escape(f"note: {note}"), soft_wrap=True)
        console.print(escape(f"wrote {target}; run it with `fwdcheck run {target}`"), soft_wrap=True)
        return 0

    raise typer.Exit(_guarded(action, debug))


def _shown(value) -> str:
    """A config value in one short cell: long lists abbreviated, absence named."""
    if value is None:
        return "(unset)"
    if isinstance(value, list):
        shown = ", ".join(map(str, value[:3])) + (f", … {len(value)} items" if len(value) > 4 else
                                                 "".join(f", {v}" for v in value[3:]))
        return f"[{shown}]"
    return str(value)


@app.command()
def schema(
    json_report: Annotated[bool, typer.Option("--json-report", help="The schema of `--format json` reports.")] = False,
) -> None:
    """Print a JSON schema. Consumers of the JSON report must ignore fields they do not know."""

    def action():
        if not json_report:
            raise UsageError("say which schema: --json-report")
        from fwdcheck.report.schema import JSON_REPORT_SCHEMA

        sys.stdout.write(json.dumps(JSON_REPORT_SCHEMA, indent=2) + "\n")
        return 0

    raise typer.Exit(_guarded(action, False))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # outside a command's own guard
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit as exc:
        # What a command printed may still sit in stdout's buffer: flush it here, where a failure (a full disk, a
        # reader gone) is still one line and exit 2, and not Python's traceback at shutdown.
        try:
            if sys.stdout is not None:
                sys.stdout.flush()
        except (OSError, ValueError) as flush_error:
            silence_stdout()
            err.print(f"[bold red]error:[/] {escape(f'cannot write to stdout ({why_not(flush_error)})')}")
            sys.exit(EXIT_USAGE if exc.code in (0, None) else exc.code)
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
