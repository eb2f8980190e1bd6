"""Every bad input gets a clear answer: the corpus in tests/bad_inputs/, one config per way a config can be wrong.

Each case runs `fwdcheck run FILE` in-process (typer's CliRunner, real torch) and must end with its documented exit
code (2 unless its header says otherwise), nothing on stdout, exactly one line on stderr that starts with
`error: FILE: ` and holds the text of the file's `# expect:` line, and no traceback anywhere. The header format is
described in tests/bad_inputs/README.md. tests/test_cli.py covers the command-line-only errors (missing file,
`--model`, `--output`); this corpus covers what a config file can get wrong.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import threading
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fwdcheck.cli import app

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
MODELS = CORPUS / "models"
CHECKPOINT = Path(__file__).resolve().parents[1] / "sample_configs" / "checkpoint" / "reference.safetensors"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

runner = CliRunner()


@dataclass(frozen=True)
class Case:
    path: Path
    expect: str
    exit_code: int = 2
    generate: tuple[str, ...] = ()
    skip_if_cuda: bool = False
    needs_transformers: bool = False

    @property
    def id(self) -> str:
        return self.path.stem


def read_case(path: Path) -> Case:
    """The `# key: value` lines heading a corpus file (read as bytes: one case is deliberately not UTF-8)."""
    header: dict[str, list[str]] = {}
    lines = path.read_bytes().splitlines()
    for raw in lines:
        line = raw.decode("utf-8", "replace")
        if not line.startswith("#"):
            break
        match = re.match(r"#\s*([a-z-]+):\s?(.*)$", line)
        if match:
            header.setdefault(match.group(1), []).append(match.group(2))
    assert lines and lines[0].startswith(b"# expect: "), f"{path.name}: the first line must be '# expect: ...'"
    (expect,) = header["expect"]
    exit_code = int(header["exit"][0].split()[0]) if "exit" in header else 2
    generate = tuple(g.split()[0] for g in header.get("generate", []))
    skip = [s.split()[0] for s in header.get("skip-if", [])]
    assert set(skip) <= {"cuda", "no-transformers"}, skip
    return Case(path, expect.strip(), exit_code, generate, "cuda" in skip, "no-transformers" in skip)


def corpus() -> list[Case]:
    return [read_case(p) for p in sorted(CORPUS.glob("*.yaml"))]


CASES = corpus()


# ---------------------------------------------------------------------------------------------------------------------
# Content better not committed: written next to a copy of the config by the case that names it in `# generate:`


def _truncated_safetensors(path: Path) -> None:
    data = CHECKPOINT.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _pickled_module(path: Path) -> None:
    from fwdcheck.model.reference import build

    torch.save(build(), path)  # the whole module, as `torch.save(model, ...)` does by mistake


def _syntax_error(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("import torch\n\n\ndef build(:\n    return torch.nn.Linear(2, 2)\n")


def _calls_system(path: Path) -> None:
    class CallsSystem:  # unpickles by calling os.system (with a command that does nothing, should it ever run)
        def __reduce__(self):
            return os.system, ("true",)

    torch.save({"wte.weight": CallsSystem()}, path)


def _protocol_4(path: Path) -> None:
    from fwdcheck.model.reference import build

    torch.save(build().state_dict(), path, pickle_protocol=4)


def _meta_tensors(path: Path) -> None:
    from fwdcheck.model.reference import build

    with torch.device("meta"):
        torch.save(build().state_dict(), path)


def _integer_weight(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(CHECKPOINT)
    tensors["layers.0.attn.k_proj.weight"] = tensors["layers.0.attn.k_proj.weight"].to(torch.int8)
    save_file(tensors, path)


def _duplicate_key(path: Path) -> None:
    # safetensors' own writer cannot name a key twice: the header is written by hand, both entries valid.
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    # %-format: the JSON template's own braces would need doubling in an f-string.
    header = '{"wte.weight": %s, "wte.weight": %s}' % (json.dumps(entry), json.dumps(entry))  # noqa: UP031
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + torch.ones(2).numpy().tobytes())


def _fifo(path: Path) -> None:
    os.mkfifo(path)

    def release():  # should a reader block on it after all, hand it an end of file: a failure, not a hung suite
        with suppress(OSError):  # OSError: no reader, nothing to release
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(10, release)
    timer.daemon = True
    timer.start()


LLAMA = {
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def _nested_config_json(depth: int):
    def write(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        deep = '{"a": ' * depth + "1" + "}" * depth
        path.write_text(json.dumps(LLAMA)[:-1] + f', "custom": {deep}}}')

    return write


def _large_config_json(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                **LLAMA,
                "vocab_size": 32000,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
            }
        )
    )


GENERATORS = {
    "truncated.safetensors": _truncated_safetensors,
    "whole_model.pt": _pickled_module,
    "models/bad_syntax.py": _syntax_error,
    "calls_system.pt": _calls_system,
    "protocol4.pt": _protocol_4,
    "meta_tensors.pt": _meta_tensors,
    "integer_weight.safetensors": _integer_weight,
    "duplicate_key.safetensors": _duplicate_key,
    "fifo.pt": _fifo,
    "hf_deep/config.json": _nested_config_json(5000),
    "hf_deep200/config.json": _nested_config_json(200),
    "hf_large/config.json": _large_config_json,
}


# ---------------------------------------------------------------------------------------------------------------------


def plain(text: str) -> str:
    return ANSI.sub("", text)


def run_cli(*args: str):
    return runner.invoke(app, ["run", *map(str, args)], catch_exceptions=False)


@pytest.fixture
def forget_corpus_modules():
    """Each case imports the corpus's model modules afresh; none stays in sys.modules for the next test."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        module = sys.modules.get(name)
        origin = str(getattr(module, "__file__", "") or "")
        if origin.startswith(str(CORPUS)) or name.startswith("bad_"):
            sys.modules.pop(name, None)


