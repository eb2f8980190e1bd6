"""fwdcheck's verdicts on the third-party corpus (tests/corpus/): real model code nobody here wrote, at tiny sizes.

Every correct model must pass every check that applies to it with no warning (a check that does not apply skips, with
its reason); every planted bug must fail the check that exists for it, with that check's finding code, and the other
checks must not complain. What each model really does (does it read the future, do samples mix, are its rotary
scores relative) is established separately with plain torch in test_ground_truth, so a wrong expectation cannot hide
behind a wrong check.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from fwdcheck.config.callables import on_sys_path, resolve_callable
from fwdcheck.config.registry import select
from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings
from tests.corpus import DIMS as TORCHTUNE_DIMS  # not from torchtune_models: importing torchtune takes seconds
from tests.corpus import VOCAB
from tests.corpus.meta_llama import DIMS as META_DIMS
from tests.corpus.modded import DIMS as MODDED_DIMS
from tests.corpus.xtransformers_models import DIMS as XT_DIMS
from tests.corpus.xtransformers_models import ROTARY_DIM as XT_ROTARY_DIM

# The third-party corpus (hundreds of cases on four libraries' models): the slow tier.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CHECKS = ("shape-ledger", "future-token", "mask-audit", "rope")
B, T = 2, 8


# -- expectations ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What one check must report: a status among `statuses`; every code in `codes` among the non-pass findings;
    nothing beyond `codes` and `also` (the same bug seen again by another part of the check)."""

    statuses: tuple[str, ...]
    codes: frozenset[str] = frozenset()
    also: frozenset[str] = frozenset()

    def admits(self, status: str, found: set[str]) -> bool:
        if status not in self.statuses or not self.codes <= found <= self.codes | self.also:
            return False
        return bool(found) if status == "fail" else not found

    def __str__(self) -> str:
        codes = "+".join(sorted(self.codes)) + ("" if not self.also else f" (+{'/'.join(sorted(self.also))})")
        return "/".join(self.statuses) + (f" {codes}" if codes else "")


def fails(*codes: str, also: tuple[str, ...] = ()) -> Verdict:
    return Verdict(("fail",), frozenset(codes), frozenset(also))


PASS, SKIP = Verdict(("pass",)), Verdict(("skip",))
# A rotary model whose tokens are mixed with their neighbours before attention: the rope check either measures the
# rotation some other way (pass) or says it could not (skip); a vacuous pass is what test_no_vacuous_rope_pass catches.
MEASURED_OR_SAID_WHY = Verdict(("pass", "skip"))

LEAK = fails("FWD101", also=("FWD105",))  # the prefix pass sees the same leak
BATCH_MIX = fails("FWD102")
NO_MASK = fails("FWD201")
INVERTED = fails("FWD202", also=("FWD205",))  # an inverted triu leaves the last query no key at all
READS_AHEAD = fails("FWD204")
ROPE_Q_ONLY = fails("FWD301", also=("FWD303", "FWD304"))
ROPE_PAIRING = fails("FWD302", also=("FWD303", "FWD304"))
ROPE_NOT_TURNING = fails("FWD307")


def correct(rotary: bool, **changes: Verdict) -> dict[str, Verdict]:
    """Every check passes; rope skips on a model without rotary embedding. `changes` (future_token=... for
    future-token) replace single verdicts."""
    verdicts = {"shape-ledger": PASS, "future-token": PASS, "mask-audit": PASS, "rope": PASS if rotary else SKIP}
    return {**verdicts, **{check.replace("_", "-"): v for check, v in changes.items()}}


def planted(rotary: bool, **catches: Verdict) -> dict[str, Verdict]:
    """A planted bug: the checks named fail as given, every other check as on the correct model."""
    return correct(rotary, **catches)


