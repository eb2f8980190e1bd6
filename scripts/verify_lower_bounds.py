"""The sample configs run on the dependency versions installed here: what makes a lower bound in pyproject.toml true.

    python scripts/verify_lower_bounds.py                 # with this interpreter's packages, fwdcheck installed
    python scripts/verify_lower_bounds.py --venv /tmp/low --pin torch==2.13.0 --pin transformers==4.46.0
                                                          # a new venv with those pins and the lowest typer, click,
                                                          # rich, pydantic and pyyaml pyproject.toml allows; then run

What it runs is what a first hour runs: `fwdcheck --version`, `fwdcheck run --help`, and one `fwdcheck run` of the
small sample configs (a clean reference model, an eager GQA one, a planted missing causal mask, a checkpoint; the tiny
Llama too when transformers is installed), each with its exit code, a JSON report written with `--json PATH`, and no
warning or traceback in what it prints. Any difference is one line, and the exit code is 1. .ci/run runs it in a
venv of the lowest versions the bounds allow; docs/compatibility.md records which torch and transformers were
verified, and when.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_configs"
# config -> the exit code a correct fwdcheck gives it
CONFIGS = {
    "toy.yaml": 0,
    "reference-eager-gqa.yaml": 0,
    "broken/no-causal-mask.yaml": 1,
    "checkpoint/reference.yaml": 0,
}
WITH_TRANSFORMERS = {"hf/llama-tiny.yaml": 0}
LOWEST = ("typer", "click", "rich", "pydantic", "pyyaml")  # installed at the lowest version the bounds allow
SHOWN = ("torch", "transformers", *LOWEST, "numpy")
NOT_ALLOWED = re.compile(r"Traceback|Warning:|warnings\.warn", re.MULTILINE)


def lowest_pins() -> list[str]:
    """`name==X` for each of LOWEST, X the `>=` bound pyproject.toml declares (click: typer's own floor, as
    pyproject.toml names it)."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    bounds = {}
    for requirement in declared:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(?:\s*,.*)?", requirement)
        if match:
            bounds[match.group(1).lower()] = match.group(2)
    missing = [name for name in LOWEST if name not in bounds]
    if missing:
        sys.exit(f"pyproject.toml declares no '>=' bound for {', '.join(missing)}")
    return [f"{name}=={bounds[name]}" for name in LOWEST]


def in_venv(venv: Path, pins: list[str]) -> int:
    """A new venv with `pins` and the lowest allowed versions, fwdcheck installed from this tree without its
    dependencies (they are the pins), and this script run in it."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pins = [*pins, *(p for p in lowest_pins() if p.split("==")[0] not in {q.split("==")[0] for q in pins})]
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]  # bytecode on first import: 3x faster
    subprocess.run([*pip, *pins, "numpy", "safetensors"], check=True)
    with tempfile.TemporaryDirectory() as tmp:  # built from a copy: pip's build/ and egg-info stay out of the tree
        source = Path(tmp) / "fwdcheck"
        skip = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*_cache", ".venv", "site")
        shutil.copytree(REPO, source, ignore=skip)
        subprocess.run([*pip, "--no-deps", str(source)], check=True)
    return subprocess.run([str(python), str(Path(__file__).resolve())], cwd=tempfile.gettempdir()).returncode


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def fwdcheck(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    command = [sys.executable, "-m", "fwdcheck", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())


def problems() -> list[str]:
    found = []
    shown = fwdcheck("--version")
    if shown.returncode != 0 or version("fwdcheck") not in shown.stdout:
        found.append(f"`fwdcheck --version` exit {shown.returncode}: {(shown.stdout + shown.stderr).strip()[:200]}")
    helped = fwdcheck("run", "--help")
    if helped.returncode != 0 or "--json" not in helped.stdout:
        found.append(f"`fwdcheck run --help` exit {helped.returncode}: {helped.stderr.strip()[-300:]}")
    configs = dict(CONFIGS)
    if version("transformers") != "not installed":
        configs.update(WITH_TRANSFORMERS)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        ran = fwdcheck("run", *(str(SAMPLES / c) for c in configs), "-q", "--json", str(report))
        said = ran.stdout + ran.stderr
        if NOT_ALLOWED.search(said):
            found.append(f"`fwdcheck run` printed a warning or a traceback:\n{said}")
        if not report.is_file():
            return [*found, f"`fwdcheck run ... --json {report}` wrote no report (exit {ran.returncode}):\n{said}"]
        document = json.loads(report.read_text(encoding="utf-8"))
    reports = {(Path(tempfile.gettempdir()) / r["config"]).resolve(): r for r in document.get("reports", [document])}
    for config, expected in configs.items():
        r = reports.get((SAMPLES / config).resolve())
        if r is None:
            found.append(f"{config}: not in the report")
        elif r["exit_code"] != expected or r["environment"]["device"] != "cpu":
            found.append(
                f"{config}: exit {r['exit_code']} on {r['environment']['device']} (expected {expected} on cpu)"
            )
    if ran.returncode != max(configs.values()):
        found.append(f"`fwdcheck run` exit {ran.returncode} (expected {max(configs.values())}):\n{said}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, help="make this venv with the lowest allowed versions and run in it")
    parser.add_argument("--pin", action="append", default=[], help="name==version installed in --venv (repeat)")
    args = parser.parse_args()
    if args.venv is not None:
        return in_venv(args.venv, args.pin)
    print("verified with: " + ", ".join(f"{name} {version(name)}" for name in SHOWN), flush=True)
    found = problems()
    for problem in found:
        print(f"FAILED: {problem}")
    print("the sample configs run as they should" if not found else f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
