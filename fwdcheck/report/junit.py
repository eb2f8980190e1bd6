"""JUnit XML: one <testsuite> per config, one <testcase> per check and per code-path cell, as CI systems read it."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from fwdcheck import __version__
from fwdcheck.report import Report
from fwdcheck.result import Finding, Status

OUTCOME = {Status.FAIL: "failure", Status.ERROR: "error", Status.SKIP: "skipped"}


def to_junit(*reports: Report) -> str:
    """One <testsuites> document: a <testsuite> per report (per config)."""
    suites = ET.Element("testsuites", name="fwdcheck")
    suites.extend(testsuite(report) for report in reports)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def testsuite(report: Report) -> ET.Element:
    name = report.config_path or report.model.get("label", "fwdcheck")
    cases = []
    for result in report.results:
        cases.append(_case(result.name, result.name, result.status, result.summary, result.findings, result.duration_s))
        for row in result.paths.rows if result.paths else ():  # each cell of the code-path matrix is a test of its own
            findings = [f for f in result.findings if f.code in row.codes]
            cases.append(_case(result.name, f"{result.name} [{row.path}]", row.status, row.summary, findings, 0.0))
    suite = ET.Element(
        "testsuite",
        name=str(name),
        tests=str(len(cases)),
        failures=str(sum(c.find("failure") is not None for c in cases)),
        errors=str(sum(c.find("error") is not None for c in cases)),
        skipped=str(sum(c.find("skipped") is not None for c in cases)),
        time=f"{sum(r.duration_s for r in report.results):.3f}",
    )
    properties = ET.SubElement(suite, "properties")
    env = report.environment
    for key, value in (
        ("fwdcheck", __version__),
        ("torch", env.get("torch")),
        ("python", env.get("python")),
        ("device", env.get("device")),
        ("dtype", env.get("dtype")),
        ("seed", env.get("seed")),
        ("model", report.model.get("label")),
    ):
        ET.SubElement(properties, "property", name=key, value=str(value))
    suite.extend(cases)
    return suite


def _case(check: str, name: str, status: Status, summary: str, findings: list[Finding], seconds: float) -> ET.Element:
    case = ET.Element("testcase", classname=f"fwdcheck.{check}", name=name, time=f"{seconds:.3f}")
    outcome = OUTCOME.get(status)
    if outcome:
        counted = [f for f in findings if f.status == status and f.ignored is None] or findings
        codes = ", ".join(sorted({f.code for f in counted}))
        element = ET.SubElement(
            case, outcome, message=f"{codes}: {summary}" if codes else summary, type=codes or status.value
        )
        if outcome != "skipped":
            element.text = "\n".join(_line(f) for f in findings)
    ignored = [f for f in findings if f.ignored]
    if ignored:
        ET.SubElement(case, "system-out").text = "\n".join(_line(f) for f in ignored)
    return case


def _line(f: Finding) -> str:
    parts = [f"{f.code} {f.status.value}: {f.message}"]
    if f.where:
        parts.append(f"at {f.where}")
    if f.source:
        parts.append(f"({f.source})")
    if f.ignored:
        parts.append(f"(ignored: {f.ignored})")
    return " ".join(parts)
