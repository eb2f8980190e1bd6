"""The pytest plugin: `pytest --fwdcheck PATH` turns configs into items, and the `fwdcheck` fixture.

Each test runs pytest inside pytest with pytester (in-process: torch is already imported, so a toy config takes about a
second), in a fresh directory holding a copy of sample_configs/. One test uses a subprocess, to see that the plugin
imports no torch when pytest starts without --fwdcheck.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
CHECKS = ["shape-ledger", "future-token", "mask-audit", "rope"]  # the sample toy's `checks:`
# what a config without `checks:` runs: every default check, each skipping where it does not apply
DEFAULT = [
    *("shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "packing", "label-shift", "grad-causality"),
    *("backends", "rope-precision", "attention-stats"),
]


def test_entry_point_registered(pytestconfig):
    """pytest found the plugin through its pytest11 entry point (so this very session has the fixture and option)."""
    import fwdcheck.pytest_plugin

    assert pytestconfig.pluginmanager.get_plugin("fwdcheck") is fwdcheck.pytest_plugin, (
        "the pytest11 entry point `fwdcheck` is missing: reinstall fwdcheck (pip install -e .)"
    )


WARN_CHECK = """\
from fwdcheck.result import Check, CheckResult, Finding, Status


class AlwaysWarns(Check):
    name = "always-warns"
    description = "warns"
    explain = "warns"
    codes = {"ACME901": "a warning"}

    def run(self, model, session):
        session.baseline()
        return CheckResult.from_findings(self.name, [Finding("ACME901", Status.WARN, "something to look at")],
                                         summary="something to look at")
"""

MODEL_TESTS = """\
import fwdcheck as fwdcheck_module
from fwdcheck.model.reference import build


def test_fixture_is_the_api(fwdcheck):
    assert fwdcheck is fwdcheck_module.api.check_model


def test_clean(fwdcheck):
    fwdcheck(build(vocab_size=32, d_model=16, n_heads=4)).raise_for_failures()


def test_planted_bug(fwdcheck):
    fwdcheck(build(vocab_size=32, d_model=16, n_heads=4, bugs=["no-causal-mask"])).raise_for_failures()
"""


@pytest.fixture
def tester(pytester: pytest.Pytester) -> pytest.Pytester:
    """A directory with sample_configs/, a config whose model cannot be built, one naming a check class directly
    (module:Class, beside it), and a model repo's test file using the fixture."""
    shutil.copytree(
        REPO / "sample_configs", pytester.path / "sample_configs", ignore=shutil.ignore_patterns("checkpoint")
    )
    pytester.path.joinpath("noload.yaml").write_text(
        "model: {source: python, factory: 'no_such_module_xyz:build'}\nchecks: [shape-ledger, rope]\n"
    )
    pytester.path.joinpath("warn.yaml").write_text(
        "model: {source: reference}\ninputs: {seq_len: 4}\nchecks: [mask-audit, 'acme_checks:AlwaysWarns']\n"
    )
    pytester.path.joinpath("acme_checks.py").write_text(WARN_CHECK)
    pytester.path.joinpath("test_my_model.py").write_text(MODEL_TESTS)
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    """node id -> PASSED | FAILED | SKIPPED | ERROR, from -v output."""
    found = {}
    for line in result.stdout.lines:
        match = re.match(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def section(result: pytest.RunResult, title: str) -> str:
    """The failure section headed `title` (up to the next section)."""
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if re.match(rf"^_+ {re.escape(title)} _+$", line))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^(_{3,} |={3,} )", lines[i])), len(lines))
    return "\n".join(lines[start + 1 : end])


def supervised_runs(monkeypatch) -> list[tuple[str, list[str]]]:
    """Each supervised run the plugin starts, as (its config, its checks), recorded as it starts."""
    import fwdcheck.process.supervisor

    runs = []
    run_supervised = fwdcheck.process.supervisor.run_supervised

    def recorded(job, **kwargs):
        runs.append((job.config, list(job.overrides.checks or [])))
        return run_supervised(job, **kwargs)

    monkeypatch.setattr(fwdcheck.process.supervisor, "run_supervised", recorded)
    return runs


