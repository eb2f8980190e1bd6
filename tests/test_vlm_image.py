"""Vision-language models from `source: hf` run their text path with an image too, with no adapter.

fwdcheck draws the image (fwdcheck/model/sources/vlm_image.py) and runs the per-path checks once more on the text after
it (fwdcheck/run/image_run.py). Real transformers models, built tiny from the image-text-to-text sweep's configs:
clean ones pass with an image; a causal mask dropped only when an image is present, and image features that never
reach the text, are caught; a model whose image path cannot be driven runs its text path alone and says why.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tests.arch_sweep import CHECKS, auto_class, tiny
from tests.conftest import run_checks

pytestmark = pytest.mark.slow

KIND = "image-text-to-text"
IMAGE_CELL = "with an image"


def consistent(model_type: str) -> dict[str, Any]:
    """The sweep's tiny config, whose image path shrink made consistent (shrink_image.py): Qwen2-VL's merger width
    the text width, Gemma 3's pooled tokens a square that divides its 14 x 14 patch grid, Idefics 3's grid a multiple
    of its pixel shuffle (scale 2)."""
    return {**tiny(model_type, KIND).config}


def built(model_type: str):
    """The tiny model built by transformers alone from the consistent config, seeded, in eval mode."""
    import torch
    from transformers import AutoConfig

    rest = {k: v for k, v in consistent(model_type).items() if k != "model_type"}
    torch.manual_seed(0)
    return auto_class(KIND).from_config(AutoConfig.for_model(model_type, **rest)).eval()


def run_hf(model_type: str, config: dict[str, Any] | None = None, **code_paths):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_checks(
            {"source": "hf", "class": "AutoModelForImageTextToText", "config": config or consistent(model_type)},
            list(CHECKS),
            inputs={"batch_size": 2, "seq_len": 8},
            code_paths={"enabled": False, **code_paths},
        )


def run_module(module):
    from fwdcheck import check_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_model(module, list(CHECKS), code_paths={"enabled": False})


def image_row(report, check: str):
    """The image run's row of a per-path check's code-path table."""
    rows = [row for row in report.result(check).paths.rows if row.path.startswith(IMAGE_CELL)]
    assert len(rows) == 1, [row.path for row in report.result(check).paths.rows]
    return rows[0]


def held_note(report) -> str:
    notes = [n for n in report.notes if n.startswith("held fixed in the image run")]
    assert len(notes) == 1, report.notes
    return notes[0]


CLEAN = ("llava", "paligemma", "gemma3", "qwen2_vl", "idefics3")


@pytest.mark.parametrize("model_type", CLEAN)
def test_a_clean_vlm_passes_with_an_image(model_type):
    report = run_hf(model_type)
    statuses = {r.name: r.status.value for r in report.results}
    assert statuses["future-token"] == "pass" and statuses["mask-audit"] == "pass", statuses
    for check in ("future-token", "mask-audit"):
        row = image_row(report, check)
        assert row.status.value == "pass", (check, row.summary)
    # the cuts were judged in the text after the image, and the text read its image
    assert "cuts" in image_row(report, "future-token").summary
    assert "the text reads its image" in image_row(report, "mask-audit").summary
    note = held_note(report)
    assert "image tokens" in note and "seed 0" in note


def test_the_image_tokens_are_counted_off_the_model():
    """LLaVA: 336 / 14 = 24 patches a side, the class token dropped (vision_feature_select_strategy default): 576,
    as its config's image_seq_length says; Gemma 3: its mm_tokens_per_image, between boi and eoi."""
    assert "its 576 image tokens" in held_note(run_hf("llava"))
    gemma = held_note(run_hf("gemma3"))
    assert "its 196 image tokens" in gemma and "198 ids in all" in gemma


def test_paligemma_prefix_is_judged_as_designed():
    """PaliGemma's image block reads itself both ways (token_type_ids 0, its prefix), the text after it is the
    causal suffix: judged as such, with no false finding, and the token types named in the notes."""
    report = run_hf("paligemma")
    assert "prefix-LM: the prefix both ways" in image_row(report, "mask-audit").summary
    assert "token_type_ids 0 on the image's ids and 1 on the text" in held_note(report)
    assert "cuts" in image_row(report, "future-token").summary


def test_image_false_keeps_the_text_path_alone():
    report = run_hf("llava", image=False)
    assert report.result("future-token").paths is None
    assert not any("image" in n for n in report.notes)


# ----------------------------------------------------------------------------------------------------------------
# Planted bugs


def drop_causal_masks_with_an_image(model) -> int:
    """Every causal attention module handed no attention_mask, in eager attention, only in forwards given pixel
    values: the text path's causal mask dropped where an image is present (a mask built anew for the merged
    sequence and lost), the text-only path left as it was. Returns the number of modules changed."""
    model.set_attn_implementation("eager")
    with_image = {"now": False}

    def note(module, args, kwargs):
        with_image["now"] = kwargs.get("pixel_values") is not None

    def drop(module, args, kwargs):
        return (args, {**kwargs, "attention_mask": None}) if with_image["now"] else None

    model.register_forward_pre_hook(note, with_kwargs=True)
    changed = 0
    for module in model.modules():
        if getattr(module, "is_causal", None) is True and module is not model:
            module.register_forward_pre_hook(drop, with_kwargs=True)
            changed += 1
    return changed


