"""Fuzzing the config file: whatever it holds, `fwdcheck run` answers with a documented exit code, never 3.

Generators, each example written to a temporary file and run through the CLI in-process (typer's CliRunner, and
`--in-process`, so that the model runs here too: the property below includes this process's state after the run; the
worker process of a default run is tested in tests/test_supervisor.py):

(a) arbitrary YAML documents: nested dicts, lists, strings, numbers, booleans and nulls (keys often the config's own
    names, values often its own words), dumped with yaml.safe_dump in varying styles, sometimes corrupted as text
    (truncated, characters inserted or deleted, a line doubled);
(b) mutations of the sample configs (sample_configs/*.yaml, broken/*.yaml, checkpoint/reference.yaml): drop a key,
    change a value's type, set a number (one already there, or a known number field at its place) to 0, -1, a
    fraction or a huge value, rename a key, add an unknown key, replace `source`, swap an enum word, flip a boolean.

(c) the document's structure: values nested up to thousands deep (flow or block style, lists or mappings, at the top
    or inside the model's kwargs or an inline Hugging Face config), aliases that expand a thousandfold, aliases inside
    the node they name;
(d) the expected ledger (`--expect-ledger`): arbitrary JSON values, and mutations of a ledger saved by --save-ledger
    (a key dropped, a type changed, null, NaN, a duplicated entry, a value nested deep).

And, not random, grids: every number field of the schema at every extreme (0, -1, 0.5, 2**63, 2**64, 10**20, 1e300,
+-inf, nan, a string, a bool, null, a list), each run once; the same for the rotary settings a Hugging Face config
declares.

The property: the exit code is 0, 1, 2 or 5 (never 3, an internal error, and never a crash); no traceback anywhere; an
exit 2 is exactly one `error: ` line on stderr and nothing on stdout; a report (exit 0, 1 or 5) is complete (the JSON
parses and agrees on the exit code, the terminal report ends with its verdict). After every example the process is as
before: no torch function mode left on, the SIGALRM handler and interval timer restored, the global RNG and default
dtype untouched, sys.path as it was.

Cost: inputs are forced small (batch_size 1-2, seq_len 2-8) and model size fields are capped at 64, but 0, negative,
fractional, string and beyond-int64 values are tried too. Most examples fail validation (exit 2) in milliseconds; the
valid ones run on a tiny model (a mutated sample, two times in three, with one check instead of four).
derandomize=True: CI runs the same examples every time.
"""

from __future__ import annotations

import copy
import json
import math
import re
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.config import schema
from fwdcheck.config.bugs import BUGS

# Hypothesis examples by the hundred, and grids over every number field: the slow tier.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SAMPLES = [
    *sorted((REPO / "sample_configs").glob("*.yaml")),
    *sorted((REPO / "sample_configs" / "broken").glob("*.yaml")),
    REPO / "sample_configs" / "checkpoint" / "reference.yaml",
]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ALLOWED_EXITS = {0, 1, 2, 5}
CHECKS = ["shape-ledger", "future-token", "mask-audit", "rope"]

# How many examples each property runs; scripts/reliability_counts.py reads these settings.
ARBITRARY = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)
MUTATIONS = settings(ARBITRARY, max_examples=200)
STRUCTURES = settings(ARBITRARY, max_examples=100)
LEDGERS = settings(ARBITRARY, max_examples=150)

runner = CliRunner()

# ---------------------------------------------------------------------------------------------------------------------
# Vocabulary

