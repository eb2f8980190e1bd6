"""The command line of a new interpreter that runs one of fwdcheck's process entry points (the worker, the fork
server), importing fwdcheck from where this process's own fwdcheck lives.

`python -m fwdcheck.process.worker` would put the working directory first on the import path: a project (or a config's
folder) holding a `fwdcheck/` directory of its own would then shadow the installed package, and the worker would
run another fwdcheck, or none ("cannot import name '__version__'"). The command below imports the package from its
own parent directory first, then takes that entry off the path again, so that the model's imports see the path a
new interpreter started there would have.
"""

from __future__ import annotations

import sys
from pathlib import Path

import fwdcheck

# Run with `python -c`: argv[1] is the module, the rest its arguments (its `main(argv)` takes them).
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, {root!r}); import fwdcheck; sys.path.remove({root!r}); "
    "import importlib; importlib.import_module(sys.argv[1]).main(sys.argv[2:])"
)


def package_root() -> str:
    """The directory this process's fwdcheck package sits in: first on the path, it imports that fwdcheck."""
    return str(Path(fwdcheck.__file__).resolve().parent.parent)


def command(module: str, *args: str) -> list[str]:
    """`python -c ...` running `module.main(args)`, the module named as the command line's first argument (so that a
    process list names it: `... fwdcheck.process.worker 7 1234`)."""
    return [sys.executable, "-c", _BOOTSTRAP.format(root=package_root()), module, *args]
