"""What transformers prints or logs because of fwdcheck's own doing never reaches the user: the "Loading weights"
progress bar of a saved model on stderr, and its note that `sdpa` does not support `output_attentions=True`, which
only the code-path matrix's cells asked for. What the model's loading says of itself still does."""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.model.library_logs import asked_for, kept_as_notes

transformers = pytest.importorskip("transformers")

runner = CliRunner()


@pytest.mark.slow
def test_a_saved_llama_runs_without_transformers_noise(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    (tmp_path / "fwdcheck.yaml").write_text("model: {source: hf, path: llama}\ninputs: {batch_size: 2, seq_len: 8}\n")
    assert transformers.utils.logging.is_progress_bar_enabled()

    quiet = runner.invoke(app, ["run", str(tmp_path / "fwdcheck.yaml"), "-q", "--in-process"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == "" and "Loading weights" not in quiet.output
    assert transformers.utils.logging.is_progress_bar_enabled()  # put back as found

    report = runner.invoke(app, ["run", str(tmp_path / "fwdcheck.yaml"), "--in-process", "--format", "json"])
    notes = json.loads(report.stdout)["notes"]
    assert any("weights loaded from" in n for n in notes)  # the loading's own news stays
    assert not [n for n in notes if "output_attentions" in n], notes  # the matrix asked for them: not news


def test_library_logs_are_notes_except_about_what_fwdcheck_asked_for():
    notes: list[str] = []
    log = logging.getLogger("transformers.models.llama.modeling_llama")  # a child: its records reach the handlers
    with kept_as_notes(("transformers",), notes):
        with asked_for(("transformers",), "output_attentions"):
            log.warning("`sdpa` attention does not support `output_attentions=True`.")
            log.warning("a line of its own")
        log.warning("output_attentions, when the model's own code asks")
    assert notes == [
        "transformers: a line of its own",
        "transformers: output_attentions, when the model's own code asks",
    ]
