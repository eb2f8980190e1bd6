"""The command line: `fwdcheck run | list | explain | init`.

Nothing heavy is imported at module level: `fwdcheck --help` and `--version` answer without importing torch.
Expected problems print one red line and exit with their documented code; a traceback only with --debug.
"""

from __future__ import annotations

import difflib
import io
import json
import re
import sys
import traceback
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from fwdcheck import __version__
from fwdcheck.config.dtypes import dtype_named
from fwdcheck.errors import ExitCode, FwdcheckError, Terminated, UsageError, exception_text, terminate_raises
from fwdcheck.model.sources import starter_config, starters
from fwdcheck.report.formats import (
    Format,
    StdoutConsole,
    Verbosity,
    report_width,
    without_trailing_spaces,
)
from fwdcheck.report.outputs import (
    isatty,
    silence_stdout,
    why_not,
    write_stdout,
    write_whole,
)
from fwdcheck.report.prose import paragraphs
from fwdcheck.report.stderr import err, one_line, print_error
from fwdcheck.report.stream_text import fit_stream
from fwdcheck.run_command import Device, DType, FailOn, RunOptions, run_configs

if TYPE_CHECKING:  # for annotations only: the commands import these where they use them
    pass

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


def _dtype(value: str) -> DType:
    """--dtype as a config's dtype: bf16 as bfloat16, the others refused naming what is taken."""
    try:
        return DType(dtype_named(value))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


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


class RunCommand(TyperCommand):
    """`fwdcheck run`: its help lists, after its own options, the flags the registered checks contribute
    (Check.flags, as pytest's addoption), read from the registry only when the help is shown."""

    def format_epilog(self, ctx, formatter) -> None:
        from fwdcheck.config.registry import applicability, command_line_flags, file_flags

        try:
            flags, files = command_line_flags(), list(file_flags().values())
            checks = applicability()
        except FwdcheckError:  # no check registered: `run` says so itself
            flags, files, checks = [], [], []
        if checks:
            # what a config without `checks:` runs, and when each applies: a model without what a check examines
            # gets a skip reading "does not apply: <reason>"
            with formatter.section("Checks (default: every check that applies; `checks:` or --check narrows)"):
                formatter.write_dl([(name, applies) for name, applies in checks])
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
    from fwdcheck.config.registry import command_line_flags, file_flags

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
    dtype: Annotated[
        DType | None,
        typer.Option(
            metavar="<float32|bfloat16|float16>",
            parser=_dtype,
            help="Override the config's dtype; bf16, fp16, fp32 and half are taken as in a config.",
        ),
    ] = None,
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


def _run(o: RunOptions) -> int:
    """The checks' flags read off the arguments (split_check_flags), then the run they and the options make."""
    flags = split_check_flags([str(path) for path in o.configs])
    o.configs, o.check_flags, o.check_files = flags.configs, flags.options, flags.files
    return run_configs(o)


def _guarded(action, debug: bool) -> int:
    """Expected errors: one line and their code. Ctrl-C: 130. Anything else is ours: exit 3."""
    try:
        return action()
    except FwdcheckError as exc:
        return print_error(exc, debug)
    except Terminated:  # SIGTERM, raised (terminate_raises): the way out cleaned up after itself
        err.print("[bold red]terminated[/]")
        return ExitCode.TERMINATED
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


def _printed(draw) -> None:
    """What a command prints on stdout, as a run's report is printed: on a terminal as rich draws it; elsewhere (a
    pipe, a file) whole lines without the spaces rich pads a table's lines with; a reader that goes away (`| head -1`)
    is no error."""

    def write(stream) -> None:
        if isatty(stream):
            draw(StdoutConsole(file=stream))
            return
        buffer = io.StringIO()
        draw(Console(file=buffer, width=report_width(stream)))
        stream.write(without_trailing_spaces(buffer.getvalue()))

    write_stdout(write)