@pytest.mark.slow
def test_configs_become_items(tester, monkeypatch):
    """One session over five configs and a model repo's own test file (pytest sessions are costly: one run)."""
    runs = supervised_runs(monkeypatch)
    configs = [
        "sample_configs/toy.yaml",
        "sample_configs/broken/no-causal-mask.yaml",
        "sample_configs/reference-learned.yaml",
        "noload.yaml",
        "warn.yaml",
    ]
    result = run(
        tester,
        *(a for c in configs for a in ("--fwdcheck", c)),
        "test_my_model.py",
        "-v",
        "-rfs",
        "--junitxml=report.xml",
    )
    result.assert_outcomes(passed=24, failed=7, skipped=2, warnings=1)
    assert result.ret == 1
    out = result.stdout.str()
    seen = outcomes(result)
    result.stdout.fnmatch_lines(["fwdcheck: configs under sample_configs/toy.yaml, *"])  # the report header

    # toy: the four built-in checks, one item each, all pass
    assert {n: seen[f"sample_configs/toy.yaml::{n}"] for n in CHECKS} == dict.fromkeys(CHECKS, "PASSED")

    # a planted bug: the checks that catch it fail with their findings as the failure text
    broken = "sample_configs/broken/no-causal-mask.yaml"
    failing = {"future-token", "mask-audit", "kv-cache", "grad-causality"}
    assert {n: seen[f"{broken}::{n}"] for n in DEFAULT} == {n: "FAILED" if n in failing else "PASSED" for n in DEFAULT}
    text = section(result, f"future-token in {broken}")
    assert text.startswith(f"fwdcheck future-token on {broken}: fail - ")
    assert "\n  FWD101 fail: earlier logits moved" in text
    assert f"rerun:   fwdcheck run {broken} --check future-token" in text
    text = section(result, f"mask-audit in {broken}")
    assert "\n  FWD201 fail: no causal restriction" in text and "\n      at layers.0.attn" in text
    assert "Traceback" not in text and "pytest_plugin.py" not in text  # the findings, not the plugin's frames
    result.stdout.fnmatch_lines(
        [f"FAILED {broken}::future-token - fail: FWD101*", f"FAILED {broken}::mask-audit - fail: FWD201*"]
    )

    # a check that does not apply skips with its reason
    assert seen["sample_configs/reference-learned.yaml::rope"] == "SKIPPED"
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]1] sample_configs/reference-learned.yaml*: rope: does not apply: no rotary embedding*"]
    )

    # a model that cannot be built: each of its items fails with fwdcheck's one line, and it is tried once
    assert seen["noload.yaml::shape-ledger"] == seen["noload.yaml::rope"] == "FAILED"
    assert section(result, "rope in noload.yaml").startswith(
        "fwdcheck: noload.yaml: factory 'no_such_module_xyz:build': cannot import 'no_such_module_xyz': "
        f"No module named 'no_such_module_xyz' (looked in {tester.path} and the installed packages: "
    )

    # a check named module:Class in the config, imported from beside it; its warning passes, as a pytest warning
    assert seen["warn.yaml::acme_checks:AlwaysWarns"] == "PASSED"
    result.stdout.fnmatch_lines(["*FwdcheckWarning: warn.yaml::acme_checks:AlwaysWarns: warn: ACME901*"])

    # the fixture, in the same session as the configs
    assert [seen[f"test_my_model.py::{t}"] for t in ("test_fixture_is_the_api", "test_clean", "test_planted_bug")] == [
        "PASSED",
        "PASSED",
        "FAILED",
    ]
    result.stdout.fnmatch_lines(
        ["E*ChecksFailed: fwdcheck: failed (exit 1)", "E*future-token FWD101: *", "E*mask-audit FWD201: *(at *)"]
    )

    # one supervised run per config, whatever the number of its items
    assert [config for config, _ in runs] == [str(tester.path / c) for c in configs]
    assert runs[0][1] == CHECKS

    # CI reads the JUnit file: the failure message carries the codes
    cases = {f"{c.get('classname')}::{c.get('name')}": c for c in ET.parse(tester.path / "report.xml").iter("testcase")}
    failure = next(c for k, c in cases.items() if k.endswith("no-causal-mask.yaml::future-token")).find("failure")
    assert "FWD101" in failure.get("message") and "FWD101 fail" in failure.text
    assert "Traceback" not in out


@pytest.mark.slow
def test_subset_and_fail_on_warn(tester, monkeypatch):
    runs = supervised_runs(monkeypatch)
    result = run(
        tester,
        "-m",
        "fwdcheck",
        "--fwdcheck",
        "sample_configs/toy.yaml",
        "--fwdcheck",
        "warn.yaml",
        "-k",
        "rope or mask or AlwaysWarns",
        "--fwdcheck-fail-on",
        "warn",
    )
    result.assert_outcomes(passed=3, failed=1, deselected=2)  # toy's shape-ledger and future-token
    # a -k subset runs only its checks, as `fwdcheck run --check` would
    assert [checks for _, checks in runs] == [["mask-audit", "rope"], ["mask-audit", "acme_checks:AlwaysWarns"]]
    result.stdout.fnmatch_lines(["  ACME901 warn: something to look at"])  # a warning fails on request


