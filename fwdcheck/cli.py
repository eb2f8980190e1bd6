"""The command line: `fwdcheck run | list | explain | init`.

Nothing heavy is imported at module level: `fwdcheck --help` and `--version` answer without importing torch.
Expected problems print one red line and exit with their documented code; a traceback only with --debug.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fwdcheck import __version__
from fwdcheck.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, FwdcheckError, UsageError

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
    with about_config(o.config):
        loaded = load_model(config)
    with about_config(o.config), \
            progress_display(enabled=o.format == Format.rich and o.output is None and sys.stdout.isatty()) as progress:
        report = run_model(loaded, settings, entries, config_path=o.config, fail_on=o.fail_on.value,
                           progress=progress)
    write_reports(report, o)
    return report.exit_code


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
    """The main report on stdout (or --output), then every extra file asked for; each file whole or not at all."""
    from fwdcheck.report.terminal import render

    if o.format == Format.rich:
        if o.output is None:
            render(report, Console(width=None if sys.stdout.isatty() else 120), debug=o.debug)
        else:  # into the file only, as --output promises: "instead of stdout"
            write_whole(o.output, recorded(report, o.debug).export_text(styles=False))
    else:
        text = render_text(report, o.format)
        if o.output is None:
            sys.stdout.write(text)
        else:
            write_whole(o.output, text)
        if o.format == Format.github:
            from fwdcheck.report.github import append_step_summary

            append_step_summary(report)
    for path, fmt in ((o.json, Format.json), (o.junit, Format.junit), (o.markdown, Format.markdown)):
        if path is not None:
            write_whole(path, render_text(report, fmt), what=f"--{fmt.value}")
    if o.html is not None or o.svg is not None:
        console = recorded(report, o.debug)
        if o.html is not None:
            write_whole(o.html, console.export_html(clear=False), what="--html")
        if o.svg is not None:
            write_whole(o.svg, console.export_svg(title="fwdcheck", clear=False), what="--svg")
    if o.save_ledger is not None:
        ledger = next((r for r in report.results if r.name == "shape-ledger"), None)
        if ledger is None or "entries" not in ledger.data:
            why = ledger.summary if ledger is not None else "not selected"
            raise UsageError(f"--save-ledger {o.save_ledger}: the shape ledger did not run ({why})")
        document = {"fwdcheck_ledger": 1, "model": report.model.get("label"), "dims": ledger.data.get("dims", {}),
                    "entries": [{k: e[k] for k in ("name", "shape", "dims", "dtype")} for e in ledger.data["entries"]]}
        write_whole(o.save_ledger, json.dumps(document, indent=2) + "\n", what="--save-ledger")


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
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--expect-ledger {path}: no such file (write one with --save-ledger)") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--expect-ledger {path}: not a readable JSON ledger ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("entries"), list) or not all(
            isinstance(e, dict) and "name" in e and "dims" in e for e in document["entries"]):
        raise UsageError(f"--expect-ledger {path}: not a ledger written by --save-ledger")
    return document


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
        err.print(f"[bold red]error:[/] {escape(one_line(str(exc)))}")  # paths, names: not markup
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug of fwdcheck's
        if debug:
            err.print(traceback.format_exc(), style="dim")
        err.print(f"[bold magenta]internal error:[/] {type(exc).__name__}: {escape(one_line(str(exc)))} — this is a "
                  "bug in fwdcheck; please report it with the output of --debug")
        return EXIT_INTERNAL


def one_line(message: str) -> str:
    """An error stays one line even when the exception's message does not (torch's C++ errors append their stack,
    a factory may raise a paragraph): the first line, and how much --debug would add."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message.strip()
    return f"{lines[0]} [{len(lines) - 1} more line{'s' if len(lines) > 2 else ''}: --debug shows them]"


def write_whole(path: Path, text: str, what: str = "--output") -> None:
    """Write to a temporary file beside the target, then rename: the file is whole or untouched.

    `what` names the target in error messages ("--output PATH", or the bare path for `init`). A target that cannot be
    written (read-only or missing directory, a file where a directory should be) is a usage error, exit 2."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if path.is_dir():
        raise UsageError(f"{label} is a directory")
    if not path.parent.exists():
        raise UsageError(f"{label}: directory {path.parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"{label}: cannot write there ({type(exc).__name__}: {exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        # mkstemp creates the file 0600; give it the mode an ordinary open() would (umask), or the replaced file's.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"{label}: cannot write there ({type(exc).__name__}: {exc.strerror or exc})") from None
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


if __name__ == "__main__":  # pragma: no cover
    main()
