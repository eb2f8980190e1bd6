"""Every seq2seq, image-text-to-text and masked-LM architecture the installed transformers ships, built tiny from its
own config class's defaults and run through fwdcheck's default checks with no adapter (`source: hf`).

The lists are transformers' own mappings (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, ..._IMAGE_TEXT_TO_TEXT_...,
..._MASKED_LM_...); each architecture is built, left out or run by the causal-LM sweep's machinery (tests/arch_sweep.py,
by kind), with one code-path cell (no matrix) to keep the slow tier cheap. What each family must show:

- an encoder-decoder is judged on its decoder: its pattern is encoder-decoder and the source was held fixed;
- a masked-LM encoder is never reported as a bare leak: its pattern is bidirectional by design, and FWD101 never shows;
- an image-text-to-text model runs its text path (no image) and is judged as its attention is designed, and again
  with an image fwdcheck draws (the code-path cell "with an image"), or says in its notes why no image was drawn.

    python -m tests.family_sweep            # print the sections of docs/compatibility.md
    python -m tests.family_sweep --write    # rewrite them between their markers

tests/test_family_sweep.py runs them (the slow tier) and holds the expectations.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from dataclasses import dataclass
from typing import Any

from tests.arch_sweep import (
    CHECKS,
    FINDING_MARK,
    GOT_OCR2_IMAGE,
    KNOWN_MARK,
    PAGE,
    SEQ_LEN,
    SWEEPS,
    Expected,
    architectures,
    family,
    image_moves_nothing,
    plain,
    skip_reason,
    sweep_report,
    tiny,
)
from tests.doc_sections import read_section, write_sections

KINDS = ("seq2seq", "image-text-to-text", "masked-lm")
ONE_CELL = (("enabled", False),)  # no code-path matrix: the matrix has tests of its own


def report(model_type: str, kind: str):
    """The default checks on the tiny model, one code-path cell, the libraries' warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sweep_report(model_type, kind, ONE_CELL)


@functools.cache
def runs(kind: str) -> dict[str, Any]:
    """Every architecture of the kind that builds, and its report."""
    return {name: report(name, kind) for name in architectures(kind) if tiny(name, kind).config is not None}


# ----------------------------------------------------------------------------------------------------------------
# Plain-torch evidence: transformers alone, no fwdcheck check involved


def _source(model) -> dict[str, Any]:
    """An encoder-decoder's source held fixed (the same ids for both rows), as keyword arguments; {} for a model
    without one."""
    import inspect

    import torch

    if not getattr(model.config, "is_encoder_decoder", False):
        return {}
    if "decoder_input_ids" not in inspect.signature(model.forward).parameters:
        return {}
    vocab = getattr(model.config, "src_vocab_size", None) or model.config.vocab_size
    source = torch.randint(3, vocab, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1)).repeat(2, 1)
    return {"input_ids": source}


def logits(model, ids, **kw):
    """The model's logits for the tokens under test: an encoder-decoder's decoder tokens beside a fixed source."""
    import torch

    source = _source(model)
    with torch.no_grad():
        if source:
            return model(**source, decoder_input_ids=ids, use_cache=False, **kw).logits
        return model(input_ids=ids, **kw).logits


def reads_the_future(model) -> bool:
    """Whether changing a token moves the logits of an earlier position."""
    import torch

    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)
    for position in range(1, SEQ_LEN):
        changed = ids.clone()
        changed[:, position] = 3 + (changed[:, position] - 2) % (vocab - 3)
        if (logits(model, changed)[:, :position] - before[:, :position]).abs().max() > 1e-4 * before.abs().max():
            return True
    return False


def prefix_alone_differs(model) -> bool:
    """Whether the first k tokens run alone give other logits than the same positions of the full run."""
    import torch

    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    full = logits(model, ids)
    scale = full.abs().max()
    return any((logits(model, ids[:, :k]) - full[:, :k]).abs().max() > 1e-4 * scale for k in range(1, SEQ_LEN))


# ----------------------------------------------------------------------------------------------------------------
# Planted bugs: the causal mask of every causal self-attention dropped (an encoder-decoder's decoder self-attention,
# a vision-language model's text path), on a sample of each family


