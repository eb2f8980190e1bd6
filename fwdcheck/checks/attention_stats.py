"""attention-stats: the effective scale of q . k, from the projections' outputs to the softmax, and what the softmax
looks like.

The scale is measured, not guessed from statistics. With unit-variance q and k the product q . k has variance d_h,
and 1/sqrt(d_h) brings the scores back to unit variance (Attention Is All You Need, section 3.2.1); a missing scale
leaves them sqrt(d_h) times too wide, one applied twice (1/d_h) sqrt(d_h) times too narrow. Whether q and k have
unit variance depends on the weights, so the spread of the scores alone proves nothing on a trained model; the
scale does not depend on the weights. It is the product of:
  the kernel's: SDPA's `scale` argument (None: 1/sqrt(d_h), what SDPA applies); for eager attention, the c for which
    softmax(c . q . k) over the keys it left unmasked reproduces the weights the model computed (1/sqrt(d_h), 1/d_h,
    1, else fitted); when none does (a bias such as ALiBi, soft-capping), the call's scale is not measured;
  and the factors q and k were multiplied by between their projections and the call (scale_chain.py): OPT's
    q_proj(x) * scaling, then an SDPA that scales again, is 1/d_h however right the kernel's argument looks.
That effective scale is judged against what the model declares (a config's `scale:`, else its attention module's
own `scaling`, else its config's knobs, else 1 for an architecture that folds the scale into its initialisation),
or 1/sqrt(d_h) where it declares nothing: applied twice (FWD955) or not at all (FWD956) fails, and so does another
than a declared one (FWD957). Where the factors cannot be measured (a q/k norm or a bias between projection and
kernel), what came before the call is unknown: the kernel's scale alone is judged, and only warns (FWD951-FWD953).

The statistics (std of q . k / sqrt(d_h), softmax entropy, the share of rows whose largest weight exceeds 0.99) are
reported per layer for every model, and judged only at initialisation (the reference model, or a Hugging Face model
built with random weights): a trained model's attention legitimately concentrates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fwdcheck.checks.attention_stats_spec import SPEC
from fwdcheck.checks.scale_chain import factor
from fwdcheck.checks.sdpa_calls import SdpaCall
from fwdcheck.checks.short_row import short_row
from fwdcheck.errors import DoesNotApply, SkipCheck
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.observe.masks import MASKED_BELOW
from fwdcheck.observe.records import Api, Observation
from fwdcheck.result import Check, CheckResult, Finding, Status, first_per_code
from fwdcheck.run.session import Session
from fwdcheck.run.tolerances import TOLERANCES

SATURATED = 0.99  # a row whose largest weight exceeds this reads one key
SATURATED_SHARE = 0.5  # at initialisation, more rows than this reading one key is worth a look
# The attributes under which libraries' attention modules declare the scale they apply: transformers' `scaling`, MPT's
# and flash-attn's `softmax_scale`, Falcon's and Bloom's `inv_norm_factor`. A bare `scale` is not read: in a model
# written by hand it is what the code hands its kernel, the measurement itself rather than a statement of intent.
SCALE_ATTRIBUTES = ("scaling", "softmax_scale", "inv_norm_factor")
# Architectures that fold 1/sqrt(d_h) into the initialisation of q and apply no scale, by design (T5's Mesh
# TensorFlow initialisation), as transformers' configs name them: their declared scale is 1.
FOLDED_SCALE = {"t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop"}


@dataclass
class Calls:
    """What the attention calls of the observed forward showed: a row of numbers per call measured (data.calls), the
    scale findings, why the other calls were not measured, and the scales the model's config declares."""

    rows: list[dict] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)
    declared: list[str] = field(default_factory=list)


