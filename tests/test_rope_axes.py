"""rope on multi-axis rotary embeddings (M-RoPE: time, height and width sections), judged per axis.

The sections are read off transformers' own code: RotaryAxes.pair_axes lays the declared sections out as Qwen2-VL's
(contiguous) and Qwen3-VL's (interleaved) rotary embeddings do, and rope_axes judges vectors those modules rotate.
Then whole tiny models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, text-only input) both ways: clean they pass, each section
turning with its own axis; with the sections split in the wrong order, the time section read from the height axis,
height and width swapped in the interleaved layout, or rope applied to q only, they fail, naming the section.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fwdcheck.checks.rope_axes import AxisCall, axis_positions, judge_axes
from fwdcheck.checks.rotation import analyze
from fwdcheck.model.capabilities import RotaryAxes
from tests.conftest import codes, run_checks

NAMES = ("time", "height", "width")


def text_rotary(family: str, head_dim: int, sections: list[int] | None):
    """transformers' text rotary embedding module of a Qwen VL family, built alone from its text config."""
    import importlib

    import transformers

    config_classes = {
        "qwen2_vl": "Qwen2VLTextConfig",
        "qwen2_5_vl": "Qwen2_5_VLTextConfig",
        "qwen3_vl": "Qwen3VLTextConfig",
        "ernie4_5_vl_moe": "Ernie4_5_VLMoeTextConfig",
    }
    params = {"rope_type": "default", "rope_theta": 10000.0, **({"mrope_section": sections} if sections else {})}
    config = getattr(transformers, config_classes[family])(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_parameters=params
    )
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary_class = next(v for k, v in vars(modeling).items() if k.endswith("RotaryEmbedding") and "Vision" not in k)
    return rotary_class(config), modeling


def axes_of_pairs(rotary, pairs: int) -> list[int]:
    """Which axis the module gives each rotary pair: position_ids that differ per axis, read back from the angles."""
    positions = torch.tensor([1, 2, 3]).view(3, 1, 1)  # axis a at position a + 1
    cos, _ = rotary(torch.zeros(1, 1, 1, 2 * pairs), positions)
    angles = torch.acos(cos[0, 0, :pairs].double().clamp(-1, 1)) / rotary.inv_freq.double()
    return [round(float(a)) - 1 for a in angles]


@pytest.mark.parametrize(
    "family, sections, layout",
    [("qwen2_vl", [2, 3, 3], "contiguous"), ("qwen2_5_vl", [4, 2, 2], "contiguous"), ("qwen3_vl", None, "interleaved")],
)
def test_the_declared_layout_is_the_modeling_codes(family, sections, layout):
    rotary, _ = text_rotary(family, 16, sections)
    axes = RotaryAxes(NAMES, tuple(rotary.mrope_section), None, "test")
    assert axes.pair_axes(8, layout) == axes_of_pairs(rotary, 8)


