"""The command line: `fwdcheck run | list | explain | init`.

Nothing heavy is imported at module level: `fwdcheck --help` and `--version` answer without importing torch.
Expected problems print one red line and exit with their documented code; a traceback only with --debug.
"""

from __future__ import annotations

import difflib
import io
import json
import os
import re
import sys
import traceback
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from fwdcheck import __version__
from fwdcheck.errors import ExitCode, FwdcheckError, UsageError, about_config, exception_text
from fwdcheck.model.sources import starter_config, starters
from fwdcheck.process.launched import launched_rank
from fwdcheck.report.outputs import (
    check_appended,
    check_outputs,
    isatty,
    model_code_files,
    silence_stdout,
    why_not,
    write_stdout,
    write_whole,
)
from fwdcheck.report.prose import paragraphs

if TYPE_CHECKING:  # for annotations only: the commands import these where they use them
    from fwdcheck.config.schema import Config
    from fwdcheck.process.events import Job

EXIT_CODES = """\b
Exit codes:
  0    every selected check passed (warnings too, unless --fail-on warn)
  1    a check failed, or errored: the model raised, hung or died
  2    usage or configuration error, or a model that cannot be built
  3    internal error of fwdcheck (please report it, with --debug output)
  5    nothing ran: every selected check skipped
  130  interrupted (Ctrl-C); 143 terminated (SIGTERM): the partial report
       is still written"""

