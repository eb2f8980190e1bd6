"""fwdcheck's four causal checks on every causal-LM architecture transformers ships (tests/arch_sweep.py builds them).

Each untouched model must pass or skip saying why. The exceptions are written down: misreadings of fwdcheck's that
are known and being fixed (`KNOWN`, allowed to fail with exactly those codes, or to pass once fixed; none today), and
true findings about transformers itself (`FINDINGS`), each shown beside it by a plain-torch test that involves no
fwdcheck check.
"""

from __future__ import annotations

import re

import pytest

from tests.arch_sweep import (
    CHECKS,
    FINDINGS,
    KNOWN,
    architectures,
    documented_section,
    entry,
    family,
    skip_reason,
    sweep_report,
    tiny,
)

# What a failure may be: a finding about the model's numbers, or (the model's own error) an error.
_OUTCOMES = {False: ("fail", "warn"), True: ("error",)}
STALE = "the sweep section of docs/compatibility.md is stale: run `python -m tests.arch_sweep --write` and commit it"


def test_the_architectures_are_enumerated_not_listed():
    """The sweep's list is transformers' own: every model_type AutoModelForCausalLM maps, nothing added or left."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert architectures() == tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    assert len(architectures()) > 150


@pytest.mark.slow
def test_every_architecture_is_built_or_left_out_with_its_reason():
    built = [tiny(name) for name in architectures()]
    for b in built:
        assert (b.config is None) == bool(b.left_out), b
    assert sum(b.config is not None for b in built) >= 150


@pytest.mark.slow
@pytest.mark.parametrize("model_type", architectures())
def test_architecture(model_type):
    built = tiny(model_type)
    documented = documented_section()
    if built.config is None:
        assert f"| {model_type} | {built.left_out} |" in documented, STALE
        pytest.skip(f"{model_type}: {built.left_out}")
    report = sweep_report(model_type)
    # The page lists the architecture as it ran, and each of its skips under its reason.
    row = next((line for line in documented.splitlines() if line.startswith(f"| {family(model_type)} |")), "")
    assert re.search(rf"(\| |, ){re.escape(entry(model_type, report))}(,| \|)", row), STALE
    for check in CHECKS:
        if report.result(check).status.value == "skip":
            line = f"| {check} | {skip_reason(report, check)} | "
            listed = next((x for x in documented.splitlines() if x.startswith(line)), "")
            assert model_type in listed[len(line) :].rstrip(" |").split(", "), STALE
    for check in CHECKS:
        result = report.result(check)
        status, codes = result.status.value, {f.code for f in result.findings}
        if status == "skip":
            assert result.summary.strip(), f"{model_type} {check}: a skip must say why"
            continue
        if status == "pass":
            continue
        expected = FINDINGS.get((model_type, check)) or KNOWN.get((model_type, check))
        assert expected is not None, f"{model_type} {check}: {status} {sorted(codes)}: {result.summary}"
        # a layout fwdcheck cannot name may be a warning rather than a failure; a model whose own forward raises on
        # some inputs is that error (FWD002)
        assert status in _OUTCOMES[expected.codes == {"FWD002"}] and codes <= expected.codes, (
            model_type,
            check,
            status,
            codes,
            result.summary,
        )


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(FINDINGS))
def test_each_true_finding_is_shown_in_plain_torch(key):
    """A finding fwdcheck makes on transformers must be the model's behaviour: the plain-torch evidence shows it, and
    fwdcheck reports it."""
    finding = FINDINGS[key]
    assert finding.evidence(), f"{key}: the plain-torch evidence does not show {finding.what}"
    model_type, check = key
    result = sweep_report(model_type).result(check)
    assert result.status.value == ("error" if finding.codes == {"FWD002"} else "fail")
    assert {f.code for f in result.findings} <= finding.codes


def test_the_plain_torch_evidence_shows_nothing_on_a_correct_model():
    """The evidence helpers can say no: on Llama no earlier logit moves, no real token weighs a masked pad, a left
    pad moves nothing and a padding mask raises nothing."""
    from tests.arch_sweep import future_leak, left_padding_moves, raises_with_padding_mask, reads_padding

    assert future_leak("llama") is False
    assert reads_padding("llama") is False
    assert left_padding_moves("llama") is False
    assert raises_with_padding_mask("llama") is False
