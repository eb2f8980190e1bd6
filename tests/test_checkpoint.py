"""The checkpoint source: a factory builds the architecture, a .safetensors/.pt file fills it.

Real files in tmp_path, real torch, tiny models. Verdicts of a checkpointed model must equal those of the same weights
checked directly; the loaded tensors must be the saved ones bit for bit; every way a file can be wrong is one line and
exit 2 through the CLI.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.config.schema import config_from_dict
from fwdcheck.errors import ModelLoadError
from fwdcheck.model.reference import build
from fwdcheck.model.sources import load_model
from tests.conftest import codes, run_checks, statuses

REF = {"vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2}
FACTORY = "fwdcheck.model.reference:build"
HELPERS = "fwdcheck_ckpt_helpers"  # the module name of the tiny test models written into tmp_path
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

runner = CliRunner()


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def reference_state(seed: int = 0, **fields) -> dict[str, torch.Tensor]:
    """The state dict of a reference model built after manual_seed(seed): seed 0 is what `source: python` builds."""
    torch.manual_seed(seed)
    return build(**REF, **fields).state_dict()


def save(state: dict, path: Path) -> Path:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        torch.save(state, path)
    return path


def checkpoint_model(path: Path, factory: str = FACTORY, **fields) -> dict:
    kwargs = fields.pop("kwargs", REF)
    return {"source": "checkpoint", "factory": factory, "kwargs": kwargs, "path": str(path), **fields}


def load(model: dict):
    return load_model(config_from_dict({"model": model}))


def cli(tmp_path: Path, model: dict):
    config = tmp_path / "fwdcheck.yaml"
    config.write_text(yaml.safe_dump({"model": model, "inputs": {"batch_size": 2, "seq_len": 8}}))
    return runner.invoke(app, ["run", str(config), "--format", "json"], catch_exceptions=False)


def one_line_error(result, *fragments: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr, no traceback; the line holds every fragment."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "Traceback" not in result.output
    lines = ANSI.sub("", result.stderr).splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def assert_same_tensors(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    loaded = module.state_dict()
    assert set(loaded) == set(saved)
    for key, tensor in saved.items():
        got = loaded[key]
        assert got.device.type == "cpu" and got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got.view(torch.uint8) if got.numel() else got, tensor.view(torch.uint8)), key  # bitwise


# ---------------------------------------------------------------------------------------------------------------------
# Round trip: same verdicts as the model checked directly, the same bits as saved


@functools.cache
def _direct_report(bugs: tuple[str, ...]):
    """The same model checked directly (`source: python`), once per bug for both file formats."""
    return run_checks({"source": "python", "factory": FACTORY, "kwargs": {**REF, "bugs": list(bugs)}})


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("bugs", [[], ["no-causal-mask"], ["rope-k-unrotated"]], ids=["clean", "no-mask", "rope-k"])
@pytest.mark.slow
def test_round_trip_verdicts_equal_direct_check(tmp_path, suffix, bugs):
    kwargs = {**REF, "bugs": bugs}
    path = save(reference_state(bugs=bugs), tmp_path / f"model{suffix}")
    direct = _direct_report(tuple(bugs))
    loaded = run_checks(checkpoint_model(path, kwargs=kwargs))
    assert statuses(loaded) == statuses(direct)
    for result in direct.results:
        assert codes(loaded, result.name) == codes(direct, result.name), result.name
    failing = {name for name, status in statuses(loaded).items() if status == "fail"}
    assert (
        failing
        == {
            (): set(),
            # the default set: the cached decode and the gradients read the future too
            ("no-causal-mask",): {"future-token", "mask-audit", "kv-cache", "grad-causality"},
            ("rope-k-unrotated",): {"rope"},
        }[tuple(bugs)]
    )
    assert loaded.model["label"] == f"{FACTORY} <- model{suffix}"
    assert loaded.model["source"] == "checkpoint"


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth", ".bin"])
def test_loaded_parameters_are_the_saved_ones_bitwise(tmp_path, suffix):
    saved = reference_state(seed=123)  # not what the config's seed would initialise: the bits must come from the file
    path = save(saved, tmp_path / f"weights{suffix}")
    loaded = load(checkpoint_model(path))
    assert_same_tensors(loaded.module, saved)
    fresh = reference_state(seed=0)
    assert not torch.equal(fresh["wte.weight"], loaded.module.state_dict()["wte.weight"])
    assert loaded.extra["built_on"] == "meta"
    assert loaded.extra["missing_keys"] == [] and loaded.extra["unexpected_keys"] == []
    assert loaded.extra["notes"] == []
    assert loaded.extra["tensors"] == len(saved) and loaded.extra["dtypes"] == {"float32": len(saved)}
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in loaded.module.parameters())
    assert loaded.vocab_size == 32


def test_checkpoint_dtype_is_kept_as_saved(tmp_path):
    saved = {k: v.to(torch.bfloat16) for k, v in reference_state().items()}
    loaded = load(checkpoint_model(save(saved, tmp_path / "bf16.safetensors")))
    assert_same_tensors(loaded.module, saved)
    assert loaded.extra["dtypes"] == {"bfloat16": len(saved)}


# ---------------------------------------------------------------------------------------------------------------------
# What a training script wraps around the weights


@pytest.mark.parametrize("wrapper", ["model", "state_dict"])
def test_nested_checkpoint_is_unwrapped(tmp_path, wrapper):
    saved = reference_state(seed=7)
    path = tmp_path / "train.pt"
    torch.save({wrapper: saved, "optimizer": {"state": {}, "param_groups": []}, "step": 1000}, path)
    loaded = load(checkpoint_model(path))
    assert_same_tensors(loaded.module, saved)
    assert any(f"unwrapped checkpoint['{wrapper}']" in note and "optimizer" in note for note in loaded.extra["notes"])


def test_compile_and_ddp_prefixes_are_stripped(tmp_path):
    saved = reference_state(seed=7)
    path = save({f"module._orig_mod.{k}": v for k, v in saved.items()}, tmp_path / "compiled.pt")
    loaded = load(checkpoint_model(path))
    assert_same_tensors(loaded.module, saved)
    assert any("stripped the prefix 'module._orig_mod.'" in note for note in loaded.extra["notes"])


def test_sharded_index_is_merged(tmp_path):
    saved = reference_state(seed=7)
    keys = sorted(saved)
    shards = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    for name, shard_keys in shards.items():
        save({k: saved[k] for k in shard_keys}, tmp_path / name)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: name for name, ks in shards.items() for k in ks}}))
    loaded = load(checkpoint_model(index))
    assert_same_tensors(loaded.module, saved)
    assert loaded.extra["format"] == "sharded"


# ---------------------------------------------------------------------------------------------------------------------
# Keys that do not match


def renamed_state(seed: int = 7) -> dict[str, torch.Tensor]:
    state = reference_state(seed=seed)
    state["layers.0.attn.query.weight"] = state.pop("layers.0.attn.q_proj.weight")
    return state


@pytest.mark.slow
def test_renamed_key_without_strict_is_a_warning_and_the_run_proceeds(tmp_path):
    path = save(renamed_state(), tmp_path / "renamed.safetensors")
    loaded = load(checkpoint_model(path, strict=False))
    assert loaded.extra["missing_keys"] == ["layers.0.attn.q_proj.weight"]
    assert loaded.extra["unexpected_keys"] == ["layers.0.attn.query.weight"]
    assert loaded.extra["renamed_keys"] == {"layers.0.attn.query.weight": "layers.0.attn.q_proj.weight"}
    notes = " | ".join(loaded.extra["notes"])
    assert (
        "key 'layers.0.attn.query.weight' in the checkpoint looks renamed from 'layers.0.attn.q_proj.weight'"
    ) in notes
    assert "missing from the checkpoint" in notes and "ignored" in notes
    said = [n for n in loaded.extra["notes"] if "keeps its fresh initialisation" in n or "was ignored" in n]
    assert len(said) == 2 and all(n.startswith("warning: ") for n in said)
    # The missing key cannot be assigned: the model is rebuilt on the CPU, the rest still the file's bits.
    assert loaded.extra["built_on"] == "cpu"
    state = loaded.module.state_dict()
    for key, tensor in renamed_state().items():
        if key in state:
            assert torch.equal(state[key], tensor), key
    assert not loaded.module.layers[0].attn.q_proj.weight.is_meta
    result = cli(tmp_path, checkpoint_model(path, strict=False))
    assert result.exit_code == 0, result.output
    assert {c["status"] for c in json.loads(result.stdout)["checks"]} == {"pass"}


@pytest.mark.parametrize("strict", [{}, {"strict": True}], ids=["by-default", "said"])
@pytest.mark.slow
def test_renamed_key_exits_2_naming_it(tmp_path, strict):
    """As load_state_dict's own default: a 3-layer factory over a 2-layer checkpoint is no model to check."""
    path = save(renamed_state(), tmp_path / "renamed.safetensors")
    one_line_error(
        cli(tmp_path, checkpoint_model(path, **strict)),
        "`strict: false` loads it anyway",
        "missing 'layers.0.attn.q_proj.weight'",
        "unexpected 'layers.0.attn.query.weight'",
        "key 'layers.0.attn.query.weight' in the checkpoint looks renamed from 'layers.0.attn.q_proj.weight'",
    )


