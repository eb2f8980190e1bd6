"""mask-audit: which keys each query may read, at every attention call, whatever encoding the mask came in.

The observation pass reduces every call to the same thing: a [T, S] set of keys each query may read. SDPA's boolean
True means "may attend"; nn.MultiheadAttention's boolean True means "masked out"; float masks of either API are added
to the scores (0 keeps, -inf drops); is_causal means lower-triangular; eager code is read off the scores that reach
the softmax. That set is compared with causal, and the encoding explains the mistake when it is not.
"""

from __future__ import annotations

import dataclasses

import torch

from fwdcheck.errors import SkipCheck
from fwdcheck.observe import AttentionCall
from fwdcheck.result import Check, CheckResult, Finding, Status

CONVENTIONS = [
    {"api": "F.scaled_dot_product_attention", "bool": "True = may attend", "float": "added to scores (0 keep, -inf drop)",
     "flag": "is_causal=True: lower-triangular, no attn_mask"},
    {"api": "nn.MultiheadAttention", "bool": "True = masked out", "float": "added to scores (0 keep, -inf drop)",
     "flag": "is_causal: a hint that attn_mask is causal"},
    {"api": "eager softmax(scores)", "bool": "-", "float": "masked scores are -inf or far below the row maximum",
     "flag": "-"},
]


def pattern(allowed: torch.Tensor) -> tuple[str, list[tuple[int, int]]]:
    """Name the shape of a square [T, T] may-read set; also the (query, key) pairs that read the future."""
    T = allowed.shape[0]
    past_and_self = torch.ones(T, T, dtype=torch.bool, device=allowed.device).tril()
    future = allowed & ~past_and_self
    pairs = [tuple(p) for p in future.nonzero().tolist()]
    if not pairs:
        if torch.equal(allowed, past_and_self):
            return "causal", []
        return "causal, restricted (window or sparse)", []
    if bool(allowed.all()):
        return "bidirectional: every key", pairs
    if not bool((allowed & past_and_self).any()):
        return "inverted: the future only", pairs
    return "leaky: some future keys", pairs