def drop_causal_masks(model):
    """Every attention module that is causal (is_causal True: an encoder's and a cross-attention's say False) handed
    no attention_mask, in eager attention, which adds the mask it is given and builds none: the mask builder's work
    lost while every flag still says causal, so the model reads its future. Returns the number of modules changed."""
    model.set_attn_implementation("eager")
    changed = 0
    for module in model.modules():
        if getattr(module, "is_causal", None) is True and module is not model:
            module.register_forward_pre_hook(
                lambda m, args, kwargs: (args, {**kwargs, "attention_mask": None}), with_kwargs=True
            )
            changed += 1
    return changed


@dataclass(frozen=True)
class Planted:
    kind: str
    model_type: str
    what: str
    codes: dict[str, frozenset[str]]  # check: the codes that must be among its findings (any one of them)


DECODER_MASK = "the decoder self-attention's causal mask dropped"
TEXT_MASK = "the text path's causal mask dropped"
PLANTED = [
    *(
        Planted("seq2seq", name, DECODER_MASK, {"future-token": frozenset({"FWD101"})})
        for name in ("bart", "marian", "m2m_100", "t5gemma")
    ),
    *(
        Planted("image-text-to-text", name, TEXT_MASK, {"future-token": frozenset({"FWD101"})})
        for name in ("llava", "gemma3", "qwen2_vl", "idefics3")
    ),
]


def planted_report(p: Planted):
    """The default checks on the tiny model with the bug planted, through the Python API (one code-path cell)."""
    from fwdcheck import check_model

    model = plain(p.model_type, p.kind)
    assert drop_causal_masks(model) > 0, f"{p.model_type}: no causal attention module to plant the bug in"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_model(model, list(CHECKS), code_paths={"enabled": False})


# ----------------------------------------------------------------------------------------------------------------
# What the sweeps expect: true findings about transformers (each shown in plain torch) and fwdcheck's known
# misreadings, per kind

PROPHETNET_PREFIX = (
    "ProphetNet's decoder: the first k tokens run alone give other logits than the same positions of the full run "
    "(plain torch), while changing a later token moves no earlier logit: its logits depend on the row's length"
)
FINDINGS: dict[tuple[str, str, str], Expected] = {
    ("seq2seq", "prophetnet", "future-token"): Expected(
        frozenset({"FWD105"}), PROPHETNET_PREFIX, lambda: prefix_alone_differs(plain("prophetnet", "seq2seq"))
    ),
    **{
        ("image-text-to-text", name, "mask-audit"): Expected(
            frozenset({"FWD215"}),
            GOT_OCR2_IMAGE,
            lambda name=name: image_moves_nothing(name, "image-text-to-text"),
        )
        for name in ("got_ocr2", "pp_chart2table")
    },
}
KNOWN: dict[tuple[str, str, str], Expected] = {}


def expected(kind: str, model_type: str, check: str) -> Expected | None:
    return FINDINGS.get((kind, model_type, check)) or KNOWN.get((kind, model_type, check))


def entry(kind: str, model_type: str, rep) -> str:
    shown = []
    for check in CHECKS:
        status = rep.result(check).status.value
        if status == "pass":
            continue
        key = (kind, model_type, check)
        mark = FINDING_MARK if key in FINDINGS else KNOWN_MARK if key in KNOWN else ""
        shown.append(f"{check} {status}{mark if status in ('fail', 'warn', 'error') else ''}")
    return f"{model_type} ({', '.join(shown)})" if shown else model_type


IMAGE_CELL = "with an image"
NO_IMAGE = "no image drawn: "


def image_run(rep) -> tuple[str, str]:
    """How the image run went: ("ran", the per-path checks' verdicts with the image) or ("not drawn", why), from
    the report's code-path rows and notes."""
    verdicts = []
    for check in CHECKS:
        paths = rep.result(check).paths
        for row in paths.rows if paths is not None else ():
            if row.path.startswith(IMAGE_CELL):
                verdicts.append(f"{check} {row.status.value}{' ' + ' '.join(row.codes) if row.codes else ''}")
    if verdicts:
        return "ran", ", ".join(verdicts)
    why = next((n[len(NO_IMAGE) :] for n in rep.notes if n.startswith(NO_IMAGE)), "no image run")
    return "not drawn", why.split("; the text path ran alone")[0]