class AttentionStats(Check, declared=SPEC):
    name = "attention-stats"

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        row = short_row(model, session)  # the first row's short length, observed once for several checks
        seen = row.seen
        calls = self._calls(model, session, seen, row.sdpa, row.projections)
        if not seen.attention:
            raise DoesNotApply("the observation pass saw no attention call (no SDPA, softmax or attention kernel)")
        if not any(row["scale"] is not None for row in calls.rows):
            why = "; ".join(calls.unmeasured[:3]) or "no attention call with q and k was observed"
            raise SkipCheck(f"no attention call's scale could be measured: {why}")
        findings = calls.findings + (self._saturation(calls.rows) if model.weights_at_init else [])
        return self._summarise(model, seen, calls, first_per_code(findings, more=_more_calls))

    def _calls(
        self,
        model: ModelUnderTest,
        session: Session,
        seen: Observation,
        sdpa_calls: list[SdpaCall],
        projections: dict[str, torch.Tensor],
    ) -> Calls:
        """Each attention call's scale, measured with its statistics, and judged against 1/sqrt(d_h) and the scales
        the model's config declares; why the others were not measured."""
        sdpa = iter(sdpa_calls)
        knobs = declared_scales(model)
        rope = _rope_attention_scaling(model.module)
        calls = Calls(declared=sorted(knobs))
        for call in seen.attention:
            if call.api == Api.SDPA:
                assert call.query is not None  # an SDPA call's q is kept when the observation keeps tensors
                recorded = next(sdpa, None)
                if recorded is None or recorded.arguments["query"].shape != call.query.shape:
                    calls.unmeasured.append(f"{call.module}: its SDPA arguments were not recorded")
                    continue
                measured = self._sdpa(recorded.arguments)
            elif call.api == Api.SOFTMAX and call.matmul is not None:
                measured = self._eager(seen, call, session)
            else:
                calls.unmeasured.append(f"{call.module or 'model'}: {call.api} computes q and k inside torch")
                continue
            if measured is None:
                calls.unmeasured.append(f"{call.module}: q, k or the weights were not kept")
                continue
            raw, weights, allowed, scale_used, how, d_h, q, k = measured
            layer = model.layer_of(call.module)
            declared = declared_scale(model, call.module, layer, d_h, knobs)
            row = {
                "module": call.module,
                "api": call.api,
                "d_h": d_h,
                "scale": scale_used,
                "measured_by": how,
                "scale_ratio": scale_used * math.sqrt(d_h) if scale_used else None,
                "declared": {name: value for name, value in declared},
                **statistics(raw, weights, allowed, d_h, scale_used),
            }
            calls.rows.append(row)
            if scale_used is None:
                calls.unmeasured.append(f"{call.module}: {how}")
                continue
            # The factors q and k were multiplied by between their projections and the call (scale_chain.py).
            block = model.block_of(call.module)
            scope = f"{block}." if block else (f"{call.module}." if call.module else "")
            q_factor, q_from = factor(q, projections, scope)
            k_factor, k_from = factor(k, projections, scope)
            row["q_factor"], row["k_factor"] = q_factor, k_factor
            if q_factor is not None and k_factor is not None:
                effective = scale_used * q_factor * k_factor
                row["effective_scale"] = effective
                row["scale_ratio"] = effective * math.sqrt(d_h)  # what q . k of the projections is scaled by
                row["chain"] = f"q from {q_from}, k from {k_from}"
                finding = judge_effective(effective, d_h, declared, call.module, scale_used, q_factor, k_factor, rope)
            else:
                row["chain"] = f"not measured: q {q_from if q_factor is None else 'measured'}; k " + (
                    k_from if k_factor is None else "measured"
                )
                # Only the part that was measured: a warning at most, what came before the call being unknown.
                partial_scale = scale_used * (q_factor or 1.0) * (k_factor or 1.0)
                conventional = acceptable([("1/sqrt(d_h)", d_h**-0.5), *declared], rope)
                finding = (
                    None
                    if matches(partial_scale, conventional)
                    else judge_scale(partial_scale, d_h, conventional, call.module, model)
                )
            if finding is not None:
                calls.findings.append(finding)
        return calls

    @staticmethod
    def _saturation(rows: list[dict]) -> list[Finding]:
        """At initialisation (FWD954): most rows of some call putting nearly all their weight on one key."""
        saturated = [r for r in rows if r["saturated_share"] is not None and r["saturated_share"] > SATURATED_SHARE]
        if not saturated:
            return []
        worst = max(saturated, key=lambda r: r["saturated_share"])
        finding = Finding(
            "FWD954",
            Status.WARN,
            f"at initialisation {worst['saturated_share']:.0%} of "
            f"the attention rows put more than {SATURATED} of their weight on one key "
            f"(in {len(saturated)} of {len(rows)} calls; scaled score std "
            f"{worst['score_std']:.3g})",
            worst["module"],
        )
        return [finding]

    def _summarise(
        self, model: ModelUnderTest, seen: Observation, calls: Calls, findings: list[Finding]
    ) -> CheckResult:
        """Every call's numbers in the data; the scale furthest from 1/sqrt(d_h) and the extreme statistics in the
        metrics and the summary."""
        rows = calls.rows
        measured_rows = [r for r in rows if r["scale"] is not None]
        at_init = model.weights_at_init  # the reference model, or random weights a source built: no checkpoint
        data = {
            "calls": rows,
            "not_measured": calls.unmeasured,
            "at_initialisation": at_init,
            "declared": calls.declared,
        }
        metrics = {
            "scale_ratio": max((r["scale_ratio"] for r in measured_rows), key=lambda x: abs(math.log(x))),
            "score_std": max(r["score_std"] for r in rows),
            "entropy_share": min((r["entropy_share"] for r in rows if r["entropy_share"] is not None), default=None),
            "saturated_share": max(
                (r["saturated_share"] for r in rows if r["saturated_share"] is not None), default=None
            ),
        }
        stats_note = "" if at_init else "; statistics reported, not judged (the weights may be trained)"
        summary = (
            f"scale x sqrt(d_h) = {metrics['scale_ratio']:.3g} (1 = 1/sqrt(d_h)) at "
            f"{len(measured_rows)} of {len(seen.attention)} attention calls; scaled score std up to "
            f"{metrics['score_std']:.3g}{stats_note}"
        )
        if findings:
            summary = f"{self.codes[findings[0].code]}; {summary}"
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def key_number(self, result: CheckResult) -> str:
        """The measured scale as a multiple of 1/sqrt(d_h): 1 is right."""
        ratio = result.metrics.get("scale_ratio")
        return f"{ratio:.3g} x 1/sqrt(d_h)" if ratio is not None else ""

    # -- one call ------------------------------------------------------------------------------------------------

    @staticmethod
    def _sdpa(arguments: dict):
        """(q . k, weights, allowed, scale, how, d_h) of an SDPA call: the weights SDPA computes from its
        arguments."""
        q, k = arguments["query"].double(), arguments["key"].double()  # (.., h, L, d_h), (.., h_kv, S, d_h)
        if k.dim() >= 3 and k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # grouped heads: (.., h, S, d_h)
        d_h = q.shape[-1]
        scale = arguments.get("scale")
        scale = float(scale) if scale is not None else d_h**-0.5
        raw = q @ k.transpose(-2, -1)  # (.., h, L, S)
        L, S = raw.shape[-2:]
        allowed = torch.ones(L, S, dtype=torch.bool, device=raw.device)
        bias = torch.zeros((), dtype=raw.dtype, device=raw.device)
        if arguments.get("is_causal"):
            allowed = allowed.tril()
        mask = arguments.get("attn_mask")
        if mask is not None:
            if mask.dtype == torch.bool:
                allowed = allowed & mask
            else:
                allowed = allowed & torch.isfinite(mask) & (mask > MASKED_BELOW)
                bias = mask.double().nan_to_num(neginf=0.0).masked_fill(~allowed, 0.0)  # a finite additive bias
        allowed = allowed.expand_as(raw)
        weights = (raw * scale + bias).masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        return raw, weights, allowed, scale, "argument", d_h, arguments["query"], arguments["key"]

    @staticmethod
    def _eager(seen, call, session):
        """(q . k, weights, allowed, scale, how, d_h) of an eager call: the scale that reproduces its weights."""
        scores = seen.matmuls[call.matmul]
        values = next((m for m in seen.matmuls if m.kind == "values" and m.call == call.index), None)
        if scores.a is None or scores.b is None or values is None or values.a is None:
            return None
        raw = scores.a.double() @ scores.b.double()  # (.., L, S): q . k as the model multiplied them
        weights = values.a.double()  # (.., L, S): after the softmax (and its casts)
        if weights.shape != raw.shape:
            return None
        d_h = scores.a.shape[-1]
        dtype = getattr(torch, call.dtype, session.dtype)
        tiny = torch.finfo(dtype).tiny if dtype.is_floating_point else 1e-30
        allowed = weights > tiny  # the keys the model left a weight on: masked ones carry none
        tolerance = TOLERANCES[dtype].attention_weights if dtype in TOLERANCES else 2e-2
        scale, how = reproducing_scale(raw, weights, allowed, d_h, tolerance)
        return raw, weights, allowed, scale, how, d_h, scores.a, scores.b.transpose(-2, -1)


