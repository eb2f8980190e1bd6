"""`fwdcheck shrink`: a big model's real config becomes a 2-layer copy of the same architecture every check can run on.

Real transformers configs (no mocks), written into tmp_path as a user's project holds them; each test works from
another directory (the shrunk config is written to the working directory), and the shrunk configs then run through
`fwdcheck run` in-process. The code-path matrix is narrowed in most source configs (the `paths:` key, which
shrink carries over) so the file stays well under a minute; the Llama case runs the whole matrix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fwdcheck.cli import app
from fwdcheck.model.sources.shrink import (
    KWARG_KEYS,
    clamp_token,
    keep_layers,
    resample,
    shrink_heads,
    shrink_hf_dict,
    shrink_sizes,
)

# Imported here, not first inside a CliRunner call: transformers' log handler would keep that call's closed stderr.
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
GPTJ_6B = {
    "architectures": ["GPTJForCausalLM"],
    "model_type": "gptj",
    "n_embd": 4096,
    "n_head": 16,
    "n_layer": 28,
    "n_positions": 2048,
    "rotary_dim": 64,
    "vocab_size": 50400,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "tie_word_embeddings": False,
}
GPT2 = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "n_ctx": 1024,
    "vocab_size": 50257,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}
# Fewer code paths than the default matrix: each check still runs, on eager and sdpa, with and without padding.
FEW_PATHS = {
    "attn_implementation": ["eager", "sdpa"],
    "output_attentions": [False],
    "attention_mask": ["absent", "left-pad"],
    "batch_size": [2],
}


@pytest.fixture(autouse=True)
def work(tmp_path, monkeypatch) -> Path:
    """The working directory: not the folder the configs are in."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "work"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def hf_project(tmp_path: Path, name: str, hf_config: dict, **top) -> Path:
    """A directory holding config.json (no weights) and a fwdcheck config pointing at it."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": {"source": "hf", "path": name}, **top}, sort_keys=False), encoding="utf-8")
    return path


def shrink(config: Path, *args) -> tuple[Path, dict, str]:
    """Shrink into the default place, the working directory; the written document and what the command printed."""
    result = invoke("shrink", config, *args)
    assert result.exit_code == 0, result.output
    out = Path(f"{config.stem}.shrunk.yaml")
    assert out.exists() and not config.with_name(out.name).exists()
    return out, yaml.safe_load(out.read_text(encoding="utf-8")), result.stdout


def run_json(config: Path, *args) -> tuple[int, dict]:
    result = invoke("run", config, "--format", "json", *args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout)


def statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def hf_config(model_block: dict):
    """The transformers config a shrunk `config:` block builds, as `fwdcheck run` would build it."""
    inline = dict(model_block["config"])
    return transformers.AutoConfig.for_model(inline.pop("model_type"), **inline)


# ---------------------------------------------------------------------------------------------------------------
# End to end: real architectures.


@pytest.mark.slow
def test_llama3_8b_shrinks_keeping_gqa_ratio_and_rope_and_every_check_passes(tmp_path):
    config = hf_project(tmp_path, "llama3-8b", LLAMA3_8B, meta=True, inputs={"batch_size": 2, "seq_len": 8})
    out, document, printed = shrink(config)

    assert "meta" not in document  # a shrunk config exists to run with values
    assert document["inputs"] == {"batch_size": 2, "seq_len": 8}
    block = document["model"]
    assert block["source"] == "hf" and "path" not in block
    small = block["config"]
    assert (small["num_hidden_layers"], small["num_attention_heads"], small["num_key_value_heads"]) == (2, 8, 2)
    assert small["head_dim"] == 16 and small["hidden_size"] == 8 * 16
    assert small["intermediate_size"] == 448  # 14336 / 4096 = 3.5 x 128
    assert small["vocab_size"] == 512 and small["bos_token_id"] == 511 and small["eos_token_id"] == [511]
    assert small["dtype"] == "float32"
    assert not {"_name_or_path", "transformers_version", "torch_dtype", "architectures"} & set(small)
    assert small["max_position_embeddings"] == 131072 and small["tie_word_embeddings"] is False
    original = transformers.AutoConfig.from_pretrained(tmp_path / "llama3-8b")
    assert hf_config(block).rope_parameters == original.rope_parameters  # llama3 scaling, theta 500000: identical
    assert hf_config(block).rope_parameters["rope_theta"] == 500000.0
    # The table of changes and the way to run it.
    for row in (["num_hidden_layers", "32", "2"], ["num_attention_heads", "32", "8"], ["head_dim", "128", "16"]):
        assert any(line.split()[:3] == row for line in printed.splitlines()), printed
    assert f"run it with `fwdcheck run {out}`" in printed

    code, report = run_json(out)
    assert code == 0, report
    assert_shrunk_run_passes(report, rope="pass")
    assert report["model"]["dims"] == {"V": 512, "d": 128, "h": 8, "h_kv": 2, "d_h": 16, "d_ff": 448, "L": 2}


@pytest.mark.slow
def test_mistral_keeps_a_sliding_window_the_test_sequence_reaches_past(tmp_path):
    config = hf_project(tmp_path, "mistral-7b", MISTRAL_7B, paths=FEW_PATHS)
    out, document, printed = shrink(config)

    small = document["model"]["config"]
    window = small["sliding_window"]
    assert 2 <= window <= 8 and document["paths"] == FEW_PATHS
    seq_len = (document.get("inputs") or {}).get("seq_len", 8)
    assert seq_len > window  # the window masks something
    assert "sliding_window" in printed

    code, report = run_json(out)
    assert code == 0, report
    assert set(statuses(report).values()) == {"pass"}
    assert "causal, restricted (window" in check(report, "mask-audit")["summary"]  # the audit saw the band


@pytest.mark.slow
def test_gptj_keeps_interleaved_rotary_with_rotary_dim_scaled(tmp_path):
    config = hf_project(tmp_path, "gpt-j-6b", GPTJ_6B, checks=["shape-ledger", "rope"])
    out, document, _ = shrink(config)

    small = document["model"]["config"]
    assert (small["n_layer"], small["n_head"], small["n_embd"]) == (2, 2, 32)  # head 256 -> 16
    assert small["rotary_dim"] == 4  # 64 of 256 -> 4 of 16
    assert document["checks"] == ["shape-ledger", "rope"]

    code, report = run_json(out)
    assert code == 0, report
    rope = check(report, "rope")
    assert rope["status"] == "pass"
    assert "pairing interleaved, rotary dim 4" in rope["summary"]


@pytest.mark.slow
def test_gpt2_caps_learned_positions(tmp_path):
    config = hf_project(tmp_path, "gpt2", GPT2, paths=FEW_PATHS)
    out, document, _ = shrink(config)

    small = document["model"]["config"]
    assert small["n_positions"] == 256 and small["n_ctx"] == 256
    assert (small["n_layer"], small["n_head"], small["n_embd"], small["vocab_size"]) == (2, 2, 32, 512)
    assert small["bos_token_id"] == small["eos_token_id"] == 511

    code, report = run_json(out)
    assert code == 0, report
    assert_shrunk_run_passes(report, rope="skip")


@pytest.mark.slow
def test_inline_config_with_one_kv_head_keeps_multi_query_and_the_other_keys(tmp_path):
    config = tmp_path / "inline.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "source": "hf",
                    "class": "LlamaForCausalLM",
                    "config": {
                        "model_type": "llama",
                        "hidden_size": 1024,
                        "num_attention_heads": 8,
                        "num_key_value_heads": 1,
                        "num_hidden_layers": 12,
                        "intermediate_size": 2816,
                        "vocab_size": 32000,
                    },
                },
                "inputs": {"batch_size": 1, "seq_len": 6, "seed": 3},
                "checks": ["shape-ledger"],
                "dtype": "float32",
                "tolerance": {"noise_factor": 20.0},
            },
            sort_keys=False,
        ),
        encoding="utf-8",
    )
    out = tmp_path / "elsewhere.yaml"
    result = invoke("shrink", config, "-o", out)
    assert result.exit_code == 0, result.output
    document = yaml.safe_load(out.read_text(encoding="utf-8"))

    block = document["model"]
    assert block["class"] == "LlamaForCausalLM"
    small = block["config"]
    assert (small["num_attention_heads"], small["num_key_value_heads"]) == (8, 1)  # MQA stays MQA, 8 per kv head
    assert small["hidden_size"] == 128 and small["intermediate_size"] == 352  # 2.75 x 128
    assert document["checks"] == ["shape-ledger"] and document["tolerance"] == {"noise_factor": 20.0}
    assert document["inputs"] == {"batch_size": 1, "seq_len": 6, "seed": 3}

    code, report = run_json(out)
    assert code == 0 and statuses(report) == {"shape-ledger": "pass"}, report


def test_refuses_to_overwrite_without_force(tmp_path):
    config = tmp_path / "toy.yaml"
    config.write_text("model: {source: reference, n_layers: 12, d_model: 256, n_heads: 4}\n", encoding="utf-8")
    out = Path("toy.shrunk.yaml")
    out.write_text("# mine\n", encoding="utf-8")

    result = invoke("shrink", config)
    assert result.exit_code == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "--force" in result.stderr
    assert out.read_text(encoding="utf-8") == "# mine\n"

    assert invoke("shrink", config, "--force").exit_code == 0
    assert yaml.safe_load(out.read_text(encoding="utf-8"))["model"]["source"] == "reference"
    same = invoke("shrink", config, "-o", config, "--force")  # never onto the config being shrunk
    assert same.exit_code == 2 and "another --output" in same.stderr


FACTORY_MODULE = """\
from fwdcheck.model.reference import build


