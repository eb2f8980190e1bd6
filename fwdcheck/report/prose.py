"""Text its author wrapped at the source's width (a check's `explain`), unwrapped for the terminal to wrap it at its
own width (`fwdcheck explain`)."""

from __future__ import annotations

import re

WRAPPED_AT = 100  # a source line at least this long was wrapped by its author: the next line goes on with it
STARTS_ITEM = re.compile(r"^([-*•]\s|\(\w\)\s|\d+[.)]\s|[A-Z][\w ,()/'-]{0,40}:\s)")  # - x, (a) x, 1. x, Label: x


def paragraphs(text: str) -> str:
    """Text its author wrapped at the source's width (an explain text), unwrapped so that the terminal wraps it at
    its own: a line goes on with the one before when it is indented deeper (a hanging continuation) or the one
    before was wrapped; blank lines, list items and `Label:` paragraphs keep their break."""
    out: list[str] = []
    item_indent, previous = 0, ""
    for line in text.strip("\n").splitlines():
        indent = len(line) - len(line.lstrip())
        goes_on = (
            previous.strip()
            and line.strip()
            and not STARTS_ITEM.match(line.lstrip())
            and (indent > item_indent or (indent == item_indent and len(previous) >= WRAPPED_AT))
        )
        if goes_on:
            out[-1] = out[-1].rstrip() + " " + line.strip()
        else:
            out.append(line)
            item_indent = indent
        previous = line
    return "\n".join(out)
