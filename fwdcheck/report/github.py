"""GitHub Actions: workflow-command annotations on the model code, and a markdown job summary.

Messages are escaped as GitHub requires (% \\r \\n in the message; also : and , in properties). At most ten errors
and ten warnings are annotated; the rest are counted in a notice, and all of them are in the summary.
"""

from __future__ import annotations

import os
from pathlib import Path

from fwdcheck.report import Report
from fwdcheck.report.markdown import to_markdown
from fwdcheck.result import Status

MAX_PER_KIND = 10
KIND = {Status.FAIL: "error", Status.ERROR: "error", Status.WARN: "warning"}


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def to_github(report: Report) -> str:
    lines, left_out = [], {"error": 0, "warning": 0}
    shown = {"error": 0, "warning": 0}
    for result in report.results:
        for f in result.findings:
            kind = KIND.get(f.status)
            if kind is None or f.ignored:
                continue
            if shown[kind] == MAX_PER_KIND:
                left_out[kind] += 1
                continue
            shown[kind] += 1
            properties = [f"title={escape_property(f'fwdcheck {result.name} {f.code}')}"]
            if f.source and ":" in f.source:
                file, line = f.source.rsplit(":", 1)
                properties[:0] = [f"file={escape_property(file)}", f"line={escape_property(line)}"]
            where = f" (at {f.where})" if f.where else ""
            lines.append(f"::{kind} {','.join(properties)}::{escape_data(f.message + where)}")
    for kind, count in left_out.items():
        if count:
            lines.append(f"::notice title=fwdcheck::{count} more {kind}s are in the job summary and the report")
    verdict = {0: "passed", 1: "failed", 3: "internal error", 5: "nothing ran", 130: "interrupted"}[report.exit_code]
    lines.append(f"fwdcheck {verdict} (exit {report.exit_code})")
    return "\n".join(lines) + "\n"


def append_step_summary(report: Report) -> bool:
    """Append the markdown summary to $GITHUB_STEP_SUMMARY when it is set; True when written."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return False
    with Path(target).open("a", encoding="utf-8") as f:
        f.write(to_markdown(report) + "\n")
    return True
