"""`fwdcheck shrink` keeps a vision-language model's image path consistent (fwdcheck/model/sources/shrink_image.py).

The fast tests hold each rule on config dictionaries; the slow ones shrink Gemma 3, Idefics 3 and SmolVLM from their
config classes' defaults with `fwdcheck shrink`'s own code and run them with an image fwdcheck draws.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from fwdcheck.model.sources.shrink_image import MAX_GRID, fit_image_path


def test_pooled_tokens_keep_a_side_that_divides_the_patch_grid():
    """Gemma 3's defaults pool 256 tokens (16 x 16) from a 224-pixel image of 16-pixel patches: a 14 x 14 grid,
    which 16 does not divide (its pooling kernel, 14 // 16, is 0). The side becomes 14, the largest divisor."""
    data = {
        "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 64},
        "vision_config": {"image_size": 224, "patch_size": 16, "hidden_size": 32},
    }
    changes = fit_image_path(data)
    assert data["mm_tokens_per_image"] == 196
    assert ("mm_tokens_per_image", 256, 196) in changes
    released = {**data, "mm_tokens_per_image": 256, "vision_config": {"image_size": 896, "patch_size": 14}}
    fit_image_path(released)  # 64 x 64 patches cut to 24 x 24: 16 does not divide 24, 12 does
    assert released["vision_config"]["image_size"] == 24 * 14 and released["mm_tokens_per_image"] == 144


def test_a_pixel_shuffle_divides_the_grid():
    """Idefics 3's defaults: a 224-pixel image of 32-pixel patches (7 x 7) and a pixel shuffle of 2, which must
    divide the grid: the image becomes 6 x 6 patches. The same for a factor under other names and as a ratio."""
    for top, vision in (
        ({"scale_factor": 2}, {}),
        ({"downsample_factor": 2}, {}),
        ({"downsample_ratio": 0.5}, {}),
        ({}, {"spatial_merge_size": 2}),
    ):
        data = {
            "text_config": {"hidden_size": 32},
            **top,
            "vision_config": {"image_size": 224, "patch_size": 32, **vision},
        }
        fit_image_path(data)
        assert data["vision_config"]["image_size"] == 192, (top, vision)
    untouched = {"scale_factor": 2, "vision_config": {"image_size": 256, "patch_size": 16}}
    assert fit_image_path(untouched) == [] and untouched["vision_config"]["image_size"] == 256


def test_a_large_image_is_cut_and_the_token_count_follows_the_grid():
    """Pixtral's 1540-pixel image (110 x 110 patches of 14) is more than an image run holds: it is cut to MAX_GRID
    patches a side, kept a multiple of its merge; PaliGemma's image_seq_length (the grid's count) follows."""
    data = {"spatial_merge_size": 2, "vision_config": {"image_size": 1540, "patch_size": 14}}
    fit_image_path(data)
    assert data["vision_config"]["image_size"] == MAX_GRID * 14
    pali = {"image_seq_length": 1024, "vision_config": {"image_size": 448, "patch_size": 14}}
    fit_image_path(pali)
    assert pali["vision_config"]["image_size"] == 336 and pali["image_seq_length"] == 576
    llava = {"image_seq_length": 576, "vision_config": {"image_size": 336, "patch_size": 14}}
    assert fit_image_path(llava) == []  # already small: nothing changes


def test_the_merger_hands_the_text_width_and_feature_layers_stay_inside_the_tower():
    """Qwen2-VL's merger output (vision hidden_size beside embed_dim) and Qwen2.5-VL's out_hidden_size are the
    width the text model reads; a top-level hidden_size is the text width; VipLLaVA's five feature layers index a
    tower cut to two layers (three hidden states)."""
    qwen2 = {"text_config": {"hidden_size": 256}, "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 32}}
    fit_image_path(qwen2)
    assert qwen2["vision_config"]["hidden_size"] == 256 and qwen2["vision_config"]["embed_dim"] == 32
    qwen25 = {"text_config": {"hidden_size": 64}, "vision_config": {"hidden_size": 32, "out_hidden_size": 3584}}
    fit_image_path(qwen25)
    assert qwen25["vision_config"] == {"hidden_size": 32, "out_hidden_size": 64}
    ovis = {"hidden_size": 1536, "text_config": {"hidden_size": 32}, "vision_config": {"hidden_size": 32}}
    fit_image_path(ovis)
    assert ovis["hidden_size"] == 32
    vip = {"vision_feature_layers": [-2, -5, -8, -11, 20], "vision_feature_layer": -2}
    vip["vision_config"] = {"num_hidden_layers": 2}
    fit_image_path(vip)
    assert vip["vision_feature_layers"] == [-2, -3, -3, -3, 2] and vip["vision_feature_layer"] == -2


def test_a_config_without_a_vision_tower_is_left_alone():
    data = {"hidden_size": 64, "scale_factor": 2, "text_config": {"hidden_size": 32}}
    assert fit_image_path(data) == [] and data["hidden_size"] == 64


# ----------------------------------------------------------------------------------------------------------------
# The command's own shrink, then an image run


def _shrunk(tmp_path: Path, model_type: str) -> tuple[dict, list]:
    from fwdcheck.model.sources.shrink import shrink_file

    path = tmp_path / f"{model_type}.yaml"
    path.write_text(
        f"model:\n  source: hf\n  class: AutoModelForImageTextToText\n  config: {{model_type: {model_type}}}\n"
    )
    shrunk = shrink_file(path, tmp_path / "out.yaml")
    assert shrunk.parameters is not None
    return shrunk.document["model"], [
        *shrunk.changes,
        ("parameters", shrunk.parameters.before, shrunk.parameters.after),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, changed",
    [
        ("gemma3", ("mm_tokens_per_image", 256, 196)),
        ("idefics3", ("vision_config.image_size", 224, 192)),
        ("smolvlm", ("vision_config.image_size", 224, 192)),
    ],
)
def test_a_shrunk_vlm_draws_an_image_and_passes_with_it(tmp_path, model_type, changed):
    """Gemma 3 kept 256 pooled tokens on a 14 x 14 grid, Idefics 3 and SmolVLM a 7 x 7 grid under a pixel shuffle of
    2: after `fwdcheck shrink` no image could run through them. Now shrink says what it changed, the model stays
    small, and the run draws an image and passes with it (the code-path cell "with an image")."""
    from tests.conftest import run_checks

    model, changes = _shrunk(tmp_path, model_type)
    assert changed in changes, changes
    (before, after) = next((b, a) for k, b, a in changes if k == "parameters")
    assert before > 50e6 and after < 5e6, (before, after)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_checks(
            model, ["future-token", "mask-audit"], inputs={"batch_size": 2, "seq_len": 8}, code_paths={"enabled": False}
        )
    assert not [n for n in report.notes if n.startswith("no image drawn")], report.notes
    for check in ("future-token", "mask-audit"):
        result = report.result(check)
        assert result.status.value == "pass", (check, result.summary)
        rows = [row for row in result.paths.rows if row.path.startswith("with an image")] if result.paths else []
        assert rows and all(row.status.value == "pass" for row in rows), (check, rows)


def test_token_ids_stated_apart_stay_apart_inside_the_vocabulary():
    """Ovis 2 states a vocab_size at its top level, so the whole config's own rule clamped its image token and its
    five visual indicator ids all onto id 511: the indicators then overwrote the image's features, and no image
    moved the text. They now move to distinct ids at the end of the text vocabulary."""
    from transformers import Ovis2Config

    from fwdcheck.model.sources.shrink import shrink_hf_dict

    data = Ovis2Config().to_dict()
    edits = shrink_hf_dict(data)
    ids = [data["image_token_id"], *data["visual_indicator_token_ids"]]
    vocab = data["text_config"]["vocab_size"]
    assert len(set(ids)) == 6 and all(i < vocab for i in ids), ids
    rows = [row for row in edits.changes if row[0] == "visual_indicator_token_ids"]
    assert rows == [("visual_indicator_token_ids", [151666, 151667, 151668, 151669, 151670], ids[1:])], rows
