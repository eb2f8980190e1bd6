"""A config wrong in several places gets every problem named, on the one error line the CLI prints."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.config.schema import MAX_PROBLEMS, config_from_dict
from fwdcheck.errors import ConfigError


def problems(document: dict) -> str:
    with pytest.raises(ConfigError) as raised:
        config_from_dict(document)
    return str(raised.value)


def test_every_problem_is_listed_unknown_keys_first():
    line = problems(
        {"model": {"source": "reference", "vocab_size": -1, "n_head": 2}, "inputs": {"seq_len": 1}, "dtype": "f8"}
    )
    assert line == (
        "config: model.n_head: unknown key; did you mean 'n_heads'?; "
        "model.vocab_size: must be greater than 0 (got -1); "
        "inputs.seq_len: must be at least 2 (got 1); "
        "dtype: expected one of float32, bfloat16 or float16 (got 'f8')"
    )


def test_past_the_limit_the_rest_are_counted_and_the_valid_keys_named_once():
    line = problems({"model": {"source": "reference", **{f"extra{i}": 1 for i in range(MAX_PROBLEMS + 4)}}})
    assert line.count("unknown key") == MAX_PROBLEMS and line.endswith("; and 4 more")
    assert line.count("valid keys: ") == 1


def test_the_cli_prints_them_on_one_line(tmp_path):
    path = tmp_path / "wrong.yaml"
    path.write_text("model: {source: reference, n_head: 2}\ninputs: {seq_len: 1}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(path), "--in-process"], catch_exceptions=False)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "model.n_head: unknown key" in lines[0] and "inputs.seq_len:" in lines[0]


@pytest.mark.parametrize(
    "text, said",
    [
        # the selection given twice: a reader keeps the last, and a leaky model passes with fewer checks
        (
            "model: {source: reference}\nchecks: [future-token]\ninputs: {seq_len: 8}\nchecks: [shape-ledger]\n",
            "the key 'checks' is given twice, at line 2 and at line 4",
        ),
        (
            "model:\n  source: reference\n  n_layers: 2\n  n_layers: 3\n",
            "the key 'n_layers' is given twice, at line 3 and at line 4",
        ),
        (
            "model: {source: reference, bugs: [], bugs: [no-causal-mask]}\n",
            "the key 'bugs' is given twice, at line 1 and at line 1",
        ),
        (
            "model: {source: reference}\nignore:\n  - {code: FWD203, reason: a, reason: b}\n",
            "the key 'reason' is given twice",
        ),
    ],
)
def test_a_key_given_twice_at_any_depth_is_one_line_naming_both(tmp_path, text, said):
    path = tmp_path / "twice.yaml"
    path.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(path), "--in-process"], catch_exceptions=False)
    assert result.exit_code == 2 and result.stdout == "" and said in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_same_key_in_two_mappings_or_through_a_merge_is_not_twice(tmp_path):
    path = tmp_path / "fine.yaml"
    path.write_text(
        "defaults: &d {seq_len: 8, batch_size: 2}\n"
        "model: {source: reference, n_layers: 2}\n"
        "inputs: {<<: *d, seq_len: 6}\n"  # a merge's key overridden: YAML's own way to say it
        "ignore: [{code: FWD203, reason: a}, {code: FWD204, reason: a}]\n",
        encoding="utf-8",
    )
    result = CliRunner().invoke(app, ["run", str(path), "--in-process", "-q"], catch_exceptions=False)
    assert "given twice" not in result.stderr
    assert "defaults: unknown key" in result.stderr  # the anchor's holder is refused for what it is, not as a twice