def reproducing_scale(raw, weights, allowed, d_h: int, tolerance: float) -> tuple[float | None, str]:
    """The scale c for which softmax(c . raw) over the allowed keys gives `weights`: the standard and alternative
    scales first, then the least-squares slope of log(weights) on raw within rows. (None, why) when no c does."""
    rows = allowed.sum(-1) >= 2  # (..,) rows with something to normalise over
    if not bool(rows.any()):
        return None, "no query row reads two keys"

    def error(c: float) -> float:
        model = (raw * c).masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        return float((model - weights).abs()[rows].max())

    candidates = [d_h**-0.5, 1.0 / d_h, 1.0]
    errors = [error(c) for c in candidates]
    fits = [c for c, e in zip(candidates, errors, strict=True) if e <= tolerance]
    if len(fits) == len(candidates):
        return None, (
            "q . k is too small at this precision to tell 1/sqrt(d_h), 1/d_h and 1 apart (largest |q . k| "
            f"{float(raw[allowed].abs().max()):.3g})"
        )
    if fits:
        return min(fits, key=lambda c: error(c)), "weights"
    # Another scale: the slope of log(weight) on q . k within each row (the row's normaliser is a constant there).
    log_w = weights.clamp_min(1e-300).log()
    count = allowed.sum(-1, keepdim=True).clamp_min(1)
    centred_log = log_w.masked_fill(~allowed, 0.0) - log_w.masked_fill(~allowed, 0.0).sum(-1, keepdim=True) / count
    centred_raw = raw.masked_fill(~allowed, 0.0) - raw.masked_fill(~allowed, 0.0).sum(-1, keepdim=True) / count
    centred_log, centred_raw = centred_log.masked_fill(~allowed, 0.0), centred_raw.masked_fill(~allowed, 0.0)
    slope = float((centred_log * centred_raw).sum() / (centred_raw * centred_raw).sum().clamp_min(1e-300))
    if slope > 0 and error(slope) <= tolerance:
        return slope, "weights"
    return None, (
        "no scale reproduces its weights from q . k (a positional bias such as ALiBi, soft-capping, or "
        "weights changed after the softmax)"
    )


