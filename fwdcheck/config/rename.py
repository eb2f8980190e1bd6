"""Rename rules: how `fwdcheck diff` maps the first model's parameter and module names to the second's.

A rule is `PATTERN -> REPLACEMENT`: a Python regular expression and what re.sub puts in its place (`\\1` for a group),
as `transformer\\.h\\.(\\d+) -> layers.\\1`. The rules apply in order, each to what the ones before made, like the
expressions of one `sed` command. They come from the second config's `diff: {rename: [...]}` and from
`fwdcheck diff --rename`; torch-free, so that the config and the command line check them before any model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ARROW = "->"


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    replacement: str
    text: str  # as written, for messages

    def apply(self, name: str) -> str:
        return self.pattern.sub(self.replacement, name)


def parse_rule(text: str) -> Rule:
    """A rule from its text; ValueError saying what is wrong (the caller names the rule): no arrow, an empty or
    invalid pattern, a replacement that names a group the pattern does not have."""
    if ARROW not in text:
        raise ValueError(f"a rename rule needs '{ARROW}': write 'PATTERN -> REPLACEMENT'")
    pattern, _, replacement = (part.strip() for part in text.partition(ARROW))
    if not pattern:
        raise ValueError("a rename rule needs a pattern before '->'")
    try:
        compiled = re.compile(pattern)
        compiled.sub(replacement, "")  # the replacement's group references are checked here, match or not
    # OverflowError: a repetition count past C's; RecursionError: groups nested thousands deep
    except (re.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"not a valid regular expression and replacement: {exc}") from None
    return Rule(compiled, replacement, text)


def renamed(name: str, rules: list[Rule]) -> str:
    """The name with every rule applied, in order."""
    for rule in rules:
        name = rule.apply(name)
    return name
