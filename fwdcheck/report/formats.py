"""The report of a run in each output format: the terminal report (rich), drawn on stdout or recorded for export
as text, HTML and SVG, and the text formats (JSON, JUnit, GitHub, markdown), each a row of TEXT_RENDERERS.

Adding a renderer: a module in fwdcheck/report/ taking a Report, a `Format` value and its row in TEXT_RENDERERS.
Nothing heavy is imported here: each renderer's module is imported when its format is asked for.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.markup import escape

from fwdcheck.report.outputs import isatty
from fwdcheck.report.stream_text import rendering_buffer


class Format(str, Enum):
    rich = "rich"
    json = "json"
    junit = "junit"
    github = "github"
    markdown = "markdown"


class Verbosity(str, Enum):  # the terminal report's views (fwdcheck.report.terminal.Verbosity)
    quiet = "quiet"
    default = "default"
    verbose = "verbose"


class RunReports(Protocol):
    """What the renderers draw of one `fwdcheck run` (the command line's Outcome): each config's report, the configs
    that could not run, and the exit code of them all."""

    @property
    def several(self) -> bool: ...
    @property
    def reports(self) -> list: ...
    @property
    def not_run(self) -> list[dict]: ...
    @property
    def exit_code(self) -> int: ...


class StdoutConsole(Console):
    """rich ends the process with exit 1 when the reader of stdout goes away; here that is write_stdout's to
    handle (the run's exit code stands)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def report_width(stream) -> int | None:
    """A terminal's own width; elsewhere COLUMNS when set (rich reads it), else 120 (a CI log is wide)."""
    return None if isatty(stream) or os.environ.get("COLUMNS", "").isdigit() else 120


def render_stdout(outcome: RunReports, stream, verbosity: Verbosity, debug: bool) -> None:
    """The terminal report on stdout. On a terminal, as rich draws it for the window. Off one (a pipe, a file, a CI
    log) every text is whole, and no line ends in the spaces rich pads a table's lines with."""
    if isatty(stream):
        render_terminal(outcome, StdoutConsole(file=stream), verbosity, debug)
        return
    buffer = rendering_buffer(stream)  # rich draws what the stream holds (ASCII boxes on an ASCII stream)
    render_terminal(outcome, Console(file=buffer, width=report_width(stream)), verbosity, debug, terminal=False)
    stream.write(without_trailing_spaces(buffer.getvalue()))


def without_trailing_spaces(text: str) -> str:
    """Each line's trailing spaces gone, also before the style codes that end a coloured line."""
    return re.sub(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$", r"\1", text, flags=re.MULTILINE)


def render_terminal(
    outcome: RunReports, console: Console, verbosity: Verbosity, debug: bool, terminal: bool | None = None
) -> None:
    """Each config's terminal report; with several, a last line with each one's verdict and the exit code, and
    each quiet line led by its config's name."""
    from fwdcheck.report.terminal import render

    given = [str(r.config_path or r.model.get("label", "?")) for r in outcome.reports]
    names = shortest_names(given + [str(n["config"]) for n in outcome.not_run])
    for i, report in enumerate(outcome.reports):
        if i and verbosity != Verbosity.quiet:
            console.print()
        name = names[given[i]] if outcome.several else None
        render(report, console, debug=debug, verbosity=verbosity.value, name=name, terminal=terminal)
    if outcome.several:
        each = [f"{names[g]} {r.verdict}" for g, r in zip(given, outcome.reports, strict=True)]
        each += [f"{names[str(n['config'])]} not run (exit {n['exit_code']})" for n in outcome.not_run]
        console.print(
            escape(f"{len(each)} configs: {', '.join(each)}") + f" → exit {outcome.exit_code}", soft_wrap=True
        )


def shortest_names(paths: list[str]) -> dict[str, str]:
    """Each path by the fewest of its last parts that tell it from the others: `fwdcheck.yaml` alone, but
    `models/a/fwdcheck.yaml` and `models/b/fwdcheck.yaml` as `a/fwdcheck.yaml` and `b/fwdcheck.yaml`."""
    parts = {p: Path(p).parts or (p,) for p in paths}
    names = {}
    for path, own in parts.items():
        others = [theirs for other, theirs in parts.items() if other != path]
        n = 1
        while n < len(own) and any(theirs[-n:] == own[-n:] for theirs in others):
            n += 1
        names[path] = Path(*own[-n:]).as_posix()
    return names


def html_page(outcome: RunReports) -> str:
    """rich's HTML page with a <title>: the configs and their verdicts, as a browser's tab and history name it."""
    from rich._export_format import CONSOLE_HTML_FORMAT

    given = [str(r.config_path or r.model.get("label", "?")) for r in outcome.reports]
    names = shortest_names(given)
    verdicts = ", ".join(dict.fromkeys(str(r.verdict) for r in outcome.reports))
    title = html.escape(f"fwdcheck {', '.join(names[g] for g in given)}: {verdicts}")
    title = title.replace("{", "{{").replace("}", "}}")  # the page is a str.format template
    return CONSOLE_HTML_FORMAT.replace("<head>\n", f"<head>\n<title>{title}</title>\n", 1)


def recorded(outcome: RunReports, verbosity: Verbosity, debug: bool, terminal: bool = True) -> Console:
    """The terminal report rendered into a recording console, for text, HTML and SVG export."""
    console = Console(file=io.StringIO(), record=True, width=120, force_terminal=True, color_system="truecolor")
    render_terminal(outcome, console, verbosity, debug, terminal=terminal)
    return console


def render_text(outcome: RunReports, fmt: Format) -> str:
    """The report in a text format. Several configs: JSON holds `reports` (each one config's report) and `not_run`,
    JUnit one testsuite per config, GitHub and markdown one after another."""
    return TEXT_RENDERERS[fmt](outcome)


def json_text(outcome: RunReports) -> str:
    from fwdcheck import __version__
    from fwdcheck.report.record import SCHEMA_VERSION

    reports = outcome.reports

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


def junit_text(outcome: RunReports) -> str:
    from fwdcheck.report.junit import to_junit

    return to_junit(*outcome.reports)


def github_text(outcome: RunReports) -> str:
    from fwdcheck.report.github import to_github

    return "".join(to_github(r) for r in outcome.reports)


def markdown_text(outcome: RunReports) -> str:
    from fwdcheck.report.markdown import to_markdown

    return "\n".join(to_markdown(r) for r in outcome.reports)


# Each text format's renderer, a row a format: a renderer's module is imported when its format is asked for, so that
# the command line answers --help without importing any. The rich format is the terminal report (render_stdout,
# recorded).
TEXT_RENDERERS: dict[Format, Callable[[RunReports], str]] = {
    Format.json: json_text,
    Format.junit: junit_text,
    Format.github: github_text,
    Format.markdown: markdown_text,
}
