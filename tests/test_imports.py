"""The import graph stays acyclic: no import cycles, even inside functions or under TYPE_CHECKING.

Two views. Every module imports alone in a fresh interpreter, which catches a cycle that breaks some import order;
and the graph of fwdcheck's imports as written, those inside functions too, has no cycle at all, which catches the
ones that only an import inside a function keeps from breaking.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import subprocess
import sys

import pytest

PACKAGES = ("fwdcheck",)
# `python -m fwdcheck`: importing it runs the command line.
NOT_IMPORTED_ALONE = {"fwdcheck.__main__"}


def modules() -> list[str]:
    names = set(PACKAGES)
    for package in PACKAGES:
        names.update(m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, f"{package}."))
    return sorted(names)


# Imports each named module in a child forked from an interpreter that has imported torch and every other package
# outside fwdcheck that fwdcheck's modules import (a first child imports them all and names those): each module meets
# no other fwdcheck module loaded before it, and the imports it shares with the others are paid once. Top-level
# packages only: a module that uses rich.table or torch.distributed.tensor without importing it must still fail.
IMPORT_EACH_ALONE = """
import importlib, os, sys, traceback
import torch
names = sys.argv[1:]
read, write = os.pipe()
if os.fork() == 0:
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:
            pass
    with os.fdopen(write, "w") as writer:
        writer.write(" ".join({m.partition(".")[0] for m in sys.modules if not m.startswith("fwdcheck")}))
    os._exit(0)
os.close(write)
with os.fdopen(read) as reader:
    outside = reader.read().split()
os.wait()
for name in outside:
    try:
        importlib.import_module(name)
    except BaseException:
        pass
assert not any(m.startswith("fwdcheck") for m in sys.modules), "a module outside fwdcheck imported it"
failed = []
for name in names:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(name)
print(" ".join(failed))
"""


@pytest.mark.slow
def test_every_module_imports_alone():
    names = [m for m in modules() if m not in NOT_IMPORTED_ALONE]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, *names], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [], proc.stderr
    assert {"fwdcheck.model.sources.hf", "fwdcheck.report.terminal", "fwdcheck.checks.rope"} <= set(names)


def imported(name: str, known: set[str]) -> set[str]:
    """The fwdcheck modules `name` imports anywhere in its file, inside functions and under TYPE_CHECKING too: a
    type-only import never runs, but a cycle through one is still two modules that cannot be read apart. An import of
    a.b.c imports the packages a.b and a first, unless they are name's own."""
    with open(importlib.util.find_spec(name).origin, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.add(node.module)
            targets.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from package import module`
    found = set()
    for target in targets & known:
        parts = target.split(".")
        # From 2: the package root (the version, and a lazy entry point) is initialised before any module in it. The
        # packages above `name` itself are initialised before it anyway: only one it names is an import of its own.
        found.update(
            package
            for package in (".".join(parts[:i]) for i in range(2, len(parts)))
            if not name.startswith(f"{package}.")
        )
        if len(parts) > 1:
            found.add(target)
    return {m for m in found & known if m != name}


def test_no_import_cycles_even_inside_functions():
    known = set(modules())
    graph = {name: imported(name, known) for name in known}
    assert "fwdcheck.run.runner" in graph["fwdcheck.process.worker"]  # the walk sees imports inside functions
    assert "fwdcheck.run.session" in graph["fwdcheck.result"]  # and type-only ones (result's `Session` annotations)
    assert "fwdcheck.report" in graph["fwdcheck.report.markdown"]  # and a module's import of its own package

    state: dict[str, str] = {}  # "open" while its imports are walked, "done" after

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (found := cycle_from(target, [*path, target])):
                return found
        state[name] = "done"
        return None

    for name in sorted(known):
        if name not in state and (found := cycle_from(name, [name])):
            pytest.fail("import cycle: " + " -> ".join(found))
