"""Third-party checks: the example plugin installed for real, checks named as module:Class, and broken plugins.

The example plugin (examples/plugin, distribution fwdcheck-logit-bound) is pip-installed into a virtual environment
created once for this module (`python -m venv --system-site-packages`, so torch and fwdcheck are visible; pip and
setuptools come from the system site too). Where that cannot be done, the entry point is registered the way an
installed distribution registers it: a `*.dist-info` directory with an `entry_points.txt` on PYTHONPATH, which
importlib.metadata reads exactly as it reads an installed one. Broken plugins are registered that way, in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from site import getsitepackages

import pytest
import yaml
from typer.testing import CliRunner

from fwdcheck.cli import app

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "examples" / "plugin"
TOY = REPO / "sample_configs" / "toy.yaml"
BUILTINS = [  # the default checks, in their order
    "shape-ledger",
    "future-token",
    "mask-audit",
    "rope",
    "kv-cache",
    "packing",
    "label-shift",
    "grad-causality",
    "backends",
    "rope-precision",
    "attention-stats",
]
LABEL = "fwdcheck-logit-bound[logit-bound]"
TIMEOUT = 180

runner = CliRunner()
pytest_plugins = ["pytester"]

HUGE_LOGITS = '''\
"""A reference transformer with the classic initialisation bug: the output layer tied to an nn.Embedding left at its
default N(0, 1) init (instead of std ~0.02): logits of order sqrt(d)."""
import torch
from fwdcheck.model.reference import build as reference


def build():
    torch.manual_seed(0)
    model = reference(vocab_size=256, d_model=64, n_heads=4, n_layers=2)
    model.lm_head.weight = model.wte.weight
    return model
'''


def write_dist_info(site: Path, name: str, entry_points: dict[str, str], version: str = "1.0") -> Path:
    """Register entry points of group fwdcheck.checks as an installed distribution would: a dist-info directory."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[fwdcheck.checks]\n{lines}")
    return info


@dataclass
class Environment:
    python: str
    env: dict[str, str]
    how: str  # "venv" or "dist-info"
    work: Path

    def fwdcheck(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.python, "-m", "fwdcheck", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=self.env,
            cwd=cwd or self.work,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Environment:
    """fwdcheck-logit-bound installed next to fwdcheck, once for the module."""
    work = tmp_path_factory.mktemp("plugin")
    source = work / "fwdcheck-logit-bound"
    # a copy: pip builds in the source tree (build/, *.egg-info), which must not land in the checkout
    shutil.copytree(
        PLUGIN, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", ".pytest_cache")
    )
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    venv = work / "venv"
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
            check=True,
            capture_output=True,
            timeout=TIMEOUT,
        )
        # --system-site-packages reaches the base interpreter's packages; when these tests run from a virtual
        # environment, fwdcheck and torch are in its site-packages instead, which the new one adds (with their .pth
        # files, an editable install's among them).
        site_dir = next(venv.glob("lib/python*/site-packages"), None) or venv / "Lib" / "site-packages"
        (site_dir / "fwdcheck_test_parent.pth").write_text(
            "".join(f"import site; site.addsitedir({path!r})\n" for path in getsitepackages())
        )
        subprocess.run(
            [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(source)],
            check=True,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=env,
        )
        return Environment(str(python), env, "venv", work)
    except (subprocess.CalledProcessError, OSError) as exc:  # no setuptools/pip visible there: register by hand
        detail = getattr(exc, "stderr", "") or str(exc)
        site = work / "site"
        write_dist_info(site, "fwdcheck-logit-bound", {"logit-bound": "fwdcheck_logit_bound:LogitBound"}, "0.1.0")
        shutil.copy(source / "fwdcheck_logit_bound.py", site / "fwdcheck_logit_bound.py")
        print(f"pip install into a venv failed, registered through a dist-info instead: {detail[-500:]}")
        return Environment(sys.executable, {**env, "PYTHONPATH": str(site)}, "dist-info", work)


