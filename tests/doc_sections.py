"""The generated parts of the README and the documentation pages: text between `<!-- NAME:start -->` and
`<!-- NAME:end -->` markers, which a generator (`python -m tests.SOMETHING --write`) rewrites and a test compares with
what it would write.

Every generator reads and writes its section through these functions, so a section that moves to another page moves
by one path.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _pattern(name: str) -> re.Pattern[str]:
    start, end = markers(name)
    return re.compile(re.escape(start) + r"\n(.*?)\n?" + re.escape(end), re.S)


def read_section(path: Path, name: str) -> str:
    """The text between the section's markers, without the markers and the newlines next to them; "" when the file
    has no such section."""
    match = _pattern(name).search(path.read_text(encoding="utf-8"))
    return match.group(1).rstrip("\n") if match else ""


def replace_section(text: str, name: str, body: str) -> str:
    """text with the section's body replaced; a text without the section's markers is an error, not a silent no-op."""
    start, end = markers(name)
    if start not in text or end not in text:
        raise ValueError(f"no {start} ... {end} section to rewrite")
    return _pattern(name).sub(lambda _: f"{start}\n{body}\n{end}", text, count=1)


def write_sections(path: Path, bodies: dict[str, str]) -> None:
    """Rewrite each named section of one file, in one write."""
    text = path.read_text(encoding="utf-8")
    for name, body in bodies.items():
        text = replace_section(text, name, body)
    path.write_text(text, encoding="utf-8")
