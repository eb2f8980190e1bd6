"""The Report of one run, and how it maps to an exit code. Renderers (terminal, json) only show it.

The record itself (fwdcheck/report/record.py) is what renderers read; Report adds the displays that call a renderer
(`str(report)`, `rich.print(report)`, `raise_for_failures`), so that no renderer imports the class that calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fwdcheck.report.record import ReportRecord

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult


class ChecksFailed(AssertionError):
    """Raised by Report.raise_for_failures(); an AssertionError so test runners show it as a failed assertion. Its
    `report` is the Report."""

    def __init__(self, message: str, report: Report):
        super().__init__(message)
        self.report = report


class Report(ReportRecord):
    """A run's record, shown: as the terminal report's text, as a rich renderable, or as a failed assertion."""

    def raise_for_failures(self) -> None:
        """Raise ChecksFailed unless the report is ok: one line per finding that failed it, with the model code's
        file:line. Under pytest the traceback stops at the caller's line: fwdcheck's own frame is hidden."""
        __tracebackhide__ = True  # pytest leaves this frame out of the failure's traceback
        if not self.ok:
            from fwdcheck.report.terminal import counted

            lines = []
            for r in counted(self):
                findings = [f for f in r.findings if f.status == r.status and not f.ignored]
                lines += [f"{r.name}: {r.status.value}: {r.summary}"] if not findings else []
                for f in findings:
                    at = " ".join(part for part in (f.module, f.source or f.where) if part)
                    lines.append(f"{r.name} {f.code}: {f.message}" + (f" (at {at})" if at else ""))
            raise ChecksFailed(f"fwdcheck: {self.verdict} (exit {self.exit_code})\n" + "\n".join(lines), self)

    def __str__(self) -> str:
        """The terminal report's text, as `fwdcheck run` writes it to a file: nothing cut, no colour."""
        import io

        from rich.console import Console

        from fwdcheck.report.terminal import render

        buffer = io.StringIO()
        render(self, Console(file=buffer, width=120, color_system=None), terminal=False)
        return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The terminal report, for `rich.print(report)` and a notebook's rich display."""
        from fwdcheck.report.terminal import parts

        yield from parts(self, terminal=console.is_terminal)