def prepare(case: Case, tmp_path: Path) -> Path:
    """The config to run: the corpus file itself, or a copy beside the files its header asks to be generated."""
    if not case.generate:
        return case.path
    config = tmp_path / case.path.name
    shutil.copyfile(case.path, config)
    for name in case.generate:
        GENERATORS[name](tmp_path / name)
    return config


def assert_one_line_error(result, config: Path, expect: str, exit_code: int = 2) -> str:
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, everything
    assert result.exit_code == exit_code, (result.exit_code, everything)
    assert result.stdout == "", f"stdout must stay empty on an error:\n{result.stdout}"
    lines = plain(result.stderr).splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got {len(lines)}:\n{result.stderr}"
    line = lines[0]
    assert line.startswith(f"error: {config}: "), f"the line must name the config file first: {line!r}"
    assert expect in line, f"{expect!r} not in {line!r}"
    return line


# The slow tier: a case whose config holds up until its ranks start launches them; the others take seconds to get
# to their error (a Hugging Face model configured, sized or read from a directory, a checkpoint read and refused,
# a huge allocation refused).
LAUNCHES_RANKS = {"distributed-hf-plan-transformers-cannot-apply"}
SLOW = LAUNCHES_RANKS | {
    "hf-directory-too-large-for-random-weights",
    "hf-inline-model-type-only",
    "hf-rope-theta-one",
    "hf-config-json-nested-deep",
    "hf-config-json-nested-200-deep",
    "hf-corrupt-config-json",
    "hf-no-config-json",
    "hf-missing-directory",
    "checkpoint-corrupt-safetensors",
    "checkpoint-fewer-layers-than-the-factory",
    "batch-size-overflow",
}
# The cases whose error is found in the supervised worker (the model's code imported or run, a checkpoint read):
# a worker starts for each, the slow tier. The inner loop keeps those the command line refuses before any worker.
SLOW |= {
    "checkpoint-integer-weight",
    "checkpoint-is-a-fifo",
    "checkpoint-meta-tensors",
    "checkpoint-missing-file",
    "checkpoint-pickle-calls-os-system",
    "checkpoint-pickle-protocol-4",
    "checkpoint-pickled-module",
    "checkpoint-safetensors-duplicate-key",
    "checkpoint-unknown-extension",
    "device-auto",
    "device-cuda-without-gpu",
    "distributed-parallelize-not-importable",
    "factory-bad-kwarg",
    "factory-calls-sys-exit",
    "factory-multiline-error",
    "factory-not-module",
    "factory-raises",
    "factory-raises-cancelled-error",
    "factory-raises-unprintable",
    "forward-adapter-missing",
    "missing-attribute",
    "module-exits-at-import",
    "module-import-name-error",
    "module-missing-dependency",
    "module-not-found",
    "module-raises-at-import",
    "module-syntax-error",
    "not-callable",
    "seq-len-beyond-max",
    "vocab-size-overflow",
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.id in SLOW else []) for c in CASES]
)
def test_bad_input_gets_one_clear_line(case: Case, tmp_path, forget_corpus_modules):
    if case.skip_if_cuda and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the case holds only without it")
    if case.needs_transformers and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the transformers package")
    config = prepare(case, tmp_path)
    sys_path = list(sys.path)
    result = run_cli(config)
    assert sys.path == sys_path, "the config's model directories must come off sys.path again"
    if case.exit_code == 0:  # not an error: the run goes ahead and says what it decided
        everything = result.stdout + result.stderr
        assert "Traceback" not in everything, everything
        assert result.exit_code == 0, everything
        assert result.stderr == ""
        assert case.expect in plain(result.stdout), result.stdout
        return
    assert_one_line_error(result, config, case.expect, case.exit_code)