def test_whole_family_renamed_pairs_each_key_with_its_own(tmp_path):
    state = reference_state()
    for old, new in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        state[f"layers.1.attn.{new}.weight"] = state.pop(f"layers.1.attn.{old}.weight")
    state["model.ln_f.weight"] = state.pop("ln_f.weight")  # a prefix in front
    loaded = load(checkpoint_model(save(state, tmp_path / "family.pt"), strict=False))
    assert loaded.extra["renamed_keys"] == {
        "layers.1.attn.query.weight": "layers.1.attn.q_proj.weight",
        "layers.1.attn.key.weight": "layers.1.attn.k_proj.weight",
        "layers.1.attn.value.weight": "layers.1.attn.v_proj.weight",
        "model.ln_f.weight": "ln_f.weight",
    }


def test_prefix_on_every_key_is_one_rename_line(tmp_path):
    path = save({f"model.{k}": v for k, v in reference_state().items()}, tmp_path / "prefixed.pt")
    loaded = load(checkpoint_model(path, strict=False))
    assert len(loaded.extra["renamed_keys"]) == len(loaded.extra["missing_keys"]) == 24
    renames = [note for note in loaded.extra["notes"] if "renamed" in note]
    assert (
        renames == [renames[0]]
        and "24 keys in the checkpoint look renamed the same way, 'model.' in front" in renames[0]
    )