def statistics(raw, weights, allowed, d_h: int, scale: float | None) -> dict:
    """Std of q . k / sqrt(d_h) and of the scores as applied, over allowed entries; softmax entropy and saturation
    over rows that read at least two keys."""
    entries = raw[allowed]
    rows = allowed.sum(-1) >= 2  # (..,)
    keys = allowed.sum(-1).double()  # (..,)
    entropy = -(weights * weights.clamp_min(1e-300).log()).sum(-1)  # (..,) nats
    stats = {
        "score_std": float(entries.std() / math.sqrt(d_h)) if entries.numel() > 1 else 0.0,
        "applied_std": float((entries * scale).std()) if scale is not None and entries.numel() > 1 else None,
        "entropy": None,
        "entropy_share": None,
        "saturated_share": None,
    }
    if bool(rows.any()):
        stats["entropy"] = float(entropy[rows].mean())
        stats["entropy_share"] = float((entropy[rows] / keys[rows].log()).mean())
        stats["saturated_share"] = float((weights.amax(-1)[rows] > SATURATED).double().mean())
    return stats


def matches(scale: float, expected: dict[str, float]) -> bool:
    """Whether a measured scale is one the model should apply (within 1%: measured scales are fitted)."""
    return any(abs(scale / value - 1) <= 1e-2 for value in expected.values())


def judge_scale(scale: float, d_h: int, expected: dict[str, float], module: str, model) -> Finding:
    """The warning that names a scale the model should not apply."""
    ratio = scale * math.sqrt(d_h)
    said = f"the scores are scaled by {scale:.4g} = {ratio:.3g} x 1/sqrt(d_h) (d_h = {d_h})"
    attribute = getattr(_attention_module(model, module), "scaling", None)
    if isinstance(attribute, float):
        said += f"; the attention module's own `scaling` is {attribute:.4g}"
    if abs(ratio / math.sqrt(d_h) - 1) <= 1e-2:
        return Finding(
            "FWD951",
            Status.WARN,
            f"{said}: no 1/sqrt(d_h) at all, so unit-variance q and k give scores "
            f"of std {math.sqrt(d_h):.3g} instead of 1 (deliberate only where the initialisation folds the "
            "scale in, as T5's does)",
            module,
        )
    if abs(ratio * math.sqrt(d_h) - 1) <= 1e-2:
        return Finding(
            "FWD952",
            Status.WARN,
            f"{said}: 1/d_h, the scale applied twice (or `/ head_dim` for "
            "`/ sqrt(head_dim)`): the softmax is sqrt(d_h) times flatter than intended",
            module,
        )
    declared = ", ".join(f"{n} = {v:.4g}" for n, v in expected.items())
    return Finding("FWD953", Status.WARN, f"{said}: neither 1/sqrt(d_h) nor a declared scale ({declared})", module)


