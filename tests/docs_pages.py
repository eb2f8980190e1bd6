"""The documentation pages generated from fwdcheck's own declarations.

    python -m tests.docs_pages            # print them
    python -m tests.docs_pages --write    # rewrite them

docs/api.md is the Python API's reference, from its types and docstrings (tests/api_page.py).
docs/codes.md lists every finding code the built-in checks declare (the `codes` their classes hold, as `fwdcheck
explain CODE` reads them) and fwdcheck's own; docs/config-reference.md lists every key of a config from the config's
model (fwdcheck/config/schema.py: each key's type, default and description); docs/checks.md shows the README's checks
table. tests/test_docs.py fails when a page is not what this module writes.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tests import api_page
from tests.doc_sections import DOCS, README, read_section, write_sections

CODES_PAGE = DOCS / "codes.md"
CONFIG_PAGE = DOCS / "config-reference.md"
CHECKS_PAGE = DOCS / "checks.md"
API_PAGE = DOCS / "api.md"

CODES_LEAD = """# Finding codes

Every finding code, from the checks' own declarations (`python -m tests.docs_pages --write` regenerates this page).
`fwdcheck explain CODE` prints a code's meaning and its check's explanation; `fwdcheck explain CHECK` a check's
codes and options. A plugin's checks declare their codes the same way, and `fwdcheck explain` finds them too.
"""

CONFIG_LEAD = """# Config reference

Every key of a config file, from the config's own model (`fwdcheck/config/schema.py`; `python -m tests.docs_pages
--write` regenerates this page). A key not listed is refused with a did-you-mean. [Your own model](configuration.md)
shows a commented config; each check's own options are listed by `fwdcheck explain CHECK`.
"""


def cell(text: str) -> str:
    """Text that stays in one table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def codes_section() -> str:
    from fwdcheck.config.registry import _is_builtin, available, info
    from fwdcheck.errors import OWN_CODES

    rows = ["| code | check | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{code}` | fwdcheck itself | {cell(meaning)} |" for code, meaning in OWN_CODES.items()]
    builtins = [entry for entry in available().values() if _is_builtin(entry)]
    for entry in sorted(builtins, key=lambda e: (info(e).order, e.name)):
        rows += [f"| `{code}` | `{entry.name}` | {cell(meaning)} |" for code, meaning in info(entry).codes.items()]
    return "\n".join(rows)


# -- the config reference ---------------------------------------------------------------------------------------------


def is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_name(annotation: object) -> str:
    """A field's type as a config's author reads it: `int`, `half | interleaved`, `list of str`, a link to a
    section's own table."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in args if arg is not type(None))
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return "mapping"
    if is_model(annotation):
        return " or ".join(f"[{model.__name__}](#{model.__name__.lower()})" for model in nested(annotation))
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type):
        return {"Path": "path", "str": "str", "int": "int", "float": "float", "bool": "bool"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def default(field) -> str:
    """The default as YAML writes it; blank where omitting the key means something the description says, or a
    section whose own keys have defaults."""
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if value is None or isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value, default=str)}`"


def former_names(field) -> str:
    """The key's former spellings, still read."""
    alias = field.validation_alias
    others = [name for name in getattr(alias, "choices", []) if isinstance(name, str)][1:]
    return f" (former name: {', '.join(f'`{name}`' for name in others)})" if others else ""


def nested(annotation: object) -> list[type[BaseModel]]:
    """The section models a field's type names, in order: for the `model:` section, each source's class."""
    from fwdcheck.config.schema import ModelSpec, model_classes

    if annotation is ModelSpec:  # validated as the class its `source:` names, through the table of sources
        return list(model_classes().values())
    if is_model(annotation):
        return [typing.cast(type[BaseModel], annotation)]
    return [model for arg in typing.get_args(annotation) for model in nested(arg)]


def model_table(model: type[BaseModel]) -> list[str]:
    doc = cell((model.__doc__ or "").strip())
    rows = [f"## {model.__name__}", ""]
    rows += [doc, ""] if doc else []
    rows += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        key = f"`{field.alias or name}`{former_names(field)}"
        rows.append(f"| {key} | {type_name(field.annotation)} | {default(field)} | {cell(field.description or '')} |")
    return rows


def config_section() -> str:
    from fwdcheck.config.schema import Config

    lines: list[str] = []
    seen: set[type[BaseModel]] = set()
    queue: list[type[BaseModel]] = [Config]
    while queue:
        model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        lines += [*model_table(model), ""]
        queue += [inner for field in model.model_fields.values() for inner in nested(field.annotation)]
    return "\n".join(lines).rstrip("\n")


def checks_section() -> str:
    """The README's checks table, its links to pages made relative to docs/."""
    return read_section(README, "checks").replace("](docs/", "](")


PAGES: dict[Path, tuple[str, typing.Callable[[], str], str]] = {
    CODES_PAGE: ("codes", codes_section, CODES_LEAD),
    CONFIG_PAGE: ("config", config_section, CONFIG_LEAD),
    API_PAGE: ("api", api_page.section, api_page.LEAD),
}


def page_text(path: Path) -> str:
    name, make, lead = PAGES[path]
    return f"{lead}\n<!-- {name}:start -->\n{make()}\n<!-- {name}:end -->\n"


def write() -> None:
    for path in PAGES:
        path.write_text(page_text(path), encoding="utf-8")
    write_sections(CHECKS_PAGE, {"checks": checks_section()})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the generated pages")
    if parser.parse_args().write:
        write()
    else:
        print("\n\n".join(page_text(path) for path in PAGES))