def ignore_the_image(model) -> None:
    """The image's features zeroed before they are merged into the sequence (the inner model's get_image_features,
    which its forward calls): the model reads nothing of its image."""
    inner = model.model
    original = inner.get_image_features

    def zeroed(*args, **kwargs):
        output = original(*args, **kwargs)
        pooled = output.pooler_output
        output.pooler_output = (
            pooled * 0 if not isinstance(pooled, (list, tuple)) else type(pooled)(t * 0 for t in pooled)
        )
        return output

    inner.get_image_features = zeroed


def text_moves(model, change_last: bool) -> float:
    """Plain torch, no check: how far the first text token's logits after the image move when the last text token
    changes (change_last), or when the image is replaced by another (not change_last). The inputs are assembled by
    fwdcheck's image drive; the comparison is this test's own."""
    import torch

    from fwdcheck.model.sources.vlm_image import ImageDrive, _parameters

    config = model.config
    token = next(getattr(config, k) for k in ("image_token_id", "image_token_index") if getattr(config, k, None))
    drive = ImageDrive(type(model).__name__, config, _parameters(model), token, config.get_text_config().vocab_size)
    with torch.no_grad():
        drive.prepare(model)
        ids = torch.tensor([[3, 4, 5, 6]])
        before = drive.call(model, ids, 0)
        after = drive.call(model, torch.tensor([[3, 4, 5, 7]]), 0) if change_last else drive.call(model, ids, 1)
    return float((after[:, 0] - before[:, 0]).abs().max())


@pytest.mark.parametrize("model_type", ("llava", "gemma3", "qwen2_vl", "idefics3"))
def test_a_mask_dropped_only_with_an_image_is_caught(model_type):
    model = built(model_type)
    assert text_moves(model, change_last=True) == 0.0  # clean: the first text token is blind to the last
    assert drop_causal_masks_with_an_image(model) > 0
    assert text_moves(model, change_last=True) > 1e-4  # planted: with the image, it reads the last
    report = run_module(model)
    future = report.result("future-token")
    assert future.status.value == "fail", future.summary
    assert not future.paths.default_fails  # the text path alone is still causal
    assert "FWD101" in image_row(report, "future-token").codes


@pytest.mark.parametrize("model_type", ("llava", "paligemma", "qwen2_vl", "idefics3"))
def test_an_image_the_model_ignores_is_fwd214(model_type):
    model = built(model_type)
    assert text_moves(model, change_last=False) > 1e-4  # clean: another image moves the text
    ignore_the_image(model)
    assert text_moves(model, change_last=False) == 0.0  # planted: it moves nothing
    report = run_module(model)
    audit = report.result("mask-audit")
    assert audit.status.value == "fail", audit.summary
    assert "FWD215" in image_row(report, "mask-audit").codes
    finding = next(f for f in audit.findings if f.code == "FWD215")
    assert "reads nothing of its image" in finding.message


def test_the_same_model_unplanted_reads_its_image():
    """The control of the two above: the same build, through the same way in, passes with an image."""
    report = run_module(built("llava"))
    assert report.result("mask-audit").status.value == "pass"
    assert image_row(report, "future-token").status.value == "pass"


# ----------------------------------------------------------------------------------------------------------------
# What cannot be driven


def test_an_image_that_cannot_run_is_a_note_not_an_error():
    """A Gemma 3 config written by hand that pools 256 tokens (16 x 16) from a 14 x 14 patch grid, which its
    projector cannot: no image is drawn, the text path runs as before, and the notes say why."""
    report = run_hf("gemma3", config={**tiny("gemma3", KIND).config, "mm_tokens_per_image": 256})
    assert {r.name: r.status.value for r in report.results}["future-token"] == "pass"
    notes = [n for n in report.notes if n.startswith("no image drawn")]
    assert len(notes) == 1 and "the text path ran alone" in notes[0], report.notes
    assert report.result("future-token").paths is None  # no cell: the matrix is off and no image was drawn


def test_a_model_whose_image_cannot_be_sized_says_why():
    """Fuyu cuts its image into patches of its own (image_patches) and has no vision_config to size one by: its
    text path runs alone and the notes say why."""
    built_fuyu = tiny("fuyu", KIND)
    if built_fuyu.config is None:
        pytest.skip(built_fuyu.left_out)
    report = run_hf("fuyu", config=built_fuyu.config)
    assert any(n.startswith("no image drawn") and "no vision_config" in n for n in report.notes), report.notes
    assert all(r.status.value != "error" for r in report.results)


def test_the_image_runs_short_row_keeps_no_tensors(monkeypatch):
    """mask-audit's batch-size-1 pass reads the short row in the image run too, where the module sees the image's
    576 tokens before the row: there only the observation is kept (q, k, SDPA's arguments and every linear output
    of the whole image would be kept for checks that never run there), on the default path everything."""
    import fwdcheck.checks.short_row as short_row

    kept = []

    def keep_projections(module, vocab_size):
        kept.append(module)
        return {}, []

    monkeypatch.setattr(short_row, "keep_projections", keep_projections)
    report = run_hf("llava")
    assert report.result("mask-audit").data["batch1"] == "observed"
    assert image_row(report, "mask-audit").status.value == "pass"
    assert len(kept) == 1  # the default path's short row alone