def judge_effective(
    effective: float,
    d_h: int,
    declared: list[tuple[str, float]],
    module: str,
    kernel: float,
    q_factor: float,
    k_factor: float,
    rope: float | None,
) -> Finding | None:
    """The effective scale of q . k (the kernel's, times what q and k were multiplied by after their projections)
    against the scale the model declares, or 1/sqrt(d_h) where it declares none. Applied twice or not at all is a
    failure; another scale than a declared one too; another one where none is declared a warning (FWD953)."""
    expected = declared or [("1/sqrt(d_h)", d_h**-0.5)]
    if matches(effective, acceptable(expected, rope)):
        return None
    name, value = expected[0]
    parts = f"the kernel's {kernel:.4g}" + "".join(
        f" x {which} multiplied by {f:.4g} after its projection"
        for which, f in (("q", q_factor), ("k", k_factor))
        if abs(f - 1) > 1e-2
    )
    said = (
        f"q . k of the projections' outputs reaches the softmax scaled by {effective:.4g} ({parts}) where "
        f"{name} = {value:.4g} is meant (d_h = {d_h})"
    )
    if abs(value - 1) > 1e-2 and matches(effective, {"twice": value * value}):
        return Finding("FWD955", Status.FAIL, f"{said}: the scale applied twice", module)
    if abs(value - 1) > 1e-2 and matches(effective, {"none": 1.0}):
        return Finding("FWD956", Status.FAIL, f"{said}: no scale applied at all", module)
    if declared:
        return Finding("FWD957", Status.FAIL, f"{said}: another scale than the model declares", module)
    return Finding("FWD953", Status.WARN, f"{said}: neither 1/sqrt(d_h) nor a declared scale", module)


def declared_scale(
    model, module: str, layer: int | None, d_h: int, knobs: dict[str, Callable[..., float]]
) -> list[tuple[str, float]]:
    """The scales the model declares for one attention call, the first the one it is judged against: a config's
    `scale:`; else the attention module's own attribute (transformers' `scaling`, ...); else its config's knobs; else
    1 for an architecture that folds the scale into its initialisation. Nothing: the convention, 1/sqrt(d_h)."""
    found: list[tuple[str, float]] = []
    if model.scale is not None:
        found.append((f"the scale {model.origins.get('scale', 'declared')}", model.scale))
    else:
        attention = _attention_module(model, module)
        for attribute in SCALE_ATTRIBUTES:
            value = getattr(attention, attribute, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                found.append((f"{type(attention).__name__}.{attribute}", float(value)))
                break
        found += [(name, f(d_h, layer)) for name, f in knobs.items()]
        model_type = getattr(getattr(model.module, "config", None), "model_type", None)
        if not found and model_type in FOLDED_SCALE:
            found.append((f"{model_type}'s scale folded into its initialisation", 1.0))
    return found


def acceptable(expected: list[tuple[str, float]], rope: float | None) -> dict[str, float]:
    """The scales that pass: those expected and, under a rotary embedding that scales cos and sin (YaRN's
    attention_scaling, which multiplies q and k both), each times its square."""
    scales = dict(expected)
    if rope is not None:
        scales.update({f"{name} x rotary attention_scaling^2": value * rope**2 for name, value in expected})
    return scales


def _rope_attention_scaling(module) -> float | None:
    """The factor a rotary embedding multiplies cos and sin by (transformers' attention_scaling: YaRN's, LongRoPE's),
    when it is not 1."""
    for child in module.modules():
        value = getattr(child, "attention_scaling", None)
        if isinstance(value, float) and abs(value - 1) > 1e-6:
            return value
    return None


def declared_scales(model) -> dict:
    """Scales the model's config asks for besides 1/sqrt(d_h), as functions of (d_h, layer index)."""
    config = getattr(model.module, "config", None)
    found: dict[str, Callable[..., float]] = {}
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if isinstance(scalar, (int, float)) and scalar > 0:
        found["query_pre_attn_scalar^-1/2"] = lambda d_h, layer, s=scalar: s**-0.5
    if getattr(config, "scale_attn_weights", True) is False:
        found["scale_attn_weights=False"] = lambda d_h, layer: 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) is True:
        found["1/(sqrt(d_h) (layer + 1))"] = lambda d_h, layer: d_h**-0.5 / ((layer or 0) + 1)
    multiplier = getattr(config, "attention_multiplier", None)
    if isinstance(multiplier, (int, float)) and multiplier > 0:
        found["attention_multiplier"] = lambda d_h, layer, m=multiplier: float(m)
    return found


def _attention_module(model, name: str):
    """The module an attention call ran in, or None."""
    try:
        return model.module.get_submodule(name) if name else model.module
    except AttributeError:
        return None


def _more_calls(first: Finding, more: int) -> None:
    """The same scale repeats in every layer: a code's first call stands for it, saying how many share it."""
    first.where = f"{first.where} and {more} more calls"
