"""OLMo-core 3.0's OLMo 3 (ai2-olmo-core's own model code, tests/olmo3_model.py) through the config's `forward:`
adapter: the default checks pass, and mask-audit holds each layer's sliding window to the declared one (FWD211),
failing where the declaration and the band differ by a key. OLMo-core keeps its blocks in an nn.ModuleDict keyed by
layer number, which is how each call finds the layer whose window it is held to.

ai2-olmo-core is not a test dependency: 3.0 pins huggingface-hub<2, which transformers 5 (>=2.4) cannot share. Where
it is installed (a virtual environment of its own), these run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fwdcheck.cli import app

REPO = Path(__file__).resolve().parents[1]
DECLARED = [4, None, 4, None]  # OLMo 3's pattern at 4 layers: windows of 4 keys, the last layer full

pytestmark = pytest.mark.slow  # builds a training framework's model


def run(tmp_path: Path, window: list[int | None], built: int = 4) -> tuple[int, dict]:
    pytest.importorskip(
        "olmo_core", reason="ai2-olmo-core is not installed (it pins huggingface-hub<2, which transformers 5 refuses)"
    )
    model = {
        "source": "python",
        "factory": "tests.olmo3_model:build",
        "kwargs": {"window": built},
        "forward": "tests.olmo3_model:forward",
        "python_path": [str(REPO)],
        "window": window,
    }
    config = tmp_path / "olmo3.yaml"
    config.write_text(json.dumps({"model": model, "inputs": {"batch_size": 2, "seq_len": 12, "seed": 0}}))
    result = CliRunner().invoke(app, ["run", str(config), "--format", "json"], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout)


def checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_olmo3_with_sliding_windows_passes_the_default_run_with_every_window_judged(tmp_path):
    code, report = run(tmp_path, DECLARED)
    assert code == 0, [(c["name"], c["status"], c["summary"]) for c in report["checks"] if c["status"] != "pass"]
    audit = checks(report)["mask-audit"]
    assert "sliding windows as declared at 4 call(s)" in audit["summary"], audit["summary"]


@pytest.mark.parametrize(
    "window, built",
    [
        (DECLARED, 5),  # the band one key wider than declared
        ([4, 4, 4, 4], 4),  # a window declared on the layers OLMo 3 keeps full
    ],
)
def test_a_window_the_band_contradicts_is_fwd211(tmp_path, window, built):
    code, report = run(tmp_path, window, built)
    audit = checks(report)["mask-audit"]
    assert code == 1 and audit["status"] == "fail", audit["summary"]
    assert "FWD211" in {f["code"] for f in audit["findings"]}, audit["findings"]
