"""Reading what the user hands over, safely: a file must be a regular file (not a FIFO or a device), a JSON file one
clear line when it is not JSON, a YAML document bounded in depth and size before any loader walks it, a key given
twice refused. The config, the ledger, the golden file and a model's config.json are read through these.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fwdcheck.errors import ConfigError, UsageError

# How deep a config, a ledger or a model's config.json may nest, and how many values a YAML document may hold once
# its aliases are expanded. Real configs are a few levels deep and a few hundred values big; past these bounds the
# readers downstream (YAML's composer, pydantic, transformers, json) recurse or copy until they break or hang.
MAX_DEPTH = 64
MAX_VALUES = 100_000


def regular_file(path: Path, label: str, error: type[Exception], what: str) -> None:
    """Refuse, before opening it, an input that is no regular file: a FIFO would block the run until some other
    process writes to it, a device (/dev/zero, /dev/urandom) would be read without end. A missing file or a directory
    is left to the reader, which names it in its own words."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = (
        "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )
    raise error(f"{label}: is {kind}, not a regular file; fwdcheck reads a {what} only from a regular file")


def read_json_file(path: Path, label: str, what: str, written_by: str, parse_constant=None) -> Any:
    """A JSON file fwdcheck wrote (a ledger, a golden file), parsed; every way it cannot be read is one UsageError
    line starting with `label` and naming the flag that writes one (`written_by`)."""
    regular_file(Path(path), label, UsageError, what=what)
    try:
        text = Path(path).read_text(encoding="utf-8")
        return json.loads(text, parse_constant=parse_constant, object_pairs_hook=_once_each)
    except DuplicateKey as exc:
        where = duplicate_key(text)
        raise UsageError(f"{label}: {where or exc}; not a {what} written by {written_by}") from None
    except FileNotFoundError:
        raise UsageError(f"{label}: no such file (write one with {written_by})") from None
    except IsADirectoryError:
        raise UsageError(f"{label}: is a directory, not a {what}") from None
    except RecursionError:
        raise UsageError(f"{label}: nested too deeply; not a {what} written by {written_by}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{label}: not a readable JSON {what} ({exc})") from None


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each named once (json.loads keeps the last of a key given twice, silently)."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise DuplicateKey(f"the key '{key}' is given twice in one object")
        document[key] = value
    return document


def check_yaml_structure(text: str, name: str) -> None:
    """Refuse a YAML document nested deeper than MAX_DEPTH, one whose aliases expand to more than MAX_VALUES values
    (the 'billion laughs'), an alias inside the node it names (a cycle), and a key given twice in one mapping (a
    YAML reader keeps the last silently: `checks:` twice would run fewer checks), before anything builds it.

    It reads the parser's event stream, which needs no recursion, and stops at the first problem: the composer and
    the constructor that safe_load runs recurse once per level, and pydantic walks every alias anew."""
    open_nodes: list[_Open] = []  # each collection being read, outermost first
    sizes: dict[str, int] = {}  # anchor -> the values its node holds, aliases expanded
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        at = f"at line {event.start_mark.line + 1}, column {event.start_mark.column + 1}" if event.start_mark else ""
        if isinstance(event, yaml.NodeEvent) and open_nodes:  # a scalar, an alias or a collection's start
            try:
                open_nodes[-1].child(event)
            except DuplicateKey as exc:
                raise ConfigError(f"{name}: {exc}") from None
        if isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append(_Open(event.anchor, {} if isinstance(event, yaml.MappingStartEvent) else None))
            if len(open_nodes) > MAX_DEPTH:
                raise ConfigError(
                    f"{name}: nested more than {MAX_DEPTH} levels deep {at}; a config is a few levels deep"
                )
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            closed = open_nodes.pop()
            count = closed.values
            if closed.anchor is not None:
                sizes[closed.anchor] = count
        elif isinstance(event, yaml.ScalarEvent):
            count = 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if any(node.anchor == event.anchor for node in open_nodes):
                raise ConfigError(f"{name}: the alias *{event.anchor} {at} refers to a node that holds it (a cycle)")
            count = sizes.get(event.anchor, 1)  # an undefined anchor: the composer names it
        else:
            continue
        if open_nodes:
            open_nodes[-1].values += count
            count = open_nodes[-1].values
        if count > MAX_VALUES:
            raise ConfigError(
                f"{name}: its aliases expand to more than {MAX_VALUES} values (by the alias {at}); a "
                "config holds a few hundred"
            )


class DuplicateKey(ValueError):
    """A mapping names one key twice."""


@dataclass
class _Open:
    """A collection being read from YAML's event stream: the values it holds so far, and for a mapping the line of
    each key it named and whether its next child is a key."""

    anchor: str | None
    keys: dict[str, int] | None  # None: a sequence
    values: int = 1
    next_is_key: bool = True

    def child(self, event) -> None:
        """Note a child node's start; a key this mapping already named raises DuplicateKey naming both lines."""
        if self.keys is None:
            return
        is_key, self.next_is_key = self.next_is_key, not self.next_is_key
        if not is_key or not isinstance(event, yaml.ScalarEvent) or event.value == "<<":  # <<: a merge, not a key
            return
        line = event.start_mark.line + 1
        if event.value in self.keys:
            raise DuplicateKey(
                f"the key '{event.value}' is given twice, at line {self.keys[event.value]} and at line {line} "
                "(a reader would keep the last one silently); give it once"
            )
        self.keys[event.value] = line


def duplicate_key(text: str) -> str | None:
    """Where a JSON (or YAML) text names a key twice in one object, both lines named; None when it does not (or when
    the text does not parse as YAML, a superset of the JSON fwdcheck writes)."""
    open_nodes: list[_Open] = []
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.NodeEvent) and open_nodes:
                open_nodes[-1].child(event)
            if isinstance(event, yaml.CollectionStartEvent):
                open_nodes.append(_Open(event.anchor, {} if isinstance(event, yaml.MappingStartEvent) else None))
            elif isinstance(event, yaml.CollectionEndEvent):
                open_nodes.pop()
    except DuplicateKey as exc:
        return str(exc)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    return None


def nesting_depth(document: Any, limit: int = MAX_DEPTH) -> int:
    """How deep dicts and lists nest in a parsed document, counted without recursion and up to limit + 1 (a
    document that holds itself counts as deeper than any limit). Each level visits a container once, however many
    times aliases share it."""
    depth = 0
    level = [document]
    while depth <= limit:
        children: dict[int, Any] = {}
        for node in level:
            items = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
            for child in items:
                if isinstance(child, (dict, list, tuple)):
                    children[id(child)] = child
        if not any(isinstance(node, (dict, list, tuple)) for node in level):
            return depth
        depth += 1
        level = list(children.values())
    return depth