def test_missing_key_without_strict_keeps_seeded_init(tmp_path):
    state = reference_state(seed=7)
    del state["lm_head.weight"]
    loaded = load(checkpoint_model(save(state, tmp_path / "partial.safetensors"), strict=False))
    assert loaded.extra["missing_keys"] == ["lm_head.weight"] and loaded.extra["renamed_keys"] == {}
    assert torch.equal(loaded.module.lm_head.weight, reference_state(seed=0)["lm_head.weight"])  # the config's seed
    assert torch.equal(loaded.module.wte.weight, state["wte.weight"])


@pytest.mark.slow
def test_more_layers_than_the_checkpoint_exits_2_by_default(tmp_path):
    path = save(reference_state(), tmp_path / "two-layers.safetensors")
    line = one_line_error(cli(tmp_path, checkpoint_model(path, kwargs={**REF, "n_layers": 3})), "missing 'layers.2.")
    assert "`strict: false` loads it anyway" in line


@pytest.mark.slow
def test_shape_mismatch_exits_2_naming_key_and_shapes(tmp_path):
    path = save(reference_state(d_ff=48), tmp_path / "wide.safetensors")
    line = one_line_error(
        cli(tmp_path, checkpoint_model(path)), "'layers.0.mlp.up.weight'", "[48, 16]", "[32, 16]", "more mismatched"
    )
    assert "size mismatch" not in line  # ours, not torch's multi-line RuntimeError


# ---------------------------------------------------------------------------------------------------------------------
# Pickles that need code


@pytest.mark.slow
def test_pickled_module_is_refused_without_trust(tmp_path):
    torch.manual_seed(7)
    path = tmp_path / "whole.pt"
    torch.save(build(**REF), path)
    one_line_error(
        cli(tmp_path, checkpoint_model(path)),
        "trust_checkpoint: true",
        "weights_only refused",
        "fwdcheck.model.reference.ReferenceTransformer",
        "run arbitrary code",
    )


@pytest.mark.slow
def test_pickled_module_loads_with_trust(tmp_path):
    torch.manual_seed(7)
    model = build(**REF)
    path = tmp_path / "whole.pt"
    torch.save(model, path)
    loaded = load(checkpoint_model(path, trust_checkpoint=True))
    assert_same_tensors(loaded.module, model.state_dict())
    assert any("weights_only=False" in note for note in loaded.extra["notes"])
    result = cli(tmp_path, checkpoint_model(path, trust_checkpoint=True))
    assert result.exit_code == 0, result.output