def test_collection_errors_and_what_a_directory_holds(tester):
    """Invalid configs are one collection error line each; a directory yields its configs and nothing else."""
    root = tester.path / "configs"
    (root / "nested").mkdir(parents=True)
    shutil.copy(tester.path / "sample_configs" / "toy.yaml", root / "toy.yaml")
    shutil.copy(tester.path / "sample_configs" / "reference-learned.yaml", root / "nested" / "learned.yml")
    (root / "workflow.yml").write_text("on: push\njobs: {}\n")  # YAML, not a config
    (root / "list.yaml").write_text("- model\n- data\n")  # not a mapping
    (root / "notes.txt").write_text("model: a config by content, not by extension\n")
    (root / "half-written.fwdcheck.yaml").write_text("model:\n  source: reference\n  d_model: [8\n")  # a config, broken
    # not named as a config, but its model names a source: a mistyped key is an error, never a config left out
    (root / "gpt.yaml").write_text("model: {source: python, factory: 'models:build', kwarg: {n_layer: 2}}\n")
    tester.path.joinpath("bad.yaml").write_text("model:\n  source: reference\n  n_head: 2\n")
    tester.path.joinpath("typo.yaml").write_text("model: {source: reference}\nchecks: [future-tokens]\n")
    result = run(
        tester, "--fwdcheck", "configs", "--fwdcheck", "bad.yaml", "--fwdcheck", "typo.yaml", "--collect-only", "-q"
    )
    collected = [line for line in result.stdout.lines if line.startswith("configs/") and "::" in line]
    assert collected == [f"configs/nested/learned.yml::{n}" for n in DEFAULT] + [
        f"configs/toy.yaml::{n}" for n in CHECKS
    ]
    result.assert_outcomes(errors=4)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert "left alone" not in result.stdout.str()
    for title, line in [
        ("ERROR collecting configs/gpt.yaml", "configs/gpt.yaml: model.kwarg: unknown key; did you mean 'kwargs'?*"),
        ("ERROR collecting bad.yaml", "bad.yaml: model.n_head: unknown key; did you mean 'n_heads'?"),
        ("ERROR collecting typo.yaml", "unknown check 'future-tokens'; did you mean 'future-token'? known: *"),
        (
            "ERROR collecting configs/half-written.fwdcheck.yaml",
            "configs/half-written.fwdcheck.yaml: not valid YAML at line *",
        ),
    ]:
        text = section(result, title).splitlines()
        assert len(text) == 1, text  # one line: no traceback of fwdcheck internals
        assert fnmatch.fnmatch(text[0], line), text[0]
    out = result.stdout.str()
    assert "Traceback" not in out and "fwdcheck/config/schema.py" not in out and "pydantic" not in out


def test_without_the_option_nothing_is_collected(tester):
    result = run(tester, "--collect-only", "-q")  # sample_configs/ and the configs are right there, and ignored
    assert [line for line in result.stdout.lines if "::" in line] == [
        f"test_my_model.py::{t}" for t in ("test_fixture_is_the_api", "test_clean", "test_planted_bug")
    ]
    assert "fwdcheck:" not in result.stdout.str()


def test_the_option_alone_collects_the_configs_alone(tester):
    """`pytest --fwdcheck configs/` in a repository whose ini names testpaths collects the configs, not the test
    suite too; a test path named beside it is collected as well."""
    (tester.path / "tests").mkdir()
    shutil.move(tester.path / "test_my_model.py", tester.path / "tests" / "test_my_model.py")
    (tester.path / "configs").mkdir()
    shutil.copy(tester.path / "sample_configs" / "toy.yaml", tester.path / "configs" / "toy.yaml")
    tester.makeini("[pytest]\ntestpaths = tests\n")
    config_items = [f"configs/toy.yaml::{n}" for n in CHECKS]
    test_items = [f"tests/test_my_model.py::{t}" for t in ("test_fixture_is_the_api", "test_clean", "test_planted_bug")]

    alone = run(tester, "--fwdcheck", "configs/", "--collect-only", "-q")
    assert [line for line in alone.stdout.lines if "::" in line] == config_items

    beside = run(tester, "tests", "--fwdcheck", "configs/", "--collect-only", "-q")
    assert sorted(line for line in beside.stdout.lines if "::" in line) == sorted(test_items + config_items)


def test_ini_option_collects_as_the_flag_does(tester):
    tester.makeini("[pytest]\nfwdcheck_paths = sample_configs/toy.yaml\n")
    result = run(tester, "--collect-only", "-q", "-m", "fwdcheck")  # the marker selects the config items
    assert [line for line in result.stdout.lines if "::" in line] == [f"sample_configs/toy.yaml::{n}" for n in CHECKS]


