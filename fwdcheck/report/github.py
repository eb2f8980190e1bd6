"""GitHub Actions: workflow-command annotations on the model code, and a markdown job summary.

Messages are escaped as GitHub requires (% \\r \\n in the message; also : and , in properties). At most ten errors
and ten warnings are annotated; the rest are counted in a notice, and all of them are in the summary. A finding the
config ignores is a notice, marked with the config's reason: it still shows, and fails nothing.
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
    lines, left_out = [], {"error": 0, "warning": 0, "notice": 0}
    shown = {"error": 0, "warning": 0, "notice": 0}
    for result in report.results:
        for f in result.findings:
            kind = KIND.get(f.status)
            if kind is None:
                continue
            kind = "notice" if f.ignored else kind
            if shown[kind] == MAX_PER_KIND:
                left_out[kind] += 1
                continue
            shown[kind] += 1
            title = f"fwdcheck {result.name} {f.code}" + (" (ignored)" if f.ignored else "")
            properties = [f"title={escape_property(title)}"]
            if f.source and ":" in f.source:
                file, line = f.source.rsplit(":", 1)
                properties[:0] = [f"file={escape_property(annotation_path(file))}", f"line={escape_property(line)}"]
            where = f" (at {f.where})" if f.where else ""
            ignored = f" (ignored: {f.ignored})" if f.ignored else ""
            lines.append(f"::{kind} {','.join(properties)}::{escape_data(f.message + where + ignored)}")
    for kind, count in left_out.items():
        if count:
            lines.append(f"::notice title=fwdcheck::{count} more {kind}s are in the job summary and the report")
    lines.append(f"fwdcheck {report.verdict} (exit {report.exit_code})")
    return "\n".join(lines) + "\n"


def annotation_path(file: str) -> str:
    """The file as GitHub places annotations: relative to the repository's root ($GITHUB_WORKSPACE), not to the
    directory fwdcheck ran in (a step with `working-directory: models/`); as given outside Actions or the checkout."""
    workspace = os.environ.get("GITHUB_WORKSPACE")
    if not workspace:
        return file
    try:
        return (Path.cwd() / file).resolve().relative_to(Path(workspace).resolve()).as_posix()
    except (ValueError, OSError):
        return file


def append_step_summary(report: Report) -> bool:
    """Append the markdown summary to $GITHUB_STEP_SUMMARY when it is set; True when written."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return False
    with Path(target).open("a", encoding="utf-8") as f:
        f.write(to_markdown(report) + "\n")
    return True