CONFIG_CLASSES = [
    schema.Config,
    schema.ReferenceModel,
    schema.PythonModel,
    schema.CheckpointModel,
    schema.HFModel,
    schema.Inputs,
    schema.Tolerance,
    schema.CodePaths,
    schema.Ignore,
    schema.RopeSpec,
]
KEYS = sorted({name for cls in CONFIG_CLASSES for name in cls.model_fields} - {"source_path"} | {"class"})
SIZE_KEYS = {
    "vocab_size",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "n_layers",
    "d_ff",
    "max_seq_len",
    "rotary_dim",
    "batch_size",
    "seq_len",
    "max_positions",
}
# Model sizes beyond int64 must be refused cleanly; n_layers is left out: range(10**20) layers would build forever.
OVERFLOW_SAFE = SIZE_KEYS - {"n_layers"}
WORDS = [
    "reference",
    "python",
    "checkpoint",
    "hf",
    "cpu",
    "cuda",
    "auto",
    "meta",
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "rope",
    "learned",
    "none",
    "half",
    "interleaved",
    "sdpa",
    "eager",
    "bool",
    "float",
    "is_causal",
    "pre",
    "post",
    "absent",
    "ones",
    "left-pad",
    "shape-ledger",
    "future-token",
    "mask-audit",
    "rope",
    "FWD203",
    "fwdcheck.model.reference:build",
    ".",
    "",
    *BUGS,
]
# The only 'module:callable' strings an example may hand to the importer; any other (a corruption can make one) is
# skipped, so that a fuzzed config never imports and calls something arbitrary from the standard library.
SAFE_REFERENCES = {"fwdcheck.model.reference:build"}
REFERENCE = re.compile(r"[A-Za-z_][\w.]*\s*:\s*[A-Za-z_][\w.]*")

# No ":" in generated text: see SAFE_REFERENCES. A small alphabet with YAML's special characters, whitespace and
# some non-ASCII is as good at breaking configs as all of Unicode, and much cheaper to draw.
ALPHABET = list("abcdefghijklmnopqrstuvwxyz_ABCXYZ-0123456789./ \t\n#&*!|>'\"{}[],%@`?~=\\") + [
    "\u00e9",
    "\u00a0",
    "\u2028",
    "\ufeff",
    "\U0001f600",
    "\x00",
    "\x85",
]
text = st.one_of(
    st.text(st.sampled_from(ALPHABET), max_size=10),
    st.text(st.characters(blacklist_characters=":", blacklist_categories=("Cs",)), max_size=10),
)
keys = st.one_of(st.sampled_from(KEYS), text)
numbers = st.one_of(
    st.integers(-4, 64),
    st.sampled_from([0, -1, 1, 2, 0.5, 2.5, -0.0, 1e-9, 1e300, -1e300]),
    st.floats(-100, 100),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text, st.sampled_from(WORDS))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=24,
)
TOP_KEYS = sorted(schema.Config.model_fields.keys() - {"source_path", "model"})
documents = st.one_of(
    values,
    st.dictionaries(keys, values, max_size=6),
    st.builds(
        lambda model, rest: {"model": model, **rest},
        st.dictionaries(keys, values, max_size=6),
        st.dictionaries(st.sampled_from(TOP_KEYS), values, max_size=4),
    ),
    st.builds(
        lambda source, rest: {"model": {"source": source, **rest}},
        st.sampled_from(["reference", "python", "hf", "checkpoint"]),
        st.dictionaries(st.sampled_from(KEYS), values, max_size=6),
    ),
)


def size_value(key: str):
    """A value for a model size field: small, or 0, negative, fractional, a string, or (when safe) beyond int64."""
    special = [0, -1, -8, 1, 2.5, 64, "8", "eight", None, [8], 1e300]
    if key in OVERFLOW_SAFE:
        special.append(10**20)
    return st.one_of(st.integers(-8, 64), st.sampled_from(special))


