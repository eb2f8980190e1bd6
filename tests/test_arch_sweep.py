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
    FINDINGS,
    KNOWN,
    KV_CACHE_FINDINGS,
    KV_CACHE_PASSES,
    LABELS_IN_PLACE,
    NOT_JUDGED,
    SPARSE_SELECTION,
    architectures,
    assert_skips_listed,
    assert_written_down,
    documented_section,
    entry,
    family,
    labels_scored_in_place,
    one_check_report,
    selection_report,
    selection_skips_itself,
    sweep_report,
    tiny,
)

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
    assert_skips_listed(documented, report, model_type, STALE)
    assert_written_down(
        report, model_type, lambda check: FINDINGS.get((model_type, check)) or KNOWN.get((model_type, check))
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


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SPARSE_SELECTION)
def test_a_sparse_indexer_that_skips_its_own_key_is_judged_within_the_causal_bound(model_type):
    """DeepSeek V3.2's indexer keeps each query's top-k keys: in plain torch some query does not keep its own, and
    mask-audit says so as a key selection within the causal bound instead of failing FWD210 (a strict causal mask,
    which the flex and fused-kernel tests still fail)."""
    assert selection_skips_itself(model_type)
    result = selection_report(model_type).result("mask-audit")
    assert result.status.value == "pass", result.summary
    notes = [f.message for f in result.findings if f.code == "FWD210"]
    assert notes and all("key selection within the causal bound" in m for m in notes), notes


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(NOT_JUDGED))
def test_a_code_path_the_model_cannot_run_is_not_judged_and_the_rest_counts(model_type):
    """XLNet's causal attention raises on any attention_mask over two rows (plain torch): those cells are not judged,
    with the model's reason, and the check's verdict is the other cells' (not an error for the whole check)."""
    assert NOT_JUDGED[model_type].evidence(), NOT_JUDGED[model_type].what
    report = sweep_report(model_type)
    for check in ("future-token", "mask-audit"):
        result = report.result(check)
        assert result.status.value == "pass", result.summary
        unjudged = [row for row in result.paths.rows if row.status.value == "skip"]
        assert unjudged and all("not judged: the model cannot run this code path" in r.summary for r in unjudged)
        assert any(row.status.value == "pass" for row in result.paths.rows)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", KV_CACHE_PASSES)
def test_kv_cache_passes_on_hybrids_asked_for_every_position(model_type):
    """Falcon-H1 and Nemotron-H's generate keeps only the last position's logits (num_logits_to_keep 1): the check
    asks for every position (logits_to_keep=0) and compares them, instead of calling the shape an error."""
    result = one_check_report(model_type, "kv-cache").result("kv-cache")
    assert result.status.value == "pass", result.summary


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(KV_CACHE_FINDINGS))
def test_each_kv_cache_finding_is_shown_in_plain_torch(model_type):
    finding = KV_CACHE_FINDINGS[model_type]
    assert finding.evidence(), finding.what
    result = one_check_report(model_type, "kv-cache").result("kv-cache")
    assert (
        result.status.value == "fail" and {f.code for f in result.findings if f.status.value == "fail"} <= finding.codes
    )


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [*LABELS_IN_PLACE, "llama"])
def test_label_shift_reads_who_shifts_the_labels_off_the_forward(model_type):
    """XLNet and BART's causal LM score each position against the label at the same position (plain torch): the
    caller shifts, and label-shift judges them so instead of FWD701; Llama shifts them itself, and passes as such."""
    assert labels_scored_in_place(model_type) is (model_type in LABELS_IN_PLACE)
    result = one_check_report(model_type, "label-shift").result("label-shift")
    assert result.status.value == "pass", result.summary
