"""A gate nothing ordinary can fool: what ordinary projects do must not turn a failing model into a pass.

Each class both ways: a model that returns its logits as a view of one buffer it reuses (static caches, CUDA graphs,
`out=` kernels) is judged on its numbers, a leak included."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fwdcheck

V, D = 32, 16


class BufferedLogits(nn.Module):
    """Logits written into one preallocated buffer and returned as a view of it: every forward's logits are the same
    memory, as a static cache's or a CUDA graph's outputs are. With `leak`, position i also reads token i + 1."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.leak = leak
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)
        self.register_buffer("out", torch.zeros(8, 64, V), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        x = self.emb(input_ids)  # (B, T, D)
        if self.leak:
            x = x + torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)  # i reads i + 1
        self.out[:B, :T].copy_(self.head(x))
        return self.out[:B, :T]  # a view: the next forward overwrites it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_in_a_reused_buffer_are_judged_on_their_numbers(dtype):
    torch.manual_seed(0)
    clean = fwdcheck.check_model(BufferedLogits().to(getattr(torch, dtype)), ["future-token"], dtype=dtype)
    assert clean.result("future-token").status.value == "pass"
    torch.manual_seed(0)
    leaky = fwdcheck.check_model(BufferedLogits(leak=True).to(getattr(torch, dtype)), ["future-token"], dtype=dtype)
    result = leaky.result("future-token")
    assert result.status.value == "fail" and "FWD101" in {f.code for f in result.findings}, result.summary


# -- outputs never harm what the user owns ---------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A model's code in a package whose __init__ refuses to be imported (the check must find its files without
    running them), a helper module beside the config, and a forward adapter and a parallelize function elsewhere."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('model code ran in the command line')\n")
    (tmp_path / "pkg" / "models.py").write_text("import torch.nn as nn\n\ndef build():\n    return nn.Identity()\n")
    (tmp_path / "helpers.py").write_text("SCALE = 1.0\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "adapters.py").write_text("def forward(model, input_ids):\n    return model(input_ids)\n")
    (tmp_path / "lib" / "sharding.py").write_text("def parallelize(model, mesh):\n    return model\n")
    (tmp_path / "m.yaml").write_text(
        "model:\n  source: python\n  factory: pkg.models:build\n  forward: adapters:forward\n  path: [lib]\n"
        "distributed:\n  parallelize: sharding:parallelize\n"
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "output, said",
    [
        ("pkg/models.py", "is the module of the factory (pkg.models)"),
        ("lib/adapters.py", "is the module of the forward adapter (adapters)"),
        ("lib/sharding.py", "is the module of the parallelize function (sharding)"),
        ("helpers.py", "is Python code in"),  # what a factory may import from the config's folder
        ("pkg/__init__.py", "is Python code in"),
    ],
)
@pytest.mark.parametrize("option", ["--json", "--junit", "--output", "--save-golden"])
def test_no_output_is_written_over_the_models_code(project, output, said, option):
    from tests.test_cli import invoke, usage_error

    before = (project / output).read_bytes()
    usage_error(invoke("run", "m.yaml", option, output), f"{option} {output} {said}")
    assert (project / output).read_bytes() == before


def test_the_job_summary_is_no_other_outputs_file(project, monkeypatch):
    from tests.test_cli import invoke, usage_error

    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(project / "report.json"))
    usage_error(
        invoke("run", "m.yaml", "--format", "github", "--json", "report.json"),
        "$GITHUB_STEP_SUMMARY",
        "is also the file of --json",
    )
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(project / "m.yaml"))
    usage_error(invoke("run", "m.yaml", "--format", "github"), "is the config file")
    assert not (project / "report.json").exists()


# -- every report format writes valid output for any text ----------------------------------------------------------

NASTY = r"boom \x1b[31mred\x1b[0m \x1b]0;title\x07 bell\x07 nul\x00 c1\x9b caf\udce9 half\ud83d end"


