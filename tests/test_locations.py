"""Findings about an attention call point at the line of model code that made the call, not at the class around it.

The observation pass records, for each attention call (SDPA, nn.MultiheadAttention, an eager softmax of q @ k^T), the
first frame beyond torch and fwdcheck; mask-audit's and shape-ledger's findings about the call carry it as their
`source`, which the JSON report, GitHub annotations, markdown and the pytest plugin show. Expected lines are found by
searching each file for the call, so that an edit above the call moves both alike.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import x_transformers.attend

from fwdcheck.api import check_model
from fwdcheck.observe.observer import observing
from fwdcheck.report.github import to_github
from fwdcheck.report.markdown import to_markdown
from tests import test_ledger_third_party as third_party
from tests.conftest import run_checks

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "fwdcheck" / "model" / "reference.py"


def lines_with(path: Path | str, text: str) -> list[int]:
    """The numbers of the lines of a file that contain `text`."""
    return [n for n, line in enumerate(Path(path).read_text().splitlines(), 1) if text in line]


def line_with(path: Path | str, text: str) -> int:
    found = lines_with(path, text)
    assert len(found) == 1, f"{text!r} is on lines {found} of {path}, expected exactly one"
    return found[0]


def at(path: Path | str, line: int) -> tuple[Path, int]:
    return Path(path).resolve(), line


def parsed(source: str | None) -> tuple[Path, int]:
    """A finding's 'path:line', the path resolved from the working directory."""
    assert source, "the finding names no source"
    path, line = source.rsplit(":", 1)
    return Path(path).resolve(), int(line)


# The line each attention path of the reference model makes its call on.
CALL_LINE = {
    "sdpa": line_with(REFERENCE, "F.scaled_dot_product_attention("),
    "eager": line_with(REFERENCE, "F.softmax("),
}


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    """Sources are relative to the working directory when under it, as CI annotations want."""
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("bug", ["inverted-bool-mask", "no-causal-mask", "float-mask-01"])
def test_planted_mask_bug_points_at_the_attention_call(bug, attention):
    report = run_checks({"source": "reference", "bugs": [bug], "attention": attention}, ["mask-audit"])
    findings = report.result("mask-audit").findings
    assert findings and all(f.status.value != "pass" for f in findings)
    expected = f"fwdcheck/model/reference.py:{CALL_LINE[attention]}"
    assert {f.source for f in findings} == {expected}, [(f.code, f.source) for f in findings]
    assert {row["source"] for row in report.result("mask-audit").data["calls"]} == {expected}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_every_report_shows_the_call_line(attention):
    report = run_checks({"source": "reference", "bugs": ["inverted-bool-mask"], "attention": attention}, ["mask-audit"])
    line = CALL_LINE[attention]
    finding = report.to_dict()["checks"][0]["findings"][0]
    assert finding["source"] == f"fwdcheck/model/reference.py:{line}"
    assert f"::error file=fwdcheck/model/reference.py,line={line}," in to_github(report)
    assert f"`fwdcheck/model/reference.py:{line}`" in to_markdown(report)


@pytest.mark.parametrize(
    "attention, call", [("sdpa", "F.scaled_dot_product_attention("), ("eager", "F.dropout(weights")]
)
def test_dropout_live_in_eval_points_at_the_call_that_applies_it(attention, call):
    report = run_checks(
        {"source": "reference", "bugs": ["sdpa-dropout-in-eval"], "attention": attention, "dropout": 0.1},
        ["mask-audit"],
    )
    live = [f for f in report.result("mask-audit").findings if f.code == "FWD207"]
    assert live and {f.source for f in live} == {f"fwdcheck/model/reference.py:{line_with(REFERENCE, call)}"}


@pytest.mark.parametrize(
    "attention, call", [("sdpa", "F.scaled_dot_product_attention("), ("eager", "F.dropout(weights")]
)
def test_future_token_names_the_line_of_live_dropout(attention, call):
    report = run_checks(
        {"source": "reference", "bugs": ["sdpa-dropout-in-eval"], "attention": attention, "dropout": 0.1},
        ["future-token"],
    )
    live = [f for f in report.result("future-token").findings if f.code == "FWD103"]
    assert live and {f.source for f in live} == {f"fwdcheck/model/reference.py:{line_with(REFERENCE, call)}"}


