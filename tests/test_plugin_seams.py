"""A plugin gets every seam a built-in check has, with no edit outside its own files: its own section of the config
(`options:`), its own command-line flag, its own terminal view with a typed record, its own finding codes, which
`fwdcheck explain CODE` finds; and a plugin's codes cannot be mistaken for another check's."""

from __future__ import annotations

import json
import sys

import pytest

from tests.test_plugins import config, invoke, toy, write_dist_info

# The plugin's torch-free face: its options, the record its data holds, and its view (read by the command line and
# the report, which never import the check itself).
FACE = """
from typing import TypedDict

from pydantic import Field
from rich.text import Text

from fwdcheck.config import CheckOptions


class Options(CheckOptions):
    limit: float = Field(100.0, gt=0, description="the largest |logit| allowed")


class Bound(TypedDict):
    largest: float
    limit: float


def bound_view(result):
    data: Bound = result.data["bound"]
    return Text(f"acme view: largest |logit| {data['largest']:.3g}, limit {data['limit']:g}")
"""

CHECK = """
from fwdcheck.result import Check, CheckResult, Finding, Status
from acme_bound_face import Bound


class LogitBound(Check):
    name = "acme-bound"
    description = "logits stay under a limit"
    explain = "Every logit of the baseline forward stays under options.acme-bound.limit."
    codes = {"ACME101": "a logit's magnitude is over the limit"}
    default = False
    options = "acme_bound_face:Options"
    flags = {"--acme-limit": "limit"}
    detail_view = "acme_bound_face:bound_view"

    def run(self, model, session):
        limit = self.options_in(session).limit
        largest = float(session.baseline().abs().max())
        data: Bound = {"largest": largest, "limit": limit}
        findings = [Finding("ACME101", Status.FAIL, f"|logit| {largest:.3g} over {limit:g}")] if largest > limit else []
        return CheckResult.from_findings(self.name, findings, f"largest |logit| {largest:.3g}", data={"bound": data})
"""

STEALS_A_CODE = """
from fwdcheck.result import Check, CheckResult, Status


class Thief(Check):
    name = "{name}"
    description = "declares a code it does not own"
    explain = ""
    codes = {{"{code}": "borrowed"}}
    default = False

    def run(self, model, session):
        return CheckResult(self.name, Status.PASS, "ran")
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    site = tmp_path / "site"
    write_dist_info(site, "acme-bound", {"acme-bound": "acme_bound:LogitBound"})
    (site / "acme_bound.py").write_text(CHECK)
    (site / "acme_bound_face.py").write_text(FACE)
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("acme_bound", "acme_bound_face"):
        sys.modules.pop(name, None)


def run_json(*args):
    result = invoke("run", *args, "--format", "json")
    return result, {c["name"]: c for c in json.loads(result.stdout)["checks"]} if result.stdout.strip() else {}


def test_a_plugins_options_come_from_its_own_section_and_its_flag(plugin, tmp_path):
    tight = config(tmp_path / "tight.yaml", **toy(checks=["acme-bound"], options={"acme-bound": {"limit": 1e-6}}))
    result, checks = run_json(tight)
    assert result.exit_code == 1 and [f["code"] for f in checks["acme-bound"]["findings"]] == ["ACME101"]
    assert checks["acme-bound"]["data"]["bound"]["limit"] == 1e-6
    result, checks = run_json(tight, "--acme-limit", "1e9")  # the flag wins over the config
    assert result.exit_code == 0 and checks["acme-bound"]["data"]["bound"]["limit"] == 1e9
    defaults = config(tmp_path / "defaults.yaml", **toy(checks=["acme-bound"]))
    assert run_json(defaults)[1]["acme-bound"]["data"]["bound"]["limit"] == 100.0


def test_a_plugins_view_flag_and_codes_are_the_command_lines(plugin, tmp_path):
    tight = config(tmp_path / "tight.yaml", **toy(checks=["acme-bound"], options={"acme-bound": {"limit": 1e-6}}))
    shown = " ".join(invoke("run", tight).stdout.split())
    assert "acme view: largest |logit|" in shown and "ACME101" in shown
    assert "--acme-limit VALUE" in invoke("run", "--help").stdout
    explained = invoke("explain", "ACME101")
    assert explained.exit_code == 0 and "a logit's magnitude is over the limit" in explained.stdout
    listed = " ".join(invoke("explain", "acme-bound").stdout.split())
    assert "limit 100.0 --acme-limit the largest |logit| allowed" in listed


def test_a_wrong_plugin_option_is_one_line_naming_it(plugin, tmp_path):
    for options, said in [
        ({"limt": 3}, "options.acme-bound.limt: unknown key; did you mean 'limit'?"),
        ({"limit": -1}, "options.acme-bound.limit: Input should be greater than 0"),
        ({"limit": "x"}, "options.acme-bound.limit: Input should be a valid number"),
    ]:
        path = config(tmp_path / "wrong.yaml", **toy(checks=["acme-bound"], options={"acme-bound": options}))
        result = invoke("run", path)
        assert result.exit_code == 2 and said in result.output, result.output
        assert "Traceback" not in result.output
    result = invoke("run", config(tmp_path / "flag.yaml", **toy(checks=["acme-bound"])), "--acme-limit", "-3")
    assert result.exit_code == 2 and "options.acme-bound.limit: Input should be greater than 0" in result.output


@pytest.mark.parametrize(
    "code, why",
    [("FWD101", "the FWD prefix is fwdcheck's own"), ("ACME101", "which acme-bound[acme-bound] already declares")],
)
def test_a_plugin_cannot_take_another_checks_code(plugin, tmp_path, monkeypatch, code, why):
    site = tmp_path / "thief"
    write_dist_info(site, "acme-thief", {"acme-thief": "acme_thief:Thief"})
    (site / "acme_thief.py").write_text(STEALS_A_CODE.format(name="acme-thief", code=code))
    monkeypatch.syspath_prepend(str(site))
    try:
        result, checks = run_json(config(tmp_path / "t.yaml", **toy(checks=["acme-thief", "acme-bound"])))
    finally:
        sys.modules.pop("acme_thief", None)
    assert checks["acme-thief"]["status"] == "error" and why in checks["acme-thief"]["summary"]
    assert checks["acme-bound"]["status"] == "pass"  # the check that owns its codes still runs


def test_an_options_section_for_no_such_check_is_refused_with_a_did_you_mean(tmp_path):
    path = config(tmp_path / "typo.yaml", **toy(options={"future-tokn": {"exhaustive": True}}))
    result = invoke("run", path)
    assert result.exit_code == 2 and "options.future-tokn: no such check; did you mean 'future-token'?" in result.output


@pytest.mark.parametrize("section", [3, "fast", [1]])
def test_a_check_section_that_is_not_a_mapping_is_one_line(tmp_path, section):
    result = invoke("run", config(tmp_path / "s.yaml", **toy(options={"future-token": section})))
    assert result.exit_code == 2 and "options.future-token: Input should be a valid dictionary" in result.output
    assert "Traceback" not in result.output and "internal error" not in result.output


def test_the_former_exhaustive_key_still_turns_on_each_checks_thorough_variant(tmp_path):
    from fwdcheck.config import config_from_dict

    config_ = config_from_dict({"model": {"source": "reference"}, "exhaustive": True})
    assert config_.options == {"future-token": {"exhaustive": True}, "backends": {"flex": True}}
    kept = config_from_dict(
        {"model": {"source": "reference"}, "exhaustive": True, "options": {"future-token": {"exhaustive": False}}}
    )
    assert kept.options["future-token"] == {"exhaustive": False}  # the check's own section wins