@dataclass
class Case:
    id: str
    library: str
    factory: str  # "module:function" in tests.corpus
    kwargs: dict = field(default_factory=dict)
    expect: dict[str, Verdict] = field(default_factory=dict)
    # What the model really does, verified in test_ground_truth: leaks (reads the future), mixes-batch, bidirectional
    # (reads the future by design, declared causal: false); for rotary models relative (a global position shift
    # leaves the logits unchanged), not-relative, or position-blind (q . k never turns with position).
    truth: frozenset[str] = frozenset()
    model: dict = field(default_factory=dict)  # extra keys of the config's model section
    inputs: dict = field(default_factory=dict)  # extra keys of the config's inputs section
    dtype: str = "float32"
    rotation: tuple[str, int, float | None] | None = None  # pairing, rotary dim, base the rope check must measure
    what: str = ""  # one line for docs/compatibility.md; its table is generated (tests/compat.py)

    @property
    def correct(self) -> bool:
        return not ({"leaks", "mixes-batch", "not-relative", "position-blind"} & self.truth)


def case(id, library, factory, kwargs=None, expect=None, truth=(), **fields) -> Case:
    return Case(id, library, factory, kwargs or {}, expect, frozenset(truth), **fields)


LITGPT_LLAMA_BUG = "litgpt_models:llama_with"
TORCHTUNE_BUG = "torchtune_models:llama3_with"
XT_BUG = "xtransformers_models:rotary_with"
LITGPT_CACHE = {"forward": "tests.corpus.litgpt_models:kv_cache_prefill"}
XT = {"dims": XT_DIMS}
TORCHTUNE = {"dims": TORCHTUNE_DIMS}
NANOGPT = {"forward": "tests.corpus.nanogpt:every_position"}
GPT_FAST = {"forward": "tests.corpus.gpt_fast:prefill"}
MODDED = {"dims": MODDED_DIMS, "vocab_size": VOCAB}