class MaskAudit(Check):
    name = "mask-audit"
    description = "reads every attention call's mask in its own convention and compares the keys it allows with causal"
    codes = {
        "FWD201": "no causal restriction: every query reads every key",
        "FWD202": "a boolean mask in the other API's convention: its True region is the future",
        "FWD203": "a 0/1 float mask: added to the scores it shifts them by 1 and masks nothing",
        "FWD204": "the mask lets some queries read future keys",
        "FWD205": "rows in which every key is masked: NaN or all-zero attention output",
        "FWD206": "attn_mask passed together with is_causal=True",
        "FWD207": "dropout is live in eval mode (dropout_p > 0 handed to attention, or F.dropout with training=True)",
        "FWD208": "with left padding, real tokens may read the padding keys",
    }
    explain = """\
Observes every scaled_dot_product_attention, multi_head_attention_forward and softmax over [.., T, T] scores (eager
attention), records the mask's kind (bool / float / none / is_causal), shape and values, and derives the set of keys
each query may read under the API's own convention:
  SDPA bool: True = may attend.   nn.MultiheadAttention bool: True = masked out.   float (both): added to the scores,
  0 keeps, -inf (or very negative) drops.   is_causal: lower-triangular.   eager: keys whose score is -inf or more
  than 80 below the row's maximum get no weight.
For a causal model that set must not contain future keys. Findings name the module and call.
Why: the two boolean conventions are opposite, and `mask.float()` of a boolean mask gives 0/1, which added to the
scores masks nothing. Both run without an error and train to a good-looking loss.
How to fix: FWD202 -> pass ~mask, or build the mask for the API you call (SDPA: torch.ones(T, T).tril().bool();
MHA: torch.triu(torch.ones(T, T), 1).bool() or nn.Transformer.generate_square_subsequent_mask(T)). FWD203 -> keep the
mask boolean, or turn it into 0/-inf with torch.zeros(T, T).masked_fill(~may_attend, float('-inf')). FWD207 -> pass
dropout_p=self.p if self.training else 0.0. A model without interceptable attention calls (custom kernels) is skipped
here; future-token still tests its behaviour."""

    def run(self, model, session) -> CheckResult:
        observation = session.observation()
        findings: list[Finding] = []
        rows = []
        pad = model.padding  # a left-padded path view: judge real queries against real keys
        for call in observation.attention:
            if pad and call.self_attention:
                reads_padding = bool(call.allowed[pad:, :pad].any())
                call = dataclasses.replace(call, allowed=call.allowed[pad:, pad:],
                                           empty_rows=int((~call.allowed[pad:].any(-1)).sum()))
                if reads_padding:
                    findings.append(Finding("FWD208", Status.FAIL, "real tokens may read the padding keys: the "
                                            "attention_mask is not applied", f"{call.module or 'model'} ({call.api})"))
            shape, future_pairs = pattern(call.allowed) if call.self_attention else ("cross / cached: not square", [])
            rows.append({"module": call.module or "model", "api": call.api, "mask": call.mask_kind,
                         "mask_shape": list(call.mask_shape) if call.mask_shape else None, "values": call.mask_values,
                         "is_causal": call.is_causal, "dropout_p": call.dropout_p, "pattern": shape,
                         "may_read": call.allowed.int().tolist() if call.allowed.numel() <= 64 * 64 else None})
            findings += self.judge(call, shape, future_pairs, model.causal)
        findings += [Finding("FWD207", Status.FAIL, f"F.dropout(p={d.p:g}, training=True) with the model in eval "
                             "mode: pass training=self.training", where=d.module or "model")
                     for d in observation.dropouts if d.training and d.p > 0]
        if not rows and not findings:
            raise SkipCheck("no attention call observed (a custom kernel?); future-token still tests the behaviour")
        findings = _group(findings)
        data = {"conventions": CONVENTIONS, "calls": rows}
        patterns = sorted({r["pattern"] for r in rows})
        bad = [f for f in findings if f.status != Status.PASS]
        summary = (f"{len(rows)} attention call(s): {', '.join(patterns)}" if not bad
                   else f"{self.codes[bad[0].code]} ({bad[0].where})")
        return CheckResult.from_findings(self.name, findings, summary, metrics={"attention_calls": len(rows)},
                                         data=data)

    @staticmethod
    def judge(call: AttentionCall, shape: str, future_pairs, causal: bool) -> list[Finding]:
        where = f"{call.module or 'model'} ({call.api})"
        api = {"sdpa": "scaled_dot_product_attention", "mha": "nn.MultiheadAttention",
               "softmax": "eager softmax"}[call.api]
        findings = []
        if call.float_01:
            findings.append(Finding("FWD203", Status.FAIL, f"0/1 float mask {call.mask_values} handed to {api}: "
                                    "added to the scores it masks nothing (a boolean turned into float?)", where))
        elif causal and future_pairs:
            T = call.allowed.shape[0]
            if shape.startswith("bidirectional"):
                how = {"none": "no attn_mask and is_causal=False", "scores": "no score is masked"}.get(
                    call.mask_kind, f"the {call.mask_kind} mask {call.mask_values} masks nothing")
                findings.append(Finding("FWD201", Status.FAIL, f"no causal restriction: {how}; every query of "
                                        f"{T} reads every key", where))
            elif shape.startswith("inverted") and call.mask_kind.startswith("bool"):
                convention = ("True = may attend, but this mask is True on the future (nn.MultiheadAttention's "
                              "convention)" if call.api == "sdpa" else
                              "True = masked out, but this mask is True on the past (SDPA's convention)")
                findings.append(Finding("FWD202", Status.FAIL, f"boolean mask in the other convention: for {api} "
                                        f"{convention}; pass ~mask", where))
            elif shape.startswith("inverted") and call.mask_kind.startswith("float"):
                # nn.MultiheadAttention and nn.TransformerEncoder turn a boolean mask into 0/-inf before the call,
                # so an SDPA-convention mask (tril, True = may attend) arrives here as -inf on the past.
                findings.append(Finding("FWD202", Status.FAIL, f"the mask handed to {api} blocks the past and opens "
                                        "the future: a mask built for the other convention (e.g. tril(...).bool(), "
                                        "SDPA's 'True = may attend', where True means masked out); pass ~mask",
                                        where))
            else:
                shown = ", ".join(f"({q},{k})" for q, k in future_pairs[:4])
                findings.append(Finding("FWD204", Status.FAIL, f"the mask lets queries read future keys ({shape}), "
                                        f"(query, key) e.g. {shown}", where))
        if call.empty_rows:
            findings.append(Finding("FWD205", Status.WARN, "(batch, head, query) rows with every key masked: their "
                                    "attention output is NaN or zero", f"{where}: {call.empty_rows} rows"))
        if call.api == "sdpa" and call.is_causal and call.mask_kind not in ("none", "is_causal"):
            findings.append(Finding("FWD206", Status.FAIL, "attn_mask passed together with is_causal=True: backends "
                                    "disagree on which wins; pass one of them", where))
        if call.dropout_p > 0:
            findings.append(Finding("FWD207", Status.FAIL, f"dropout_p={call.dropout_p:g} handed to {api} with the "
                                    "model in eval mode: pass dropout_p=p if self.training else 0.0", where))
        return findings


def _group(findings: list[Finding]) -> list[Finding]:
    """One finding per code and message shape, listing every call it applies to."""
    grouped: dict[tuple[str, str], Finding] = {}
    for f in findings:
        key = (f.code, f.message)
        if key in grouped:
            grouped[key].where = f"{grouped[key].where}, {f.where}"
        else:
            grouped[key] = Finding(f.code, f.status, f.message, f.where)
    return list(grouped.values())