def rotated(
    rotary, modeling, axes: RotaryAxes, axis: int | None, P: int, k_time_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (P, d_h), the same vector at each position, rotated by the module: `axis` walking 0..P-1 and the
    others held at 3 (every axis walking together when None). k_time_only plants a k rotated by the time axis's
    positions on every axis, as a path that hands k one row of positions would."""
    g = torch.Generator().manual_seed(0)
    d = rotary.inv_freq.numel() * 2
    q, k = torch.randn(2, 1, 1, 1, d, generator=g).expand(2, 1, 1, P, d)
    if axis is None:
        positions = torch.arange(P).view(1, 1, P).expand(3, 1, P)
    else:
        positions = axis_positions(axes, axis, P, 3, torch.device("cpu"))
    cos, sin = rotary(q, positions)
    q_rot, k_rot = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    if k_time_only:
        cos, sin = rotary(k, positions[:1].expand(3, 1, P))
        k_rot = modeling.apply_rotary_pos_emb(k, k, cos, sin)[1]
    return q_rot[0, 0], k_rot[0, 0]


def judged(rotary, modeling, sections, k_time_only: bool = False) -> tuple[list, dict]:
    axes = RotaryAxes(NAMES, tuple(sections), None, "test")
    P, tol = 32, 1e-4
    q_all, k_all = rotated(rotary, modeling, axes, None, P, k_time_only)
    call = AxisCall("layer", analyze(q_all, tol), analyze(k_all, tol), 8)
    seen = [{"layer": rotated(rotary, modeling, axes, a, P, k_time_only)} for a in range(3)]
    data: dict = {}
    return judge_axes(axes, [call], seen, P, 3, tol, data), data


def test_sections_of_a_rotary_module_judged_per_axis_both_ways():
    rotary, modeling = text_rotary("qwen2_vl", 16, [2, 3, 3])
    findings, data = judged(rotary, modeling, [2, 3, 3])
    assert findings == [] and data["axes"]["layout"] == "contiguous"
    assert data["axes"]["sections"]["time"]["pairs"] == [0, 1] and data["axes"]["sections"]["height"]["pairs"] == [
        2,
        3,
        4,
    ]
    # The same module read against sections in another order: the time section's third pair is the height's.
    findings, _ = judged(rotary, modeling, [3, 2, 3])
    assert [f.code for f in findings] == [
        "FWD309"
    ] and "the time section (pairs 0-2): pair 2 turns with the height axis" in findings[0].message


def test_k_rotated_by_one_row_of_positions_fails_along_the_other_axes():
    """k turned by the time axis's positions on every axis, q by all three: with every axis at one position they
    agree, so only the per-axis probe sees it: FWD302 along every axis (along time k turns every pair, q only the
    time section's; along height and width k turns none)."""
    rotary, modeling = text_rotary("qwen2_vl", 16, [2, 3, 3])
    findings, _ = judged(rotary, modeling, [2, 3, 3], k_time_only=True)
    assert [f.message.split(" (")[0] for f in findings] == [f"along the {axis} axis" for axis in NAMES]
    assert {f.code for f in findings} == {"FWD302"}
    assert "q turns pairs 0-1, k pairs 0-7" in findings[0].message
    assert "q turns pairs 2-4, k pairs none" in findings[1].message


def test_a_layout_of_the_modeling_codes_own_is_not_judged():
    """Ernie 4.5-VL lays its sections out in height, width, time order, height and width interleaved: held against
    the standard layouts its correct rotary fails FWD309, so the hf source says it lays them out its own way and rope
    says the sections are not judged."""
    import torch.nn as nn

    from fwdcheck.model.sources.hf_rotary import rotary_axes

    rotary, modeling = text_rotary("ernie4_5_vl_moe", 16, [3, 3, 2])
    findings, _ = judged(rotary, modeling, [3, 3, 2])
    assert [f.code for f in findings] == ["FWD309"]  # what judging it would say of a correct model
    holder = nn.Module()
    holder.rotary_emb = rotary
    axes = rotary_axes(holder, rotary.config, "config.json")
    assert axes is not None and axes.sections == (3, 3, 2)
    assert axes.own_layout is not None and "height, width, time order" in axes.own_layout


# -- whole models, text-only input -------------------------------------------------------------------------------


def rope_of(model_type: str):
    from tests.arch_sweep import SEQ_LEN, model_section

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_checks(
            model_section(model_type, "image-text-to-text"),
            ["rope"],
            inputs={"batch_size": 2, "seq_len": SEQ_LEN},
            code_paths={"enabled": False},
        )
    return report, report.result("rope")


def contiguous_split(order):
    """Qwen2-VL's recomposition with the section split or the axes read in another order: `order(sections, i)`
    gives the split sizes and the axis section i reads."""

    def recomposition_frequencies(self, freq):
        sizes, axis_of = order(self.mrope_section)
        freq = torch.cat([m[axis_of(i)] for i, m in enumerate(freq.split(sizes, dim=-1))], dim=-1)
        return torch.cat((freq, freq), dim=-1)

    return recomposition_frequencies


REVERSED_SPLIT = contiguous_split(lambda s: (list(s)[::-1], lambda i: i % 3))  # [2, 3, 3] split as [3, 3, 2]
TIME_FROM_HEIGHT = contiguous_split(lambda s: (list(s), lambda i: 1 if i == 0 else i % 3))


def interleaved_swapped(self, freq):
    """Qwen3-VL's interleaved recomposition with the height and width offsets swapped."""
    freqs_thw = freq[0]
    for dim, offset in enumerate((2, 1), start=1):  # transformers: (1, 2)
        idx = slice(offset, self.mrope_section[dim] * 3, 3)
        freqs_thw[..., idx] = freq[dim, ..., idx]
    return torch.cat((freqs_thw, freqs_thw), dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, sections",
    [
        ("qwen2_vl", {"time": [0, 1], "height": [2, 3, 4], "width": [5]}),
        ("qwen2_5_vl", {"time": [0, 1], "height": [2, 3, 4], "width": [5]}),
        ("qwen3_vl", {"time": [0, 3], "height": [1, 4], "width": [2, 5]}),
    ],
)
def test_clean_multi_axis_models_pass_per_axis(model_type, sections):
    _, result = rope_of(model_type)
    assert result.status.value == "pass", result.findings
    axes = result.data["axes"]
    assert {name: v["pairs"] for name, v in axes["sections"].items()} == sections
    assert "each M-RoPE section turns with its own axis" in result.summary


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, rotary_class, planted, named",
    [
        (
            "qwen2_vl",
            "Qwen2VLRotaryEmbedding",
            REVERSED_SPLIT,
            "the height section (pairs 2-4): pair 2 turns with the time axis",
        ),
        (
            "qwen2_5_vl",
            "Qwen2_5_VLRotaryEmbedding",
            REVERSED_SPLIT,
            "the width section (pairs 5-7): pair 5 turns with the height axis",
        ),
        (
            "qwen2_vl",
            "Qwen2VLRotaryEmbedding",
            TIME_FROM_HEIGHT,
            "the time section (pairs 0-1): pairs 0-1 turn with the height axis",
        ),
        (
            "qwen3_vl",
            "Qwen3VLTextRotaryEmbedding",
            interleaved_swapped,
            "the height section (pairs 1, 4, 7): pairs 1, 4 turn with the width axis",
        ),
    ],
)
def test_sections_read_from_the_wrong_axis_fail_naming_the_section(
    monkeypatch, model_type, rotary_class, planted, named
):
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    monkeypatch.setattr(getattr(modeling, rotary_class), "recomposition_frequencies", planted)
    _, result = rope_of(model_type)
    assert codes_of(result) == {"FWD309"}, result.findings
    assert named in result.findings[0].message


def codes_of(result) -> set[str]:
    return {f.code for f in result.findings}


@pytest.mark.slow
def test_rope_on_q_only_in_a_multi_axis_model_fails(rope_on_q_only):
    rope_on_q_only("qwen2_vl")
    report, _ = rope_of("qwen2_vl")
    assert "FWD301" in codes(report, "rope")


def logits_only(model, input_ids):
    """A forward adapter that hands the model its tokens alone: the model counts its own positions."""
    return model(input_ids=input_ids).logits


@pytest.mark.slow
def test_axes_that_cannot_be_driven_apart_are_not_judged_and_nothing_fails(monkeypatch):
    """Where rope cannot drive the axes apart it says so: the sections not judged, with the reason, never a
    finding on a correct model; the one-axis identity is still judged. Through an adapter that takes no
    position_ids, and through a text model that refuses position_ids of more than one row."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    from fwdcheck.api import check_model
    from tests.arch_sweep import plain

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_model(
            plain("qwen2_vl", "image-text-to-text"), ["rope"], forward=logits_only, code_paths={"enabled": False}
        )
    result = report.result("rope")
    assert result.status.value == "pass", result.findings
    assert result.data["axes"].startswith("not judged: forward takes no position_ids")
    assert "multi-axis sections not judged" in result.summary

    original = modeling_qwen2_vl.Qwen2VLTextModel.forward

    def one_row_of_positions(self, *args, position_ids=None, **kwargs):
        if position_ids is not None and position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [B, T], got {list(position_ids.shape)}")
        return original(self, *args, position_ids=position_ids, **kwargs)

    monkeypatch.setattr(modeling_qwen2_vl.Qwen2VLTextModel, "forward", one_row_of_positions)
    _, result = rope_of("qwen2_vl")
    assert result.status.value == "pass", result.findings
    assert result.data["axes"].startswith("not judged: forward refused position_ids [3, 1, ")
