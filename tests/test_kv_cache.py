"""kv-cache: decoding through the KV cache matches the full forward, on the reference transformer (clean and with each
planted cache bug), tiny Hugging Face models (eager and sdpa), gpt-fast and litgpt (through `cache:` in the config).

Shapes: B (batch), T (sequence), S (key slots).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from pydantic import ValidationError

import fwdcheck
from fwdcheck.config.registry import available, info
from fwdcheck.config.schema import PythonModel, config_from_dict
from fwdcheck.errors import ConfigError
from fwdcheck.model.reference import KVCache, build
from fwdcheck.model.sources import load_model
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings
from tests.conftest import run_checks

CHECK = ["kv-cache"]


def result(model: dict, seq_len: int = 8, **top):
    return run_checks(model, CHECK, inputs={"batch_size": 2, "seq_len": seq_len}, **top).result("kv-cache")


def failing(res) -> set[str]:
    return {f.code for f in res.findings if f.status.value == "fail"}


def clean_pass(res) -> None:
    assert res.status.value == "pass", (res.summary, res.findings)
    assert {f.code for f in res.findings} == {"FWD501", "FWD502"}


# =====================================================================================================================
# The reference transformer


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"mask": "float"},
        {"mask": "is_causal"},
        {"n_kv_heads": 1},
        {"positional": "learned"},
        {"norm": "post"},
        {"rope": {"pairing": "interleaved"}},
    ],
)
def test_reference_passes(reference, attention, variant):
    res = result(reference(attention=attention, **variant))
    clean_pass(res)
    # a prefill of 4, one token, one chunk of 2: three calls on the first two rows, the last of the 8 tokens unread
    metrics = res.metrics
    assert (metrics["calls"], metrics["prefill"], metrics["rows"], metrics["tokens_run"]) == (4, 4, 2, 16)
    assert res.metrics["max_change"] <= res.metrics["threshold"]


# bug -> (code, why): which way of decoding catches it
PLANTED = {
    "kv-cache-position-off-by-one": "FWD501",  # every decoded token sits one position late: caught at the first step
    "kv-cache-rope-restart": "FWD501",  # decoded tokens rotated from 0: caught at the first step
    "kv-cache-mask-top-left": "FWD502",  # one query reads every key (no mask needed): only chunks show it
}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("mask", ["bool", "is_causal"])
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_reference_bugs_fail_at_the_first_decoded_position(reference, bug, attention, mask):
    res = result(reference(bugs=[bug], attention=attention, mask=mask))
    assert res.status.value == "fail"
    assert failing(res) == {PLANTED[bug]}, res.findings
    finding = res.findings[0]
    # the one-token steps decode positions 4 and 5, the chunk after them 6 and 7
    first = 6 if bug == "kv-cache-mask-top-left" else 4
    assert f"position {first}" in finding.where and "first parts at layers.0" in finding.where
    if bug == "kv-cache-mask-top-left":
        assert "one token at a time agrees" in finding.message and "top-left" in finding.message
        assert res.metrics["token_max_change"] <= res.metrics["threshold"] < res.metrics["chunked_max_change"]
        # decoded again straight after the prefill, the chunk still parts: the mask, not what the step cached
        assert res.metrics["chunk_after_prefill_max_change"] > res.metrics["threshold"]
    else:
        assert "the chunk of 2 after it parts too, from position 6" in finding.message


def test_position_bug_without_positions_is_no_bug(reference):
    """No positional encoding at all: a position off by one changes nothing, and nothing is reported."""
    clean_pass(result(reference(positional="none", bugs=["kv-cache-position-off-by-one"])))


def test_short_sequences_shape_the_plan(reference):
    res = result(reference(), seq_len=4)
    clean_pass(res)
    assert (res.metrics["prefill"], res.data["chunks"], res.metrics["calls"]) == (1, [2], 3)  # one one-token step
    res = result(reference(), seq_len=5)
    assert (res.metrics["prefill"], res.data["chunks"], res.metrics["calls"]) == (1, [2], 4)
    assert result(reference(), seq_len=6).metrics["prefill"] == 2
    res = result(reference(), seq_len=16)
    assert (res.metrics["prefill"], res.data["chunks"], res.metrics["tokens_run"]) == (4, [2], 16)


def test_a_declared_window_makes_the_prefill_longer_than_it(reference):
    """The decoded tokens read a cache the window has cut: a prefill of the window, as far as seq_len allows."""
    assert result(reference(window=6), seq_len=16).metrics["prefill"] == 6
    clean_pass(result(reference(window=6), seq_len=16))
    assert result(reference(window=6), seq_len=8).metrics["prefill"] == 4  # positions 6 and 7 read past the band
    assert result(reference(window=8), seq_len=8).metrics["prefill"] == 4  # no band cuts 8 tokens: nothing to show


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_passes_clean_and_still_catches(reference, dtype):
    clean_pass(result(reference(), seq_len=16, dtype=dtype))
    assert failing(result(reference(bugs=["kv-cache-mask-top-left"]), seq_len=16, dtype=dtype)) == {"FWD502"}


def test_reference_cache_leaves_the_plain_forward_alone():
    torch.manual_seed(0)
    model = build(vocab_size=32, d_model=16, n_heads=4).eval()
    ids = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        logits, cache = model(ids, use_cache=True)
        assert torch.equal(logits, model(ids))
        assert cache.get_seq_length() == 8 and len(cache.keys) == 2


# =====================================================================================================================
# Hugging Face


def hf_model(model_type: str, attn: str, **fields):
    transformers = pytest.importorskip("transformers")
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    if model_type == "gpt2":
        sizes = dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=64, max_position_embeddings=128, **{**sizes, **fields}
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def hf_result(model, seq_len: int = 8, **kw):
    report = fwdcheck.check_model(model, CHECK, seq_len=seq_len, code_paths={"enabled": False}, **kw)
    return report.result("kv-cache")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "model_type, fields", [("llama", {}), ("gpt2", {}), ("mistral", {"sliding_window": 64}), ("qwen2", {})]
)
def test_hf_models_pass(model_type, fields, attn):
    res = hf_result(hf_model(model_type, attn, **fields))
    clean_pass(res)
    assert "use_cache=True" in res.data["cache_call"]


def test_hf_sliding_window_shorter_than_the_sequence_passes():
    """Mistral with a window of 4 decoding positions 12-15: the cache and the mask keep the window."""
    clean_pass(hf_result(hf_model("mistral", "sdpa", sliding_window=4), seq_len=16))


def test_hf_bfloat16_passes():
    clean_pass(hf_result(hf_model("llama", "sdpa"), seq_len=16, dtype="bfloat16"))


def test_hf_rope_restarted_for_decoded_tokens_fails():
    """The rotary embedding fed positions counted from the first new token: right for the prompt, wrong after."""
    model = hf_model("llama", "sdpa")
    rotary = model.model.rotary_emb
    original = rotary.forward
    rotary.forward = lambda x, position_ids: original(x, position_ids - position_ids[:, :1])
    res = hf_result(model)
    assert failing(res) == {"FWD501"}, res.findings
    assert "model.layers.0" in res.findings[0].where


# =====================================================================================================================
# Declared caches: gpt-fast and litgpt (input_pos), Hugging Face style python models (past_key_values)

GPT_FAST = {
    "source": "python",
    "factory": "tests.corpus.gpt_fast:transformer",
    "forward": "tests.corpus.gpt_fast:prefill",
    "cache": {"style": "gpt-fast"},
}


def litgpt(name: str) -> dict:
    pytest.importorskip("litgpt")
    return {
        "source": "python",
        "factory": f"tests.corpus.litgpt_models:{name}",
        "cache": {"style": "gpt-fast", "setup": "set_kv_cache"},
    }


def gpt_fast_mask_rows_by_length():
    """gpt-fast whose forward slices the mask rows by length, causal_mask[None, None, :T], instead of by input_pos:
    right for a prompt at 0 .. T-1, the rows of the first positions for every later call."""
    from tests.corpus import gpt_fast

    class MaskRowsByLength(gpt_fast.Transformer):
        def forward(self, idx, input_pos):
            mask = self.causal_mask[None, None, : idx.shape[1]]  # (1, 1, T, S): the first T rows
            freqs_cis = self.freqs_cis.to(idx.device)[input_pos]
            x = self.tok_embeddings(idx)
            for layer in self.layers:
                x = layer(x, input_pos, freqs_cis, mask)
            return self.output(self.norm(x))

    torch.manual_seed(0)
    return MaskRowsByLength(gpt_fast.ModelArgs())


def test_gpt_fast_passes_and_is_left_as_found():
    from tests.corpus import gpt_fast

    config = config_from_dict({"model": GPT_FAST, "checks": CHECK})
    model = load_model(config)
    report = run_model(model, Settings.from_config(config), fwdcheck.config.registry.select(CHECK))
    clean_pass(report.result("kv-cache"))
    assert report.result("kv-cache").data["cache_call"] == "setup_caches, then forward(input_ids, input_pos)"
    # the caches the check and the `forward:` adapter set up (8, then 8 + 20 tokens rounded up to 32 slots) are taken
    # off again: the sizes, the mask and the cache modules as found, before any setup
    module = model.module
    assert module.max_seq_length == module.max_batch_size == -1 and module.causal_mask is None
    assert all(block.attention.kv_cache is None for block in module.layers)
    assert "kv_cache" not in dict(module.named_modules()).get("layers.0.attention")._modules
    # and the model runs as before: its adapter sets the caches up again
    logits = gpt_fast.prefill(module, torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, module.config.vocab_size) and module.max_seq_length == 32


def test_gpt_fast_mask_rows_by_length_fails():
    res = result({**GPT_FAST, "factory": "tests.test_kv_cache:gpt_fast_mask_rows_by_length"})
    assert failing(res) == {"FWD501"}, res.findings


@pytest.mark.parametrize("name", ["llama", "pythia"])
@pytest.mark.slow
def test_litgpt_passes(name):
    clean_pass(result(litgpt(name)))


@pytest.mark.slow
def test_litgpt_sliding_window_ring_buffer_fails_in_chunks():
    """litgpt 0.5's sliding-window cache is a ring buffer of window slots whose mask is the first `window` columns of
    the input_pos rows: once the ring wraps, a chunk's first query reads its successor's key. One token at a time it
    is right (it reads every slot), so only the chunks part: a real finding, not a false alarm."""
    res = result(litgpt("mistral"))
    assert failing(res) == {"FWD502"}, res.findings


def test_python_model_with_declared_hf_style_cache():
    model = {
        "source": "python",
        "factory": "fwdcheck.model.reference:build",
        "kwargs": {"vocab_size": 32},
        "cache": {"style": "hf"},
    }
    clean_pass(result(model))
    bad = {**model, "kwargs": {"vocab_size": 32, "bugs": ["kv-cache-rope-restart"]}}
    assert failing(result(bad)) == {"FWD501"}


class LockedCache(KVCache):
    """The reference's cache with a lock in it, as a cache shared between threads has: no copy of it can be made."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