def other_number():
    """A value for any other number: anything, huge included (seeds, bases, tolerances, timeouts)."""
    return st.one_of(
        st.integers(-2, 10),
        st.sampled_from([0, -1, 10**20, 2**63, 2**64, 1e-6, 1e-3, 1e300, 0.5]),
        st.sampled_from([math.nan, math.inf, -math.inf]),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Text corruption and document mutations


@st.composite
def corrupted(draw, text_: str) -> str:
    if not text_ or not draw(st.booleans()):
        return text_
    at = draw(st.integers(0, len(text_)))
    how = draw(st.sampled_from(["truncate", "insert", "delete", "double-line"]))
    if how == "truncate":
        return text_[:at]
    if how == "insert":
        return (
            text_[:at]
            + draw(st.text(st.sampled_from(list("{}[]:,-&*!|>'\"#%@`?\t\n \\")), min_size=1, max_size=3))
            + text_[at:]
        )
    if how == "delete":
        return text_[:at] + text_[at + draw(st.integers(1, 5)) :]
    lines = text_.splitlines(keepends=True)
    i = draw(st.integers(0, len(lines) - 1))
    return "".join(lines[: i + 1] + lines[i:])


@st.composite
def yaml_texts(draw) -> str:
    document = draw(documents)
    style = draw(st.sampled_from([None, True, False]))
    dumped = yaml.safe_dump(document, default_flow_style=style, allow_unicode=draw(st.booleans()), sort_keys=False)
    return draw(corrupted(dumped))


def locations(node, path=()):
    """(container, key, path) for every value inside node, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        yield node, key, (*path, key)
        yield from locations(value, (*path, key))


def _pick(draw, doc, want=lambda container, key: True):
    found = [(c, k, p) for c, k, p in locations(doc) if want(c, k)]
    return draw(st.sampled_from(found)) if found else None


def drop_key(draw, doc):
    spot = _pick(draw, doc, lambda c, k: isinstance(c, dict))
    if spot:
        del spot[0][spot[1]]


def change_type(draw, doc):
    spot = _pick(draw, doc)
    if spot:
        container, key, _ = spot
        old = container[key]
        new = draw(
            st.one_of(
                st.none(),
                st.booleans(),
                text,
                st.lists(scalars, max_size=2),
                st.dictionaries(text, scalars, max_size=2),
                numbers,
            )
        )
        if type(new) is not type(old):
            container[key] = new


def set_number(draw, doc):
    spot = _pick(draw, doc, lambda c, k: isinstance(c[k], (int, float)) and not isinstance(c[k], bool))
    if spot:
        container, key, _ = spot
        container[key] = draw(size_value(key) if key in SIZE_KEYS else other_number())


def rename_key(draw, doc):
    spot = _pick(draw, doc, lambda c, k: isinstance(c, dict) and isinstance(k, str) and k)
    if spot:
        container, key, _ = spot
        i = draw(st.integers(0, len(key) - 1))
        new = (
            draw(
                st.sampled_from(
                    [
                        key[:i] + key[i + 1 :],
                        key + "s",
                        key.upper(),
                        key.replace("_", "-"),
                        key[:i] + key[i + 1 : i + 2] + key[i : i + 1] + key[i + 2 :],
                    ]
                )
            )
            or "x"
        )
        container[new] = container.pop(key)


def add_unknown_key(draw, doc):
    targets = [doc] + [c[k] for c, k, _ in locations(doc) if isinstance(c[k], dict)]
    target = draw(st.sampled_from(targets))
    target[draw(keys)] = draw(scalars)


def replace_source(draw, doc):
    model = doc.get("model")
    if isinstance(model, dict):
        model["source"] = draw(st.sampled_from(["reference", "python", "checkpoint", "hf", "pytorch", "", None, 3]))


def swap_word(draw, doc):
    spot = _pick(draw, doc, lambda c, k: isinstance(c[k], str))
    if spot:
        spot[0][spot[1]] = draw(st.sampled_from(WORDS))


def flip_bool(draw, doc):
    spot = _pick(draw, doc, lambda c, k: isinstance(c[k], bool))
    if spot:
        spot[0][spot[1]] = not spot[0][spot[1]]
    else:
        doc[draw(st.sampled_from(["meta", "exhaustive"]))] = True


NUMBER_FIELDS = [
    ("timeout_s",),
    ("inputs", "seed"),
    ("inputs", "batch_size"),
    ("inputs", "seq_len"),
    ("tolerance", "rtol"),
    ("tolerance", "atol"),
    ("tolerance", "noise_factor"),
    ("model", "rope", "base"),
    ("model", "rope", "rotary_dim"),
    ("model", "dropout"),
    *[
        ("model", key)
        for key in (
            "vocab_size",
            "d_model",
            "n_heads",
            "n_kv_heads",
            "n_layers",
            "d_ff",
            "max_seq_len",
            "max_positions",
        )
    ],
]


def set_field(draw, doc):
    """A number field at its own place in the config (set or added), to an ordinary or an extreme value."""
    *parents, key = draw(st.sampled_from(NUMBER_FIELDS))
    node = doc
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[key] = draw(size_value(key) if key in SIZE_KEYS else other_number())


MUTATION_KINDS = {
    f.__name__: f
    for f in (
        drop_key,
        change_type,
        set_number,
        set_field,
        rename_key,
        add_unknown_key,
        replace_source,
        swap_word,
        flip_bool,
    )
}


@st.composite
def mutated_samples(draw) -> tuple[str, list[str], str]:
    sample = draw(st.sampled_from(SAMPLES))
    doc = yaml.safe_load(sample.read_text())
    model = doc["model"]
    if isinstance(model.get("path"), str):  # the checkpoint: the copy is run from a temporary folder
        model["path"] = str((sample.parent / model["path"]).resolve())
    inputs = doc.get("inputs") if isinstance(doc.get("inputs"), dict) else {}
    doc["inputs"] = {**inputs, "batch_size": draw(st.integers(1, 2)), "seq_len": draw(st.integers(2, 8))}
    if draw(st.integers(0, 2)):  # two times in three one check, not all four: a valid example costs less
        doc["checks"] = [draw(st.sampled_from(CHECKS))]
    applied = draw(st.lists(st.sampled_from(sorted(MUTATION_KINDS)), min_size=1, max_size=3))
    for name in applied:
        MUTATION_KINDS[name](draw, doc)
    return sample.name, applied, yaml.safe_dump(doc, sort_keys=False)


# ---------------------------------------------------------------------------------------------------------------------
# The property


def imports_something_unvetted(text_: str) -> bool:
    try:
        document = yaml.safe_load(text_)
    except (yaml.YAMLError, ValueError):  # not YAML: fwdcheck refuses it before anything is imported
        return False
    strings = []

    def walk(node):
        if isinstance(node, str):
            strings.append(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(k)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(document)
    return any(REFERENCE.search(s) and s.strip() not in SAFE_REFERENCES for s in strings)


def process_state() -> dict:
    return {
        "function_mode": torch._C._is_torch_function_mode_enabled(),
        "sigalrm": signal.getsignal(signal.SIGALRM),
        "itimer": signal.getitimer(signal.ITIMER_REAL),
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "sys_path": list(sys.path),
    }


def run_and_judge(config: Path, text_: str, output_format: str, outcomes: Counter) -> None:
    config.write_text(text_, encoding="utf-8")
    before, rng = process_state(), torch.get_rng_state()
    result = runner.invoke(app, ["run", str(config), "--format", output_format, "--in-process"], catch_exceptions=False)
    everything = result.stdout + result.stderr
    code = result.exit_code
    outcomes[code] += 1
    assert code in ALLOWED_EXITS, f"exit {code} for:\n{text_}\n---\n{everything}"
    assert "Traceback" not in everything, everything
    assert process_state() == before, "the run left the process changed"
    assert torch.equal(rng, torch.get_rng_state()), "the run moved the global RNG"
    if code == 2:
        assert result.stdout == "", result.stdout
        lines = ANSI.sub("", result.stderr).splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        return
    assert result.stderr == "", result.stderr
    if output_format == "json":
        assert json.loads(result.stdout)["exit_code"] == code
    else:
        assert ANSI.sub("", result.stdout).rstrip().endswith(f"(exit {code})"), result.stdout


def test_arbitrary_yaml_documents():
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "fuzz.yaml"

        @ARBITRARY
        @given(text_=yaml_texts(), output_format=st.sampled_from(["rich", "json"]))
        def check(text_, output_format):
            assume(not imports_something_unvetted(text_))
            run_and_judge(config, text_, output_format, outcomes)

        check()
    print(f"\narbitrary YAML: {sum(outcomes.values())} documents, exit codes {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) >= ARBITRARY.max_examples * 0.9, outcomes


def test_mutated_sample_configs():
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "mutated.yaml"

        @MUTATIONS
        @given(case=mutated_samples(), output_format=st.sampled_from(["rich", "json"]))
        def check(case, output_format):
            _sample, _applied, text_ = case
            assume(not imports_something_unvetted(text_))
            run_and_judge(config, text_, output_format, outcomes)

        check()
    print(f"\nmutated samples: {sum(outcomes.values())} documents, exit codes {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) >= MUTATIONS.max_examples * 0.9, outcomes
    # The mutations reach the checks, not only validation: some configs still run to a report.
    assert outcomes[2] < sum(outcomes.values()) and outcomes[0] + outcomes[1] + outcomes[5] >= 10, outcomes


# ---------------------------------------------------------------------------------------------------------------------
# Not random: every number field of the schema at every extreme, once (hypothesis may or may not draw these)

EXTREMES = [0, -1, 0.5, 2**63, 2**64, 10**20, 1e300, math.inf, -math.inf, math.nan, "8", True, None, [1]]
REFERENCE_BASE = {
    "model": {"source": "reference", "max_seq_len": 16, "rope": {"base": 10000.0}},
    "inputs": {"batch_size": 1, "seq_len": 2},
}
PYTHON_BASE = {
    "model": {"source": "python", "factory": "fwdcheck.model.reference:build", "kwargs": {"max_seq_len": 16}},
    "inputs": {"batch_size": 1, "seq_len": 2},
}
GRID = (
    [
        (
            REFERENCE_BASE,
            field,
            ["rope"] if "rope" in field else ["future-token"] if "tolerance" in field else ["shape-ledger"],
        )
        for field in NUMBER_FIELDS
        if field[-1] != "max_positions"
    ]
    + [(PYTHON_BASE, ("model", key), ["shape-ledger"]) for key in ("vocab_size", "max_positions")]
    + [(PYTHON_BASE, ("model", "kwargs", key), ["shape-ledger"]) for key in ("vocab_size", "d_model", "n_layers")]
)


@pytest.mark.parametrize(
    ("base", "field", "checks"), GRID, ids=[f"{b['model']['source']}:{'.'.join(f)}" for b, f, _ in GRID]
)
def test_number_field_extremes(base, field, checks, tmp_path):
    """Each value either validates and runs, or is one clear line; never an internal error, never a hang: the one
    size that would build forever (n_layers beyond int64: a loop of 10**20 layers) is not tried."""
    outcomes: Counter = Counter()
    config = tmp_path / "extreme.yaml"
    for value in EXTREMES:
        if field[-1] == "n_layers" and isinstance(value, int) and not isinstance(value, bool) and value > 2**62:
            continue
        doc = copy.deepcopy(base)
        doc["checks"] = checks
        node = doc
        for part in field[:-1]:
            node = node.setdefault(part, {})
        node[field[-1]] = value
        run_and_judge(config, yaml.safe_dump(doc, sort_keys=False), "json", outcomes)
    assert outcomes[2] >= 1, outcomes  # every field has values it refuses


# ---------------------------------------------------------------------------------------------------------------------
# (c) The document's structure: depth and aliases, written as text (yaml.safe_dump itself recurses once per level)

# transformers builds an inline config at its own defaults for what it does not say: a 7-billion-parameter Llama.
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}
PLACES = {  # where the deep value goes: (text before it, text after it)
    "top": ("model: {source: reference}\nextra: ", "\n"),
    "inputs": ("model: {source: reference}\ninputs: ", "\n"),
    "kwargs": ('model:\n  source: python\n  factory: "fwdcheck.model.reference:build"\n  kwargs: {x: ', "}\n"),
    "hf-inline": (
        "model:\n  source: hf\n  config: {" + ", ".join(f"{k}: {v}" for k, v in TINY_LLAMA.items()) + ", extra: ",
        "}\ninputs: {batch_size: 1, seq_len: 4}\nchecks: [shape-ledger]\n",
    ),
}


@st.composite
def deep_texts(draw) -> str:
    depth = draw(st.sampled_from([1, 2, 63, 64, 65, 100, 499, 500, 1000, 5000]) | st.integers(1, 200))
    before, after = PLACES[draw(st.sampled_from(sorted(PLACES)))]
    style = draw(st.sampled_from(["flow-list", "flow-map", "block-list", "mixed"]))
    leaf = draw(st.sampled_from(["1", "x", "null", "[]", "{}"]))
    if style == "flow-list":
        value = "[" * depth + leaf + "]" * depth
    elif style == "flow-map":
        value = "{a: " * depth + leaf + "}" * depth
    elif style == "mixed":
        value = (
            "".join("[" if i % 2 else "{a: " for i in range(depth))
            + leaf
            + "".join("]" if i % 2 else "}" for i in reversed(range(depth)))
        )
    else:  # compact block sequences on a line of their own, `- - - 1`, under a block mapping
        head = draw(
            st.sampled_from(
                [
                    "model: {source: reference}\nextra:\n  ",
                    'model:\n  source: python\n  factory: "fwdcheck.model.reference:build"\n  kwargs:\n    x:\n      ',
                ]
            )
        )
        return head + "- " * depth + leaf + "\n"
    return before + value + after


@st.composite
def alias_texts(draw) -> str:
    levels = draw(st.integers(1, 8))
    fanout = draw(st.integers(1, 12))
    lines = ["model: {source: reference}", "a0: &a0 [x, y]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fanout) + "]")
    if draw(st.booleans()):  # an alias inside the node it names
        lines.append("loop: &loop {again: *loop}" if draw(st.booleans()) else "loop: &loop [1, [2, *loop]]")
    return "\n".join(lines) + "\n"


def test_deep_and_aliased_yaml_documents():
    """Never exit 3, never a hang: a document nested past the limit or expanding past it is one line, exit 2."""
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "structure.yaml"

        @STRUCTURES
        @given(text_=st.one_of(deep_texts(), alias_texts()))
        def check(text_):
            run_and_judge(config, text_, "json", outcomes)

        check()
    print(f"\nstructures: {sum(outcomes.values())} documents, exit codes {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) == STRUCTURES.max_examples, outcomes
    assert outcomes[2] >= 1, outcomes


# ---------------------------------------------------------------------------------------------------------------------
# (d) The expected ledger


TOY = REPO / "sample_configs" / "toy.yaml"
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 2**64),
        st.sampled_from([math.nan, math.inf, 0.5, -0.0]),
        text,
        st.sampled_from(["B", "T", "V", "h", "d_h", "logits", "input_ids", "float32"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(text, st.sampled_from(["entries", "dims", "name", "shape", "dtype", "fwdcheck_ledger"])),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def saved_ledger(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("ledger") / "saved.json"
    result = runner.invoke(
        app, ["run", str(TOY), "--check", "shape-ledger", "--save-ledger", str(path)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


@st.composite
def mutated_ledgers(draw, saved: dict) -> str:
    doc = copy.deepcopy(saved)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["drop", "type", "null", "nan", "duplicate", "nest", "number"]))
        spot = _pick(draw, doc)
        if spot is None:
            break
        container, key, _ = spot
        if how == "drop" and isinstance(container, dict):
            del container[key]
        elif how == "type":
            container[key] = draw(json_values)
        elif how == "null":
            container[key] = None
        elif how == "nan":
            container[key] = math.nan
        elif how == "duplicate" and isinstance(doc.get("entries"), list) and doc["entries"]:
            doc["entries"].append(copy.deepcopy(draw(st.sampled_from(doc["entries"]))))
        elif how == "nest":
            depth = draw(st.sampled_from([2, 70, 1000, 100_000]))
            return json.dumps(doc).replace('"entries"', '"x": ' + "[" * depth + "]" * depth + ', "entries"', 1)
        elif how == "number":
            container[key] = draw(other_number())
    return json.dumps(doc)


def test_expected_ledgers(saved_ledger):
    """Whatever --expect-ledger holds, the run exits 0, 1 or 2, never 3; exit 2 is one line naming the file."""
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory() as folder:
        ledger = Path(folder) / "expected.json"

        @LEDGERS
        @given(text_=st.one_of(json_values.map(json.dumps), mutated_ledgers(saved_ledger)))
        def check(text_):
            ledger.write_text(text_, encoding="utf-8")
            result = runner.invoke(
                app,
                [
                    "run",
                    str(TOY),
                    "--check",
                    "shape-ledger",
                    "--format",
                    "json",
                    "--in-process",
                    "--expect-ledger",
                    str(ledger),
                ],
                catch_exceptions=False,
            )
            everything = result.stdout + result.stderr
            outcomes[result.exit_code] += 1
            assert result.exit_code in (0, 1, 2), f"exit {result.exit_code} for:\n{text_[:2000]}\n---\n{everything}"
            assert "Traceback" not in everything, everything
            if result.exit_code == 2:
                lines = ANSI.sub("", result.stderr).splitlines()
                assert len(lines) == 1 and lines[0].startswith(f"error: --expect-ledger {ledger}"), result.stderr
                assert result.stdout == ""
            else:
                assert json.loads(result.stdout)["exit_code"] == result.exit_code

        check()
    print(f"\nexpected ledgers: {sum(outcomes.values())} documents, exit codes {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) == LEDGERS.max_examples, outcomes
    assert outcomes[2] >= 1 and outcomes[0] + outcomes[1] >= 1, outcomes  # some mutations still read as ledgers


# ---------------------------------------------------------------------------------------------------------------------
# Not random: the rotary settings a Hugging Face config declares, at their extremes

HF_ROPE = (
    [("rope_theta", v) for v in (1.0, 0, -1, 0.5, math.nan, math.inf, "abc", True, None, [1], 2**64)]
    + [("partial_rotary_factor", v) for v in (0, -1, 0.5, 2, math.nan, "half", [1])]
    + [("head_dim", v) for v in (0, -8, 3)]
)


@pytest.mark.parametrize(("key", "value"), HF_ROPE, ids=[f"{k}={v!r}" for k, v in HF_ROPE])
def test_hf_rope_settings_extremes(key, value, tmp_path):
    pytest.importorskip("transformers")
    config = {**TINY_LLAMA, key: value}
    doc = {
        "model": {"source": "hf", "config": config},
        "inputs": {"batch_size": 1, "seq_len": 4},
        "checks": ["rope"],
        "paths": {"enabled": False},
    }
    run_and_judge(tmp_path / "hf.yaml", yaml.safe_dump(doc, sort_keys=False), "json", Counter())


def test_reliability_structure_counts_line():
    """docs/reliability.md's second counts line (scripts/reliability_counts.py) stays what these properties run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reliability_counts", REPO / "scripts" / "reliability_counts.py")
    counts_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts_module)
    counts = counts_module.structure_counts()
    assert counts == {"fuzzed_structures": STRUCTURES.max_examples, "fuzzed_ledgers": LEDGERS.max_examples}
    line = counts_module.structure_line(counts)
    page = counts_module.PAGE.read_text()
    first = re.search(r"\d+ bad configs, \d+ fuzzed documents, [^\n]*\n\s*(.*)", page)
    said = first.group(1) if first else None
    assert said is not None and said.startswith(line), (
        f"{counts_module.PAGE.name} says {said!r}; the tests give {line!r}"
    )
