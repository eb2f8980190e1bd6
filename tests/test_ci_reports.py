"""Reports CI systems read: JUnit XML, GitHub annotations and job summary, markdown, HTML/SVG, the JSON schema,
ignored codes, and the shape-ledger contract (--save-ledger / --expect-ledger)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.report.github import MAX_PER_KIND, escape_data, escape_property, to_github
from fwdcheck.report.schema import JSON_REPORT_SCHEMA
from fwdcheck.result import CheckResult, Finding, Status
from tests.conftest import run_checks

ROOT = Path(__file__).resolve().parent.parent
TOY = str(ROOT / "sample_configs" / "toy.yaml")
BROKEN = str(ROOT / "sample_configs" / "broken" / "no-causal-mask.yaml")


def invoke(*args):
    return CliRunner().invoke(app, ["run", *map(str, args)])


@pytest.mark.slow
def test_junit_has_a_case_per_check_with_codes_and_properties(tmp_path):
    result = invoke(BROKEN, "--junit", tmp_path / "r.xml", "--json", tmp_path / "r.json")
    assert result.exit_code == 1
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    train = "[train mode, default attention, mask absent, B=3]"  # the train path's cell of each per-path check
    assert set(cases) == {
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
        f"future-token {train}",
        f"mask-audit {train}",
    }
    assert all(c.get("classname") == f"fwdcheck.{n.split(' ')[0]}" for n, c in cases.items())
    failure = cases["future-token"].find("failure")
    assert "FWD101" in failure.get("message") and "FWD101" in failure.text
    assert cases["mask-audit"].find("failure") is not None and cases["rope"].find("failure") is None
    assert cases[f"future-token {train}"].find("failure") is not None  # the dropped mask, on the train path too
    assert cases["kv-cache"].find("failure") is not None and cases["grad-causality"].find("failure") is not None
    assert (suite.get("tests"), suite.get("failures")) == ("13", "6")  # the cached decode and gradients read it too
    properties = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert {"fwdcheck", "torch", "python", "device", "dtype", "seed"} <= set(properties)
    assert json.loads((tmp_path / "r.json").read_text())["exit_code"] == 1  # written in the same run


@pytest.mark.slow
def test_junit_lists_every_code_path_cell(tmp_path):
    config = tmp_path / "paths.yaml"
    config.write_text(
        f"model: {{source: python, factory: 'tests.models:path_bug', kwargs: {{bug: mask-ignored}}, "
        f"path: ['{ROOT}']}}\npaths: {{enabled: true, batch_size: [2]}}\n"
        "checks: [future-token]\n"
    )
    assert invoke(config, "--format", "junit", "--output", tmp_path / "r.xml").exit_code == 1
    cases = ET.parse(tmp_path / "r.xml").getroot().find("testsuite").findall("testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert len(cases) == 1 + 6 + 1 and all("left-pad" in name for name in failed[1:]) and len(failed) == 3
    assert cases[-1].get("name") == "future-token [train mode, default attention, mask absent, B=2]"


def test_github_annotations_point_at_model_code_and_escape():
    report = run_checks({"source": "reference", "bugs": ["no-causal-mask"]})
    text = to_github(report)
    assert "::error file=fwdcheck/model/reference.py,line=" in text  # the attention class of the reference model
    assert text.rstrip().endswith("fwdcheck failed (exit 1)")
    assert escape_data("50% a\r\nb") == "50%25 a%0D%0Ab"
    assert escape_property("a:b,c") == "a%3Ab%2Cc"


def test_github_caps_annotations_and_counts_the_rest():
    report = run_checks({"source": "reference"}, ["rope"])
    many = [Finding("FWD999", Status.FAIL, f"problem {i}") for i in range(MAX_PER_KIND + 5)]
    report.results.append(CheckResult("flood", Status.FAIL, "many", many))
    lines = to_github(report).splitlines()
    assert sum(line.startswith("::error") for line in lines) == MAX_PER_KIND
    assert any(line.startswith("::notice") and "5 more errors" in line for line in lines)


@pytest.mark.slow
def test_github_format_appends_the_step_summary(tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = invoke(TOY, "--format", "github")
    assert result.exit_code == 0 and "fwdcheck passed (exit 0)" in result.stdout
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "| future-token | ✅ pass |" in text


@pytest.mark.slow
def test_markdown_html_and_svg_exports(tmp_path):
    result = invoke(BROKEN, "--markdown", tmp_path / "r.md", "--html", tmp_path / "r.html", "--svg", tmp_path / "r.svg")
    assert result.exit_code == 1
    markdown = (tmp_path / "r.md").read_text()
    assert "| mask-audit | ❌ fail |" in markdown and "| FWD201 |" in markdown
    html = (tmp_path / "r.html").read_text()
    assert html.lstrip().startswith("<!DOCTYPE html>") and "FWD101" in html and "query\\k" in html
    assert "<title>fwdcheck no-causal-mask.yaml: failed</title>" in html  # the browser tab's name
    assert (tmp_path / "r.svg").read_text().lstrip().startswith("<svg")


@pytest.mark.slow
def test_json_report_validates_against_the_published_schema(tmp_path):
    schema = json.loads(CliRunner().invoke(app, ["schema", "--json-report"]).stdout)
    assert schema == JSON_REPORT_SCHEMA
    for config in (TOY, BROKEN):
        document = json.loads(invoke(config, "--format", "json").stdout)
        jsonschema.validate(document, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"schema_version": 1}, schema)


@pytest.mark.slow
def test_ignored_codes_still_show_but_do_not_count(tmp_path):
    config = tmp_path / "ignore.yaml"
    config.write_text(
        "model: {source: reference, bugs: [float-mask-01]}\nchecks: [mask-audit]\n"
        "ignore: [{code: FWD203, reason: 'known; fixed upstream in #12'}]\n"
    )
    result = invoke(config, "--format", "json")
    assert result.exit_code == 0
    finding = json.loads(result.stdout)["checks"][0]["findings"][0]
    assert finding["code"] == "FWD203" and finding["ignored"] == "known; fixed upstream in #12"
    missing_reason = tmp_path / "bad.yaml"
    missing_reason.write_text("model: {source: reference}\nignore: [{code: FWD203}]\n")
    bad = invoke(missing_reason)
    assert bad.exit_code == 2 and "ignore[0].reason" in bad.stderr


@pytest.mark.slow
def test_ledger_contract_catches_a_changed_head_layout(tmp_path):
    ledger = tmp_path / "ledger.json"
    assert invoke(TOY, "--save-ledger", ledger).exit_code == 0
    saved = json.loads(ledger.read_text())
    assert {"name": "logits", "shape": [2, 4, 16], "dims": ["B", "T", "V"], "dtype": "float32"} in saved["entries"]
    assert invoke(TOY, "--expect-ledger", ledger).exit_code == 0  # the same model: no difference
    gqa = tmp_path / "gqa.yaml"
    gqa.write_text(Path(TOY).read_text().replace("n_heads: 2", "n_heads: 2\n  n_kv_heads: 1"))
    changed = invoke(gqa, "--expect-ledger", ledger, "--format", "json")
    assert changed.exit_code == 1
    ledger_result = json.loads(changed.stdout)["checks"][0]
    assert {f["code"] for f in ledger_result["findings"]} == {"FWD406"}
    assert ledger_result["data"]["ledger_diff"] == ["dimension h_kv: 2 -> 1"]
    transposed = tmp_path / "eager.yaml"  # the eager path records q @ k^T instead of SDPA's q, k, v
    transposed.write_text(Path(TOY).read_text().replace("attention: sdpa", "attention: eager"))
    eager = json.loads(invoke(transposed, "--expect-ledger", ledger, "--format", "json").stdout)["checks"][0]
    assert {f["code"] for f in eager["findings"]} == {"FWD405"}
    assert "tensor layers.0.attn q [B,h,T,d_h] is gone" in eager["data"]["ledger_diff"]


def test_ledger_errors_are_usage_errors(tmp_path):
    assert invoke(TOY, "--expect-ledger", tmp_path / "none.json").exit_code == 2
    (tmp_path / "bad.json").write_text("[1, 2]")
    result = invoke(TOY, "--expect-ledger", tmp_path / "bad.json")
    assert result.exit_code == 2 and "not a ledger" in result.stderr
    assert invoke(TOY, "--check", "rope", "--save-ledger", tmp_path / "x.json").exit_code == 2
    # A key given twice: json.loads would keep the last (an empty ledger would compare nothing).
    (tmp_path / "twice.json").write_text(
        '{\n "entries": [{"name": "logits", "dims": ["B", "T", "V"]}],\n "entries": []\n}'
    )
    twice = invoke(TOY, "--expect-ledger", tmp_path / "twice.json")
    assert twice.exit_code == 2 and "the key 'entries' is given twice, at line 2 and at line 3" in twice.stderr


def test_github_annotations_are_relative_to_the_repository_root(tmp_path, monkeypatch):
    """GitHub places an annotation by its path from the repository's root ($GITHUB_WORKSPACE): a step that ran in a
    subdirectory (`working-directory: sub/`) names the model code from the root, not from where it ran."""
    report = run_checks({"source": "reference", "bugs": ["no-causal-mask"]})
    monkeypatch.chdir(ROOT)  # the report names fwdcheck/model/reference.py from here
    monkeypatch.setenv("GITHUB_WORKSPACE", str(ROOT.parent))  # a checkout whose root is one level up
    assert f"::error file={ROOT.name}/fwdcheck/model/reference.py,line=" in to_github(report)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(ROOT))  # fwdcheck ran at the root
    assert "::error file=fwdcheck/model/reference.py,line=" in to_github(report)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path))  # model code outside the checkout: as the report says
    assert "::error file=fwdcheck/model/reference.py,line=" in to_github(report)
    monkeypatch.delenv("GITHUB_WORKSPACE")  # outside Actions
    assert "::error file=fwdcheck/model/reference.py,line=" in to_github(report)