@pytest.mark.parametrize("name", ["unknown-nested-key", "factory-raises", "seq-len-beyond-max", "unknown-check"])
@pytest.mark.slow
def test_json_format_errors_the_same_way(name, forget_corpus_modules):
    """--format json promises a report on stdout; a config that cannot run gives none (no half document), only the
    same one line on stderr."""
    case = read_case(CORPUS / f"{name}.yaml")
    result = runner.invoke(app, ["run", str(case.path), "--format", "json"], catch_exceptions=False)
    assert_one_line_error(result, case.path, case.expect)


@pytest.mark.slow
def test_relative_config_path_is_named_as_given(monkeypatch, forget_corpus_modules):
    """Run from the corpus folder with a bare file name: the error names the file as the user typed it, and the
    config's own relative paths still resolve against the file, not the working directory."""
    monkeypatch.chdir(CORPUS / "models")  # a working directory where `models/` does not exist
    config = Path("..") / "factory-raises.yaml"
    assert_one_line_error(run_cli(config), config, "raised RuntimeError: no weights at /nowhere")


def test_the_corpus_is_complete():
    """Each case has its expectation; every helper module and generated file is used by some case."""
    assert len(CASES) >= 40, len(CASES)
    assert all(c.expect for c in CASES)
    named = {n for c in CASES for n in c.generate}
    assert named == set(GENERATORS), (named, set(GENERATORS))
    texts = "\n".join(c.path.read_bytes().decode("utf-8", "replace") for c in CASES)
    for module in MODELS.glob("bad_*.py"):
        assert f'"{module.stem}:' in texts, f"{module.name} is named by no case"
    # one case per required kind of bad input (the brief the corpus was built to)
    required = {
        "empty",
        "not-yaml",
        "top-level-list",
        "top-level-scalar",
        "unknown-top-level-key",
        "unknown-nested-key",
        "batch-size-string",
        "batch-size-zero",
        "seq-len-one",
        "d-model-negative",
        "seq-len-beyond-max",
        "unknown-check",
        "unknown-source",
        "factory-without-colon",
        "module-missing-dependency",
        "module-syntax-error",
        "module-raises-at-import",
        "missing-attribute",
        "factory-raises",
        "factory-not-module",
        "factory-bad-kwarg",
        "hf-missing-directory",
        "hf-no-config-json",
        "hf-corrupt-config-json",
        "checkpoint-corrupt-safetensors",
        "checkpoint-pickled-module",
        "device-cuda-without-gpu",
        "device-auto",
        "ignore-without-reason",
        # and those of issue 11 (never exit 3 for what the user did)
        "yaml-nested-500-deep",
        "yaml-nested-deep-block-style",
        "yaml-alias-bomb",
        "yaml-alias-cycle",
        "hf-rope-theta-one",
        "hf-config-json-nested-deep",
        "checkpoint-pickle-calls-os-system",
        "checkpoint-pickle-protocol-4",
        "checkpoint-integer-weight",
        "checkpoint-safetensors-duplicate-key",
        "checkpoint-is-a-fifo",
        "factory-raises-cancelled-error",
        "factory-raises-unprintable",
    }
    assert required <= {c.id for c in CASES}, required - {c.id for c in CASES}