def _image_lines(run: dict[str, Any]) -> list[str]:
    """The image run's tables: the architectures that ran with an image, and why the others did not."""
    ran: dict[str, list[str]] = {}
    not_drawn: list[tuple[str, str]] = []
    for name, rep in sorted(run.items()):
        how, what = image_run(rep)
        if how == "ran":
            ran.setdefault(what, []).append(name)
        else:
            not_drawn.append((name, what.replace("|", "/")))
    lines = ["", "| with an image | architectures |", "| --- | --- |"]
    lines += [f"| {what} | {', '.join(names)} |" for what, names in sorted(ran.items(), key=lambda i: -len(i[1]))]
    if not_drawn:
        lines += ["", "| text path alone | why no image was drawn |", "| --- | --- |"]
        lines += [f"| {name} | {why} |" for name, why in not_drawn]
    return lines


def section(kind: str) -> str:
    import transformers

    sweep = SWEEPS[kind]
    names = architectures(kind)
    built = {name: tiny(name, kind) for name in names}
    run = runs(kind)
    families: dict[str, list[str]] = {}
    for name in names:
        if name in run:
            families.setdefault(family(name), []).append(entry(kind, name, run[name]))
    skips: dict[tuple[str, str], list[str]] = {}
    for name, rep in run.items():
        for check in CHECKS:
            if rep.result(check).status.value == "skip":
                skips.setdefault((check, skip_reason(rep, check)), []).append(name)
    planted = [p for p in PLANTED if p.kind == kind]
    lines = [
        f"transformers {transformers.__version__}: {len(names)} {sweep.what} architectures enumerated "
        f"(`{sweep.mapping}`), {len(run)} built tiny from their config class's defaults as `{sweep.auto_class}` and "
        f"run with no adapter, {len(names) - len(run)} left out (last table). An architecture listed alone passed "
        f"the four checks ({', '.join(CHECKS)}); {KNOWN_MARK} marks a known misreading of fwdcheck's, "
        f"{FINDING_MARK} a true finding.",
        "",
        "| family | architectures |",
        "| --- | --- |",
        *(f"| {fam} | {', '.join(entries)} |" for fam, entries in sorted(families.items())),
    ]
    if skips:
        lines += ["", "| check | why it skips | architectures |", "| --- | --- | --- |"]
        lines += [
            f"| {check} | {reason} | {', '.join(sorted(archs))} |"
            for (check, reason), archs in sorted(skips.items(), key=lambda item: (item[0][0], -len(item[1])))
        ]
    if kind == "image-text-to-text":
        lines += _image_lines(run)
    if planted:
        lines += ["", "| planted bug | architectures | caught by |", "| --- | --- | --- |"]
        grouped: dict[tuple[str, str], list[str]] = {}
        for p in planted:
            caught = ", ".join(f"{c} {' or '.join(sorted(codes))}" for c, codes in sorted(p.codes.items()))
            grouped.setdefault((p.what, caught), []).append(p.model_type)
        lines += [f"| {what} | {', '.join(names)} | {caught} |" for (what, caught), names in grouped.items()]
    for title, table in (("True findings about transformers", FINDINGS), ("Known misreadings of fwdcheck's", KNOWN)):
        rows = [(name, check, e) for (k, name, check), e in sorted(table.items()) if k == kind]
        if rows:
            lines += ["", f"{title}:", "", "| architecture | check | codes | why |", "| --- | --- | --- | --- |"]
            lines += [f"| {name} | {check} | {' '.join(sorted(e.codes))} | {e.what} |" for name, check, e in rows]
    left = [(name, b.left_out) for name, b in built.items() if b.config is None]
    if left:
        lines += ["", "| left out | why |", "| --- | --- |", *(f"| {name} | {why} |" for name, why in left)]
    return "\n".join(lines)


def marker(kind: str) -> str:
    return f"sweep-{kind}"


def documented_section(kind: str) -> str:
    return read_section(PAGE, marker(kind))


def write(kinds: tuple[str, ...] = KINDS) -> None:
    write_sections(PAGE, {marker(kind): section(kind) for kind in kinds})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the sections of docs/compatibility.md")
    parser.add_argument("--kind", choices=KINDS, action="append", help="only this kind (repeatable)")
    args = parser.parse_args()
    chosen = tuple(args.kind or KINDS)
    if args.write:
        write(chosen)
    else:
        print("\n\n".join(section(kind) for kind in chosen))
