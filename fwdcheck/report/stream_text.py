"""Text written to a stream that cannot hold every character: what it can hold, never an encoding error.

An ASCII-only stream (PYTHONIOENCODING=ascii, a C locale without UTF-8 under a pipe) cannot encode the "·" of a
report line, and a strict stream raised UnicodeEncodeError on it: every run exited 2 and a correct model failed CI.
The command line now sets, on such a stdout and stderr, an error handler that writes each character the stream
cannot hold as the nearest text it can (`·` as `-`, `→` as `->`, `é` as `e`, a box-drawing line as `-`, `|` or `+`,
anything else as `?`), so every renderer, warning and error line reaches the reader. rich draws its tables with ASCII
boxes on such a stream by itself (it reads the stream's encoding; a buffer rendered for it says the same encoding).
Formats a program reads stay exact: JSON is written with ASCII escapes already, and XML (JUnit) gets character
references, which its reader turns back into the characters.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import unicodedata

HANDLER = "fwdcheck-nearest"
# What fwdcheck's own text uses beyond ASCII, in ASCII (every other character: its decomposition, else "?").
NEAREST = {
    "·": "-",
    "—": "--",
    "–": "-",
    "…": "...",
    "→": "->",
    "←": "<-",
    "×": "x",
    "≤": "<=",
    "≥": ">=",
    "≈": "~",
    "±": "+-",
    "•": "*",
    "■": "#",
    "█": "#",
    "◀": "<",
    "▶": ">",
    "⚠": "!",
    "✅": "[ok]",
    "❌": "[x]",
    "💥": "[!]",
    "⏭": ">>",
    "\N{VARIATION SELECTOR-16}": "",
    "\N{ZERO WIDTH JOINER}": "",
}
# What fwdcheck writes and a stream should hold; a stream that cannot gets the handler.
PROBE = "·—→…"


def nearest(character: str) -> str:
    """The nearest ASCII text for one character."""
    if character in NEAREST:
        return NEAREST[character]
    if "\u2500" <= character <= "\u257f":  # box drawing: lines and corners
        name = unicodedata.name(character, "")
        if " AND " in name or "ARC" in name or "DIAGONAL" in name:  # corners, crossings, junctions
            return "+"
        return "-" if "HORIZONTAL" in name else "|" if "VERTICAL" in name else "+"
    if "\u2580" <= character <= "\u259f":  # block elements
        return "#"
    plain = unicodedata.normalize("NFKD", character).encode("ascii", "ignore").decode("ascii")
    return plain or "?"


def _write_nearest(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    return "".join(nearest(c) for c in error.object[error.start : error.end]), error.end


codecs.register_error(HANDLER, _write_nearest)


def holds(stream, text: str = PROBE) -> bool:
    """Whether the stream's encoding holds every character of `text` (a stream without an encoding: a text buffer,
    it holds everything)."""
    encoding = getattr(stream, "encoding", None)
    if not encoding:
        return True
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    except LookupError:  # an encoding Python does not know: the stream will fail on its own terms
        return True
    return True


def fit_stream(stream) -> None:
    """Give a text stream that cannot hold fwdcheck's characters the handler that writes the nearest ones; a stream
    that holds them, or whose errors the user chose (PYTHONIOENCODING=ascii:replace), is left as it is."""
    if stream is None or holds(stream) or getattr(stream, "errors", None) != "strict":
        return
    with contextlib.suppress(AttributeError, ValueError, OSError):  # not a TextIOWrapper, or closed: nothing to set
        stream.reconfigure(errors=HANDLER)


def rendering_buffer(stream) -> io.StringIO:
    """A buffer to render for `stream` in: it tells rich the stream's encoding, so rich draws what the stream
    holds (ASCII boxes on an ASCII stream)."""
    buffer = _EncodedBuffer()
    buffer.stream_encoding = getattr(stream, "encoding", None) or "utf-8"
    return buffer


class _EncodedBuffer(io.StringIO):
    stream_encoding = "utf-8"

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream_encoding


def exact_for_xml(text: str, stream) -> str:
    """XML for `stream`: every character it cannot hold as a character reference, which XML readers turn back."""
    encoding = getattr(stream, "encoding", None)
    if not encoding or holds(stream, text):
        return text
    return text.encode(encoding, "xmlcharrefreplace").decode(encoding)
