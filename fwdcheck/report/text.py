"""Text from the model, made safe for every report format where it enters the report.

A model's exception message, a library's log line, a module's name or a file name of its code is the model's text:
it may hold terminal escapes (colour codes, or sequences that move the cursor and rewrite what a reader sees), control
characters XML 1.0 forbids (a JUnit file holding one is malformed, and CI drops the whole report), or lone
surrogates (a Latin-1 file name read with Python's surrogateescape, half an emoji cut from a vocabulary file), which
no UTF-8 writer can encode. Each is replaced with U+FFFD, escapes removed whole, once, when the report is assembled:
every renderer then writes valid output for any text.
"""

from __future__ import annotations

import re
from typing import Any

# ESC-led sequences: CSI (ESC [ ... final byte), OSC (ESC ] ... BEL or ESC \), and the two-byte ones (ESC @ to ESC _).
ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# What XML 1.0 forbids (C0 controls but tab, newline and return; U+FFFE, U+FFFF), what terminals read as commands
# (DEL and the C1 controls, U+009B among them: a one-character CSI), and lone surrogates.
UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def clean(text: str) -> str:
    """`text` with terminal escapes removed and every other unsafe character replaced with U+FFFD."""
    if not UNSAFE.search(text):
        return text
    return UNSAFE.sub("\ufffd", ESCAPE.sub("", text))


def cleaned(value: Any) -> Any:
    """Every string in a structure of dicts, lists and tuples cleaned (keys too); other values as they are."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {cleaned(k): cleaned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cleaned(v) for v in value)
    return value