@app.command("list")
def list_checks() -> None:
    """List the registered checks: name, where each comes from, what it verifies."""
    from rich.table import Table

    def action():
        from fwdcheck.config.registry import available, info

        table = Table(box=None, pad_edge=False)
        table.add_column("check", no_wrap=True)
        table.add_column("from", no_wrap=True)  # a plugin's distribution and version, whole
        table.add_column("default", no_wrap=True)  # runs when a config names no checks
        table.add_column("what it verifies")
        for entry in available().values():
            try:
                about = info(entry)
                description, default = escape(about.description), "yes" if about.default else "no"
                description += f"\n[dim]applies to: {escape(about.applies_when or 'every model')}[/dim]"
            except FwdcheckError as exc:
                description, default = f"[red]{escape(str(exc))}[/red]", "yes"
            # escaped: a label such as fwdcheck[rope] is text, not a rich markup tag
            table.add_row(escape(entry.name), escape(entry.label), default, description)

        def draw(console: Console) -> None:
            console.print(table)
            console.print(
                "A config without `checks:` runs the default ones, each where it applies (a model without what a "
                "check examines gets a skip: 'does not apply: <reason>'); `checks: [default, NAME]` adds one, "
                "`checks: [all]` runs every check.",
                highlight=False,
                markup=False,
            )

        _printed(draw)
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
        from fwdcheck.config.registry import available, info, select

        if FINDING_CODE.match(what) and what not in available():
            _printed(lambda console: explain_code(what.upper(), console))
            return 0
        entry = select([what])[0]
        about = info(entry)
        _printed(lambda console: explain_check(entry, about, console))
        return 0

    def explain_check(entry, about, console: Console) -> None:
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

    def explain_code(code: str, console: Console) -> None:
        from fwdcheck.config.registry import code_owners, info
        from fwdcheck.errors import OWN_CODES, Own

        if code in OWN_CODES:
            console.print(escape(f"{code} (fwdcheck itself): {OWN_CODES[code]}"))
            if code == Own.MODEL_RAISED:  # how to fix it: the model, or the call (a forward adapter)
                from fwdcheck.model.call_convention import FIX

                console.print()
                console.print(FIX, highlight=False, markup=False)
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

    from fwdcheck.config.registry import options_model

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
    epilog="Exit codes: 0 written, or nothing to shrink (the model is already small: nothing written) · 2 usage "
    "error (a python or checkpoint config whose kwargs name no sizes, an existing output without --force, a config "
    "transformers cannot build) · 3 internal error of fwdcheck · 4 still too big: the shrunk model keeps over 120M "
    "parameters in a part the rules do not cut (written when something was cut; nothing written when nothing was)."
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

    Cut: depth (2), head size (16), widths, vocabulary (512), learned position tables (256), in every sub-config.
    Weights are not carried. It lists each value it changed and, for a Hugging Face config, the parameters before
    and after; a model already small gets one line and nothing is written.
    """
    from rich.table import Table

    def action():
        from fwdcheck.model.sources.shrink import (
            MAX_SHRUNK_PARAMETERS,
            STILL_TOO_BIG,
            default_output,
            shrink_file,
        )

        target = output if output is not None else default_output(config)
        if target.exists() and target.resolve() == config.resolve():
            raise UsageError(f"{target} is the config being shrunk; give another --output")
        shrunk = shrink_file(config, target)
        console = Console()
        counted = shrunk.parameters
        limit = _parameters(MAX_SHRUNK_PARAMETERS)
        if not shrunk.cut:  # a copy would only be the original again
            if counted is not None and counted.too_big:
                console.print(
                    escape(
                        f"nothing to shrink that the rules can cut: {config} has {_parameters(counted.after)} "
                        f"parameters (over the limit of {limit}){_largest(counted)}; lower its sizes by "
                        "hand; nothing written"
                    ),
                    soft_wrap=True,
                )
                return STILL_TOO_BIG
            size = f" ({_parameters(counted.after)} parameters)" if counted is not None else ""
            console.print(
                escape(f"nothing to shrink: {config} is already small{size}; run it as it is: `fwdcheck run {config}`"),
                soft_wrap=True,
            )
            return 0
        if target.exists() and not force:
            raise UsageError(f"{target} exists; pass --force to overwrite it")
        write_whole(target, shrunk.text)
        title = f"shrunk {escape(str(config))}"
        if counted is not None and counted.before is not None:
            title += f": {_parameters(counted.before)} → {_parameters(counted.after)} parameters"
        elif counted is not None:
            title += f": {_parameters(counted.after)} parameters"
        table = Table(box=None, pad_edge=False, title=title, title_justify="left")
        table.add_column("key", no_wrap=True)
        table.add_column("old")
        table.add_column("new")
        for key, old, new in shrunk.changes:
            table.add_row(escape(key), escape(_shown(old)), escape(_shown(new)))
        console.print(table)
        for note in shrunk.notes:  # soft_wrap: paths stay whole, to copy
            console.print(escape(f"note: {note}"), soft_wrap=True)
        console.print(escape(f"wrote {target}; run it with `fwdcheck run {target}`"), soft_wrap=True)
        if counted is not None and counted.too_big:
            console.print(
                escape(
                    f"still too big: {_parameters(counted.after)} parameters after shrinking (over the limit of "
                    f"{limit}){_largest(counted)}; lower its sizes by hand in {target}"
                ),
                soft_wrap=True,
            )
            return STILL_TOO_BIG
        return 0

    raise typer.Exit(_guarded(action, debug))


def _parameters(count: int) -> str:
    """A parameter count in millions: 7,063M, 120M, 0.12M."""
    return f"{count / 1e6:,.0f}M" if count >= 10e6 else f"{count / 1e6:.2g}M"


def _largest(counted) -> str:
    """ ", most of it in model.vision_model (248M)", naming where the parameters the rules did not cut are."""
    if counted.largest is None:
        return ""
    name, count = counted.largest
    return f", most of it in {name} ({_parameters(count)}), which spells its sizes in a way shrink does not read"


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

        # Both models run in a supervised worker (its prints relayed to stderr), each step under A's timeout_s.
        job = Job(
            config=str(config_a),
            factory=None,
            plan=None,  # the worker reads both configs: a comparison is no run of checks
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
    for stream in (sys.stdout, sys.stderr):  # an ASCII-only stream gets the nearest text, not an encoding error
        fit_stream(stream)
    try:
        with terminate_raises():  # SIGTERM ends the command through its cleanup, not by the signal
            app()
    except Terminated:  # outside a command's own guard
        sys.exit(ExitCode.TERMINATED)
    except KeyboardInterrupt:
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
