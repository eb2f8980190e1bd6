"""fwdcheck's default checks, with no adapter, on every seq2seq, image-text-to-text and masked-LM architecture
transformers ships (tests/family_sweep.py builds and runs them through the causal-LM sweep's machinery).

Each untouched model must pass or skip saying why, unless its failure is written down as a true finding (shown in
plain torch) or a known misreading of fwdcheck's. Beyond that, each family is judged as it is designed: an
encoder-decoder on its decoder with the source held fixed, a masked-LM encoder as bidirectional (never a bare leak).
A sample of each family, with the causal mask of its decoder or text path dropped, must be caught.
"""

from __future__ import annotations

import re

import pytest

from tests.arch_sweep import CHECKS, SWEEPS, architectures, assert_skips_listed, assert_written_down, family, tiny
from tests.doc_sections import DOCS
from tests.family_sweep import (
    FINDINGS,
    KINDS,
    KNOWN,
    PLANTED,
    documented_section,
    drop_causal_masks,
    entry,
    expected,
    logits,
    plain,
    planted_report,
    reads_the_future,
    report,
)

STALE = "a sweep section of docs/compatibility.md is stale: run `python -m tests.family_sweep --write` and commit it"
CASES = [(kind, name) for kind in KINDS for name in architectures(kind)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_architectures_are_enumerated_not_listed(kind):
    """Each sweep's list is transformers' own mapping, nothing added or left."""
    from transformers.models.auto import modeling_auto

    assert architectures(kind) == tuple(sorted(getattr(modeling_auto, SWEEPS[kind].mapping)))
    assert len(architectures(kind)) > 30


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "model_type"), CASES)
def test_architecture(kind, model_type):
    built = tiny(model_type, kind)
    documented = documented_section(kind)
    if built.config is None:
        assert f"| {model_type} | {built.left_out} |" in documented, STALE
        pytest.skip(f"{model_type}: {built.left_out}")
    rep = report(model_type, kind)
    row = next((line for line in documented.splitlines() if line.startswith(f"| {family(model_type)} |")), "")
    assert re.search(rf"(\| |, ){re.escape(entry(kind, model_type, rep))}(,| \|)", row), STALE
    assert_skips_listed(documented, rep, model_type, STALE)

    pattern = rep.model["attention_pattern"]
    if built.config.get("is_encoder_decoder"):
        # an encoder-decoder is judged on its decoder, the source held fixed and said so
        assert pattern.startswith("encoder-decoder"), pattern
        assert any(n.startswith("held fixed:") for n in rep.notes), rep.notes
    if kind == "masked-lm":
        # an encoder is bidirectional by design: never judged as a causal model, never a bare leak
        assert not pattern.startswith("causal"), pattern
    for check in CHECKS:
        assert "FWD101" not in {f.code for f in rep.result(check).findings} or not pattern.startswith("bidirectional")

    assert_written_down(rep, model_type, lambda check: expected(kind, model_type, check))


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(FINDINGS))
def test_each_true_finding_is_shown_in_plain_torch(key):
    finding = FINDINGS[key]
    kind, model_type, check = key
    built = tiny(model_type, kind)
    if built.config is None:  # the sweep leaves it out (its table says why): nothing of it to show here
        pytest.skip(f"{model_type} is left out of the {kind} sweep: {built.left_out}")
    assert finding.evidence(), f"{key}: the plain-torch evidence does not show {finding.what}"
    result = report(model_type, kind).result(check)
    assert result.status.value == ("error" if finding.codes == {"FWD002"} else "fail")
    assert {f.code for f in result.findings} <= finding.codes


@pytest.mark.slow
@pytest.mark.parametrize("planted", PLANTED, ids=lambda p: f"{p.kind}-{p.model_type}")
def test_a_planted_causal_mask_drop_is_caught(planted):
    """The bug is real (plain torch: an earlier position reads a later token once it is planted, and not before),
    and fwdcheck catches it with the codes the page lists."""
    clean = plain(planted.model_type, planted.kind)
    assert not reads_the_future(clean)
    bugged = plain(planted.model_type, planted.kind)
    drop_causal_masks(bugged)
    assert reads_the_future(bugged)
    rep = planted_report(planted)
    for check, codes in planted.codes.items():
        result = rep.result(check)
        assert result.status.value == "fail", (check, result.summary)
        assert {f.code for f in result.findings} & codes, (check, result.summary)


def test_the_plain_torch_evidence_can_say_no():
    """On a tiny BART (its decoder held to a fixed source) no earlier logit moves; with its decoder mask dropped
    one does."""
    import torch

    model = plain("bart", "seq2seq")
    assert not reads_the_future(model)
    drop_causal_masks(model)
    assert reads_the_future(model)
    assert logits(model, torch.zeros(2, 8, dtype=torch.long)).shape[:2] == (2, 8)


def test_every_kind_has_its_section_and_no_stray_expectation():
    for kind in KINDS:
        assert documented_section(kind), f"docs/compatibility.md has no sweep-{kind} section"
    for kind, model_type, _check in [*FINDINGS, *KNOWN]:
        assert model_type in architectures(kind)


# -- the recipes of docs/families.md run as written ----------------------------------------------------------------

FAMILIES_PAGE = DOCS / "families.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", FAMILIES_PAGE.read_text(encoding="utf-8"), re.S)


def test_the_family_page_has_its_recipes():
    assert len(blocks("yaml")) == 3 and len(blocks("python")) == 1


@pytest.mark.slow
@pytest.mark.parametrize("index", range(3))
def test_a_family_recipe_runs_clean(index):
    """Each config of the page, as a user writes it: every default check passes or skips saying why, judged as the
    family is designed."""
    import yaml

    from tests.conftest import run_checks

    document = yaml.safe_load(blocks("yaml")[index])
    rep = run_checks(document["model"], inputs=document["inputs"], code_paths={"enabled": False})
    for check in CHECKS:
        result = rep.result(check)
        assert result.status.value in ("pass", "skip") and result.summary.strip(), (check, result.summary)
    pattern = rep.model["attention_pattern"]
    assert pattern.split(" ")[0] in ("encoder-decoder", "causal", "bidirectional"), pattern


@pytest.mark.slow
def test_the_prefix_lm_recipe_runs():
    exec(compile(blocks("python")[0], str(FAMILIES_PAGE), "exec"), {})


@pytest.mark.slow
def test_xlm_is_read_by_its_causal_flag():
    """XLMWithLMHeadModel is both transformers' causal LM and its masked LM: with causal False (the masked-LM
    sweep's, its config's default) it reads the future in plain torch and is read as bidirectional; with causal True
    (the causal-LM sweep's) as causal."""
    from fwdcheck.model.sources.pattern import read_pattern

    masked = plain("xlm", "masked-lm")
    assert reads_the_future(masked)
    assert read_pattern(masked).kind == "bidirectional"
    assert read_pattern(plain("xlm", "causal-lm")).kind == "causal"