def test_trust_is_not_needed_for_a_plain_state_dict(tmp_path):
    path = save(reference_state(), tmp_path / "plain.pt")
    loaded = load(checkpoint_model(path, trust_checkpoint=True))
    assert not any("weights_only=False" in note for note in loaded.extra["notes"])  # still loaded the safe way


@pytest.mark.slow
def test_pickle_calling_into_os_is_refused_even_when_trusted(tmp_path):
    class CallsSystem:  # unpickles by calling os.system (with a command that does nothing, should it ever run)
        def __reduce__(self):
            return os.system, ("true",)

    path = tmp_path / "calls.pt"
    torch.save({"wte.weight": CallsSystem()}, path, _use_new_zipfile_serialization=False)
    for trusted in (False, True):
        one_line_error(
            cli(tmp_path, checkpoint_model(path, trust_checkpoint=trusted)),
            "refused: unpickling it needs code: it calls posix.system, from module posix",
            "refused even with trust_checkpoint: true",
        )


@pytest.mark.slow
def test_pickle_protocol_the_safe_loader_does_not_read_is_named_and_loads_when_trusted(tmp_path):
    saved = reference_state()
    path = tmp_path / "p5.pt"
    torch.save(saved, path, pickle_protocol=5)
    line = one_line_error(
        cli(tmp_path, checkpoint_model(path)),
        "written with pickle protocol 5",
        "torch.load(weights_only=True) does not read (opcode FRAME)",
        "trust_checkpoint: true",
    )
    assert "corrupt" not in line
    loaded = load(checkpoint_model(path, trust_checkpoint=True))
    assert_same_tensors(loaded.module, saved)
    assert (
        "loaded with weights_only=False (trust_checkpoint: true): written with pickle protocol 5"
        in loaded.extra["notes"]
    )
    result = cli(tmp_path, checkpoint_model(path, trust_checkpoint=True))
    assert result.exit_code == 0 and result.stderr == "", result.output  # torch's protocol warning is not shown


# ---------------------------------------------------------------------------------------------------------------------
# Files that cannot be loaded: one line, exit 2


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _random_bytes(path: Path) -> None:
    path.write_bytes(
        torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8).numpy().tobytes()
    )