app = typer.Typer(
    name="fwdcheck",
    help="Forward-pass sanity checks for transformer code: causal leaks, mask conventions, RoPE, shapes.",
    epilog=EXIT_CODES,
    add_completion=False,
    no_args_is_help=True,
    # Click's own help layout: flags shown without a type, paragraphs wrapped to the terminal (typer's rich panels
    # print `--exhaustive <bool>` for a flag that takes no value, and keep the docstrings' line breaks).
    rich_markup_mode=None,
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
    version: Annotated[
        bool | None,
        typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """Forward-pass sanity checks for transformer code."""


class Verbosity(str, Enum):  # the terminal report's views (fwdcheck.report.terminal.Verbosity)
    quiet = "quiet"
    default = "default"
    verbose = "verbose"


DEFAULT_CONFIG = Path("fwdcheck.yaml")  # what `fwdcheck init` and the pre-commit hook write
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


class RunCommand(TyperCommand):
    """`fwdcheck run`: its help lists, after its own options, the flags the registered checks contribute
    (Check.flags, as pytest's addoption), read from the registry only when the help is shown."""

    def format_epilog(self, ctx, formatter) -> None:
        from fwdcheck.registry import command_line_flags, file_flags

        try:
            flags, files = command_line_flags(), list(file_flags().values())
        except FwdcheckError:  # no check registered: `run` says so itself
            flags, files = [], []
        rows = [(f.flag if f.annotation is bool else f"{f.flag} VALUE", f.help) for f in flags]
        rows += [(f"{f.flag} PATH", f"{f.check}: {f.help}") for f in files]
        if rows:
            with formatter.section("Options the checks add"):
                formatter.write_dl(rows)
        super().format_epilog(ctx, formatter)


def _own_options() -> list[str]:
    """`run`'s own option names, for a did-you-mean."""
    command = typer.main.get_command(app)
    run_command = getattr(command, "commands", {}).get("run", command)
    return [name for param in run_command.params for name in getattr(param, "opts", []) if name.startswith("--")]


@dataclass
class CheckFlags:
    """What `run`'s arguments hold beside its own options: the configs, and what the checks' flags say."""

    configs: list[Path] = field(default_factory=list)
    options: dict[str, dict] = field(default_factory=dict)  # check name -> the options its flags set (Check.flags)
    files: dict[str, Path] = field(default_factory=dict)  # file flag (Check.files) -> the path given


def split_check_flags(items: list[str]) -> CheckFlags:
    """The configs and the checks' flags. `run` takes options it does not know as arguments (click's
    ignore_unknown_options) and hands them here: a flag a check declares sets its option (a value flag takes the
    next argument, or `--flag=value`; pydantic types it when the options are validated), a file flag takes a path,
    any other is an unknown option, named with a did-you-mean."""
    found = CheckFlags()
    if not any(item.startswith("-") for item in items):
        found.configs = [Path(item) for item in items]
        return found
    from fwdcheck.registry import command_line_flags, file_flags

    declared = {flag.flag: flag for flag in command_line_flags()}
    files = file_flags()
    rest = iter(items)
    for item in rest:
        if not item.startswith("-") or item == "-":
            found.configs.append(Path(item))
            continue
        name, equals, value = item.partition("=")
        flag = declared.get(name)
        if flag is None and name not in files:
            close = difflib.get_close_matches(name, [*declared, *files, *_own_options()], n=1)
            raise UsageError(f"no such option: {name}" + (f" (did you mean {close[0]}?)" if close else ""))
        if flag is not None and flag.annotation is bool:
            if equals:
                raise UsageError(f"{name} takes no value")
            given: object = True
        else:
            given = value if equals else next(rest, None)
            if given is None or (flag is None and not given):
                raise UsageError(f"{name} needs a value")
        if flag is None:
            found.files[name] = Path(str(given))
            continue
        for check, option in flag.targets:
            found.options.setdefault(check, {})[option] = given
    return found


@app.command(
    cls=RunCommand,
    epilog=EXIT_CODES,
    context_settings={"ignore_unknown_options": True},
    help="Check a model's forward pass and exit with a code CI can gate on.\n\n"
    "With no CONFIG, ./fwdcheck.yaml. Several configs make one report and one exit code, the worst. The "
    "model runs in a process of its own: what it prints goes to stderr, and whether it exits, hangs past "
    "timeout_s or crashes, the report is written and the exit code is fwdcheck's.",
)
def run(
    configs: Annotated[
        list[Path] | None,
        typer.Argument(metavar="CONFIG", show_default=False, help="YAML configs (`fwdcheck init` writes one)."),
    ] = None,
    check: Annotated[
        list[str] | None,
        typer.Option(
            "--check", "-c", metavar="NAME", help="Run only this check (repeatable); narrows the config's selection."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", metavar="MODULE:FACTORY", help="A callable returning an nn.Module, instead of a config."
        ),
    ] = None,
    device: Annotated[Device | None, typer.Option(help="Override the config's device.")] = None,
    dtype: Annotated[DType | None, typer.Option(help="Override the config's dtype.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the config's input seed.")] = None,
    output_format: Annotated[
        Format, typer.Option("--format", help="Report format on stdout (or --output).")
    ] = Format.rich,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="Write the report to this file (whole or not at all) instead of stdout.",
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", metavar="PATH", help="Also write the JSON report here.")
    ] = None,
    junit_path: Annotated[
        Path | None, typer.Option("--junit", metavar="PATH", help="Also write JUnit XML here.")
    ] = None,
    markdown_path: Annotated[
        Path | None, typer.Option("--markdown", metavar="PATH", help="Also write a markdown report here.")
    ] = None,
    html_path: Annotated[
        Path | None,
        typer.Option("--html", metavar="PATH", help="Also export the terminal report (every panel) as HTML."),
    ] = None,
    svg_path: Annotated[
        Path | None, typer.Option("--svg", metavar="PATH", help="Also export the terminal report (every panel) as SVG.")
    ] = None,
    fail_on: Annotated[FailOn, typer.Option(help="Lowest status that makes the exit code 1.")] = FailOn.fail,
    meta: Annotated[
        bool,
        typer.Option(
            "--meta",
            help="Build on the meta device: the shape ledger of a model too "
            "big for this machine, no weights allocated.",
        ),
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            metavar="N",
            min=1,
            max=256,
            help="Run the model sharded across N processes (the config's distributed.nproc).",
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Every check's detail panel, passing ones too.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line: the verdict and what failed.")] = False,
    in_process: Annotated[
        bool,
        typer.Option(
            "--in-process",
            help="Run the model in this process, for a debugger "
            "or profiler; a model that exits, hangs or crashes then ends the run "
            "itself.",
        ),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    options = RunOptions(
        configs=configs or [],
        checks=check,
        model=model,
        device=device,
        dtype=dtype,
        seed=seed,
        format=output_format,
        output=output,
        json=json_path,
        junit=junit_path,
        markdown=markdown_path,
        html=html_path,
        svg=svg_path,
        fail_on=fail_on,
        check_flags={},
        check_files={},
        meta=meta,
        nproc=nproc,
        verbosity=Verbosity.quiet if quiet else Verbosity.verbose if verbose else Verbosity.default,
        in_process=in_process,
        debug=debug,
    )
    raise typer.Exit(_guarded(lambda: _run(options), debug))


@dataclass
class RunOptions:
    configs: list[Path]
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
    fail_on: FailOn
    check_flags: dict[str, dict]  # check name -> the options its flags set (RunCommand)
    check_files: dict[str, Path]  # a check's file flag (Check.files: --save-golden) -> the path given
    meta: bool
    nproc: int | None
    verbosity: Verbosity
    in_process: bool
    debug: bool


@dataclass
class Planned:
    """One config's run, validated before any model loads."""

    path: Path | None  # None: --model
    config: Config
    job: Job


def _run(o: RunOptions) -> int:
    flags = split_check_flags([str(path) for path in o.configs])
    o.configs, o.check_flags, o.check_files = flags.configs, flags.options, flags.files
    if o.configs and o.model is not None:
        raise UsageError("give either a config file or --model, not both")
    paths: list[Path | None] = list(o.configs) or ([None] if o.model is not None else [default_config()])
    if len(paths) > 1 and o.check_files:  # a saved contract is one model's
        raise UsageError(
            f"{' and '.join(o.check_files)} take{'s' if len(o.check_files) == 1 else ''} one config; give one"
        )
    if o.seed is not None and not SEED_RANGE[0] <= o.seed <= SEED_RANGE[1]:
        raise UsageError(f"--seed {o.seed}: out of range; a seed is between {SEED_RANGE[0]} and {SEED_RANGE[1]}")
    launched = launched_rank()
    if launched is not None:  # a rank of the user's launcher (torchrun, srun): it starts no rank of its own
        if o.nproc is not None:
            raise UsageError(
                f"--nproc starts ranks, but {launched.launcher} started this process as rank {launched.rank} of "
                f"{launched.world} already: leave --nproc out"
            )
        o.nproc = launched.world
    expected = read_expected(o.check_files)
    plans = [plan(o, path, expected) for path in paths]  # every config validated before any model loads
    outputs = [(option, getattr(o, attribute)) for option, attribute in OUTPUTS if getattr(o, attribute) is not None]
    outputs += [(flag, path) for flag, path in o.check_files.items() if file_flag(flag).writes]
    inputs = [i for p in plans for i in run_inputs(o, p.path, p.config)]
    model_code = [model_code_files(p.config, p.path) for p in plans]
    inputs += [file for files, _ in model_code for file in files]
    code_dirs = [directory for _, dirs in model_code for directory in dirs]
    # an unwritable report, or one over what the run reads: now, not after the run
    check_outputs(outputs, inputs, to_stdout=o.output is None, code_dirs=code_dirs)
    summary = os.environ.get("GITHUB_STEP_SUMMARY") if o.format == Format.github else None
    if summary:  # appended to, after the reports
        check_appended(f"$GITHUB_STEP_SUMMARY {summary}", Path(summary), outputs, inputs)
    outcome = Outcome(several=len(plans) > 1)
    reporting = launched is None or launched.rank == 0  # rank 0 writes the job's report, the other ranks nothing
    shown = reporting and o.format == Format.rich and o.output is None and isatty(sys.stdout)
    with progress_display(enabled=shown) as progress:
        for index, planned in enumerate(plans):
            try:
                if launched is None:
                    report = run_job(
                        planned.job,
                        progress,
                        in_process=o.in_process,
                        timeout_s=planned.config.timeout_s,
                        debug=o.debug,
                    )
                else:
                    report, code = run_as_rank(launched, index, planned, progress, o)
                    if report is None:  # rank 0 writes it; this rank keeps the job's exit code
                        outcome.written_by_rank_0.append(code)
                        continue
            except FwdcheckError as exc:
                if not outcome.several:
                    raise
                code = print_error(exc, o.debug)  # this config's line; the others still run
                outcome.not_run.append(
                    {"config": str(planned.path), "exit_code": code, "error": one_line(exception_text(exc))}
                )
                continue
            outcome.reports.append(report)
            if report.interrupted:
                break
    if not reporting:
        return outcome.exit_code
    with signals_deferred():  # the verdict is decided: a Ctrl-C now must not leave a report half written
        write_reports(outcome, o)
    return outcome.exit_code


def run_as_rank(launched, index: int, planned: Planned, progress, o: RunOptions):
    """One config's run as a rank of the user's launcher (fwdcheck/process/launched.py): rank 0 gets the job's report,
    the other ranks none; each the job's exit code."""
    from fwdcheck.process.launched import across_ranks, job_fields

    planned.job.launched = job_fields(launched, index)
    timeout_s = planned.config.timeout_s
    report, code = across_ranks(
        launched,
        index,
        timeout_s,
        lambda: run_job(planned.job, progress, in_process=o.in_process, timeout_s=timeout_s, debug=o.debug),
    )
    declared = planned.config.distributed.nproc
    if report is not None and declared not in (1, launched.world):  # the launcher's count is the job's
        report.notes.append(
            f"distributed.nproc {declared} in the config is not read under a launcher: {launched.launcher} "
            f"started {launched.world} ranks"
        )
    return report, code


@dataclass
class Outcome:
    """What one `fwdcheck run` made: each config's report, the configs that could not run (several configs only:
    one alone is its error line), and the exit code of them all."""

    several: bool
    reports: list = field(default_factory=list)
    not_run: list[dict] = field(default_factory=list)  # {"config", "exit_code", "error"}
    written_by_rank_0: list[int] = field(default_factory=list)  # on a launched rank but 0: each job's exit code

    @property
    def exit_code(self) -> int:
        codes = [r.exit_code for r in self.reports] + [n["exit_code"] for n in self.not_run]
        return worst_exit(codes + self.written_by_rank_0)


def default_config() -> Path:
    if not DEFAULT_CONFIG.is_file():
        raise UsageError(
            f"give a config file (there is no ./{DEFAULT_CONFIG}; `fwdcheck init` writes one) or "
            "--model pkg.module:factory"
        )
    return DEFAULT_CONFIG


def file_flag(flag: str):
    """The check's file flag (registry.FileFlag) of this name."""
    from fwdcheck.registry import file_flags

    return file_flags()[flag]


def read_expected(files: dict[str, Path]) -> dict[str, dict]:
    """The files the checks' reading flags name (--expect-golden), each read and validated before any config is
    planned: flag -> the document the check compares with."""
    return {
        flag: file_flag(flag).call("reads", path, f"{flag} {path}")
        for flag, path in files.items()
        if file_flag(flag).reads
    }


def plan(o: RunOptions, path: Path | None, expected: dict[str, dict]) -> Planned:
    """Read and validate one config with the command line's choices: its Job for the worker."""
    from fwdcheck.config.schema import config_for
    from fwdcheck.process.events import Job
    from fwdcheck.registry import check_options
    from fwdcheck.run.overrides import Overrides

    config = config_for(path, o.model)
    entries = planned_checks(o, path, config)
    overrides = Overrides(
        checks=[e.name for e in entries],
        device=o.device.value if o.device else None,
        dtype=o.dtype.value if o.dtype else None,
        seed=o.seed,
        options=o.check_flags,
        meta=o.meta,
        expected=expected,
        fail_on=o.fail_on.value,
        nproc=o.nproc,
    )
    refuse_impossible_runs(o, overrides.applied(config), entries, expected)
    with about_config(path, ""):  # each check's options, before any model loads
        check_options(overrides.applied(config).options, o.check_flags, entries)
    job = Job(
        config=str(path) if path is not None else None,
        factory=o.model,
        overrides=overrides,
        sys_path=[p for p in sys.path if p],
    )
    return Planned(path, config, job)


def planned_checks(o: RunOptions, path: Path | None, config) -> list:
    """The checks one config runs: --check narrows the config's own selection (a name outside it is refused), a
    distributed run starts with the checks that open one (the sharding check), and a check's file flag selects its
    check when it says so (--save-golden) or needs it selected (--save-ledger)."""
    from fwdcheck.registry import DIRECT, select, selected

    selection = o.checks if o.checks else config.checks
    # an unknown name is reported as unknown (with the known ones), not as outside the config
    named = select(o.checks) if o.checks else []
    if o.checks and config.checks:
        with about_config(path, "checks: "):
            in_config = [entry.name for entry in select(config.checks)]
        outside = [e.name for e in named if e.name not in in_config and e.distribution != DIRECT]
        if outside:
            raise UsageError(
                f"{path}: --check {outside[0]} is not among the config's checks ({', '.join(config.checks)})"
            )
    nproc = o.nproc or config.distributed.nproc
    mesh = config.distributed.mesh
    if mesh and nproc != config.distributed.nproc:  # the mesh's product is the config's nproc (config.Distributed)
        raise UsageError(
            f"{path or o.model}: --nproc {nproc} but distributed.mesh makes {config.distributed.nproc} ranks "
            f"({' x '.join(f'{name} {size}' for name, size in mesh.items())}); leave --nproc out"
        )
    with about_config(path if config.checks and not o.checks else None, "checks: "):
        entries = selected(selection, nproc)
    if nproc > 1 and not config.model.shards_itself and not config.distributed.parallelize:
        raise UsageError(
            f"{path or o.model}: distributed.parallelize is needed to run a {config.model.source} "
            "model on several processes: name a function (model, device_mesh) -> model that shards it"
        )
    for flag in o.check_files:
        does = file_flag(flag)
        if does.check in [e.name for e in entries]:
            continue
        if not does.selects:
            raise UsageError(f"{flag} needs the {does.check} check in the selection")
        entries += select([does.check])  # the flag is the selection: no config need name it
    return entries


def refuse_impossible_runs(o: RunOptions, run_config, entries: list, expected: dict[str, dict]) -> None:
    """The combinations no run can make, each one line: a check that runs on one process in a distributed run, the
    meta device sharded, a file flag of a check that needs values on the meta device, a file made for another run
    than this one (`run_config`, overrides in: a golden file made at other inputs)."""
    from fwdcheck.registry import info

    nproc = run_config.distributed.nproc
    for entry in entries if nproc > 1 else []:
        why = info(entry).one_process
        if why:
            raise UsageError(f"the {entry.name} check runs on one process: {why}")
    if nproc > 1 and run_config.meta:
        raise UsageError("--meta and a distributed run do not go together: sharding needs the weights' values")
    for flag in o.check_files:
        if run_config.meta and file_flag(flag).needs_values:
            raise UsageError(f"{flag} needs values; on the meta device only shapes exist")
    for flag, document in expected.items():
        file_flag(flag).call("fits", document, run_config, f"{flag} {o.check_files[flag]}")


# Which exit code wins when several configs ran: an interruption, then fwdcheck's own bug, then a config that could
# not run, then a failure, then nothing ran, then a pass.
EXIT_SEVERITY = (
    ExitCode.TERMINATED,
    ExitCode.INTERRUPTED,
    ExitCode.INTERNAL,
    ExitCode.USAGE,
    ExitCode.FAILED,
    ExitCode.NOTHING_RAN,
    ExitCode.OK,
)


def worst_exit(codes: list[int]) -> int:
    return min(codes, key=lambda code: EXIT_SEVERITY.index(code) if code in EXIT_SEVERITY else 0, default=ExitCode.OK)


@contextmanager
def signals_deferred():
    """Ctrl-C ignored while the reports are written (SIGTERM still ends the process)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_job(job, progress, *, in_process: bool, timeout_s: float | None, debug: bool):
    """The report of `job`: from a supervised worker process (fwdcheck/process/supervisor.py), or, with --in-process,
    from this one. Warnings of a run that could not be made are shown with --debug."""
    from fwdcheck.process.supervisor import run_supervised
    from fwdcheck.process.worker import execute

    try:
        if in_process:  # model code's prints still stay off a report on stdout
            with redirect_stdout(sys.stderr):
                return execute(job, progress=progress)
        return run_supervised(job, timeout_s=timeout_s, progress=progress)
    except BaseException as exc:
        if debug:
            for line in getattr(exc, "warning_notes", []):
                err.print(escape(line), style="dim")
        raise


def write_reports(outcome: Outcome, o: RunOptions) -> None:
    """The main report on stdout (or --output), then every extra file asked for; each file whole or not at all.
    Several configs make one report of each kind (their reports in order, and the combined exit code).

    One output that cannot be written does not keep the others from being written; the first failure is the error
    line (exit 2) once all were tried. The job summary ($GITHUB_STEP_SUMMARY) is an extra: it only warns."""
    failures: list[UsageError] = []

    def attempt(write, *args, **kwargs) -> None:
        try:
            write(*args, **kwargs)
        except UsageError as exc:
            failures.append(exc)

    if o.format == Format.rich:
        if o.output is None:
            attempt(write_stdout, lambda stream: render_stdout(outcome, stream, o.verbosity, o.debug))
        else:  # into the file only, as --output promises: "instead of stdout"
            text = recorded(outcome, o.verbosity, o.debug, terminal=False).export_text(styles=False)
            attempt(write_whole, o.output, without_trailing_spaces(text))
    else:
        text = render_text(outcome, o.format)
        if o.output is None:
            attempt(write_stdout, lambda stream: stream.write(text))
        else:
            attempt(write_whole, o.output, text)
    for path, fmt in ((o.json, Format.json), (o.junit, Format.junit), (o.markdown, Format.markdown)):
        if path is not None:
            attempt(write_whole, path, render_text(outcome, fmt), what=f"--{fmt.value}")
    if o.html is not None or o.svg is not None:  # artifacts to read later: every panel
        console = recorded(outcome, Verbosity.verbose, o.debug)
        if o.html is not None:
            attempt(write_whole, o.html, console.export_html(clear=False), what="--html")
        if o.svg is not None:
            attempt(write_whole, o.svg, console.export_svg(title="fwdcheck", clear=False), what="--svg")
    for flag, path in o.check_files.items():
        if file_flag(flag).writes:
            attempt(save_check_file, outcome.reports[0] if outcome.reports else None, flag, path)
    if o.format == Format.github:
        for report in outcome.reports:
            append_job_summary(report)
    if failures:
        more = len(failures) - 1
        first = failures[0]
        raise UsageError(
            f"{first}" + (f" (and {more} more output{'s' if more > 1 else ''} not written)" if more else "")
        )


def save_check_file(report, flag: str, path: Path) -> None:
    """The file a check's writing flag asks for (--save-golden), from the check's result; a UsageError when the
    check did not run."""
    does = file_flag(flag)
    result = next((r for r in report.results if r.name == does.check), None) if report else None
    text = does.call("writes", result, report) if result is not None else None
    if text is None:
        why = result.summary if result is not None else "not selected"
        raise UsageError(f"{flag} {path}: the {does.check} check did not run ({why})")
    write_whole(path, text, what=flag)


class StdoutConsole(Console):
    """rich ends the process with exit 1 when the reader of stdout goes away; here that is write_stdout's to
    handle (the run's exit code stands)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def report_width(stream) -> int | None:
    """A terminal's own width; elsewhere COLUMNS when set (rich reads it), else 120 (a CI log is wide)."""
    return None if isatty(stream) or os.environ.get("COLUMNS", "").isdigit() else 120


def render_stdout(outcome: Outcome, stream, verbosity: Verbosity, debug: bool) -> None:
    """The terminal report on stdout. On a terminal, as rich draws it for the window. Off one (a pipe, a file, a CI
    log) every text is whole, and no line ends in the spaces rich pads a table's lines with."""
    if isatty(stream):
        render_terminal(outcome, StdoutConsole(file=stream), verbosity, debug)
        return
    buffer = io.StringIO()
    render_terminal(outcome, Console(file=buffer, width=report_width(stream)), verbosity, debug, terminal=False)
    stream.write(without_trailing_spaces(buffer.getvalue()))


def without_trailing_spaces(text: str) -> str:
    """Each line's trailing spaces gone, also before the style codes that end a coloured line."""
    return re.sub(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$", r"\1", text, flags=re.MULTILINE)


def render_terminal(
    outcome: Outcome, console: Console, verbosity: Verbosity, debug: bool, terminal: bool | None = None
) -> None:
    """Each config's terminal report; with several, a last line with each one's verdict and the exit code, and
    each quiet line led by its config's name."""
    from fwdcheck.report.terminal import render

    for i, report in enumerate(outcome.reports):
        if i and verbosity != Verbosity.quiet:
            console.print()
        name = Path(report.config_path or report.model.get("label", "?")).name if outcome.several else None
        render(report, console, debug=debug, verbosity=verbosity.value, name=name, terminal=terminal)
    if outcome.several:
        each = [f"{Path(r.config_path or r.model.get('label', '?')).name} {r.verdict}" for r in outcome.reports]
        each += [f"{Path(n['config']).name} not run (exit {n['exit_code']})" for n in outcome.not_run]
        console.print(
            escape(f"{len(each)} configs: {', '.join(each)}") + f" → exit {outcome.exit_code}", soft_wrap=True
        )


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


def render_text(outcome: Outcome, fmt: Format) -> str:
    """The report in a text format. Several configs: JSON holds `reports` (each one config's report) and `not_run`,
    JUnit one testsuite per config, GitHub and markdown one after another."""
    reports = outcome.reports
    if fmt == Format.json:
        from fwdcheck import __version__
        from fwdcheck.report import SCHEMA_VERSION

        document = (
            {
                "schema_version": SCHEMA_VERSION,
                "fwdcheck_version": __version__,
                "exit_code": outcome.exit_code,
                "reports": [r.to_dict() for r in reports],
                "not_run": outcome.not_run,
            }
            if outcome.several
            else reports[0].to_dict()
        )
        return json.dumps(document, indent=2, default=str) + "\n"
    if fmt == Format.junit:
        from fwdcheck.report.junit import to_junit

        return to_junit(*reports)
    if fmt == Format.github:
        from fwdcheck.report.github import to_github

        return "".join(to_github(r) for r in reports)
    from fwdcheck.report.markdown import to_markdown

    return "\n".join(to_markdown(r) for r in reports)


def recorded(outcome: Outcome, verbosity: Verbosity, debug: bool, terminal: bool = True) -> Console:
    """The terminal report rendered into a recording console, for text, HTML and SVG export."""
    console = Console(file=io.StringIO(), record=True, width=120, force_terminal=True, color_system="truecolor")
    render_terminal(outcome, console, verbosity, debug, terminal=terminal)
    return console


@contextmanager
def progress_display(enabled: bool):
    """A transient progress line on a terminal; nothing when the output is a file, a pipe or a CI log."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True, console=err
    ) as bar:
        task = bar.add_task("loading", total=None)
        yield lambda description: bar.update(task, description=description)


def _guarded(action, debug: bool) -> int:
    """Expected errors: one line and their code. Ctrl-C: 130. Anything else is ours: exit 3."""
    try:
        return action()
    except FwdcheckError as exc:
        return print_error(exc, debug)
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        return ExitCode.INTERRUPTED
    except Exception as exc:  # a bug of fwdcheck's
        if debug:
            err.print(traceback.format_exc(), style="dim")
        message = escape(one_line(exception_text(exc)))
        err.print(
            f"[bold magenta]internal error:[/] {type(exc).__name__}: {message} — this is a bug in fwdcheck; "
            "please report it with the output of --debug"
        )
        return ExitCode.INTERNAL


def print_error(exc: FwdcheckError, debug: bool) -> int:
    """An expected error's one line on stderr (with --debug, the traceback first); its exit code."""
    if debug:  # an error made in the model's process carries that process's traceback
        err.print(getattr(exc, "detail", None) or traceback.format_exc(), style="dim")
    if exc.exit_code == ExitCode.INTERNAL:
        err.print(
            f"[bold magenta]internal error:[/] {escape(one_line(exception_text(exc)))} — this is a bug in "
            "fwdcheck; please report it with the output of --debug"
        )
    elif exc.exit_code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):
        err.print("[bold red]interrupted[/]")
    else:
        err.print(f"[bold red]error:[/] {escape(one_line(exception_text(exc)))}")  # paths, names: not markup
    return exc.exit_code


def one_line(message: str) -> str:
    """An error stays one line even when the exception's message does not (torch's C++ errors append their stack,
    a factory may raise a paragraph): the first line, and how much --debug would add; the model's text in it made
    safe for a terminal (fwdcheck/report/text.py)."""
    from fwdcheck.report.text import clean

    message = clean(message)
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message.strip()
    return f"{lines[0]} [{len(lines) - 1} more line{'s' if len(lines) > 2 else ''}: --debug shows them]"


# The outputs a run writes, as (option, RunOptions field): checked before the model loads, written after the run.
OUTPUTS = (
    ("--output", "output"),
    ("--json", "json"),
    ("--junit", "junit"),
    ("--markdown", "markdown"),
    ("--html", "html"),
    ("--svg", "svg"),
)


def run_inputs(o: RunOptions, config_path: Path | None, config) -> list[tuple[str, Path]]:
    """The files a run reads, named as an error would name them: no output may be written over one."""
    inputs: list[tuple[str, Path]] = []
    if config_path is not None:
        inputs.append(("the config file", Path(config_path)))
    inputs += [(f"the {flag} file", path) for flag, path in o.check_files.items() if file_flag(flag).reads]
    return inputs + config.model.files_read()


@app.command("list")
def list_checks() -> None:
    """List the registered checks: name, where each comes from, what it verifies."""
    from rich.table import Table

    def action():
        from fwdcheck.registry import available, info

        table = Table(box=None, pad_edge=False)
        table.add_column("check", no_wrap=True)
        table.add_column("from", no_wrap=True)  # a plugin's distribution and version, whole
        table.add_column("default", no_wrap=True)  # runs when a config names no checks
        table.add_column("what it verifies")
        for entry in available().values():
            try:
                about = info(entry)
                description, default = escape(about.description), "yes" if about.default else "no"
            except FwdcheckError as exc:
                description, default = f"[red]{escape(str(exc))}[/red]", "yes"
            # escaped: a label such as fwdcheck[rope] is text, not a rich markup tag
            table.add_row(escape(entry.name), escape(entry.label), default, description)
        console = Console()
        console.print(table)
        console.print(
            "A config without `checks:` runs the default ones; `checks: [default, NAME]` adds one, "
            "`checks: [all]` runs every check.",
            highlight=False,
            markup=False,
        )
        return 0

    raise typer.Exit(_guarded(action, False))


FINDING_CODE = re.compile(r"^[A-Z][A-Z0-9]*\d{3}$", re.IGNORECASE)  # FWD202, a plugin's ACME101


@app.command()
def explain(
    what: Annotated[
        str,
        typer.Argument(
            metavar="CHECK|CODE",
            help="A check name from `fwdcheck list`, or a finding code such as FWD202 (a plugin's too).",
        ),
    ],
) -> None:
    """What a check verifies, why it matters, what each finding code means, how to fix it; or one code's meaning."""
    from rich.table import Table

    def action():
        from fwdcheck.registry import available, info, select

        console = Console()
        if FINDING_CODE.match(what) and what not in available():
            explain_code(what.upper(), console)
            return 0
        entry = select([what])[0]
        about = info(entry)
        console.print(f"[bold]{escape(entry.name)}[/bold] ({escape(entry.label)}) — {escape(about.description)}\n")
        console.print(paragraphs(about.explain), highlight=False, markup=False)
        table = Table(box=None, pad_edge=False, title="finding codes", title_justify="left")
        table.add_column("code", no_wrap=True)
        table.add_column("meaning")
        for code, meaning in about.codes.items():
            table.add_row(escape(code), escape(meaning))
        console.print(table)
        options = options_table(entry, about.flags)
        if options is not None:
            console.print(f"\n[bold]options[/bold] (`options: {{{escape(entry.name)}: {{...}}}}` in a config)")
            console.print(options)
        return 0

    def explain_code(code: str, console: Console) -> None:
        from fwdcheck.errors import OWN_CODES
        from fwdcheck.registry import code_owners, info

        if code in OWN_CODES:
            console.print(escape(f"{code} (fwdcheck itself): {OWN_CODES[code]}"))
            return
        owner = code_owners().get(code)  # every registered check's, plugins' included
        if owner is None:
            raise UsageError(f"unknown finding code {code}; `fwdcheck explain CHECK` lists a check's codes")
        entry, meaning = owner
        console.print(f"[bold]{escape(code)}[/bold] ({escape(entry.name)}): {escape(meaning)}\n")
        console.print(paragraphs(info(entry).explain), highlight=False, markup=False)

    raise typer.Exit(_guarded(action, False))


def options_table(entry, flags: dict[str, str]):
    """A check's options as `explain` lists them (name, default, flag, meaning); None for a check without any."""
    from rich.table import Table

    from fwdcheck.registry import options_model

    model = options_model(entry)
    if model is None or not model.model_fields:
        return None
    flag_of = {option: flag for flag, option in flags.items()}
    table = Table(box=None, pad_edge=False)
    for column in ("option", "default", "flag", "meaning"):
        table.add_column(column, no_wrap=column != "meaning")
    for name, field_info in model.model_fields.items():
        table.add_row(
            escape(name),
            escape(repr(field_info.default)),
            escape(flag_of.get(name, "")),
            escape(field_info.description or ""),
        )
    return table


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="Where to write the starter config.")] = Path("fwdcheck.yaml"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    source: Annotated[
        str,
        typer.Option(
            "--source",
            "-s",
            metavar="SOURCE",
            help=f"The model source the config describes: {' | '.join(starters())}.",
        ),
    ] = "reference",
) -> None:
    """Write a commented starter config, valid as written, for one model source."""

    def action():
        text = starter_config(source, str(path))  # an unknown source is its one line before anything is written
        if path.exists() and not force:
            raise UsageError(f"{path} exists; pass --force to overwrite it")
        write_whole(path, text, what="")
        Console().print(escape(f"wrote {path}; run it with `fwdcheck run {path}`"))
        return 0

    raise typer.Exit(_guarded(action, False))


@app.command(
    epilog="Exit codes: 0 written · 2 usage error (a python or checkpoint config whose kwargs name no "
    "sizes, an existing output without "
    "--force, a config transformers cannot build) · 3 internal error of fwdcheck."
)
def shrink(
    config: Annotated[
        Path,
        typer.Argument(
            help="YAML config of any source, e.g. the real config of the model you are about to train.",
            show_default=False,
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Where to write the shrunk config; default: CONFIG's stem + .shrunk.yaml in the working directory.",
            show_default=False,
        ),
    ] = None,
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
        from fwdcheck.model.sources.shrink import default_output, shrink_file

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
        shown = ", ".join(map(str, value[:3])) + (
            f", … {len(value)} items" if len(value) > 4 else "".join(f", {v}" for v in value[3:])
        )
        return f"[{shown}]"
    return str(value)


class DiffFormat(str, Enum):
    rich = "rich"
    json = "json"


@app.command(
    "diff",
    epilog="Exit codes: 0 equal within tolerance · 1 they part (or a model raised) · 2 usage error "
    "(a config, names that do not match one to one, shapes that differ) · 3 internal error of fwdcheck.",
)
def diff_command(
    config_a: Annotated[
        Path,
        typer.Argument(
            metavar="A",
            help="The first implementation's config: its weights, inputs, dtype and device are used for both.",
            show_default=False,
        ),
    ],
    config_b: Annotated[
        Path,
        typer.Argument(
            metavar="B",
            help="The second implementation's config; its `diff: {rename: [...]}` maps A's names to its own.",
            show_default=False,
        ),
    ],
    rename: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            metavar="'PATTERN -> REPLACEMENT'",
            help="A regex rule mapping A's parameter and module names to B's, after B's config's own (repeatable).",
        ),
    ] = None,
    output_format: Annotated[
        DiffFormat,
        typer.Option("--format", help="The table (and, on a terminal, a plot of the difference by depth), or JSON."),
    ] = DiffFormat.rich,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Compare two implementations of one model, module by module: B gets A's weights, both run A's inputs, and the
    first pair of corresponding modules whose outputs part is named.

    Modules pair by name (after renaming), else by order among outputs of the same shape. A 2-D weight whose shape is
    its counterpart's transposed is transposed (GPT-2's Conv1D against nn.Linear). What the models print goes to
    stderr."""

    def action():
        from fwdcheck.config.rename import parse_rule
        from fwdcheck.config.schema import load_config

        configs = [load_config(config_a), load_config(config_b)]  # both validated before any model loads
        rules = []
        for text in [*configs[1].diff.rename, *(rename or [])]:
            try:
                rules.append(parse_rule(text))
            except ValueError as exc:  # a config's rules were checked as it loaded: these are --rename's
                raise UsageError(f"--rename '{text}': {exc}") from None
        from fwdcheck.process.events import Job
        from fwdcheck.process.supervisor import compare_supervised
        from fwdcheck.report.terminal import render_diff
        from fwdcheck.run.overrides import Overrides

        # Both models run in a supervised worker (its prints relayed to stderr), each step under A's timeout_s.
        job = Job(
            config=str(config_a),
            factory=None,
            overrides=Overrides(checks=[]),
            sys_path=[p for p in sys.path if p],
            compare_with=str(config_b),
            rename=list(rename or []),
        )
        result = compare_supervised(job, timeout_s=configs[0].timeout_s)
        if output_format == DiffFormat.json:
            write_stdout(lambda stream: stream.write(json.dumps(result, indent=2) + "\n"))
        else:
            write_stdout(
                lambda stream: render_diff(
                    result, StdoutConsole(file=stream, width=report_width(stream)), plot=isatty(stream)
                )
            )
        return result["exit_code"]

    raise typer.Exit(_guarded(action, debug))


@app.command()
def schema(
    json_report: Annotated[
        bool, typer.Option("--json-report", help="The schema of `--format json` reports (the default; the only one).")
    ] = True,
) -> None:
    """Print the JSON schema of `--format json` reports. Consumers must ignore fields they do not know."""

    def action():
        from fwdcheck.report.schema import JSON_REPORT_SCHEMA

        sys.stdout.write(json.dumps(JSON_REPORT_SCHEMA, indent=2) + "\n")
        return 0

    raise typer.Exit(_guarded(action, False))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # outside a command's own guard
        sys.exit(ExitCode.INTERRUPTED)
    except SystemExit as exc:
        # What a command printed may still sit in stdout's buffer: flush it here, where a failure (a full disk, a
        # reader gone) is still one line and exit 2, and not Python's traceback at shutdown.
        try:
            if sys.stdout is not None:
                sys.stdout.flush()
        except BrokenPipeError:  # the reader left early (`| head`): the exit code stands
            silence_stdout()
        except (OSError, ValueError) as flush_error:
            silence_stdout()
            err.print(f"[bold red]error:[/] {escape(f'cannot write to stdout ({why_not(flush_error)})')}")
            sys.exit(ExitCode.USAGE if exc.code in (0, None) else exc.code)
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