def make(**sizes):
    return build(**sizes)
"""


@pytest.mark.slow
def test_python_kwargs_shrink_by_name_and_the_copy_finds_the_factory_from_the_working_directory(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "mymodel.py").write_text(FACTORY_MODULE, encoding="utf-8")
    config = project / "big.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "source": "python",
                    "factory": "mymodel:make",
                    "path": ["src"],
                    "kwargs": {
                        "vocab_size": 128256,
                        "d_model": 4096,
                        "n_heads": 32,
                        "n_kv_heads": 8,
                        "n_layers": 32,
                        "d_ff": 14336,
                        "max_seq_len": 8192,
                    },
                    "vocab_size": 128256,
                    "dims": {"d": 4096, "h": 32, "h_kv": 8, "d_h": 128, "V": 128256},
                    "rope": {"base": 10000, "rotary_dim": 128},
                },
                "meta": True,
            },
            sort_keys=False,
        ),
        encoding="utf-8",
    )
    out, document, printed = shrink(config)

    model = document["model"]
    assert model["kwargs"] == {
        "vocab_size": 512,
        "d_model": 128,
        "n_heads": 8,
        "n_kv_heads": 2,
        "n_layers": 2,
        "d_ff": 448,
        "max_seq_len": 8192,
    }  # 4 query heads per kv head, head size 16
    assert model["vocab_size"] == 512 and model["dims"] == {"d": 128, "h": 8, "h_kv": 2, "d_h": 16, "V": 512}
    assert model["rope"] == {"base": 10000, "rotary_dim": 16}  # the whole head, as before
    assert model["python_path"] == [str(project / "src"), str(project)]  # the module, from here
    assert "meta" not in document
    assert any(line.split()[:3] == ["kwargs.n_layers", "32", "2"] for line in printed.splitlines()), printed

    code, report = run_json(out)
    assert code == 0 and set(statuses(report).values()) == {"pass"}, report
    assert report["model"]["dims"]["d_h"] == 16


@pytest.mark.slow
def test_checkpoint_becomes_the_factory_randomly_initialised_and_the_samples_stay_unwritten():
    config = REPO / "sample_configs" / "checkpoint" / "reference.yaml"
    out, document, printed = shrink(config)

    model = document["model"]
    assert model["source"] == "python" and model["factory"] == "fwdcheck.model.reference:build"
    assert not {"path", "strict", "trust_checkpoint"} & set(model)  # `path:` named the weights file
    assert "reference.safetensors are not carried over" in " ".join(printed.split())

    code, report = run_json(out)
    assert code == 0 and set(statuses(report).values()) == {"pass"}, report


@pytest.mark.parametrize(("kwargs", "says"), [(None, "no `kwargs:`"), ({"seed": 1}, "its kwargs (seed) name no size")])
def test_a_factory_without_size_kwargs_is_one_line(tmp_path, kwargs, says):
    model = {"source": "python", "factory": "mypkg.model:build", **({"kwargs": kwargs} if kwargs else {})}
    config = tmp_path / "factory.yaml"
    config.write_text(yaml.safe_dump({"model": model}), encoding="utf-8")

    result = invoke("shrink", config)
    assert result.exit_code == 2 and result.stdout == ""
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.output
    assert says in line and "n_layers" in line
    assert not Path("factory.shrunk.yaml").exists()


def test_reference_toy_is_already_small_nothing_is_written(tmp_path):
    """2 layers, 2 heads of 4, vocabulary 16: nothing to cut. One line says so, exit 0, and no copy is written: the
    original is what to run."""
    config = tmp_path / "toy.yaml"
    config.write_text((REPO / "sample_configs" / "toy.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    result = invoke("shrink", config)
    assert result.exit_code == 0, result.output
    assert (
        result.stdout.strip()
        == f"nothing to shrink: {config} is already small; run it as it is: `fwdcheck run {config}`"
    )
    assert "shrunk" not in result.stdout and not Path("toy.shrunk.yaml").exists()


@pytest.mark.slow
def test_a_small_hf_config_says_nothing_to_shrink_with_its_parameters(tmp_path):
    """An inline T5 already at 2 layers of width 16: only its dtype would change, which cuts nothing."""
    config = tmp_path / "t5.yaml"
    config.write_text(
        "model:\n  source: hf\n  config: {model_type: t5, vocab_size: 64, d_model: 16, d_kv: 8, d_ff: 32, "
        "num_layers: 2, num_heads: 2}\n",
        encoding="utf-8",
    )
    result = invoke("shrink", config)
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith(f"nothing to shrink: {config} is already small (0.012M parameters)"), line
    assert len(line.splitlines()) == 1 and not Path("t5.shrunk.yaml").exists()


@pytest.mark.slow
def test_a_model_the_rules_cannot_cut_exits_4_naming_the_part(tmp_path):
    """RWKV's blocks keep their width (its sizes are spelled attention_hidden_size and the like): the copy is still
    441M parameters, so the command writes it, says where the parameters are, and exits 4. pi0 (a 3.5B
    vision-language-action config whose parts spell no size the rules read) is cut nowhere: exit 4, nothing written."""
    rwkv = tmp_path / "rwkv.yaml"
    rwkv.write_text("model:\n  source: hf\n  config: {model_type: rwkv}\n", encoding="utf-8")
    result = invoke("shrink", rwkv)
    assert result.exit_code == 4, result.output
    assert Path("rwkv.shrunk.yaml").exists()
    said = " ".join(result.stdout.split())
    assert "shrunk " in said and "7,393M → 441M parameters" in said, said
    assert "still too big: 441M parameters after shrinking (over the limit of 120M)" in said
    assert "most of it in rwkv.blocks.0" in said

    pi0 = tmp_path / "pi0.yaml"
    pi0.write_text(
        "model:\n  source: hf\n  class: AutoModelForImageTextToText\n  config: {model_type: pi0}\n", encoding="utf-8"
    )
    result = invoke("shrink", pi0)
    assert result.exit_code == 4, result.output
    line = result.stdout.strip()
    assert len(line.splitlines()) == 1 and "shrunk" not in line, line
    assert line.startswith(f"nothing to shrink that the rules can cut: {pi0} has 3,501M parameters"), line
    assert not Path("pi0.shrunk.yaml").exists()


@pytest.mark.slow
def test_reference_big_config_keeps_ratio_rope_and_planted_bugs(tmp_path):
    config = tmp_path / "big.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "source": "reference",
                    "vocab_size": 128256,
                    "d_model": 4096,
                    "n_heads": 32,
                    "n_kv_heads": 8,
                    "n_layers": 32,
                    "d_ff": 14336,
                    "max_seq_len": 8192,
                    "attention": "eager",
                    "mask": "float",
                    "rope": {"base": 500000, "pairing": "interleaved", "rotary_dim": 64},
                    "bugs": ["no-causal-mask"],
                },
                "meta": True,
            }
        ),
        encoding="utf-8",
    )
    out, document, printed = shrink(config)

    model = document["model"]
    assert (model["n_layers"], model["n_heads"], model["n_kv_heads"]) == (2, 8, 2)
    assert model["d_model"] == 8 * 64  # head size 64: the declared rotary dim needs it
    assert model["d_ff"] == 3.5 * 512 and model["vocab_size"] == 512 and model["max_seq_len"] == 8192
    assert model["rope"] == {"base": 500000, "pairing": "interleaved", "rotary_dim": 64}
    assert model["bugs"] == ["no-causal-mask"] and "meta" not in document
    assert "n_layers" in printed

    code, report = run_json(out, "--check", "future-token")
    assert code == 1 and statuses(report) == {"future-token": "fail"}  # the planted bug survives the shrink


# ---------------------------------------------------------------------------------------------------------------
# The rules on their own.


@pytest.mark.parametrize(
    ("heads", "kv", "expected"),
    [
        (32, 8, (8, 2)),  # Llama 3 8B: 4 query heads per kv head
        (32, 32, (2, 2)),  # multi-head
        (64, 8, (16, 2)),  # 8 per kv head: two groups fill the cap
        (48, 4, (12, 1)),  # 12 per kv head: two groups would pass 16, one keeps the ratio
        (71, 1, (16, 1)),  # Falcon 7B, multi-query: stays multi-query, capped
        (12, 1, (12, 1)),
    ],
)
def test_heads_keep_their_grouping(heads, kv, expected):
    assert shrink_heads(heads, kv) == expected


def test_gemma3_keeps_one_layer_of_each_type():
    AutoConfig = transformers.AutoConfig
    data = AutoConfig.for_model("gemma3_text").to_dict()  # 26 layers, 5 sliding : 1 full
    edits = shrink_hf_dict(data)
    assert data["num_hidden_layers"] == 2 and data["layer_types"] == ["sliding_attention", "full_attention"]
    assert (data["num_attention_heads"], data["num_key_value_heads"], data["head_dim"]) == (4, 2, 16)
    assert data["rope_parameters"] == AutoConfig.for_model("gemma3_text").rope_parameters
    assert {key for key, _, _ in edits.changes} >= {"num_hidden_layers", "layer_types", "sliding_window"}


def _builds(model_type: str, data: dict) -> None:
    """The shrunk config builds its model and runs one forward (the constraints the config class checks, and those
    only the modelling code does)."""
    import torch

    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 20_000_000
    with torch.no_grad():
        model(torch.randint(0, 8, (1, 8)))


@pytest.mark.parametrize(
    ("model_type", "sizes"),
    [
        # heads x head size is the expanded hidden size, and the heads split into the groups evenly
        (
            "mamba2",
            lambda d: (
                d["num_heads"] * d["head_dim"] == d["expand"] * d["hidden_size"] and not d["num_heads"] % d["n_groups"]
            ),
        ),
        ("bamba", lambda d: d["mamba_n_heads"] * d["mamba_d_head"] == d["mamba_expand"] * d["hidden_size"]),
        # an inner size stated outright (Falcon-H1's mamba_d_ssm) is what heads x head size must make
        ("falcon_h1", lambda d: d["mamba_n_heads"] * d["mamba_d_head"] == d["mamba_d_ssm"]),
        ("xlnet", lambda d: d["d_head"] == d["d_model"] // d["n_head"] == 16),  # XLNet's own spelling of the head size
        # the layers that do something (indexed attention) renumbered among the layers kept, the kv-source list too
        ("kolibri1_1", lambda d: d["index_layers"] == [1] and d["kv_source_layers"] == [0, 1]),
        # a per-layer vocabulary table as small as the vocabulary; shared-cache layers keep their share (none of 2)
        ("gemma3n_text", lambda d: d["vocab_size_per_layer_input"] == 512 and d["num_kv_shared_layers"] == 0),
        # a pattern of blocks shorter than the depth: one of each kind kept
        ("recurrent_gemma", lambda d: d["num_hidden_layers"] == 3),
    ],
)
@pytest.mark.slow
def test_sizes_that_must_agree_still_agree(model_type, sizes):
    data = transformers.AutoConfig.for_model(model_type).to_dict()
    shrink_hf_dict(data)
    assert sizes(data), {k: v for k, v in data.items() if not isinstance(v, (dict, list)) or "layer" in k}
    if model_type != "bamba":  # Bamba's defaults have no attention layer, which its own forward refuses
        _builds(model_type, data)


def test_small_rules():
    assert keep_layers(["a", "a", "a", "b", "a", "a"], 2) == [0, 3]
    assert keep_layers(["a", "b", "c", "a"], 2) == [0, 1, 2]  # one of each type beats the layer count
    assert keep_layers(None, 2) == [0, 1]
    assert clamp_token(128000, 512) == 511 and clamp_token(2, 512) == 2 and clamp_token(None, 512) is None
    assert clamp_token([128001, 128009, 3], 512) == [511, 3]
    assert resample(list(range(48)), 8) == [0, 7, 13, 20, 27, 34, 40, 47]


def test_partial_rotary_and_longrope_factors_follow_the_head_size():
    AutoConfig = transformers.AutoConfig
    factors = [1.0 + i / 10 for i in range(48)]
    phi3 = AutoConfig.for_model(
        "phi3",
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": factors,
            "long_factor": factors,
            "original_max_position_embeddings": 4096,
        },
    ).to_dict()
    shrink_hf_dict(phi3)
    assert len(phi3["rope_parameters"]["long_factor"]) == 8  # one per rotary pair of a 16-wide head
    assert phi3["rope_parameters"]["long_factor"][0] == 1.0 and phi3["rope_parameters"]["long_factor"][-1] == 5.7

    neox = AutoConfig.for_model("gpt_neox").to_dict()  # partial_rotary_factor 0.25: 4 rotary dims of 16
    shrink_hf_dict(neox)
    assert neox["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert neox["hidden_size"] // neox["num_attention_heads"] == 16


def test_factory_kwargs_in_the_spellings_models_use():
    nanogpt = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50304, "block_size": 1024, "bias": False}
    shrink_sizes(nanogpt, KWARG_KEYS)
    assert nanogpt == {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 512, "block_size": 1024, "bias": False}

    litgpt = {
        "n_layer": 32,
        "n_head": 32,
        "n_query_groups": 8,
        "n_embd": 4096,
        "head_size": 128,
        "intermediate_size": 14336,
        "padded_vocab_size": 128256,
        "rotary_percentage": 1.0,
    }
    edits = shrink_sizes(litgpt, KWARG_KEYS)
    assert litgpt == {
        "n_layer": 2,
        "n_head": 8,
        "n_query_groups": 2,
        "n_embd": 128,
        "head_size": 16,
        "intermediate_size": 448,
        "padded_vocab_size": 512,
        "rotary_percentage": 1.0,
    }
    assert len(edits.changes) == 7

    width_in_code = {"n_layers": 24, "d_model": 1024}  # no heads: the width cannot be cut safely
    shrink_sizes(width_in_code, KWARG_KEYS)
    assert width_in_code == {"n_layers": 2, "d_model": 1024}


# -- configs made of configs: vision-language models and encoder-decoders -------------------------------------------


def _parameters(model_type: str, model_class: str, config: dict) -> int:
    import torch

    rest = {k: v for k, v in config.items() if k != "model_type"}
    built = transformers.AutoConfig.for_model(model_type, **rest)
    with torch.device("meta"):
        return sum(p.numel() for p in getattr(transformers, model_class).from_config(built).parameters())


def _shrunk(tmp_path: Path, model_type: str, model_class: str | None) -> tuple[dict, list]:
    from fwdcheck.model.sources.shrink import shrink_file

    named = f"  class: {model_class}\n" if model_class else ""
    path = tmp_path / f"{model_type}.yaml"
    path.write_text(f"model:\n  source: hf\n{named}  config: {{model_type: {model_type}}}\n")
    shrunk = shrink_file(path, tmp_path / "out.yaml")
    return shrunk.document["model"]["config"], shrunk.changes


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, model_class",
    [
        ("llava", "AutoModelForImageTextToText"),
        ("paligemma", "AutoModelForImageTextToText"),
        ("gemma3", "AutoModelForImageTextToText"),
        ("qwen2_vl", "AutoModelForImageTextToText"),
        ("bart", "AutoModelForSeq2SeqLM"),
        ("t5", None),  # AutoModelForSeq2SeqLM by default: T5 has no causal LM class
        # sizes under their own names: Mllama's vision tower (attention_heads, num_global_layers, and a
        # vision_output_dim of six hidden states side by side), ProphetNet's num_encoder_layers and
        # num_{encoder,decoder}_attention_heads
        ("mllama", "AutoModelForImageTextToText"),
        ("prophetnet", "AutoModelForSeq2SeqLM"),
    ],
)
def test_every_sub_config_shrinks_and_the_parts_still_agree(tmp_path, model_type, model_class):
    """LLaVA stayed 7.1B parameters and BART kept d_model 1024: their text_config, vision_config and decoder sizes
    were not shrunk. Now each model is under 5M parameters (counted on the meta device), token ids the top level
    names sit inside the text vocabulary and apart, and what the parts hand each other keeps one width."""
    cls = model_class or "AutoModelForSeq2SeqLM"
    before = _parameters(model_type, cls, {"model_type": model_type})
    config, changes = _shrunk(tmp_path, model_type, model_class)
    after = _parameters(model_type, cls, config)
    assert before > 50e6 and after < 5e6, (before, after)
    text = config.get("text_config", config)
    vocab = text.get("vocab_size") or config["vocab_size"]
    named = [v for k, v in config.items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)]
    assert all(v < vocab for v in named), named
    if "text_config" in config:  # a VLM's image, video and vision-boundary tokens stay apart
        assert len(set(named)) == len(named), named
        assert any(key == "text_config.hidden_size" for key, _, _ in changes)
        assert "vision_config.num_hidden_layers" in {k for k, _, _ in changes} or "vision_config.depth" in {
            k for k, _, _ in changes
        }
    if model_type == "bart":
        assert config["d_model"] == 32 and config["decoder_attention_heads"] == config["encoder_attention_heads"]
    if model_type == "mllama":  # the projector reads the last hidden state and one per listed layer, side by side
        vision = config["vision_config"]
        assert vision["vision_output_dim"] == vision["hidden_size"] * (1 + len(vision["intermediate_layers_indices"]))
        assert vision["num_global_layers"] == 2 and config["text_config"]["cross_attention_layers"]
    if model_type == "prophetnet":
        assert config["num_encoder_layers"] == config["num_decoder_layers"] == 2
        assert config["num_encoder_attention_heads"] == config["num_decoder_attention_heads"] == 2


@pytest.mark.slow
def test_the_seq2seq_mapping_shrinks_whole(tmp_path):
    """`fwdcheck shrink` over every seq2seq architecture (tests/shrink_sweep.py): each is cut below the limit but
    the speech models whose encoders spell their sizes their own way. ProphetNet (391M, once left at 187M) is among
    the cut."""
    from tests.shrink_sweep import outcomes

    results = {o.model_type: o for o in outcomes("seq2seq")}
    too_big = {name for name, o in results.items() if o.verdict == "too big"}
    assert too_big == {"granite_speech", "granite_speech_plus", "nemo_speechlm", "vibevoice_asr"}, too_big
    assert {o.verdict for name, o in results.items() if name not in too_big} == {"shrunk"}
    prophetnet = results["prophetnet"]
    assert prophetnet.before is not None and prophetnet.before > 300e6 and prophetnet.after < 1e6


@pytest.mark.slow
def test_multi_axis_rotary_sections_follow_the_head_size(tmp_path):
    """Qwen2-VL's mrope_section comes from its modeling code's default ([16, 24, 24] for a head of 128): a smaller
    head crashed the model until the sections, scaled to sum to half the new head, are written out."""
    config, _ = _shrunk(tmp_path, "qwen2_vl", "AutoModelForImageTextToText")
    text = config["text_config"]
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    sections = text["rope_parameters"]["mrope_section"]
    assert sum(sections) == head // 2 and len(sections) == 3 and min(sections) >= 1
    assert config["vision_config"]["hidden_size"] == text["hidden_size"]  # the patch merger hands the text width


@pytest.mark.slow
def test_a_hand_shrunk_multi_axis_config_gets_sections_that_fit_its_head(tmp_path):
    """A Qwen2-VL config written small by hand (head 16) that states no mrope_section raised in the model: the
    modeling code's default [16, 24, 24] does not split 8 rotary pairs. Shrunk, the default is written out scaled
    (the head keeps its size), and rope judges the sections per axis."""
    from fwdcheck.model.sources.shrink import shrink_file
    from tests.conftest import run_checks

    path = tmp_path / "hand.yaml"
    path.write_text(
        "model:\n  source: hf\n  class: AutoModelForImageTextToText\n  config:\n    model_type: qwen2_vl\n"
        "    text_config: {model_type: qwen2_vl_text, hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 2,"
        " intermediate_size: 128, num_hidden_layers: 2, vocab_size: 256}\n"
        "    vision_config: {depth: 1, embed_dim: 32, hidden_size: 64, num_heads: 2, mlp_ratio: 2}\n"
        "    image_token_id: 250\n    video_token_id: 251\n    vision_start_token_id: 252\n"
    )
    shrunk = shrink_file(path, tmp_path / "out.yaml")
    model = shrunk.document["model"]
    assert model["config"]["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert ("text_config.rope_parameters.mrope_section", [16, 24, 24], [2, 3, 3]) in shrunk.changes
    rope = run_checks(model, ["rope"], code_paths={"enabled": False}).result("rope")
    assert rope.status.value == "pass" and rope.data["axes"]["layout"] == "contiguous", rope.summary


@pytest.mark.slow
def test_a_shrunk_vision_language_model_runs_its_text_path(tmp_path, monkeypatch):
    config, _ = _shrunk(tmp_path, "llava", "AutoModelForImageTextToText")
    from tests.conftest import run_checks

    report = run_checks(
        {"source": "hf", "class": "AutoModelForImageTextToText", "config": config}, code_paths={"enabled": False}
    )
    statuses = {r.name: r.status.value for r in report.results}
    assert statuses["future-token"] == "pass" and statuses["mask-audit"] == "pass", statuses


def assert_shrunk_run_passes(report: dict, rope: str) -> None:
    """The shrunk model's default run: the four causal checks as expected (rope passing, or skipping where the model
    has no rotary embedding), every other default check passing or not applying."""
    got = statuses(report)
    assert {k: got[k] for k in ("shape-ledger", "future-token", "mask-audit", "rope")} == {
        "shape-ledger": "pass",
        "future-token": "pass",
        "mask-audit": "pass",
        "rope": rope,
    }
    assert set(got.values()) <= {"pass", "skip"}, got
