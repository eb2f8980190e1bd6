"""The image drive's own rules, on plain objects (no transformers model built): what a config names as the image's ids,
how many features get_image_features returned, and an image too large for the image run refused before any of the
model's code runs. tests/test_vlm_image.py runs real vision-language models (the slow tier)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from fwdcheck.model.capabilities import ImageNotDrawn
from fwdcheck.model.sources.vlm_image import MAX_IMAGE_TOKENS, ImageDrive, _features, _modality_ids


def test_the_ids_of_other_modalities_are_read_off_the_config_and_its_text_config():
    config = SimpleNamespace(
        image_token_id=9,
        video_token_id=8,
        vision_start_token_id=7,
        boi_token_index=6,
        pad_token_id=0,  # not an image's
        eos_token_id=1,
        text_config=SimpleNamespace(audio_token_id=5, bos_token_id=2),
    )
    assert _modality_ids(config) == {5, 6, 7, 8, 9}


def test_features_are_counted_as_rows_of_the_projected_width():
    assert _features(torch.zeros(2, 576, 16)) == 1152  # two images of 576 features
    assert _features((torch.zeros(4, 16), torch.zeros(9, 16))) == 13  # Qwen2-VL: one tensor per image
    assert _features(SimpleNamespace(pooler_output=torch.zeros(1, 256, 8))) == 256  # a ModelOutput's projected ones
    assert _features(SimpleNamespace(pooler_output=None)) == 0


class Tower(nn.Module):
    """Counts its calls: an image refused for its size must not reach the model."""

    calls = 0

    def get_image_features(self, pixel_values):
        Tower.calls += 1
        return pixel_values


def test_an_image_too_large_for_the_run_is_refused_before_the_model_runs():
    """Pixtral's declared 1540 pixels in patches of 14 are 12,100 patches: far more than the image run holds."""
    config = SimpleNamespace(vision_config=SimpleNamespace(image_size=1540, patch_size=14), image_token_id=3)
    drive = ImageDrive("Big", config, {"pixel_values", "image_sizes"}, 3, 10)
    with pytest.raises(ImageNotDrawn, match=f"12100 patches of 14.*{MAX_IMAGE_TOKENS} tokens"):
        drive.prepare(Tower())
    assert Tower.calls == 0


def test_a_model_with_no_vision_config_says_so():
    drive = ImageDrive("Patches", SimpleNamespace(image_token_id=3), {"pixel_values"}, 3, 10)
    with pytest.raises(ImageNotDrawn, match="no vision_config"):
        drive.prepare(Tower())