BAD_FILES = {
    "truncated-safetensors": ("model.safetensors", "truncate", ["not a readable safetensors file"]),
    "random-safetensors": ("model.safetensors", "random", ["not a readable safetensors file"]),
    "truncated-pt": ("model.pt", "truncate", ["not a readable torch checkpoint"]),
    "random-pt": ("model.pt", "random", ["model.pt", "corrupt"]),
    "empty-pt": ("model.pt", "empty", ["empty (0 bytes)"]),
    "missing": ("nowhere.safetensors", "missing", ["nowhere.safetensors: no such file"]),
    "directory": ("weights", "directory", ["is a directory", "model.safetensors"]),
    "unknown-extension": ("model.onnx", "plain", ["unknown extension '.onnx'", ".safetensors", ".pt", ".pth", ".bin"]),
    "no-tensors-pt": ("meta.pt", "no-tensors", ["holds no tensors", "step"]),
    "no-tensors-safetensors": ("empty.safetensors", "no-tensors", ["holds no tensors"]),
    "not-a-state-dict": ("list.pt", "list", ["holds no tensors", "list"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.slow
def test_unloadable_file_is_one_line_exit_2(tmp_path, case):
    name, how, fragments = BAD_FILES[case]
    path = tmp_path / name
    if how in ("truncate", "plain"):
        save(reference_state(), path.with_suffix(".safetensors") if how == "plain" else path)
        if how == "plain":
            path.with_suffix(".safetensors").rename(path)
        else:
            _truncated(path)
    elif how == "random":
        _random_bytes(path)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "directory":
        path.mkdir()
        save(reference_state(), path / "model.safetensors")
    elif how == "no-tensors":
        save({} if path.suffix == ".safetensors" else {"step": 3, "config": {"lr": 1e-3}}, path)
    elif how == "list":
        torch.save([1, 2, 3], path)
    one_line_error(cli(tmp_path, checkpoint_model(path)), *fragments)
    with pytest.raises(ModelLoadError):
        load(checkpoint_model(path))


@pytest.mark.slow
def test_sharded_index_with_a_missing_shard_names_it(tmp_path):
    save(reference_state(), tmp_path / "model-00001-of-00002.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(
        json.dumps(
            {
                "weight_map": {
                    "wte.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    one_line_error(
        cli(tmp_path, checkpoint_model(index)),
        "model.safetensors.index.json",
        "shard model-00002-of-00002.safetensors: no such file",
    )


@pytest.mark.slow
def test_load_error_keeps_every_key_torch_names(tmp_path, helpers):
    """torch puts the keys on the lines after "Error(s) in loading state_dict for X:"; the one line keeps them."""
    torch.manual_seed(3)
    path = save(helpers.build(kind="picky").state_dict(), tmp_path / "picky.safetensors")
    one_line_error(
        cli(tmp_path, helpers(path, kwargs={"kind": "picky"})),
        "Error(s) in loading state_dict for Picky: layers.0.qkv.weight: stored transposed? refusing it",
    )


@pytest.mark.slow
def test_meta_tensors_and_duplicate_safetensors_keys_are_refused(tmp_path):
    with torch.device("meta"):
        meta_state = build(**REF).state_dict()
    torch.save(meta_state, tmp_path / "meta.pt")
    one_line_error(cli(tmp_path, checkpoint_model(tmp_path / "meta.pt")), "'wte.weight'", "hold no data (meta tensors")
    entry = '{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
    header = f'{{"w": {entry}, "w": {entry}}}'
    duplicate = tmp_path / "dup.safetensors"
    duplicate.write_bytes(len(header).to_bytes(8, "little") + header.encode() + torch.ones(2).numpy().tobytes())
    one_line_error(cli(tmp_path, checkpoint_model(duplicate)), "the safetensors header names 'w' more than once")


def test_directory_of_a_hugging_face_model_points_at_source_hf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="source: hf"):
        load(checkpoint_model(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# A model of our own: a RoPE cache that no checkpoint stores, tied weights


HELPER_SOURCE = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Rotary(nn.Module):
    """Llama-style: inv_freq computed in __init__, kept as a non-persistent buffer (never in a state dict)."""

    def __init__(self, head_dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, positions):  # x (B, h, T, d), positions (B, T)
        angles = positions[:, None, :, None].float() * self.inv_freq  # (B, 1, T, d/2)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.chunk(2, dim=-1)  # half pairing
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim, n_heads, base):
        super().__init__()
        self.n_heads = n_heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.rotary = Rotary(dim // n_heads, base)

    def forward(self, x, positions):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for t in self.qkv(self.norm(x)).split(C, dim=-1))
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(B, T, C))


class TinyRope(nn.Module):
    def __init__(self, vocab_size=32, dim=16, n_heads=2, n_layers=2, base=10000.0, tie=False):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, base) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, input_ids, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x, position_ids)
        return self.head(self.norm(x))


class Picky(TinyRope):
    """Refuses a weight while loading, as modules that check their own state do; torch names the key on a line of its
    own."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        error_msgs.append("layers.0.qkv.weight: stored transposed? refusing it")


def build(kind="tiny", **kwargs):
    return (Picky if kind == "picky" else TinyRope)(**kwargs)
'''


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    """The helper module written into tmp_path; returns a builder for a checkpoint config that uses it."""
    source = tmp_path / f"{HELPERS}.py"
    source.write_text(HELPER_SOURCE)
    monkeypatch.delitem(sys.modules, HELPERS, raising=False)
    spec = importlib.util.spec_from_file_location(f"{HELPERS}_local", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def model(path: Path, **fields) -> dict:
        return checkpoint_model(
            path, factory=f"{HELPERS}:build", kwargs=fields.pop("kwargs", {}), python_path=[str(tmp_path)], **fields
        )

    model.build = module.build
    yield model
    sys.modules.pop(HELPERS, None)


def test_rope_buffer_not_in_checkpoint_is_computed_on_cpu(tmp_path, helpers):
    torch.manual_seed(11)
    saved = helpers.build().state_dict()
    assert not any("inv_freq" in k for k in saved)  # non-persistent: no checkpoint holds it
    path = save(saved, tmp_path / "rope.safetensors")
    loaded = load(helpers(path))
    assert loaded.extra["built_on"] == "cpu"
    assert any(
        "not stored in checkpoints" in note and "layers.0.rotary.inv_freq" in note for note in loaded.extra["notes"]
    )
    assert loaded.extra["missing_keys"] == []
    expected = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    for block in loaded.module.layers:
        assert torch.equal(block.rotary.inv_freq, expected)
    assert_same_tensors(loaded.module, saved)
    report = run_checks(helpers(path, rope={"base": 10000.0, "pairing": "half"}))
    # every check passes that applies (this checkpoint's model offers no cache, loss or packing to drive)
    assert {r.status.value for r in report.results if not r.summary.startswith("does not apply: ")} == {"pass"}, (
        statuses(report)
    )
    assert {statuses(report)[name] for name in ("shape-ledger", "future-token", "mask-audit", "rope")} == {"pass"}


def test_cpu_rebuild_of_a_bfloat16_checkpoint_says_it_converted(tmp_path, helpers):
    torch.manual_seed(11)
    saved = {k: v.to(torch.bfloat16) for k, v in helpers.build().state_dict().items()}
    loaded = load(helpers(save(saved, tmp_path / "rope-bf16.safetensors")))
    assert loaded.extra["built_on"] == "cpu" and loaded.extra["dtypes"] == {"bfloat16": len(saved)}
    assert any(f"{len(saved)} bfloat16 -> float32" in note for note in loaded.extra["notes"])
    for key, tensor in saved.items():
        assert torch.equal(loaded.module.state_dict()[key], tensor.float()), key  # bfloat16 -> float32 is exact


def test_rope_base_mismatch_still_caught_after_loading(tmp_path, helpers):
    """The buffer comes from the factory's kwargs, so a declared base that differs must still fail the rope check."""
    torch.manual_seed(11)
    path = save(helpers.build().state_dict(), tmp_path / "rope.pt")
    report = run_checks(helpers(path, kwargs={"base": 500.0}, rope={"base": 10000.0}))
    assert statuses(report)["rope"] == "fail"
    assert "FWD305" in codes(report, "rope")


@pytest.mark.parametrize("drop_alias", [False, True], ids=["both-keys", "one-key"])
def test_tied_weights_stay_tied(tmp_path, helpers, drop_alias):
    torch.manual_seed(11)
    model = helpers.build(tie=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # safetensors stores shared tensors once
    if drop_alias:
        del saved["head.weight"]
    path = save(saved, tmp_path / "tied.safetensors")
    loaded = load(helpers(path, kwargs={"tie": True}))
    assert loaded.module.head.weight is loaded.module.embed.weight
    assert torch.equal(loaded.module.head.weight, model.embed.weight)
    assert loaded.extra["missing_keys"] == []
    if drop_alias:
        assert any(
            "'head.weight' is not stored in the checkpoint; it is tied" in note for note in loaded.extra["notes"]
        )


def test_factory_that_cannot_run_on_meta_builds_on_cpu(tmp_path, helpers):
    (tmp_path / "fwdcheck_ckpt_value_init.py").write_text(
        "import torch\n"
        "from fwdcheck.model.reference import build as reference\n"
        "def build(**kw):\n"
        "    scale = torch.ones(1).item()  # reads a value: impossible on the meta device\n"
        "    return reference(**kw)\n"
    )
    saved = reference_state(seed=7)
    path = save(saved, tmp_path / "m.safetensors")
    try:
        loaded = load(checkpoint_model(path, factory="fwdcheck_ckpt_value_init:build", python_path=[str(tmp_path)]))
    finally:
        sys.modules.pop("fwdcheck_ckpt_value_init", None)
    assert loaded.extra["built_on"] == "cpu"
    assert any("cannot run on the meta device" in note for note in loaded.extra["notes"])
    assert_same_tensors(loaded.module, saved)


@pytest.mark.slow
def test_sample_config_runs_clean():
    """sample_configs/checkpoint/reference.yaml: a committed 23 KB safetensors file, loaded strictly, passes."""
    sample = Path(__file__).resolve().parents[1] / "sample_configs" / "checkpoint" / "reference.yaml"
    result = runner.invoke(app, ["run", str(sample), "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["label"] == "fwdcheck.model.reference:build <- reference.safetensors"
    assert {c["status"] for c in report["checks"]} == {"pass"}