def test_third_party_finding_points_into_the_library_at_its_attention_call():
    """x-transformers with its causal flag off: the eager softmax is made in x_transformers/attend.py."""
    report = run_checks(
        {
            "source": "python",
            "factory": "tests.corpus.xtransformers_models:rotary_with",
            "kwargs": {"bug": "no-mask"},
            "path": [str(REPO)],
        },
        ["mask-audit"],
    )
    findings = report.result("mask-audit").findings
    assert {f.code for f in findings} == {"FWD201"}
    attend = x_transformers.attend.__file__
    assert {parsed(f.source) for f in findings} == {at(attend, line_with(attend, "self.attn_fn(sim)"))}


@pytest.mark.slow
def test_third_party_sdpa_call_is_recorded_in_the_library():
    """litgpt's Llama hands its mask to F.scaled_dot_product_attention in litgpt/model.py: each call says so."""
    # Imported here: litgpt imports lightning, seconds that every test process would spend collecting.
    from litgpt import model as litgpt_model

    from tests.corpus.litgpt_models import llama

    model = llama().eval()
    with torch.no_grad(), observing(model, seq_len=8) as seen:
        model(torch.randint(0, 64, (2, 8)))
    calls = {parsed(call.source) for call in seen.attention}
    sdpa_lines = lines_with(litgpt_model.__file__, "F.scaled_dot_product_attention(")
    assert seen.attention and calls <= {at(litgpt_model.__file__, line) for line in sdpa_lines}, calls


def test_ledger_finding_about_a_call_points_at_it():
    """A missing transpose (FWD402) at the SDPA call, a softmax over the queries (FWD403) at the softmax."""
    module = inspect.getsourcefile(third_party)
    untransposed = third_party.ledger(third_party.SDPAModel(lambda: third_party.UntransposedSDPA(32, 4, 4, 8)))
    misplaced = [f for f in untransposed.findings if f.code == "FWD402"]
    sdpa = line_with(module, "F.scaled_dot_product_attention(q, k, v, is_causal=True)  # attends over the heads")
    assert misplaced and {parsed(f.source) for f in misplaced} == {at(module, sdpa)}
    over_queries = third_party.ledger(third_party.TextbookGPT(softmax_dim=-2))
    softmax = line_with(module, "F.softmax(att, dim=self.softmax_dim)")
    assert {parsed(f.source) for f in over_queries.findings if f.code == "FWD403"} == {at(module, softmax)}


class TorchOnly(nn.Module):
    """A model whose attention call torch makes on its behalf, from code that is all torch's: no line of its own."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.layers = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True))

    def forward(self, ids):
        return self.head(self.layers(self.embed(ids)))  # bidirectional: no mask


def test_call_made_by_torch_alone_falls_back_to_the_module_class():
    report = check_model(TorchOnly(), ["mask-audit"], vocab_size=16)
    findings = report.result("mask-audit").findings
    assert {f.code for f in findings} == {"FWD201"}
    # The first frame beyond torch is the model's own forward, on the line that called the layer stack.
    body, first = inspect.getsourcelines(TorchOnly.forward)
    calling = first + next(i for i, line in enumerate(body) if "self.layers(" in line)
    assert {parsed(f.source) for f in findings} == {at(__file__, calling)}
    bare = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    report = check_model(nn.Sequential(nn.Embedding(16, 8), bare, nn.Linear(8, 16)), ["mask-audit"], vocab_size=16)
    findings = report.result("mask-audit").findings
    mha = inspect.getsourcefile(nn.MultiheadAttention), inspect.getsourcelines(nn.MultiheadAttention)[1]
    assert findings and {parsed(f.source) for f in findings} == {at(*mha)}  # no model line: the class, as before
