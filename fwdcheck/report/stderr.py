"""What the command line writes on stderr: an expected error as one red line (its traceback first with --debug),
fwdcheck's own bug, an interruption; the console every command writes its errors and warnings on."""

from __future__ import annotations

import traceback

from rich.console import Console
from rich.markup import escape

from fwdcheck.errors import ExitCode, FwdcheckError, exception_text

# soft_wrap: an error is one line even when stderr is a file or a pipe (rich would wrap it at 80 columns there).
err = Console(stderr=True, highlight=False, soft_wrap=True)


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
