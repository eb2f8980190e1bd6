"""Rules the layout keeps, read off the source: checks ask a model's capabilities, never which source built it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "fwdcheck" / "model" / "sources"
# The core and the checks: every module but the sources' own.
OUTSIDE_SOURCES = sorted(p for p in (ROOT / "fwdcheck").rglob("*.py") if SOURCES not in p.parents)
SOURCE_NAMES = {"reference", "python", "checkpoint", "hf"}
# The command line's dispatch into the sources' package: `fwdcheck shrink` is each source's rules for its config.
DISPATCH = {("cli.py", "fwdcheck.model.sources.shrink")}


def named_sources(tree: ast.AST, file: str = "") -> list[str]:
    """Where a module names a source: an import of one source's module (the package's own entry points,
    fwdcheck.model.sources.load_model and from_module, aside), a comparison of a `.source` with a source's name, or an
    isinstance test against the reference transformer's class."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("fwdcheck.model.sources.")
            and (file, node.module) not in DISPATCH
        ):
            found.append(f"line {node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: imports {a.name}"
                for a in node.names
                if a.name.startswith("fwdcheck.model.sources.")
            ]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            reads_source = any(isinstance(s, ast.Attribute) and s.attr == "source" for s in sides)
            names = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in SOURCE_NAMES]
            if reads_source and names:
                found.append(f"line {node.lineno}: compares .source with {names[0]!r}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "isinstance"
            and len(node.args) == 2
            and "ReferenceTransformer" in ast.unparse(node.args[1])
        ):
            found.append(f"line {node.lineno}: isinstance(..., ReferenceTransformer)")
    return found


