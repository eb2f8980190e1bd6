"""docs/api.md, the Python API's reference, written from the code: `check_model`'s signature and docstring, and each
type a report hands back (Report, CheckResult, Finding, Status, ChecksFailed) with its fields' and members' types as
annotated and their docstrings (a dataclass field's, its comment in the source). `python -m tests.docs_pages --write`
rewrites it with the other generated pages; tests/test_docs.py fails when it drifts."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re

from fwdcheck.api import check_model
from fwdcheck.report import ChecksFailed, Report
from fwdcheck.report.record import ReportRecord
from fwdcheck.result import CheckResult, Finding, Status

LEAD = """# Python API

`fwdcheck.check_model(model)` runs the checks on any `nn.Module` and returns a `Report`; this page lists what it
takes and what the report holds, from the code's own types and docstrings (`python -m tests.docs_pages --write`
regenerates it).

```python
import fwdcheck

report = fwdcheck.check_model(model, vocab_size=32000)
report.ok  # True: exit code 0
codes = {f.code for r in report.failures for f in r.findings}  # failures are check results; findings have codes
report.raise_for_failures()  # in a test: one line per finding, at the model's line
print(report)  # the terminal report
```
"""

TYPES: list[type] = [Report, CheckResult, Finding, Status, ChecksFailed]


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def doc(obj: object) -> str:
    """The docstring's first paragraph, on one line."""
    text = inspect.getdoc(obj) or ""
    return cell(text.split("\n\n")[0])


def field_comments(cls: type) -> dict[str, str]:
    """`name: type = default  # comment` in the class's source: the comment, with the comment lines below it that go
    on (lower case); a comment line that starts a sentence (upper case) is the next field's."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        last, before = None, ""
        for line in inspect.getsource(klass).splitlines():
            field = re.match(r"    (\w+): [^#]*?(?:#\s*(.*))?$", line)
            comment = re.match(r"    #\s*(.*)$", line)
            if comment:
                text = comment.group(1)
                if last is not None and comments.get(last) and text[:1].islower():
                    comments[last] += " " + text
                else:
                    before, last = f"{before} {text}".strip(), None
            elif field and not line.strip().startswith(("def ", "@")):
                last = field.group(1)
                comments[last] = " ".join(part for part in (field.group(2) or "", before) if part)
                before = ""
            else:
                last, before = None, ""
    return comments


def parameters(function) -> tuple[list[str], str]:
    """Each parameter as written in the source (annotations unquoted, defaults as repr), `*` where the keyword-only
    ones start; and the return annotation."""
    signature = inspect.signature(function)
    shown, star = [], False
    for p in signature.parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            shown.append("*")
            star = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        star = star or p.kind == p.VAR_POSITIONAL
        annotation = "" if p.annotation is p.empty else f": {p.annotation}"
        default = "" if p.default is p.empty else f" = {p.default!r}"
        shown.append(f"{prefix}{p.name}{annotation}{default}")
    returns = "" if signature.return_annotation is signature.empty else str(signature.return_annotation)
    return shown, returns


def members(cls: type) -> list[str]:
    rows = ["| member | type | what |", "| --- | --- | --- |"]
    if dataclasses.is_dataclass(cls):
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            rows.append(f"| `{f.name}` | `{cell(str(f.type))}` | {cell(comments.get(f.name, ''))} |")
    for name, value in inspect.getmembers(cls):
        if name.startswith("_") and name not in ("__str__", "__rich_console__"):
            continue
        if isinstance(inspect.getattr_static(cls, name), property):
            prop = inspect.getattr_static(cls, name)
            returns = inspect.signature(prop.fget).return_annotation
            rows.append(f"| `{name}` | `{cell(str(returns))}` | {doc(prop.fget)} |")
        elif inspect.isfunction(value) or inspect.ismethod(value):
            if value.__qualname__.split(".")[0] not in {c.__name__ for c in cls.__mro__}:
                continue
            shown, returns = parameters(value)
            rows.append(f"| `{name}({cell(', '.join(shown))})` | `{cell(returns)}` | {doc(value)} |")
    return rows


def section() -> str:
    shown, returns = parameters(check_model)
    lines = [f"    {p}," for p in shown]
    parts = ["## fwdcheck.check_model", "", "```python", "check_model(", *lines, f") -> {returns}", "```", ""]
    parts += [inspect.getdoc(check_model) or "", ""]
    for cls in TYPES:
        parts += [f"## {cls.__name__}", "", f"`{cls.__module__}.{cls.__name__}`: {doc(cls)}", ""]
        if issubclass(cls, enum.Enum):
            parts += ["| value | |", "| --- | --- |", *(f"| `{m.value}` | `{cls.__name__}.{m.name}` |" for m in cls)]
            parts += ["", f"`rank`: {doc(cls.rank.fget)}", ""]  # type: ignore[attr-defined]
            continue
        if cls is Report:
            parts += [
                f"A `{ReportRecord.__name__}` ({doc(ReportRecord)}), shown as text, as rich, or as an assertion.",
                "",
            ]
        parts += [*members(cls), ""]
    return "\n".join(parts).rstrip()
