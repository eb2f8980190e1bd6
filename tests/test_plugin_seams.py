"""A plugin gets every seam a built-in check has, with no edit outside its own files: its own section of the config
(`options:`), its own command-line flag, its own files to save and compare with (as --save-golden/--expect-golden),
its own terminal view with a typed record, its own finding codes, which `fwdcheck explain CODE` finds, a former
top-level key of its own; and a plugin's codes cannot be mistaken for another check's."""

from __future__ import annotations

import json
import sys

import pytest

from tests.test_plugins import config, invoke, toy, write_dist_info

# The plugin's torch-free face: its options, the record its data holds, and its view (read by the command line and
# the report, which never import the check itself).
FACE = """
import json
from typing import TypedDict

from pydantic import Field
from rich.text import Text

from fwdcheck.config.schema import CheckOptions
from fwdcheck.errors import UsageError


class Options(CheckOptions):
    limit: float = Field(100.0, gt=0, description="the largest |logit| allowed")


class Bound(TypedDict):
    largest: float
    limit: float


def bound_view(result):
    data: Bound = result.data["bound"]
    return Text(f"acme view: largest |logit| {data['largest']:.3g}, limit {data['limit']:g}")


def bound_text(result, report):
    # --save-bound: the largest |logit| and the seed it was measured at
    data = result.data.get("bound")
    return None if data is None else json.dumps({"largest": data["largest"], "seed": report.environment["seed"]})


def read_bound(path, label):
    # --expect-bound: a file --save-bound wrote, or one line naming what is wrong
    try:
        document = json.loads(path.read_text())
        return {"largest": float(document["largest"]), "seed": int(document["seed"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{label}: not a bound file ({exc})") from None


def same_seed(document, run, label):
    if document["seed"] != run.inputs.seed:
        raise UsageError(f"{label}: measured at seed {document['seed']} (this run: {run.inputs.seed})")
"""