CASES = [
    # -- litgpt: its vocabulary padded 96 -> 128, so the logits are wider than the vocabulary --------------------------
    case(
        "litgpt-pythia",
        "litgpt",
        "litgpt_models:pythia",
        expect=correct(rotary=True),
        truth={"relative"},
        rotation=("half", 4, 10000.0),
        what="GPT-NeoX/Pythia config: parallel residual, rotary on 1/4 of each head",
    ),
    case(
        "litgpt-llama",
        "litgpt",
        "litgpt_models:llama",
        expect=correct(rotary=True),
        truth={"relative"},
        model={"rope": {"base": 500000, "pairing": "half"}},
        rotation=("half", 8, 500000.0),
        what="Llama config: GQA 4/2, RMSNorm, SwiGLU, base 5e5 (declared)",
    ),
    case(
        "litgpt-gemma",
        "litgpt",
        "litgpt_models:gemma",
        expect=correct(rotary=True),
        truth={"relative"},
        rotation=("half", 16, 10000.0),
        what="Gemma config: multi-query, heads of 16 (h * d_h = 2d), scaled embeddings",
    ),
    case(
        "litgpt-mistral",
        "litgpt",
        "litgpt_models:mistral",
        expect=correct(rotary=True),
        truth={"relative"},
        rotation=("half", 8, 10000.0),
        what="Mistral config: sliding window of 4 as a float mask",
    ),
    case(
        "litgpt-llama-kv-cache",
        "litgpt",
        "litgpt_models:llama",
        expect=correct(rotary=True),
        truth={"relative"},
        model=LITGPT_CACHE,
        rotation=("half", 8, 500000.0),
        what="Llama config through its KV cache: keys [B, h, T + 20, d_h], bool mask rows by input_pos",
    ),
    case(
        "litgpt-llama-generate",
        "litgpt",
        "litgpt_models:llama",
        expect=correct(rotary=True),
        truth={"relative"},
        model={"forward": "tests.corpus.litgpt_models:generate"},
        rotation=("half", 8, 500000.0),
        what="generate-style: prefill, then one-token steps at input_pos [t]",
    ),
    case(
        "litgpt-llama-no-mask",
        "litgpt",
        LITGPT_LLAMA_BUG,
        {"bug": "no-mask"},
        planted(True, future_token=LEAK, mask_audit=NO_MASK),
        truth={"leaks", "relative"},
        what="SDPA gets no mask and is_causal=False",
    ),
    case(
        "litgpt-llama-inverted-bool-mask",
        "litgpt",
        LITGPT_LLAMA_BUG,
        {"bug": "inverted-bool-mask"},
        planted(True, future_token=LEAK, mask_audit=INVERTED),
        truth={"leaks", "relative"},
        what="triu(ones, 1).bool() handed to SDPA",
    ),
    case(
        "litgpt-llama-kv-cache-inverted-bool-mask",
        "litgpt",
        LITGPT_LLAMA_BUG,
        {"bug": "inverted-bool-mask"},
        planted(True, future_token=LEAK, mask_audit=INVERTED),
        truth={"leaks", "relative"},
        model=LITGPT_CACHE,
        what="the same on the cached call: T queries over T + 20 keys",
    ),
    case(
        "litgpt-llama-rope-q-only",
        "litgpt",
        LITGPT_LLAMA_BUG,
        {"bug": "rope-q-only"},
        planted(True, rope=ROPE_Q_ONLY),
        truth={"not-relative"},
        what="apply_rope on q only",
    ),
    case(
        "litgpt-llama-rope-pairing",
        "litgpt",
        LITGPT_LLAMA_BUG,
        {"bug": "rope-pairing"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        what="q rotate_half, k rotate_every_two",
    ),
    case(
        "litgpt-llama-kv-cache-rope-pairing",
        "litgpt",
        LITGPT_LLAMA_BUG,
        {"bug": "rope-pairing"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        model=LITGPT_CACHE,
        what="the same read through the KV cache (empty slots beyond T)",
    ),
    # -- torchtune: no config object, sizes declared with dims: --------------------------------------------------------
    case(
        "torchtune-llama3",
        "torchtune",
        "torchtune_models:llama3",
        expect=correct(rotary=True),
        truth={"relative"},
        model=TORCHTUNE,
        rotation=("interleaved", 8, 500000.0),
        what="llama3() builder: GQA 4/2, interleaved RoPE, base 5e5",
    ),
    case(
        "torchtune-llama3-no-dims",
        "torchtune",
        "torchtune_models:llama3",
        expect=correct(rotary=True),
        truth={"relative"},
        rotation=("interleaved", 8, 500000.0),
        what="the same with no `dims:` in the config",
    ),
    case(
        "torchtune-qwen2",
        "torchtune",
        "torchtune_models:qwen2",
        expect=correct(rotary=True),
        truth={"relative"},
        model=TORCHTUNE,
        rotation=("half", 8, 1e6),
        what="qwen2() builder: GQA 4/2, qkv bias, rotate_half, base 1e6",
    ),
    case(
        "torchtune-llama3-no-mask",
        "torchtune",
        TORCHTUNE_BUG,
        {"bug": "no-mask"},
        planted(True, future_token=LEAK, mask_audit=NO_MASK),
        truth={"leaks", "relative"},
        model=TORCHTUNE,
        what="is_causal off, no mask",
    ),
    case(
        "torchtune-llama3-inverted-bool-mask",
        "torchtune",
        TORCHTUNE_BUG,
        {"bug": "inverted-bool-mask"},
        planted(True, future_token=LEAK, mask_audit=INVERTED),
        truth={"leaks", "relative"},
        model=TORCHTUNE,
        what="triu(ones, 1).bool() handed to SDPA",
    ),
    case(
        "torchtune-llama3-rope-q-only",
        "torchtune",
        TORCHTUNE_BUG,
        {"bug": "rope-q-only"},
        planted(True, rope=ROPE_Q_ONLY),
        truth={"not-relative"},
        model=TORCHTUNE,
        what="RoPE on q only",
    ),
    case(
        "torchtune-llama3-rope-pairing",
        "torchtune",
        TORCHTUNE_BUG,
        {"bug": "rope-pairing"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        model=TORCHTUNE,
        what="q Llama 3's interleaved RoPE, k Qwen 2's rotate_half",
    ),
    # -- x-transformers: no config object, sizes declared with dims: ---------------------------------------------------
    case(
        "xt-rotary",
        "x-transformers",
        "xtransformers_models:rotary",
        expect=correct(rotary=True),
        truth={"relative"},
        model=XT,
        rotation=("interleaved", XT_ROTARY_DIM, 10000.0),
        what="Decoder: rotary on half of each head, GQA 4/2, eager attention",
    ),
    case(
        "xt-rotary-no-dims",
        "x-transformers",
        "xtransformers_models:rotary",
        expect=correct(rotary=True),
        truth={"relative"},
        rotation=("interleaved", XT_ROTARY_DIM, 10000.0),
        what="the same with no `dims:` in the config",
    ),
    case(
        "xt-rotary-flash",
        "x-transformers",
        "xtransformers_models:rotary",
        {"flash": True},
        correct(rotary=True),
        truth={"relative"},
        model={**XT, "rope": {"pairing": "interleaved", "rotary_dim": XT_ROTARY_DIM, "base": 10000}},
        rotation=("interleaved", XT_ROTARY_DIM, 10000.0),
        what="the same through SDPA (attn_flash), rope declared",
    ),
    case(
        "xt-alibi",
        "x-transformers",
        "xtransformers_models:alibi",
        expect=correct(rotary=False),
        model=XT,
        what="Decoder: ALiBi bias as SDPA's float mask, no absolute positions",
    ),
    case(
        "xt-cache",
        "x-transformers",
        "xtransformers_models:rotary",
        expect=correct(rotary=True),
        truth={"relative"},
        model={**XT, "forward": "tests.corpus.xtransformers_models:cached_logits"},
        rotation=("interleaved", XT_ROTARY_DIM, 10000.0),
        what="rotary Decoder run as prefill + one-token decode steps through its cache",
    ),
    case(
        "xt-shift-tokens",
        "x-transformers",
        "xtransformers_models:rotary",
        {"shift_tokens": 1},
        correct(True, rope=MEASURED_OR_SAID_WHY),
        truth={"relative"},
        model=XT,
        what="rotary Decoder with shift_tokens=1 (each token mixed with its predecessor)",
    ),
    case(
        "xt-encoder",
        "x-transformers",
        "xtransformers_models:encoder",
        expect=correct(rotary=False),
        truth={"bidirectional"},
        model={**XT, "causal": False},
        what="Encoder, declared causal: false",
    ),
    case(
        "xt-no-mask",
        "x-transformers",
        XT_BUG,
        {"bug": "no-mask"},
        planted(True, future_token=LEAK, mask_audit=NO_MASK),
        truth={"leaks", "relative"},
        model=XT,
        what="causal flag off in every attention layer",
    ),
    case(
        "xt-block-leak",
        "x-transformers",
        XT_BUG,
        {"bug": "block-leak"},
        planted(True, future_token=LEAK, mask_audit=READS_AHEAD),
        truth={"leaks", "relative"},
        model=XT,
        what="causal mask lets position i read i + 1",
    ),
    case(
        "xt-rope-q-only",
        "x-transformers",
        XT_BUG,
        {"bug": "rope-q-only"},
        planted(True, rope=ROPE_Q_ONLY),
        truth={"not-relative"},
        model=XT,
        what="apply_rotary_pos_emb on q only",
    ),
    case(
        "xt-rope-pairing",
        "x-transformers",
        XT_BUG,
        {"bug": "rope-pairing"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        model=XT,
        what="q interleaved pairs, k rotate_half",
    ),
    case(
        "xt-gqa-batch-mix",
        "x-transformers",
        XT_BUG,
        {"bug": "gqa-batch-mix"},
        planted(True, future_token=BATCH_MIX),
        truth={"mixes-batch", "relative"},
        model=XT,
        what="GQA repeat tiles the batch, not the heads",
    ),
    case(
        "xt-shift-roll",
        "x-transformers",
        XT_BUG,
        {"bug": "shift-roll"},
        planted(True, future_token=LEAK, rope=MEASURED_OR_SAID_WHY),
        truth={"leaks", "relative"},
        model=XT,
        what="token shift by torch.roll: the last token wraps into position 0",
    ),
    # -- rotary-embedding-torch inside a small GPT ---------------------------------------------------------------------
    case(
        "rotary-embedding-torch",
        "rotary-embedding-torch",
        "rotary_models:gpt",
        expect=correct(rotary=True),
        truth={"relative"},
        model={"rope": {"pairing": "interleaved", "base": 10000}},
        rotation=("interleaved", 8, 10000.0),
        what="RotaryEmbedding.rotate_queries_or_keys on q and k, rope declared",
    ),
    case(
        "rotary-embedding-torch-q-only",
        "rotary-embedding-torch",
        "rotary_models:gpt_with",
        {"bug": "rope-q-only"},
        planted(True, rope=ROPE_Q_ONLY),
        truth={"not-relative"},
        what="rotate_queries_or_keys on q only",
    ),
    case(
        "rotary-embedding-torch-pairing",
        "rotary-embedding-torch",
        "rotary_models:gpt_with",
        {"bug": "rope-pairing"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        what="q through the library, k through rotate_half",
    ),
    case(
        "rotary-embedding-torch-heads-axis",
        "rotary-embedding-torch",
        "rotary_models:gpt_with",
        {"bug": "rope-heads-axis"},
        planted(True, rope=ROPE_NOT_TURNING),
        truth={"position-blind"},
        model={"rope": {"pairing": "interleaved", "base": 10000}},
        what="q, k rotated as (B, T, h, d_h): the heads turn, the positions do not",
    ),
    # -- torch.nn: decoders with cross-attention to a fixed memory -----------------------------------------------------
    case(
        "nn-transformer-decoder",
        "torch.nn",
        "torch_models:decoder",
        expect=correct(rotary=False),
        what="nn.TransformerDecoder, causal tgt_mask, memory from a fixed source",
    ),
    case(
        "nn-transformer",
        "torch.nn",
        "torch_models:transformer",
        expect=correct(rotary=False),
        what="nn.Transformer: encoder over a fixed source, causal decoder",
    ),
    case(
        "nn-transformer-decoder-memory-8",
        "torch.nn",
        "torch_models:decoder",
        {"source_length": T},
        correct(rotary=False),
        what="the same with a memory as long as the sequence (cross-attention [T, T])",
    ),
    case(
        "nn-transformer-memory-8",
        "torch.nn",
        "torch_models:transformer",
        {"source_length": T},
        correct(rotary=False),
        what="nn.Transformer with a source as long as the sequence",
    ),
    case(
        "nn-transformer-decoder-no-mask",
        "torch.nn",
        "torch_models:decoder",
        {"mask": "none"},
        planted(False, future_token=LEAK, mask_audit=NO_MASK),
        truth={"leaks"},
        what="tgt_mask forgotten",
    ),
    # -- textbook shapes -----------------------------------------------------------------------------------------------
    case(
        "nanogpt-eager",
        "nanoGPT",
        "nanogpt:gpt",
        expect=correct(rotary=False),
        model=NANOGPT,
        what="masked_fill on a registered tril buffer, learned positions (wpe), fused c_attn",
    ),
    case(
        "nanogpt-eager-padded-vocab",
        "nanoGPT",
        "nanogpt:gpt",
        {"padded_vocab": True},
        correct(rotary=False),
        model=NANOGPT,
        what="the same with wte/lm_head padded lit-style: 96 tokens, 128 logits",
    ),
    case(
        "nanogpt-no-mask",
        "nanoGPT",
        "nanogpt:gpt_with",
        {"bug": "no-mask"},
        planted(False, future_token=LEAK, mask_audit=NO_MASK),
        truth={"leaks"},
        model=NANOGPT,
        what="mask buffer of ones (tril forgotten)",
    ),
    case(
        "nanogpt-block-leak",
        "nanoGPT",
        "nanogpt:gpt_with",
        {"bug": "block-leak"},
        planted(False, future_token=LEAK, mask_audit=READS_AHEAD),
        truth={"leaks"},
        model=NANOGPT,
        what="mask buffer tril(ones, diagonal=1): i reads i + 1",
    ),
    case(
        "nanogpt-batch1-leak",
        "nanoGPT",
        "nanogpt:gpt_with",
        {"bug": "batch1-leak"},
        planted(False, future_token=LEAK, mask_audit=NO_MASK),
        truth={"leaks"},
        model=NANOGPT,
        what="batch size 1 takes an SDPA fast path without is_causal",
    ),
    case(
        "gpt-fast-prefill",
        "gpt-fast",
        "gpt_fast:transformer",
        expect=correct(rotary=True),
        truth={"relative"},
        model=GPT_FAST,
        rotation=("interleaved", 8, 10000.0),
        what="KV cache of 32 slots for T=8, mask sliced by input_pos, GQA by repeat_interleave",
    ),
    case(
        "gpt-fast-generate",
        "gpt-fast",
        "gpt_fast:transformer",
        expect=correct(rotary=True),
        truth={"relative"},
        model={"forward": "tests.corpus.gpt_fast:generate"},
        rotation=("interleaved", 8, 10000.0),
        what="generate-style: prefill, then one-token decode steps through the cache",
    ),
    case(
        "gpt-fast-inverted-bool-mask",
        "gpt-fast",
        "gpt_fast:transformer_with",
        {"bug": "inverted-bool-mask"},
        planted(True, future_token=LEAK, mask_audit=INVERTED),
        truth={"leaks", "relative"},
        model=GPT_FAST,
        what="triu(ones, 1).bool() sliced by input_pos on the cached call",
    ),
    case(
        "gpt-fast-gqa-batch-mix",
        "gpt-fast",
        "gpt_fast:transformer_with",
        {"bug": "gqa-batch-mix"},
        planted(True, future_token=BATCH_MIX),
        truth={"mixes-batch", "relative"},
        model=GPT_FAST,
        what="k.repeat(n_rep, 1, 1, 1).view(B, -1, S, d_h)",
    ),
    case(
        "gpt-fast-rope-pairing",
        "gpt-fast",
        "gpt_fast:transformer_with",
        {"bug": "rope-pairing"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        model=GPT_FAST,
        what="q pairs (2i, 2i+1), k rotate_half, read through the cache",
    ),
    case(
        "gpt-fast-generate-rope-pairing",
        "gpt-fast",
        "gpt_fast:transformer_with",
        {"bug": "rope-pairing"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        model={"forward": "tests.corpus.gpt_fast:generate"},
        what="the same behind the generate-style forward",
    ),
    case(
        "meta-llama",
        "Meta Llama",
        "meta_llama:transformer",
        expect=correct(rotary=True),
        truth={"relative"},
        model={"dims": META_DIMS},
        rotation=("interleaved", 8, 10000.0),
        what="complex RoPE (torch.polar, view_as_complex), repeat_kv GQA, additive float mask",
    ),
    case(
        "meta-llama-rope-q-only",
        "Meta Llama",
        "meta_llama:transformer_with",
        {"bug": "rope-q-only"},
        planted(True, rope=ROPE_Q_ONLY),
        truth={"not-relative"},
        model={"dims": META_DIMS},
        what="apply_rotary_emb returns xk unrotated",
    ),
    case(
        "modded-value-embeds",
        "modded-nanogpt",
        "modded:gpt",
        {"value_embeds": True},
        correct(rotary=True),
        truth={"relative"},
        model=MODDED,
        what="value embeddings (nn.Embedding of the ids, width 16), half-truncated RoPE, lm head 128 wide",
    ),
    case(
        "modded-smear",
        "modded-nanogpt",
        "modded:gpt",
        {"smear": True},
        correct(True, rope=MEASURED_OR_SAID_WHY),
        truth={"relative"},
        model=MODDED,
        what="token smearing: each token mixed with its predecessor",
    ),
    case(
        "modded-min-two-tokens",
        "modded-nanogpt",
        "modded:gpt",
        {"min_two_tokens": True},
        correct(rotary=True),
        truth={"relative"},
        model=MODDED,
        what="forward asserts T > 1 (found out)",
    ),
    case(
        "modded-min-two-tokens-declared",
        "modded-nanogpt",
        "modded:gpt",
        {"min_two_tokens": True},
        correct(rotary=True),
        truth={"relative"},
        model=MODDED,
        inputs={"min_seq_len": 2},
        what="forward asserts T > 1 (declared min_seq_len: 2)",
    ),
    case(
        "modded-smear-roll",
        "modded-nanogpt",
        "modded:gpt_with",
        {"bug": "smear-roll"},
        planted(True, future_token=LEAK, rope=MEASURED_OR_SAID_WHY),
        truth={"leaks", "relative"},
        model=MODDED,
        what="smearing by torch.roll: the last token leaks into position 0",
    ),
    case(
        "modded-smear-roll-min-two-tokens",
        "modded-nanogpt",
        "modded:gpt_with",
        {"bug": "smear-roll", "min_two_tokens": True},
        planted(True, future_token=LEAK, rope=MEASURED_OR_SAID_WHY),
        truth={"leaks", "relative"},
        model=MODDED,
        what="the same in a forward that asserts T > 1",
    ),
    case(
        "modded-rope-backwards",
        "modded-nanogpt",
        "modded:gpt_with",
        {"bug": "rope-backwards"},
        planted(True, rope=ROPE_PAIRING),
        truth={"not-relative"},
        model=MODDED,
        what="q turned by +theta, k by -theta, behind token smearing",
    ),
]


def in_bfloat16(*ids: str) -> list[Case]:
    """The same models run in bfloat16: the verdicts must not change. The measured rotation is not compared: in
    bfloat16 the slowest pairs barely turn within the probe, so the rotary dim and base come out lower."""
    by_id = {c.id: c for c in CASES}
    return [
        replace(by_id[i], id=f"{i}-bf16", dtype="bfloat16", rotation=None, what="the same in bfloat16") for i in ids
    ]


CASES += in_bfloat16(
    "litgpt-llama",
    "litgpt-llama-kv-cache",
    "torchtune-llama3",
    "torchtune-qwen2",
    "xt-rotary-flash",
    "xt-shift-tokens",
    "rotary-embedding-torch",
    "nn-transformer-decoder",
    "nanogpt-eager",
    "gpt-fast-generate",
    "meta-llama",
    "modded-smear",
    "litgpt-llama-rope-pairing",
    "xt-rope-q-only",
    "gpt-fast-inverted-bool-mask",
    "modded-rope-backwards",
)
BY_ID = {c.id: c for c in CASES}


# -- running fwdcheck --------------------------------------------------------------------------------------------------


def config(case: Case):
    return config_from_dict(
        {
            "model": {
                "source": "python",
                "factory": f"tests.corpus.{case.factory}",
                "kwargs": case.kwargs,
                "path": [str(REPO)],
                **case.model,
            },
            "inputs": {"batch_size": B, "seq_len": T, "seed": 0, **case.inputs},
            "dtype": case.dtype,
        }
    )


# A library whose import needs a torch newer than the one installed: torchtune 0.6 imports torchao, and the torchao
# the test extra installs (0.13) does not import on torch < 2.6, which pyproject.toml allows.
NEEDS_IMPORT = {"torchtune": "torchtune.modules"}


def skip_unless_importable(case: Case) -> None:
    module = NEEDS_IMPORT.get(case.library)
    if module is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except Exception as exc:  # ImportError, or what a library built for another torch raises as it imports
        pytest.skip(f"{case.library} does not import with torch {torch.__version__}: {type(exc).__name__}: {exc}")


@functools.cache
def report(case_id: str):
    skip_unless_importable(BY_ID[case_id])
    cfg = config(BY_ID[case_id])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's nested-tensor and the libraries' deprecation notices
        return run_model(load_model(cfg), Settings.from_config(cfg), select(None))


def result(case_id: str, check: str):
    return next(r for r in report(case_id).results if r.name == check)


def problems(r) -> set[str]:
    return {f.code for f in r.findings if f.status.value != "pass"}


def describe(r) -> str:
    return f"{r.status.value}: {r.summary}\n" + "\n".join(
        f"  {f.code} {f.status.value}: {f.message} [{f.where}]" for f in r.findings if f.status.value != "pass"
    )


@pytest.mark.parametrize(
    "case_id, check", [pytest.param(c.id, check, id=f"{c.id}-{check}") for c in CASES for check in CHECKS]
)
def test_verdict(case_id, check):
    expected = BY_ID[case_id].expect[check]
    r = result(case_id, check)
    assert expected.admits(r.status.value, problems(r)), f"expected {expected}, got {describe(r)}"


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.correct])
def test_correct_models_pass_the_other_default_checks_that_apply(case_id):
    """The default checks beyond the four judged case by case above (kv-cache, packing, label-shift, grad-causality,
    backends, rope-precision, attention-stats): on a correct model each passes, or skips saying why (most of this
    code offers no cache, loss or packing fwdcheck can drive); none fails, warns or errors."""
    others = [r for r in report(case_id).results if r.name not in CHECKS]
    assert others, "the default selection runs more than the four checks"
    for r in others:
        assert r.status.value in ("pass", "skip") and r.summary, describe(r)


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.rotation])
def test_rope_measures_what_the_library_does(case_id):
    pairing, rotary_dim, base = BY_ID[case_id].rotation
    r = result(case_id, "rope")
    assert (r.metrics.get("pairing"), r.metrics.get("rotary_dim")) == (pairing, rotary_dim), r.metrics
    if base is not None:
        assert r.metrics.get("base") == pytest.approx(base, rel=0.02), r.metrics


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.expect["rope"] is MEASURED_OR_SAID_WHY])
def test_no_vacuous_rope_pass(case_id):
    """A rope pass on a model whose tokens are mixed before attention must rest on a measured rotation."""
    r = result(case_id, "rope")
    if r.status.value == "pass":
        assert r.metrics.get("pairing"), f"rope passed without measuring a rotation: {describe(r)}"
    else:
        assert r.summary, "a skip says why"


# -- the ground truth, measured with plain torch (no fwdcheck) ---------------------------------------------------------


def _build(case: Case):
    skip_unless_importable(case)
    with on_sys_path([REPO]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = resolve_callable(f"tests.corpus.{case.factory}", "factory")(**case.kwargs).eval()
        adapter = case.model.get("forward")
        forward = functools.partial(resolve_callable(adapter, "forward"), model) if adapter else model
        module = sys.modules[f"tests.corpus.{case.factory.split(':')[0]}"]
    return model, forward, module


def _changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) > 1e-4 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.dtype == "float32"])  # bfloat16 twins: the same models
def test_ground_truth(case_id):
    """What each model really does, so every expectation above rests on a fact, not on fwdcheck."""
    case = BY_ID[case_id]
    model, forward, module = _build(case)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = forward(ids)  # (B, T, V or wider: litgpt and modded-nanogpt pad the vocabulary)
        assert base.shape[:2] == (B, T) and base.shape[2] >= VOCAB and torch.isfinite(base).all()
        other = ids.clone()
        other[1] = torch.randint(0, VOCAB, (T,), generator=g)
        mixes = _changed(forward(other)[0], base[0])  # sample 0 unchanged, sample 1 changed
        leaks = False  # one row alone, so that a batch leak does not pass for a future leak
        alone = forward(ids[:1])  # (1, T, V)
        for k in range(1, T):
            cut = ids[:1].clone()  # (1, T)
            cut[:, k:] = (cut[:, k:] + torch.randint(1, VOCAB, (T - k,), generator=g)) % VOCAB  # every token differs
            leaks |= _changed(forward(cut)[:, :k], alone[:, :k])
        assert mixes == ("mixes-batch" in case.truth)
        assert leaks == bool({"leaks", "bidirectional"} & case.truth)
        if {"relative", "not-relative"} & case.truth:
            # a rotary encoding is relative when moving every position by the same offset changes nothing
            moved = _changed(module.shifted_logits(model, ids, 5), module.shifted_logits(model, ids, 0))
            assert moved == ("not-relative" in case.truth)
        if "position-blind" in case.truth:
            # one token repeated: without any position signal every position computes the same logits
            same = forward(torch.full((1, T), 7))
            assert not _changed(same, same[:, :1].expand_as(same))


def test_readme_corpus_table_is_what_the_tests_verified():
    from tests import compat

    assert compat.documented_corpus_table() == compat.corpus_table(), (
        "run `python -m tests.compat --write` and commit docs/compatibility.md"
    )