def test_missing_path_is_a_usage_error(tester):
    result = run(tester, "--fwdcheck", "nowhere.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--fwdcheck nowhere.yaml: no such file or directory*"])


@pytest.mark.slow
def test_startup_imports_no_torch(pytester):
    """A fresh interpreter: with the plugin loaded but no --fwdcheck, torch stays unimported."""
    pytester.makeconftest(
        textwrap.dedent("""
        import sys


        def pytest_collection_finish(session):
            print("fwdcheck plugin loaded:", session.config.pluginmanager.has_plugin("fwdcheck"))
            print("torch imported:", "torch" in sys.modules)
    """)
    )
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["fwdcheck plugin loaded: True", "torch imported: False"])


@pytest.mark.slow
def test_a_golden_file_beside_a_config_is_checked(tester):
    """configs/toy.golden.json beside configs/toy.yaml adds the item `golden`, compared as --expect-golden: it passes
    on the model it was made from, fails naming the first module that moved on a changed one, and a golden file of
    another config is one collection error line."""
    from typer.testing import CliRunner

    from fwdcheck.cli import app

    root = tester.path / "configs"
    root.mkdir()
    toy = (tester.path / "sample_configs" / "toy.yaml").read_text()
    (root / "toy.yaml").write_text(toy)
    made = CliRunner().invoke(app, ["run", str(root / "toy.yaml"), "--save-golden", str(root / "toy.golden.json")])
    assert made.exit_code == 0, made.output
    result = run(tester, "--fwdcheck", "configs", "-v")
    assert outcomes(result) == {f"configs/toy.yaml::{n}": "PASSED" for n in [*CHECKS, "golden"]}

    (root / "toy.yaml").write_text(toy.replace("attention: sdpa", "attention: sdpa\n  bugs: [heads-swapped]"))
    result = run(tester, "--fwdcheck", "configs", "-v")
    assert outcomes(result) == {
        **{f"configs/toy.yaml::{n}": "PASSED" for n in CHECKS},
        "configs/toy.yaml::golden": "FAILED",
    }
    text = section(result, "golden in configs/toy.yaml")
    assert "\n  FWD961 fail: layers.0.attn.o_proj: output moved by " in text
    assert "rerun:   fwdcheck run configs/toy.yaml --expect-golden configs/toy.golden.json" in text

    (root / "toy.yaml").write_text(toy.replace("seed: 0", "seed: 5"))
    result = run(tester, "--fwdcheck", "configs")
    assert result.ret == 2
    result.stdout.fnmatch_lines(["configs/toy.golden.json: made with another config: seed 0 (this run: 5)*"])


@pytest.mark.slow
def test_a_yaml_of_another_tool_is_left_alone(tester):
    """A Hydra-style configs/train.yaml with a `model:` key of its own is no collection error: it is left alone and
    named in the summary, while the configs beside it are collected; a file named as a config reports its errors,
    and the ini option fwdcheck_files changes what a config's name is."""
    root = tester.path / "configs"
    root.mkdir()
    (root / "train.yaml").write_text(
        "defaults: [_self_]\nmodel:\n  _target_: mylib.GPT\n  n_layer: 12\noptim: {lr: 3e-4}\n"
    )
    shutil.copy(tester.path / "sample_configs" / "toy.yaml", root / "toy.yaml")
    shutil.copy(tester.path / "sample_configs" / "toy.yaml", root / "fwdcheck-gpt.yaml")
    result = run(tester, "--fwdcheck", "configs", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK
    items = [line for line in result.stdout.lines if "::" in line]
    assert items == [f"configs/fwdcheck-gpt.yaml::{n}" for n in CHECKS] + [f"configs/toy.yaml::{n}" for n in CHECKS]
    result.stdout.fnmatch_lines(["fwdcheck: left alone configs/train.yaml: not a fwdcheck config (*); *"])

    # the same file, named as a config is: its error is the collection error it should be
    shutil.copy(root / "train.yaml", root / "train.fwdcheck.yaml")
    result = run(tester, "--fwdcheck", "configs", "--collect-only", "-q")
    result.assert_outcomes(errors=1)
    assert "ERROR collecting configs/train.fwdcheck.yaml" in result.stdout.str()
    (root / "train.fwdcheck.yaml").unlink()

    # every *.yaml a config by its name: the ini option, as python_files
    tester.makeini("[pytest]\nfwdcheck_files = *.yaml\n")
    result = run(tester, "--fwdcheck", "configs", "--collect-only", "-q")
    result.assert_outcomes(errors=1)
    assert "ERROR collecting configs/train.yaml" in result.stdout.str()
