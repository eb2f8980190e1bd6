"""The compatibility tables of docs/compatibility.md, generated from the verdicts the tests verify.

    python -m tests.compat            # print the tables
    python -m tests.compat --write    # rewrite the page's tables between their markers

tests/test_hf.py asserts every verdict listed in CASES and that the page holds exactly this table;
tests/test_corpus.py does the same for the third-party corpus (corpus_table, from its CASES and runs).
"""

from __future__ import annotations

import argparse
import functools

from tests.conftest import run_checks
from tests.doc_sections import DOCS, read_section, write_sections

CHECKS = ("shape-ledger", "future-token", "mask-audit", "rope")
PAGE = DOCS / "compatibility.md"  # the sections `compat` and `corpus`


def hf(model_type: str, model_class: str | None = None, **fields) -> dict:
    """A tiny Hugging Face config: 2 layers, width 32, 4 heads, vocabulary 64, built offline with random weights."""
    config = {"model_type": model_type, "vocab_size": 64, "max_position_embeddings": 128, **fields}
    spec = {"source": "hf", "config": config}
    if model_class:
        spec["class"] = model_class
    return spec


LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)

# transformers' Falcon (up to 5.24) ignored the causal mask on the path that returns attention weights; 5.25 sends
# both paths through one attention function. Tests measure the leak in plain torch (falcon_leaks) rather than assume
# a release: fwdcheck must flag exactly the paths that leak, and none where none does.
FALCON = hf(
    "falcon",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    multi_query=True,
    new_decoder_architecture=False,
    parallel_attn=True,
    alibi=False,
)


def falcon_leaks(length: int) -> dict[bool, bool]:
    """Whether changing the last of `length` tokens moves an earlier logit of FALCON, without and with
    output_attentions, measured directly: two forwards per path, no fwdcheck check involved."""
    import torch

    from fwdcheck.config.schema import config_from_dict
    from fwdcheck.model.sources import load_model

    model = load_model(config_from_dict({"model": FALCON})).module.eval()
    ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 64
    leaks = {}
    for weights in (False, True):
        with torch.no_grad():
            before = model(ids, output_attentions=weights).logits[:, :-1]
            after = model(changed, output_attentions=weights).logits[:, :-1]
        leaks[weights] = bool((before - after).abs().max() > 1e-4)
    return leaks


P, F, S = "pass", "fail", "skip"

