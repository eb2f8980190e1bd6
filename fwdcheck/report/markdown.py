"""A markdown report: the summary table and every finding, for job summaries, pull-request comments and wikis."""

from __future__ import annotations

from fwdcheck.report import Report
from fwdcheck.result import Status

ICON = {Status.PASS: "✅", Status.WARN: "⚠️", Status.FAIL: "❌", Status.SKIP: "⏭️", Status.ERROR: "💥"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: Report) -> str:
    env = report.environment
    lines = [
        f"### fwdcheck {report.verdict}: {_cell(report.model.get('label', ''))}",
        "",
        f"{env.get('device')} · {env.get('dtype')} · B={env.get('batch_size')} T={env.get('seq_len')} · "
        f"seed {env.get('seed')} · torch {env.get('torch')}",
        "",
        "| check | status | summary |",
        "| --- | --- | --- |",
    ]
    for r in report.results:
        lines.append(f"| {r.name} | {ICON[r.status]} {r.status.value} | {_cell(r.summary)} |")
    findings = [(r.name, f) for r in report.results for f in r.findings if f.status not in (Status.PASS,)]
    if findings:
        lines += ["", "| check | code | status | message | where |", "| --- | --- | --- | --- | --- |"]
        for name, f in findings:
            status = f"{f.status.value} (ignored: {_cell(f.ignored)})" if f.ignored else f.status.value
            where = " ".join(x for x in (f.where, f"`{f.source}`" if f.source else None) if x)
            lines.append(f"| {name} | {f.code} | {status} | {_cell(f.message)} | {_cell(where)} |")
    for note in report.notes:
        lines.append(f"\n> {_cell(note)}")
    return "\n".join(lines) + "\n"