class ForgetfulCache(KVCache):
    """The reference's cache whose one-token steps read the cached keys beside their own but keep none of theirs:
    the write-back skipped on the decoding path, as a cache that concatenates into a local for a single new token
    does. The step itself is right; the call after it reads a cache one token short (and counts its length from it)."""

    def update(self, k, v, layer_idx):
        if k.shape[2] == 1 and layer_idx < len(self.keys):
            return torch.cat([self.keys[layer_idx], k], dim=2), torch.cat([self.values[layer_idx], v], dim=2)
        return super().update(k, v, layer_idx)


class OwnCacheModel(torch.nn.Module):
    """The reference transformer making its cache of the given class when forward is handed none."""

    def __init__(self, cache_class: type[KVCache], bugs: list[str]):
        super().__init__()
        self.cache_class = cache_class
        self.inner = build(vocab_size=32, d_model=16, n_heads=4, bugs=bugs)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = self.cache_class()
        return self.inner(input_ids, past_key_values=past_key_values, use_cache=use_cache)


def locked_cache(bugs: list[str] | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return OwnCacheModel(LockedCache, bugs or [])


def forgetful_cache() -> torch.nn.Module:
    torch.manual_seed(0)
    return OwnCacheModel(ForgetfulCache, [])


def test_a_cache_that_cannot_be_copied_is_decoded_all_the_same():
    """deepcopy refuses the lock; the cached run is one chain of calls, which copies nothing: it judges both ways
    (a rope restarted at the decoded tokens fails at the first of them)."""
    with pytest.raises(TypeError):
        copy.deepcopy(LockedCache())
    model = {"source": "python", "factory": "tests.test_kv_cache:locked_cache", "cache": {"style": "hf"}}
    clean_pass(result(model))
    assert failing(result({**model, "kwargs": {"bugs": ["kv-cache-rope-restart"]}})) == {"FWD501"}


def test_a_one_token_step_that_keeps_nothing_fails_as_the_one_token_step():
    """The first one-token step agrees, the second reads a cache the first kept nothing in: FWD501 at the second
    step's position, not a mask of several queries over the cache (FWD502)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8))
    forgetful = forgetful_cache().eval()
    with torch.no_grad():  # in plain torch: the first step is right, the one after it is not
        full = forgetful(ids)  # (2, 8, V)
        _, cache = forgetful(ids[:, :4], use_cache=True)
        step, cache = forgetful(ids[:, 4:5], past_key_values=cache, use_cache=True)
        second, _ = forgetful(ids[:, 5:6], past_key_values=cache, use_cache=True)
    assert torch.allclose(step, full[:, 4:5], atol=1e-5) and not torch.allclose(second, full[:, 5:6], atol=1e-2)
    res = result({"source": "python", "factory": "tests.test_kv_cache:forgetful_cache", "cache": {"style": "hf"}})
    assert failing(res) == {"FWD501"}, res.findings
    assert res.metrics["token_max_change"] > res.metrics["threshold"]
    assert "decoding one token at a time" in res.findings[0].message
    assert "position 5" in res.findings[0].where


class LongRowsShifted(torch.nn.Module):
    """The reference transformer whose logits move by 0.01 on rows of 16 tokens or more, cached ones counted (another
    kernel chosen by length): its logits depend on the row's length, future-token's FWD105, not on any later token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = build(vocab_size=32, d_model=16, n_heads=4)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        out = self.inner(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        logits, cache = out if use_cache else (out, None)
        length = cache.get_seq_length() if cache is not None else input_ids.shape[1]
        logits = logits + 0.01 * (length >= 16)
        return (logits, cache) if use_cache else logits


def test_a_model_whose_logits_depend_on_the_length_is_judged_at_the_length_it_decoded():
    """The session's 32-token rows are shifted, the 7 decoded tokens are not: the change from the session's logits
    is confirmed against a forward of exactly the decoded tokens, which the cached run matches (no false finding)."""
    model = {"source": "python", "factory": "tests.test_kv_cache:LongRowsShifted", "cache": {"style": "hf"}}
    res = result(model, seq_len=32)
    clean_pass(res)
    assert res.data["full_forward"] == "a forward of the decoded tokens"
    assert result(model, seq_len=8).data["full_forward"].startswith("the session's logits")


def test_reference_through_the_python_api():
    torch.manual_seed(0)
    clean = fwdcheck.check_model(build(vocab_size=32, d_model=16, n_heads=4), CHECK)
    clean_pass(clean.result("kv-cache"))
    torch.manual_seed(0)
    broken = fwdcheck.check_model(build(vocab_size=32, d_model=16, n_heads=4, bugs=["kv-cache-mask-top-left"]), CHECK)
    assert failing(broken.result("kv-cache")) == {"FWD502"}
    assert not broken.ok


# =====================================================================================================================
# Skips, errors, registration, config


@pytest.mark.parametrize(
    "model, seq_len, reason",
    [
        ({"source": "python", "factory": "tests.models:nanogpt"}, 8, "no KV-cache path fwdcheck knows how to drive"),
        ({"source": "reference"}, 3, "seq_len 3 is too short"),
        (
            {
                "source": "python",
                "factory": "fwdcheck.model.reference:build",
                "causal": False,
                "cache": {"style": "hf"},
            },
            8,
            "bidirectional",
        ),
    ],
)
def test_skips_with_a_reason(model, seq_len, reason):
    res = result(model, seq_len=seq_len)
    assert res.status.value == "skip" and reason in res.summary, res.summary


def test_meta_skips(reference):
    res = result(reference(), meta=True)
    assert res.status.value == "skip"


def test_model_raising_in_the_cached_call_is_fwd002():
    """A model the config says takes past_key_values, whose forward does not: the model's error, not fwdcheck's."""
    report = run_checks({"source": "python", "factory": "tests.models:nanogpt", "cache": {"style": "hf"}}, CHECK)
    res = report.result("kv-cache")
    assert res.status.value == "error" and [f.code for f in res.findings] == ["FWD002"]
    assert "unexpected keyword argument 'use_cache'" in res.summary
    assert report.exit_code == 1


def test_registered_and_default_where_it_applies():
    entry = available()["kv-cache"]
    assert entry.value == "fwdcheck.checks.kv_cache:KVCache"
    assert info(entry).default is True and "KV cache" in info(entry).applies_when
    assert set(info(entry).codes) == {"FWD501", "FWD502", "FWD503", "FWD504"}


def test_cache_config_is_validated():
    spec = PythonModel(source="python", factory="a:b", cache={"style": "gpt-fast", "setup": "set_kv_cache"})
    assert spec.cache.setup == "set_kv_cache"
    assert PythonModel(source="python", factory="a:b", cache={"style": "hf"}).cache.setup == "setup_caches"
    with pytest.raises(ValidationError):
        PythonModel(source="python", factory="a:b", cache={"style": "vllm"})
    with pytest.raises(ConfigError, match="cache"):
        config_from_dict({"model": {"source": "reference", "cache": {"style": "hf"}}})


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, status, said",
    [
        # a cache class of its own, which forward makes when generate passes none
        ("minimax", "pass", "max change"),
        # forward slices the cached prefix off the whole sequence itself: a prefix LM by design (future-token's
        # true finding), so its cached decoding parts from a full forward whose prompt reads both ways
        ("cpmant", "fail", "differ from the full forward"),
        # generate appends a mask token and reads its logits: no next-token decoding to compare
        ("xlm", "skip", "a mask token appended"),
    ],
)
def test_each_model_is_stepped_as_its_own_generate_steps_it(model_type, status, said):
    """transformers 5 models decode through their own prepare_inputs_for_generation and their own cache class:
    never an error from a cache or an input slice that generate would not have handed them."""
    from tests.arch_sweep import tiny
    from tests.conftest import run_checks

    result = run_checks({"source": "hf", "config": tiny(model_type).config}, ["kv-cache"]).result("kv-cache")
    assert result.status.value == status, result.summary
    assert said in result.summary or any(said in f.message for f in result.findings), result.summary


# =====================================================================================================================
# The cache generate makes


def test_the_cache_is_made_from_the_decoder_text_config_as_generate_makes_it():
    """generate makes its DynamicCache from config.get_text_config(decoder=True): a multimodal model's top config
    holds no layers of its own, its text config does."""
    transformers = pytest.importorskip("transformers")
    from fwdcheck.model.sources.hf import dynamic_cache

    holder = torch.nn.Module()
    holder.config = transformers.Gemma3Config(text_config={"num_hidden_layers": 3, "sliding_window": 4})
    made = dynamic_cache(holder)
    assert made is not None and len(made.layers) == 3


def test_a_cache_its_library_cannot_make_is_the_models_error_not_fwdchecks():
    """BLT's top config holds no num_hidden_layers (its sub-configs do), and transformers' DynamicCache(config=...)
    raises AttributeError on it, under generate too: the model's error (FWD002), never fwdcheck's internal one."""
    transformers = pytest.importorskip("transformers")
    from fwdcheck.checks.kv_cache import PastKeyValues
    from fwdcheck.errors import ModelRaised
    from fwdcheck.model.sources.hf import dynamic_cache

    class Holder(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    holder = Holder()
    holder.config = transformers.BltConfig()
    with pytest.raises(ModelRaised, match="making the cache as generate does .* 'num_hidden_layers'"):
        PastKeyValues(holder, new_cache=dynamic_cache).step(None, torch.zeros(1, 2, dtype=torch.long), 0)


REFORMER = {
    "model_type": "reformer",
    "hidden_size": 32,
    "num_attention_heads": 2,
    "attention_head_size": 16,
    "feed_forward_size": 64,
    "vocab_size": 64,
    "attn_layers": ["local", "lsh"],
    "axial_pos_embds_dim": [16, 16],
    "axial_pos_shape": [4, 4],
    "max_position_embeddings": 16,
    "lsh_attn_chunk_length": 4,
    "local_attn_chunk_length": 4,
    "num_buckets": 4,
    "is_decoder": True,
}


@pytest.mark.slow  # builds a Hugging Face model
def test_a_model_that_decodes_without_a_cache_skips_saying_so():
    """Reformer's forward returns no cache and generate makes none for it: nothing cached to compare, a skip with the
    reason (it was an error, FWD002)."""
    res = result({"source": "hf", "config": REFORMER})
    assert res.status.value == "skip", (res.summary, res.findings)
    assert "decodes without a KV cache" in res.summary
