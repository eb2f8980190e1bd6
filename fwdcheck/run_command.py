"""What `fwdcheck run` does once its command line is read (cli.py): every config read and validated with the
command line's choices before any model loads (its checks, the combinations no run can make, every output
writable and none a file the run reads), each config run in its supervised worker or as a rank of the user's
launcher, the reports written whole once the verdict is decided, and the exit code of them all.

Nothing heavy is imported at module level: the command line imports this module to answer `fwdcheck --help`.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from fwdcheck.errors import ExitCode, FwdcheckError, UsageError, about_config, exception_text
from fwdcheck.process.launched import launched_rank
from fwdcheck.report.formats import (
    Format,
    Verbosity,
    html_page,
    recorded,
    render_stdout,
    render_text,
    without_trailing_spaces,
)
from fwdcheck.report.outputs import (
    check_appended,
    check_outputs,
    isatty,
    model_code_files,
    why_not,
    write_stdout,
    write_whole,
)
from fwdcheck.report.stderr import err, one_line, print_error
from fwdcheck.report.stream_text import exact_for_xml

if TYPE_CHECKING:  # for annotations only: imported where they are used
    from fwdcheck.config.schema import Config
    from fwdcheck.process.events import Job


# The values `fwdcheck run`'s options take (cli.py offers them; RunOptions holds them).
class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    auto = "auto"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class FailOn(str, Enum):
    fail = "fail"
    warn = "warn"


DEFAULT_CONFIG = Path("fwdcheck.yaml")  # what `fwdcheck init` and the pre-commit hook write
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


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


def outputs_checked(o: RunOptions, plans: list[Planned]) -> None:
    """An unwritable report, or one over what the run reads (a config, a weights file, the model's code): refused
    now, before any model loads, not after the run."""
    outputs = [(option, getattr(o, attribute)) for option, attribute in OUTPUTS if getattr(o, attribute) is not None]
    outputs += [(flag, path) for flag, path in o.check_files.items() if file_flag(flag).writes]
    inputs = [i for p in plans for i in run_inputs(o, p.path, p.config)]
    model_code = [model_code_files(p.config, p.path) for p in plans]
    inputs += [file for files, _ in model_code for file in files]
    code_dirs = [directory for _, dirs in model_code for directory in dirs]
    check_outputs(outputs, inputs, to_stdout=o.output is None, code_dirs=code_dirs)
    summary = os.environ.get("GITHUB_STEP_SUMMARY") if o.format == Format.github else None
    if summary:  # appended to, after the reports
        check_appended(f"$GITHUB_STEP_SUMMARY {summary}", Path(summary), outputs, inputs)


def run_configs(o: RunOptions) -> int:
    """Every config planned before any model loads, each run, the reports written: the exit code of them all."""
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
    outputs_checked(o, plans)
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
    from fwdcheck.config.registry import file_flags

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
    """Read and validate one config with the command line's choices: its Job for the worker, which carries the run's
    plan (fwdcheck/run/plan.py) resolved here, once."""
    from fwdcheck.config.schema import config_for
    from fwdcheck.process.events import Job
    from fwdcheck.run.overrides import Overrides
    from fwdcheck.run.plan import RunPlan

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
    run_config = overrides.applied(config)
    refuse_impossible_runs(o, run_config, entries, expected)
    with about_config(path, ""):  # each check's options, before any model loads
        run_plan = RunPlan.made(run_config, entries, overrides)
    job = Job(
        config=str(path) if path is not None else None,
        factory=o.model,
        plan=run_plan,
        sys_path=[p for p in sys.path if p],
    )
    return Planned(path, config, job)


def planned_checks(o: RunOptions, path: Path | None, config) -> list:
    """The checks one config runs: --check narrows the config's own selection (a name outside it is refused), a
    distributed run starts with the checks that open one (the sharding check), and a check's file flag selects its
    check when it says so (--save-golden) or needs it selected (--save-ledger)."""
    from fwdcheck.config.registry import DIRECT, select, selected

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
    from fwdcheck.config.registry import info

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
            # XML keeps what the stream cannot hold as character references (the stream's handler writes the
            # nearest text, fwdcheck/report/stream_text.py); JSON is ASCII already
            xml = o.format == Format.junit
            attempt(write_stdout, lambda stream: stream.write(exact_for_xml(text, stream) if xml else text))
        else:
            attempt(write_whole, o.output, text)
    for path, fmt in ((o.json, Format.json), (o.junit, Format.junit), (o.markdown, Format.markdown)):
        if path is not None:
            attempt(write_whole, path, render_text(outcome, fmt), what=f"--{fmt.value}")
    if o.html is not None or o.svg is not None:  # artifacts to read later: every panel
        console = recorded(outcome, Verbosity.verbose, o.debug)
        if o.html is not None:
            page = console.export_html(clear=False, code_format=html_page(outcome))
            attempt(write_whole, o.html, page, what="--html")
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