CHECK = """
from fwdcheck.result import Check, CheckResult, Finding, Status
from acme_bound_face import Bound


class LogitBound(Check):
    name = "acme-bound"
    description = "logits stay under a limit"
    explain = "Every logit of the baseline forward stays under options.acme-bound.limit."
    codes = {"ACME101": "a logit's magnitude is over the limit", "ACME102": "the largest |logit| moved"}
    default = False
    options = "acme_bound_face:Options"
    flags = {"--acme-limit": "limit"}
    former_keys = {"bound_limit": "limit"}
    files = {
        "--save-bound": {"writes": "acme_bound_face:bound_text", "help": "write the largest |logit| here"},
        "--expect-bound": {
            "reads": "acme_bound_face:read_bound",
            "fits": "acme_bound_face:same_seed",
            "help": "fail when the largest |logit| moved from this file",
            "selects": True,
            "beside": ".bound.json",
        },
    }
    detail_view = "acme_bound_face:bound_view"

    def run(self, model, session):
        limit = self.options_in(session).limit
        largest = float(session.baseline().abs().max())
        data: Bound = {"largest": largest, "limit": limit}
        findings = [Finding("ACME101", Status.FAIL, f"|logit| {largest:.3g} over {limit:g}")] if largest > limit else []
        expected = self.expected_in(session)
        if expected is not None and abs(expected["largest"] - largest) > 1e-4 * abs(largest):
            was = expected["largest"]
            findings.append(Finding("ACME102", Status.FAIL, f"largest |logit| {largest:.6g}, was {was:.6g}"))
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


@pytest.mark.slow
def test_a_plugins_options_come_from_its_own_section_and_its_flag(plugin, tmp_path):
    tight = config(tmp_path / "tight.yaml", **toy(checks=["acme-bound"], options={"acme-bound": {"limit": 1e-6}}))
    result, checks = run_json(tight)
    assert result.exit_code == 1 and [f["code"] for f in checks["acme-bound"]["findings"]] == ["ACME101"]
    assert checks["acme-bound"]["data"]["bound"]["limit"] == 1e-6
    result, checks = run_json(tight, "--acme-limit", "1e9")  # the flag wins over the config
    assert result.exit_code == 0 and checks["acme-bound"]["data"]["bound"]["limit"] == 1e9
    defaults = config(tmp_path / "defaults.yaml", **toy(checks=["acme-bound"]))
    assert run_json(defaults)[1]["acme-bound"]["data"]["bound"]["limit"] == 100.0


@pytest.mark.slow
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
        ({"limit": -1}, "options.acme-bound.limit: must be greater than 0"),
        ({"limit": "x"}, "options.acme-bound.limit: expected a number"),
    ]:
        path = config(tmp_path / "wrong.yaml", **toy(checks=["acme-bound"], options={"acme-bound": options}))
        result = invoke("run", path)
        assert result.exit_code == 2 and said in result.output, result.output
        assert "Traceback" not in result.output
    result = invoke("run", config(tmp_path / "flag.yaml", **toy(checks=["acme-bound"])), "--acme-limit", "-3")
    assert result.exit_code == 2 and "options.acme-bound.limit: must be greater than 0" in result.output


@pytest.mark.parametrize(
    "code, why",
    [("FWD101", "the FWD prefix is fwdcheck's own"), ("ACME101", "which acme-bound[acme-bound] already declares")],
)
@pytest.mark.slow
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
    assert result.exit_code == 2 and "options.future-token: expected a mapping (key: value pairs)" in result.output
    assert "Traceback" not in result.output and "internal error" not in result.output


def test_the_former_exhaustive_key_still_turns_on_each_checks_thorough_variant(tmp_path):
    from fwdcheck.config.schema import config_from_dict

    config_ = config_from_dict({"model": {"source": "reference"}, "exhaustive": True})
    assert config_.options == {"future-token": {"exhaustive": True}, "backends": {"flex": True}}
    kept = config_from_dict(
        {"model": {"source": "reference"}, "exhaustive": True, "options": {"future-token": {"exhaustive": False}}}
    )
    assert kept.options["future-token"] == {"exhaustive": False}  # the check's own section wins


@pytest.mark.slow
def test_a_plugins_files_are_saved_compared_validated_and_protected(plugin, tmp_path):
    clean = config(tmp_path / "clean.yaml", **toy(checks=["acme-bound"]))
    saved = tmp_path / "bound.json"
    assert invoke("run", clean, "--save-bound", saved).exit_code == 0
    assert json.loads(saved.read_text())["seed"] == 0
    result, checks = run_json(clean, "--expect-bound", saved)
    assert result.exit_code == 0 and checks["acme-bound"]["findings"] == []
    # The same file against another model: the check compares, and fails naming what moved.
    other = config(tmp_path / "other.yaml", **toy(checks=["acme-bound"], inputs={"seed": 0, "batch_size": 3}))
    moved = json.loads(saved.read_text())
    saved.write_text(json.dumps({**moved, "largest": moved["largest"] * 2}))
    result, checks = run_json(other, "--expect-bound", saved)
    assert result.exit_code == 1 and [f["code"] for f in checks["acme-bound"]["findings"]] == ["ACME102"]
    # The flag selects its check: a config that does not name it still runs it.
    unnamed = config(tmp_path / "unnamed.yaml", **toy(checks=["shape-ledger"]))
    assert "acme-bound" in run_json(unnamed, "--expect-bound", saved)[1]
    # Refused before any model loads, one line each: a broken file, a file made for another run, several configs,
    # an output over the file it reads.
    (tmp_path / "broken.json").write_text("{")
    for args, said in [
        (("--expect-bound", tmp_path / "broken.json"), "not a bound file"),
        (("--expect-bound", saved, "--seed", "3"), "measured at seed 0 (this run: 3)"),
        ((clean, "--save-bound", tmp_path / "b.json"), "--save-bound takes one config"),
        (("--expect-bound", saved, "--save-bound", saved), "is the --expect-bound file"),
        (("--expect-bound",), "--expect-bound needs a value"),
    ]:
        result = invoke("run", clean, *args)
        assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "b.json").exists()
    assert "--expect-bound PATH" in invoke("run", "--help").stdout


def test_a_plugins_file_flag_without_its_check_selected_is_refused(plugin, tmp_path):
    result = invoke(
        "run", config(tmp_path / "c.yaml", **toy(checks=["shape-ledger"])), "--save-bound", tmp_path / "b.json"
    )
    assert result.exit_code == 2 and "--save-bound needs the acme-bound check in the selection" in result.output


def test_a_plugins_former_top_level_key_sets_its_option(plugin, tmp_path):
    from fwdcheck.config.schema import config_from_dict

    config_ = config_from_dict({"model": {"source": "reference"}, "bound_limit": 3.0})
    assert config_.options == {"acme-bound": {"limit": 3.0}}


def test_what_a_check_declares_is_one_list():
    """CheckInfo's fields are what a check declares: the Check base class has each, with the same default, and the
    reader of a class body's literals takes its types from them (a field added there is read everywhere)."""
    import dataclasses
    import typing

    from fwdcheck.config.registry import _INFO_DEFAULTS, _INFO_FIELDS, CheckInfo
    from fwdcheck.result import Check

    fields = {f.name for f in dataclasses.fields(CheckInfo)}
    assert set(_INFO_FIELDS) == fields and set(_INFO_DEFAULTS) == fields - {"description"}
    assert {"description", "explain"} <= set(typing.get_type_hints(Check))  # declared by every check, no default
    assert {name: getattr(Check, name) for name in fields - {"description", "explain"}} == {
        name: _INFO_DEFAULTS[name] for name in fields - {"description", "explain"}
    }
    assert _INFO_FIELDS["order"] == (int,) and _INFO_FIELDS["options"] == (str, type(None))


def test_each_builtin_is_declared_by_its_spec_module_which_its_class_reads():
    """fwdcheck's own checks declare CheckInfo's fields once, in fwdcheck/checks/<name>_spec.py: what `list` and
    `explain` import instead of the check is what the loaded check holds, every field of it."""
    import dataclasses

    from fwdcheck.config.registry import CheckInfo, available, info, spec_of

    builtins = [entry for entry in available().values() if entry.value.startswith("fwdcheck.checks.")]
    assert len(builtins) >= 15
    for entry in builtins:
        declared = spec_of(entry)
        assert isinstance(declared, CheckInfo), entry.name
        assert info(entry) is declared
        check = entry.load()
        for declaration in dataclasses.fields(CheckInfo):  # the spec's own values, not copies that could drift
            assert getattr(check, declaration.name) is getattr(declared, declaration.name), (entry.name, declaration)


def test_a_declared_value_written_again_in_the_class_body_is_refused():
    from fwdcheck.config.registry import CheckInfo
    from fwdcheck.result import Check

    declared = CheckInfo("one line", order=5)

    class Declared(Check, declared=declared):
        name = "declared"

    assert Declared.order == 5 and Declared.description == "one line" and Declared.default is True
    with pytest.raises(TypeError, match="sets order both in its class body and in `declared`"):

        class Twice(Check, declared=declared):
            name = "twice"
            order = 6