@pytest.fixture
def nasty_model(tmp_path, monkeypatch):
    """A model whose text holds terminal escapes, characters XML 1.0 forbids and lone surrogates: its exception
    message, and a note it logs as a warning."""
    (tmp_path / "nasty.py").write_text(
        "import warnings\n"
        "import torch.nn as nn\n\n\n"
        "class Nasty(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(16, 8)\n\n"
        "    def forward(self, input_ids):\n"
        f'        warnings.warn("{NASTY}")\n'
        f'        raise ValueError("{NASTY}")\n\n\n'
        "def build():\n"
        "    return Nasty()\n"
    )
    (tmp_path / "m.yaml").write_text("model:\n  source: python\n  factory: nasty:build\n  vocab_size: 16\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("in_process", [False, True])
@pytest.mark.slow
def test_every_report_format_is_valid_for_any_text(nasty_model, in_process):
    import json
    import xml.etree.ElementTree as ET

    from tests.test_cli import invoke

    outputs = ["--junit", "r.xml", "--markdown", "r.md", "--html", "r.html", "--json", "r.json", "--svg", "r.svg"]
    result = invoke("run", "m.yaml", *outputs, *(["--in-process"] if in_process else []))
    assert result.exit_code == 1, result.output  # the model's error: FWD002, not a usage error or fwdcheck's own
    assert "the model raised ValueError: boom red" in result.stdout  # said once, its escapes removed
    assert "\x1b]0;" not in result.stdout and "\x00" not in result.stdout
    ET.parse(nasty_model / "r.xml")  # well-formed XML 1.0
    ET.parse(nasty_model / "r.svg")
    document = json.loads((nasty_model / "r.json").read_text(encoding="utf-8"))
    for path in ("r.xml", "r.md", "r.html", "r.json", "r.svg"):
        text = (nasty_model / path).read_text(encoding="utf-8")  # valid UTF-8, no lone surrogate
        assert "\x1b" not in text and "\x00" not in text and "\x9b" not in text, path
    finding = document["checks"][0]["findings"][0]
    assert finding["code"] == "FWD002" and "boom red  bell" in finding["message"] and "caf\ufffd" in finding["message"]


# -- exit 0 only when the run ended cleanly ---------------------------------------------------------------------------

ENDS_BADLY = """
import os
import signal
import time

import torch.nn as nn


class EndsBadly(nn.Module):
    '''A correct model whose own code ends or holds its process after the last check: when fwdcheck puts back the
    training mode it found (the model's __setattr__ sees it), as a helper's teardown or a rank exiting late would.'''

    def __init__(self, how):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.how = how
        self.armed = True

    def __setattr__(self, name, value):
        if name == "training" and value is True and self.__dict__.get("armed"):
            if self.how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        super().__setattr__(name, value)

    def forward(self, input_ids):
        return self.head(self.emb(input_ids))


def build(how):
    return EndsBadly(how)  # in training mode, as a model is built
"""


@pytest.mark.slow  # a worker process each, one of them held until its time limit
@pytest.mark.parametrize("how, said", [("killed", "SIGKILL"), ("hangs", "stayed silent past timeout_s")])
def test_a_run_whose_worker_ends_badly_after_its_last_check_is_no_pass(tmp_path, monkeypatch, how, said):
    import json

    from tests.test_cli import invoke

    (tmp_path / "ends_badly.py").write_text(ENDS_BADLY)
    (tmp_path / "m.yaml").write_text(
        "model:\n  source: python\n  factory: ends_badly:build\n"
        f"  kwargs: {{how: {how}}}\n  vocab_size: 16\n"
        "checks: [shape-ledger, future-token]\ntimeout_s: 2\n"
        "code_paths: {train: false}\n"  # the train path's cell would put it in training mode before the end
    )
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "m.yaml", "--format", "json")
    report = json.loads(result.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["shape-ledger"] == statuses["future-token"] == "pass"  # the streamed results stand
    end = next(c for c in report["checks"] if c["name"] == "(end of run)")
    assert end["status"] == "error" and said in end["summary"] and "not compared" in end["summary"]
    assert result.exit_code == 1


FORKS_ONCE = """
import os
import time

import torch
import torch.nn as nn


class ForksOnce(nn.Module):
    '''Forks in its first forward. The child, clean, carries on with fwdcheck's run in its copy of the worker and
    finishes first; the model's own process reads the next token (position i adds token i + 1).'''

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.forked = False
        self.child = False

    def forward(self, input_ids):
        if not self.forked:
            self.forked = True
            self.child = os.fork() == 0
            if not self.child:
                time.sleep(3)  # the child's report comes first
        x = self.emb(input_ids)
        if not self.child:
            x = x + torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
        return self.head(x)


def build():
    return ForksOnce()
"""


@pytest.mark.slow  # a worker process, and a fork of it
def test_only_the_started_process_reports(tmp_path, monkeypatch):
    import json

    from tests.test_cli import invoke

    (tmp_path / "forks_once.py").write_text(FORKS_ONCE)
    (tmp_path / "m.yaml").write_text(
        "model:\n  source: python\n  factory: forks_once:build\n  vocab_size: 16\nchecks: [future-token]\n"
    )
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "m.yaml", "--format", "json")
    report = json.loads(result.stdout)
    (future,) = [c for c in report["checks"] if c["name"] == "future-token"]
    assert future["status"] == "fail" and "FWD101" in {f["code"] for f in future["findings"]}
    assert result.exit_code == 1
    assert any("not the model's process, were ignored" in note for note in report["notes"]), report["notes"]


@pytest.mark.slow
def test_the_readme_counts_these_cases():
    """docs/reliability.md's third counts line (scripts/reliability_counts.py) is what this file collects."""
    import importlib.util
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("reliability_counts", repo / "scripts" / "reliability_counts.py")
    assert spec is not None and spec.loader is not None
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    line = counts.gate_line()
    assert int(re.search(r"\d+", line).group()) >= 20
    assert line in counts.PAGE.read_text(), f"{counts.PAGE.name} should say: {line}"
