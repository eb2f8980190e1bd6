"""The command line: `fwdcheck run | list | explain | init`.

Nothing heavy is imported at module level: `fwdcheck --help` and `--version` answer without importing torch.
Expected problems print one red line and exit with their documented code; a traceback only with --debug.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
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
    seed: Annotated[Optional[int], typer.Option(help="Override the config's input seed.")] = None,
    output_format: Annotated[Format, typer.Option("--format", help="Report format.")] = Format.rich,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file "
                                                   "(whole or not at all) instead of stdout.")] = None,
    fail_on: Annotated[FailOn, typer.Option(help="Lowest status that makes the exit code 1.")] = FailOn.fail,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="future-token: perturb every position and draw "
                                             "the full leak map.")] = False,
    meta: Annotated[bool, typer.Option("--meta", help="Build on the meta device: the shape ledger of a model too "
                                       "big for this machine, no weights allocated.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Check a model's forward pass and exit with a code CI can gate on."""
    code = _guarded(lambda: _run(config, check, model, device, dtype, seed, output_format, output, fail_on,
                                 exhaustive, debug, meta), debug)
    raise typer.Exit(code)


def _run(config_path, checks, model_ref, device, dtype, seed, output_format, output, fail_on, exhaustive, debug,
         meta=False) -> int:
    from fwdcheck.config import config_from_dict, load_config
    from fwdcheck.model import load_model
    from fwdcheck.registry import select
    from fwdcheck.runner import run_model
    from fwdcheck.session import Settings

    if config_path is not None and model_ref is not None:
        raise UsageError("give either a config file or --model, not both")
    if config_path is None and model_ref is None:
        raise UsageError("give a config file (`fwdcheck init` writes one) or --model pkg.module:factory")
    if config_path is not None:
        config = load_config(config_path)
    else:
        config = config_from_dict({"model": {"source": "python", "factory": model_ref}})
    selection = checks if checks else config.checks
    if checks:
        select(checks)  # an unknown name is reported as unknown (with the known ones), not as outside the config
    if checks and config.checks:
        outside = [c for c in checks if c not in config.checks and ":" not in c]  # module:Class is explicit
        if outside:
            raise UsageError(f"--check {outside[0]} is not among the config's checks ({', '.join(config.checks)})")
    entries = select(selection)
    config.meta = meta or config.meta
    settings = Settings.from_config(config)
    settings.device = device.value if device else settings.device
    settings.dtype = dtype.value if dtype else settings.dtype
    settings.seed = seed if seed is not None else settings.seed
    settings.exhaustive = exhaustive or settings.exhaustive
    loaded = load_model(config)
    report = run_model(loaded, settings, entries, config_path=config_path, fail_on=fail_on.value)

    from fwdcheck.report.terminal import render

    if output_format == Format.json:
        import json

        text = json.dumps(report.to_dict(), indent=2, default=str) + "\n"
        if output is None:
            sys.stdout.write(text)
        else:
            write_whole(output, text)
    else:
        if output is None:
            render(report, Console(width=None if sys.stdout.isatty() else 120), debug=debug)
        else:  # into the file only, as --output promises: "instead of stdout"
            import io

            console = Console(file=io.StringIO(), record=True, width=120)
            render(report, console, debug=debug)
            write_whole(output, console.export_text(styles=False))
    return report.exit_code


def _guarded(action, debug: bool) -> int:
    """Expected errors: one line and their code. Ctrl-C: 130. Anything else is ours: exit 3."""
    try:
        return action()
    except FwdcheckError as exc:
        if debug:
            err.print(traceback.format_exc(), style="dim")
        err.print(f"[bold red]error:[/] {escape(str(exc))}")  # paths, names: not markup
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug of fwdcheck's
        if debug:
            err.print(traceback.format_exc(), style="dim")
        err.print(f"[bold magenta]internal error:[/] {type(exc).__name__}: {escape(str(exc))} — this is a bug in "
                  "fwdcheck; please report it with the output of --debug")
        return EXIT_INTERNAL


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


@app.command(epilog=EXIT_CODES)
def shrink(
    config: Annotated[Path, typer.Argument(help="YAML config with source hf or reference, e.g. the real config of "
                                           "the model you are about to train.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where to write the shrunk config; "
                                                   "default: CONFIG's stem + .shrunk.yaml beside it.",
                                                   show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Write a config of the same architecture with 2 layers and small widths, so every check runs in seconds."""
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


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # outside a command's own guard
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":  # pragma: no cover
    main()