@pytest.mark.parametrize("path", OUTSIDE_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_outside_the_sources_names_a_source(path):
    assert named_sources(ast.parse(path.read_text(encoding="utf-8")), path.name) == []


def test_checks_never_read_which_source_built_the_model():
    """`model.source` is for the report; a check asks what the model can do."""
    readers = [
        f"{p.name}:{node.lineno}"
        for p in sorted((ROOT / "fwdcheck" / "checks").glob("*.py"))
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
        and node.attr == "source"
        and isinstance(node.value, ast.Name)
        and node.value.id == "model"
    ]
    assert readers == []


def test_the_rule_finds_each_way_of_naming_a_source():
    planted = """
from fwdcheck.model.sources.hf import find_rotary
import fwdcheck.model.sources.python
if model.source == "hf": pass
if "reference" != model.source: pass
if isinstance(model.module, ReferenceTransformer): pass
from fwdcheck.model.sources import load_model
if model.source == other: pass
"""
    assert [line.split(": ", 1)[1] for line in named_sources(ast.parse(planted))] == [
        "imports fwdcheck.model.sources.hf",
        "imports fwdcheck.model.sources.python",
        "compares .source with 'hf'",
        "compares .source with 'reference'",
        "isinstance(..., ReferenceTransformer)",
    ]


# The core: every module but the checks' own and the sources' (which say what a model offers, in words that may be a
# check's too: packing).
CHECKS = ROOT / "fwdcheck" / "checks"
CORE = sorted(p for p in (ROOT / "fwdcheck").rglob("*.py") if SOURCES not in p.parents and CHECKS not in p.parents)
# Words of the config's own vocabulary that are also a check's name: `positional: rope` is the model's scheme.
VOCABULARY = {"rope"}


def builtin_check_names() -> set[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return set(project["project"]["entry-points"]["fwdcheck.checks"]) - VOCABULARY


def named_checks(tree: ast.AST, names: set[str]) -> list[str]:
    """Where a module names a check: an import of a check's module, or a string that is a check's name (docstrings
    aside: prose may name them)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        modules = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found += [f"line {node.lineno}: imports {m}" for m in modules if m.startswith("fwdcheck.checks")]
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings:
            found.append(f"line {node.lineno}: names the check {node.value!r}")
    return found


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_names_no_check(path):
    """What the core knows of a check, the check declares (its options, flags, files, views, codes, the runs it opens
    or refuses): the core treats every check as it treats a plugin's."""
    assert named_checks(ast.parse(path.read_text(encoding="utf-8")), builtin_check_names()) == []


def test_the_rule_finds_each_way_of_naming_a_check():
    planted = '''
"""The golden check's module docstring may name it: golden."""
from fwdcheck.checks.golden_file import read_golden
import fwdcheck.checks.golden
if name == "golden": pass
entries = select(["sharding"])
positional = "rope"
'''
    assert [line.split(": ", 1)[1] for line in named_checks(ast.parse(planted), builtin_check_names())] == [
        "imports fwdcheck.checks.golden_file",
        "imports fwdcheck.checks.golden",
        "names the check 'golden'",
        "names the check 'sharding'",
    ]


# A check module is one an entry point names; every other module in fwdcheck/checks/ is shared (a view, a file
# format, what several checks use). A check imports shared modules, never another check's: what two checks share
# moves into a module named for its job, so that each check reads, changes and loads alone.
CHECKS_PACKAGE = "fwdcheck.checks"


def check_modules() -> set[str]:
    """The modules the built-in checks' entry points name: fwdcheck.checks.rope for `rope = "...rope:Rope"`."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {value.partition(":")[0] for value in project["project"]["entry-points"]["fwdcheck.checks"].values()}


def imported_checks(tree: ast.AST, own: str, checks: set[str]) -> list[str]:
    """Where a module imports a check's module other than its own, at the top or inside a function: `import
    fwdcheck.checks.x`, `from fwdcheck.checks.x import y`, `from fwdcheck.checks import x`, their relative forms
    (`from .x import y`, `from . import x`), and importlib.import_module or __import__ of the module's name."""
    found = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to fwdcheck.checks, the package every module here is in
                package = CHECKS_PACKAGE.rsplit(".", node.level - 1)[0] if node.level > 1 else CHECKS_PACKAGE
                base = f"{package}.{base}".rstrip(".")
            modules = [base, *(f"{base}.{a.name}" for a in node.names)]  # `from package import module`
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            modules = [node.args[0].value]
        found += [f"line {node.lineno}: imports {m}" for m in modules if m in checks and m != own]
    return found


CHECK_FILES = sorted(p for p in CHECKS.glob("*.py") if f"{CHECKS_PACKAGE}.{p.stem}" in check_modules())


@pytest.mark.parametrize("path", CHECK_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_check_imports_another_check(path):
    """What several checks share lives in a shared module (sdpa_calls.py, rotation.py, gradients.py, ...)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert imported_checks(tree, f"{CHECKS_PACKAGE}.{path.stem}", check_modules()) == []


def test_every_check_module_is_a_file_in_the_checks_package():
    """The rule reads the files the entry points name: an entry point it cannot find would escape it."""
    assert {f"{CHECKS_PACKAGE}.{p.stem}" for p in CHECK_FILES} == check_modules()


def test_the_rule_finds_each_way_of_importing_a_check():
    planted = '''
"""rope's docstring may name backends."""
from fwdcheck.checks.backends import RecordSdpa
import fwdcheck.checks.future_token as future
from fwdcheck.checks import grad_causality, rotation
from .rope import analyze
from . import compile
from .. import checks
from fwdcheck.checks.sdpa_calls import RecordSdpa
from fwdcheck.checks.rope_precision import ANGLE_BAR


def late():
    from fwdcheck.checks.golden import Golden
    importlib.import_module("fwdcheck.checks.kv_cache")
    return __import__("fwdcheck.checks.sharding")
'''
    assert [
        line.split(": ", 1)[1]
        for line in imported_checks(ast.parse(planted), "fwdcheck.checks.rope_precision", check_modules())
    ] == [
        "imports fwdcheck.checks.backends",
        "imports fwdcheck.checks.future_token",
        "imports fwdcheck.checks.grad_causality",
        "imports fwdcheck.checks.rope",
        "imports fwdcheck.checks.compile",
        "imports fwdcheck.checks.golden",
        "imports fwdcheck.checks.kv_cache",
        "imports fwdcheck.checks.sharding",
    ]


def private_imports(tree: ast.AST) -> list[str]:
    """The names with a leading underscore a module of the checks package imports from outside it: another layer's
    private name, which a change there may drop."""
    return [
        f"line {node.lineno}: imports {node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        if not (node.module == CHECKS_PACKAGE or node.module.startswith(f"{CHECKS_PACKAGE}."))
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


@pytest.mark.parametrize("path", sorted(CHECKS.glob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_check_imports_a_private_name_of_another_layer(path):
    """What the checks read of the observer, the run and the model is public (the observer's SDPA_SIGNATURE)."""
    assert private_imports(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_the_rule_finds_a_private_import():
    planted = """
from fwdcheck.observe.kernels.sdpa import SDPA_SIGNATURE, _sdpa
from fwdcheck.checks.rotation import _pairs
from __future__ import annotations
def late():
    from fwdcheck.observe.masks import _read_mask as read
"""
    assert private_imports(ast.parse(planted)) == [
        "line 2: imports fwdcheck.observe.kernels.sdpa._sdpa",
        "line 6: imports fwdcheck.observe.masks._read_mask",
    ]


# No module over 900 lines: one that long holds more than one job.
MAX_LINES = 900
MODULES = sorted((ROOT / "fwdcheck").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_the_line_limit(path):
    name = path.relative_to(ROOT).as_posix()
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (limit {MAX_LINES})"


# fwdcheck's own finding codes are symbols of one table (errors.py `Own`); a check's codes are the check's.
CODE_TABLE = ROOT / "fwdcheck" / "errors.py"
FINDING_CODE = r"FWD\d+"


def literal_codes(tree: ast.AST) -> list[str]:
    """Where a module writes a finding code as a literal: a string that is one ("FWD002"), or one written into an
    f-string (f"{status} FWD002 {message}"). Prose may name codes: docstrings, help texts and comments give examples."""
    import re

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [p.value for p in node.values if isinstance(p, ast.Constant) and isinstance(p.value, str)]
            found += [
                f"line {node.lineno}: writes {code} into an f-string"
                for part in parts
                for code in re.findall(rf"\b{FINDING_CODE}\b", part)
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(FINDING_CODE, node.value):
            found.append(f"line {node.lineno}: the literal {node.value!r}")
    return sorted(found, key=lambda line: int(line.split(":")[0].removeprefix("line ")))


@pytest.mark.parametrize("path", [p for p in CORE if p != CODE_TABLE], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_writes_no_finding_code_literally(path):
    """The core names its own codes by symbol (errors.Own) and a check's code by what the check declares (its
    `codes`, `ends_distributed_runs`): a code renumbered is one line of its table."""
    assert literal_codes(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_the_rule_finds_each_literal_code():
    planted = '''
"""A docstring may name FWD002."""
finding = Finding("FWD002", Status.ERROR, message)
if f.code in ("FWD004", "FWD005"): pass
ends = "FWD983"
line = f" FWD002 {message}"
line = f" {Own.MODEL_RAISED} {message}"
help = "a finding code such as FWD202"
prefix = "FWD"
'''
    assert [line.split(": ", 1)[1] for line in literal_codes(ast.parse(planted))] == [
        "the literal 'FWD002'",
        "the literal 'FWD004'",
        "the literal 'FWD005'",
        "the literal 'FWD983'",
        "writes FWD002 into an f-string",
    ]


# The layers, from the top down (docs/architecture.md draws them): a module imports from its own layer and the ones
# below it. A layer is a folder of fwdcheck/, or a few modules at the top.
LAYERS = [
    {"cli", "run_command", "api", "pytest_plugin", "__main__"},
    {"process"},
    {"checks"},
    {"run"},
    {"report"},
    {"model"},
    {"observe"},
    {"config"},
    {"result", "errors"},
]
# Imports that point up on purpose: the package's lazy `check_model`, and the types in Check.run's signature.
UPWARD_ON_PURPOSE = {
    ("fwdcheck", "fwdcheck.api"),
    ("fwdcheck.result", "fwdcheck.model.tested"),
    ("fwdcheck.result", "fwdcheck.run.session"),
}


def layer_of(module: str) -> int | None:
    """The layer of a dotted fwdcheck module: its folder's, or its own at the top; None for the package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return next(i for i, names in enumerate(LAYERS) if parts[1] in names)


def upward_imports(tree: ast.AST, module: str) -> list[str]:
    """Where `module` imports from a layer above its own, anywhere in its file (inside functions and under
    TYPE_CHECKING too)."""
    own = layer_of(module)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module]
        else:
            continue
        for target in targets:
            if not target.startswith("fwdcheck.") or (module, target) in UPWARD_ON_PURPOSE:
                continue
            theirs = layer_of(target)
            if own is None or (theirs is not None and theirs < own):
                found.append(f"line {node.lineno}: imports {target}")
    return found


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_from_a_layer_above_its_own(path):
    assert upward_imports(ast.parse(path.read_text(encoding="utf-8")), module_name(path)) == []


def test_every_module_is_in_a_layer():
    """A new folder or top-level module is placed in the layers before it lands."""
    placed = set().union(*LAYERS)
    names = [module_name(p) for p in MODULES if module_name(p) != "fwdcheck"]
    assert [name for name in names if name.split(".")[1] not in placed] == []


def test_the_rule_finds_an_import_from_above():
    planted = """
from fwdcheck.run.session import Session
from fwdcheck.config.schema import Config
import fwdcheck.process.worker
def late():
    from fwdcheck.cli import app
"""
    found = [line.split(": ", 1)[1] for line in upward_imports(ast.parse(planted), "fwdcheck.model.tested")]
    assert found == ["imports fwdcheck.run.session", "imports fwdcheck.process.worker", "imports fwdcheck.cli"]