# name -> (model section, what the model is, expected status per check, rope pairing expected or None)
CASES: dict[str, tuple[dict, str, dict[str, str], str | None]] = {
    "GPT-2": (
        hf("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0),
        "learned positions",
        dict(zip(CHECKS, (P, P, P, S), strict=True)),
        None,
    ),
    "Llama (GQA)": (
        hf("llama", num_key_value_heads=2, **LLAMA_LIKE),
        "rotary, grouped-query",
        dict(zip(CHECKS, (P, P, P, P), strict=True)),
        "half",
    ),
    "Mistral (sliding window 4)": (
        hf("mistral", num_key_value_heads=2, sliding_window=4, **LLAMA_LIKE),
        "rotary, sliding window",
        dict(zip(CHECKS, (P, P, P, P), strict=True)),
        "half",
    ),
    "Qwen2": (
        hf("qwen2", num_key_value_heads=2, **LLAMA_LIKE),
        "rotary, qkv bias",
        dict(zip(CHECKS, (P, P, P, P), strict=True)),
        "half",
    ),
    "GPT-NeoX (partial rotary 0.5)": (
        hf("gpt_neox", rotary_pct=0.5, **LLAMA_LIKE),
        "rotary on half of each head",
        dict(zip(CHECKS, (P, P, P, P), strict=True)),
        "half",
    ),
    "GPT-J (interleaved rotary)": (
        hf("gptj", n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4),
        "rotate_every_two",
        dict(zip(CHECKS, (P, P, P, P), strict=True)),
        "interleaved",
    ),
    "Phi (partial rotary 0.5)": (
        hf("phi", partial_rotary_factor=0.5, **LLAMA_LIKE),
        "rotary, parallel block",
        dict(zip(CHECKS, (P, P, P, P), strict=True)),
        "half",
    ),
    "Gemma (MQA)": (
        hf("gemma", num_key_value_heads=1, head_dim=8, **LLAMA_LIKE),
        "rotary, multi-query",
        dict(zip(CHECKS, (P, P, P, P), strict=True)),
        "half",
    ),
    "OPT": (
        hf("opt", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
        "learned positions",
        dict(zip(CHECKS, (P, P, P, S), strict=True)),
        None,
    ),
    "BERT (BertForMaskedLM)": (
        hf("bert", "BertForMaskedLM", **LLAMA_LIKE),
        "bidirectional encoder, by design",
        dict(zip(CHECKS, (P, P, P, S), strict=True)),
        None,
    ),
    "nn.TransformerEncoder + generate_square_subsequent_mask": (
        {"source": "python", "factory": "tests.models:torch_encoder", "kwargs": {"mask": "float"}},
        "float 0/-inf mask",
        dict(zip(CHECKS, (P, P, P, S), strict=True)),
        None,
    ),
    "nn.TransformerEncoder + bool triu(1) mask": (
        {"source": "python", "factory": "tests.models:torch_encoder", "kwargs": {"mask": "bool"}},
        "True = masked, right for MHA",
        dict(zip(CHECKS, (P, P, P, S), strict=True)),
        None,
    ),
    "nn.TransformerEncoder, no mask": (
        {"source": "python", "factory": "tests.models:torch_encoder", "kwargs": {"mask": "none"}},
        "bidirectional",
        dict(zip(CHECKS, (P, F, F, S), strict=True)),
        None,
    ),
    "nn.TransformerEncoder + bool tril mask": (
        {"source": "python", "factory": "tests.models:torch_encoder", "kwargs": {"mask": "tril_bool"}},
        "SDPA's convention handed to MHA",
        dict(zip(CHECKS, (P, F, F, S), strict=True)),
        None,
    ),
}


@functools.cache
def report(name: str):
    return run_checks(CASES[name][0], list(CHECKS), inputs={"batch_size": 2, "seq_len": 8})  # the table's four columns


def shown_base(base: float) -> str:
    """A fitted estimate of the rotary base: 3 significant digits (500000, not 500006) stay the same across the
    numerics of a run; 1.1e+12 rather than 13 digits of a base that large."""
    return f"{float(f'{base:.3g}'):.0f}" if base < 1e7 else f"{base:.2g}"


def table() -> str:
    lines = [
        "| model | what it is | " + " | ".join(CHECKS) + " | code paths | rope measured |",
        "| --- | --- | " + " | ".join("---" for _ in CHECKS) + " | ---: | --- |",
    ]
    for name, (_, what, _, _) in CASES.items():
        r = report(name)
        cells = [r.result(c).status.value for c in CHECKS]
        matrix = r.result("future-token").paths
        paths = len(matrix.rows) if matrix is not None else 1
        rope = r.result("rope")
        m = rope.metrics
        measured = (
            f"{m['pairing']}, dim {m['rotary_dim']}, base {shown_base(m['base'])}"
            if rope.status.value == "pass" and m.get("base")
            else "-"
        )
        lines.append(f"| {name} | {what} | " + " | ".join(cells) + f" | {paths} | {measured} |")
    return "\n".join(lines)


def corpus_table() -> str:
    """The corpus's correct models with each check's status, then each planted bug with the checks that fail on it."""
    from tests import test_corpus as corpus  # the corpus imports litgpt, torchtune, x-transformers: only when asked

    def measured(rope) -> str:
        m = rope.metrics
        if rope.status.value != "pass" or not m.get("pairing"):
            return "-"
        base = m.get("base")
        shown = f", base {shown_base(base)}" if base else ""
        return f"{m['pairing']}, dim {m['rotary_dim']}{shown}"

    lines = [
        "| library | model | what it is | " + " | ".join(CHECKS) + " | rope measured |",
        "| --- | --- | --- | " + " | ".join("---" for _ in CHECKS) + " | --- |",
    ]
    for case in (c for c in corpus.CASES if c.correct):
        r = corpus.report(case.id)
        cells = [r.result(c).status.value for c in CHECKS]
        lines.append(
            f"| {case.library} | `{case.id}` | {case.what} | "
            + " | ".join(cells)
            + f" | {measured(r.result('rope'))} |"
        )
    lines += ["", "| library | planted bug | what it is | caught by |", "| --- | --- | --- | --- |"]
    for case in (c for c in corpus.CASES if not c.correct):
        r = corpus.report(case.id)
        caught = [
            f"{c} {' '.join(sorted(corpus.problems(r.result(c))))}"
            for c in CHECKS
            if r.result(c).status.value == "fail"
        ]
        lines.append(f"| {case.library} | `{case.id}` | {case.what} | {', '.join(caught) or 'missed'} |")
    return "\n".join(lines)


def documented_table() -> str:
    return read_section(PAGE, "compat")


def documented_corpus_table() -> str:
    return read_section(PAGE, "corpus")


def write() -> None:
    write_sections(PAGE, {"compat": table(), "corpus": corpus_table()})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables of docs/compatibility.md")
    if parser.parse_args().write:
        write()
    else:
        print(table(), corpus_table(), sep="\n\n")