def config(path: Path, **document) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def toy(**top) -> dict:
    document = yaml.safe_load(TOY.read_text())
    document.pop("checks")  # every registered check, the plugin's included
    return {**document, **top}


# -- the example plugin, installed -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_installed_plugin_is_listed(installed):
    proc = installed.fwdcheck("list")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    row = next(r for r in rows if r and r[0] == "logit-bound")
    assert row[1] == LABEL
    assert "finite" in " ".join(row[2:])
    named = [r[0] for r in rows[1:] if len(r) > 1 and "[" in r[1]]  # rows that start a check (name, label, ...)
    assert [n for n in named if n in BUILTINS] == BUILTINS  # the default built-ins in their order
    builtins = [r[0] for r in rows[1:] if len(r) > 1 and r[1].startswith("fwdcheck[")]
    assert named.index("logit-bound") == len(builtins)  # a plugin after every built-in


@pytest.mark.slow
def test_installed_plugin_runs_and_passes_on_the_toy_model(installed):
    path = config(installed.work / "toy-all.yaml", **toy())
    proc = installed.fwdcheck("run", path, "--format", "json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert [c["name"] for c in report["checks"]] == [*BUILTINS, "logit-bound"]
    check = report["checks"][-1]
    assert check["status"] == "pass" and check["findings"] == []
    assert check["metrics"]["max_abs_logit"] < check["metrics"]["bound"] == 30


@pytest.mark.slow
def test_installed_plugin_fails_a_model_with_huge_logits(installed):
    (installed.work / "huge_logits.py").write_text(HUGE_LOGITS)
    path = config(
        installed.work / "huge.yaml",
        model={"source": "python", "factory": "huge_logits:build"},
        inputs={"batch_size": 2, "seq_len": 8},
        checks=["shape-ledger", "logit-bound"],
    )
    proc = installed.fwdcheck("run", path, "--format", "json")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["shape-ledger"]["status"] == "pass"
    assert checks["logit-bound"]["status"] == "fail"
    assert [f["code"] for f in checks["logit-bound"]["findings"]] == ["LOGIT102"]
    assert "exceeds the bound 30" in checks["logit-bound"]["findings"][0]["message"]


def test_example_plugin_own_tests_pass(pytester):
    """The tests shipped with the plugin (one model it must pass, one per code it must flag) pass as shipped."""
    result = pytester.runpytest(
        str(PLUGIN / "tests"), "-p", "no:cacheprovider", f"--rootdir={PLUGIN}", "-c", str(PLUGIN / "pyproject.toml")
    )
    result.assert_outcomes(passed=7, skipped=1)  # skipped: the entry point, when the plugin is not installed here


# -- module:Class in a config, without registering ---------------------------------------------------------------------


DIRECT_CHECK = '''\
from fwdcheck.errors import SkipCheck
from fwdcheck.result import Check, CheckResult, Finding, Status


class VocabularyUsed(Check):
    """Every position's most likely token is a real token id (a check of one's own, named as module:Class)."""

    name = "vocabulary-used"
    description = "argmax of the logits is a valid token id"
    explain = "illustration"
    codes = {"ACME101": "argmax outside the vocabulary"}

    def run(self, model, session):
        if model.vocab_size < 2:
            raise SkipCheck("a vocabulary of one token")
        logits = session.baseline()
        top = int(logits.argmax(-1).max())
        status = Status.PASS if top < model.vocab_size else Status.FAIL
        return CheckResult.from_findings(self.name, [Finding("ACME101", status, f"largest argmax {top}")],
                                         summary=f"largest argmax {top} of {model.vocab_size}")
'''


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working directory holding a check module of one's own; fwdcheck runs from there."""
    (tmp_path / "acme_direct.py").write_text(DIRECT_CHECK)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("acme_direct", None)


@pytest.mark.slow
def test_config_names_a_check_class_directly(project):
    path = config(project / "direct.yaml", **toy(checks=["shape-ledger", "acme_direct:VocabularyUsed"]))
    result = invoke("run", path, "--format", "json")
    assert result.exit_code == 0, result.output
    checks = json.loads(result.stdout)["checks"]
    assert [c["name"] for c in checks] == ["shape-ledger", "vocabulary-used"]  # the check's own name in the report
    assert checks[1]["status"] == "pass" and checks[1]["findings"][0]["code"] == "ACME101"


@pytest.mark.slow
def test_check_flag_names_a_class_directly(project):
    result = invoke("run", TOY, "--check", "acme_direct:VocabularyUsed", "--format", "json")
    assert result.exit_code == 0, result.output
    assert [c["name"] for c in json.loads(result.stdout)["checks"]] == ["vocabulary-used"]
    result = invoke("explain", "acme_direct:VocabularyUsed")
    assert result.exit_code == 0 and "ACME101" in result.stdout


@pytest.mark.slow
def test_direct_class_that_does_not_import_is_an_error_naming_it(project):
    path = config(project / "direct.yaml", **toy(checks=["shape-ledger", "acme_nowhere:Check"]))
    result = invoke("run", path, "--format", "json")
    assert result.exit_code == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["shape-ledger"]["status"] == "pass"
    failed = checks["acme_nowhere:Check"]
    assert failed["status"] == "error" and failed["findings"][0]["code"] == "FWD001"
    assert "check acme_nowhere:Check failed to load" in failed["summary"]
    assert "No module named 'acme_nowhere'" in failed["summary"]


@pytest.mark.slow
def test_a_check_whose_run_returns_none_is_its_own_internal_error(project):
    """A plugin's run() that forgets its return value: that check errors (FWD003, exit 3: a bug in check code, not in
    the model) and the checks before and after it still run and are reported."""
    (project / "acme_none.py").write_text(
        DIRECT_CHECK.replace("        return CheckResult.from_findings(", "        CheckResult.from_findings(")
    )
    path = config(project / "none.yaml", **toy(checks=["shape-ledger", "acme_none:VocabularyUsed", "rope"]))
    try:
        result = invoke("run", path, "--format", "json")
    finally:
        sys.modules.pop("acme_none", None)
    assert result.exit_code == 3, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["shape-ledger"]["status"] == "pass" and checks["rope"]["status"] == "pass"
    failed = checks["acme_none:VocabularyUsed"]
    assert failed["status"] == "error" and [f["code"] for f in failed["findings"]] == ["FWD003"]
    assert "VocabularyUsed.run() returned None, not a CheckResult" in failed["summary"]


@pytest.mark.parametrize("reference", ["acme_direct:", "acme_direct:Vocabulary:Used", "acme direct:VocabularyUsed"])
def test_malformed_direct_reference_is_a_usage_error(project, reference):
    path = config(project / "direct.yaml", **toy(checks=["shape-ledger", reference]))
    result = invoke("run", path)
    assert result.exit_code == 2
    assert f"check '{reference}' is not of the form 'package.module:Class'" in result.stderr


# -- broken plugins ----------------------------------------------------------------------------------------------------


@pytest.fixture
def broken_plugins(tmp_path, monkeypatch):
    """Three plugins that cannot load: a missing module, a module raising at import, one calling sys.exit()."""
    site = tmp_path / "site"
    write_dist_info(
        site,
        "acme-broken",
        {
            "acme-missing": "acme_missing_module:Check",
            "acme-raises": "acme_raises:Check",
            "acme-exits": "acme_exits:Check",
        },
    )
    (site / "acme_raises.py").write_text("raise RuntimeError('plugin bug at import time')\n")
    (site / "acme_exits.py").write_text("import sys\nsys.exit('no GPU, giving up')\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("acme_missing_module", "acme_raises", "acme_exits"):
        sys.modules.pop(name, None)


@pytest.mark.slow
def test_broken_plugins_error_by_name_and_the_rest_runs(broken_plugins, tmp_path):
    path = config(tmp_path / "toy-all.yaml", **toy())
    result = invoke("run", path, "--format", "json")
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    for name in BUILTINS:  # the toy's 4 tokens are too short to pack three documents: packing skips, saying so
        assert checks[name]["status"] in ("pass", "skip"), checks[name]["summary"]
        assert checks[name]["status"] == "pass" or checks[name]["summary"], name
    assert {checks[name]["status"] for name in BUILTINS[:4]} == {"pass"}
    expected = {
        "acme-missing": "No module named 'acme_missing_module'",
        "acme-raises": "RuntimeError: plugin bug at import time",
        "acme-exits": "no GPU, giving up",
    }  # sys.exit() in a plugin ends only that plugin
    for name, reason in expected.items():
        failed = checks[name]
        assert failed["status"] == "error"
        assert failed["summary"].startswith(f"check acme-broken[{name}] failed to load"), failed["summary"]
        assert reason in failed["summary"]
        assert name != "acme-exits" or "SystemExit" in failed["summary"]
        assert [f["code"] for f in failed["findings"]] == ["FWD001"]


def test_broken_plugins_are_listed_with_their_error(broken_plugins):
    result = invoke("list")
    assert result.exit_code == 0
    listing = " ".join(result.stdout.split())
    assert "acme-broken[acme-raises]" in listing and "plugin bug at import time" in listing
    assert "acme-broken[acme-missing]" in listing and "rope" in listing


def test_a_plugin_cannot_replace_a_builtin(tmp_path, monkeypatch):
    """A plugin registering a built-in's name does not take it over, wherever it sits on sys.path."""
    site = tmp_path / "site"
    write_dist_info(site, "acme-shadow", {"rope": "acme_shadow:Rope"})
    monkeypatch.syspath_prepend(str(site))
    from fwdcheck.config.registry import available

    assert available()["rope"].label == "fwdcheck[rope]"


OPT_IN_CHECK = """
from fwdcheck.result import Check, CheckResult, Status


class Expensive(Check):
    name = "acme-expensive"
    description = "a check that runs only when named"
    explain = "illustration"
    codes = {}
    default = False

    def run(self, model, session):
        return CheckResult(self.name, Status.PASS, "ran")
"""


@pytest.fixture
def opt_in_plugin(tmp_path, monkeypatch):
    """An installed plugin whose check says `default = False`."""
    site = tmp_path / "site"
    write_dist_info(site, "acme-opt-in", {"acme-expensive": "acme_opt_in:Expensive"})
    (site / "acme_opt_in.py").write_text(OPT_IN_CHECK)
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop("acme_opt_in", None)


@pytest.mark.slow
def test_a_check_outside_the_default_runs_only_when_named(opt_in_plugin, tmp_path):
    from fwdcheck.config.registry import select

    assert [e.name for e in select(None)] == BUILTINS
    assert [e.name for e in select(["default"])] == BUILTINS
    assert [e.name for e in select(["default", "acme-expensive"])] == [*BUILTINS, "acme-expensive"]
    assert "acme-expensive" in [e.name for e in select(["all"])]
    assert [e.name for e in select(["rope", "all"])][0] == "rope"  # named order first, no duplicates
    listing = invoke("list").stdout
    row = next(line for line in listing.splitlines() if line.startswith("acme-expensive"))
    assert " no " in row, listing
    path = config(tmp_path / "opt-in.yaml", **toy(checks=["default", "acme-expensive"]))
    result = invoke("run", path, "--format", "json", "--check", "acme-expensive")
    assert result.exit_code == 0, result.output
    assert [c["name"] for c in json.loads(result.stdout)["checks"]] == ["acme-expensive"]
