"""rope: rotated query . key must depend only on n - m; measure the pairing and the frequencies actually used.

Three views, each catching what the others cannot:
  probe (the model's own attention path): feed one token repeated, so every position enters attention with the same
    q and k before rotation; what q and k hold at the attention call is then the rotation alone. From it: which dims
    rotate, in which pairing (half: i with i + r/2; interleaved: 2i with 2i+1), at which frequencies, whether q and k
    agree, and whether q_m . k_n depends on n - m only. Run again with every position shifted: a relative encoding
    gives the same scores.
  logits (when forward takes position_ids): shifting every position by an offset must leave the logits unchanged.
  component (the reference model, or a rotary function named in the config): the identity
    <R(m)q, R(n)k> = <q, R(n-m)k> on random vectors, norms preserved, position 0 the identity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from fwdcheck.errors import ModelRaised, SkipCheck
from fwdcheck.model import model_frame
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.session import position_change

# Relative tolerance for comparing rotated vectors and scores, by dtype: rotations are exact up to rounding.
RELATIVE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
PROBE_LENGTH = (16, 64)  # enough positions to fit every pair's frequency; more only costs time
SHIFT = 17  # positions added in the shift tests; any offset works for a relative encoding


@dataclass
class Rotation:
    """What a stack of vectors X[m] = R(m) x reveals about R."""

    rotates: bool
    pairing: str | None = None  # half | interleaved | None when no pairing keeps pair norms constant
    rotary_dim: int = 0
    thetas: list[float] = field(default_factory=list)  # radians per position, per pair
    base: float | None = None
    decay: float | None = None  # theta_p = exp(-decay * p); base = exp(decay * rotary_dim / 2)
    norm_error: float = 0.0  # largest relative drift of a pair's norm across positions, under the best pairing


def pair_indices(pairing: str, rotary_dim: int) -> tuple[list[int], list[int]]:
    half = rotary_dim // 2
    if pairing == "half":
        return list(range(half)), list(range(half, rotary_dim))
    return list(range(0, rotary_dim, 2)), list(range(1, rotary_dim, 2))


def analyze(X: torch.Tensor, tol: float, prefer: str | None = None, noise: float | None = None) -> Rotation:
    """X: (P, D), the same vector rotated to positions 0..P-1. Which dims turn, paired how, how fast.

    tol judges whether pair norms stay constant; noise (default tol) is the relative change below which a dim counts
    as still: set it near the dtype's rounding so that slow pairs, which turn by little within the probe, still count.
    """
    X = X.double()
    P, D = X.shape
    scale = float(X.abs().max()) or 1.0
    moving = (X - X[0]).abs().amax(0) > (tol if noise is None else noise) * scale  # (D,)
    if not bool(moving.any()):
        return Rotation(rotates=False)
    # Every (pairing, rotary dim) that holds every moving dim; a rotation keeps each pair's norm constant.
    candidates = []
    for pairing in ("half", "interleaved"):
        for rotary_dim in range(2, D + 1, 2):
            if bool(moving[rotary_dim:].any()):
                continue
            i, j = pair_indices(pairing, rotary_dim)
            radius = torch.hypot(X[:, i], X[:, j])  # (P, r/2)
            drift = float((radius - radius[0]).abs().amax(0).max() / (radius.max() + 1e-30))
            candidates.append((drift, pairing, rotary_dim))
    valid = [c for c in candidates if c[0] <= tol]
    if not valid:
        drift, _, rotary_dim = min(candidates)
        return Rotation(rotates=True, pairing=None, rotary_dim=rotary_dim, norm_error=drift)
    # The smallest rotary dim that works (pairs that never turn are not rotary), the declared pairing on a tie.
    drift, pairing, rotary_dim = min(valid, key=lambda c: (c[2], c[1] != prefer, c[0]))
    i, j = pair_indices(pairing, rotary_dim)
    angle = torch.atan2(X[:, j], X[:, i])  # (P, r/2)
    step = torch.remainder(angle[1:] - angle[:-1] + math.pi, 2 * math.pi) - math.pi  # per-position turn, unwrapped
    turned = step.cumsum(0)  # (P-1, r/2): total angle at positions 1..P-1
    m = torch.arange(1, P, dtype=X.dtype)[:, None]
    thetas = ((m * turned).sum(0) / (m * m).sum()).tolist()  # least squares through the origin
    # theta_p = base^(-2p/r) = exp(-decay p): the decay comes from the pairs that turned enough to measure, the base
    # from the decay and the rotary dim.
    decays = sorted(-math.log(abs(t)) / p for p, t in enumerate(thetas) if p > 0 and well_measured(t, P, tol))
    decay = decays[len(decays) // 2] if decays else None
    base = math.exp(decay * rotary_dim / 2) if decay else None
    return Rotation(True, pairing, rotary_dim, thetas, base, decay=decay, norm_error=drift)


def well_measured(theta: float, positions: int, tol: float) -> bool:
    """A pair's frequency is trusted when its total turn over the probe is far above the rounding noise."""
    return abs(theta) * (positions - 1) > 20 * tol


def toeplitz_error(scores: torch.Tensor) -> float:
    """How far scores[m, n] is from depending on n - m alone, relative to the largest |score|."""
    P = scores.shape[0]
    worst = 0.0
    for offset in range(-P + 1, P):
        diagonal = torch.diagonal(scores, offset)
        worst = max(worst, float(diagonal.max() - diagonal.min()))
    return worst / (float(scores.abs().max()) + 1e-30)


class Rope(Check):
    name = "rope"
    description = "rotated q.k must depend only on n - m; reports the pairing and frequencies actually used"
    codes = {
        "FWD301": "one of q and k is rotated by position, the other is not",
        "FWD302": "q and k are rotated with different pairings or frequencies",
        "FWD303": "rotated q.k depends on more than n - m: the relative-position identity fails",
        "FWD304": "shifting every position changes the scores or logits: an absolute offset reaches q and k differently",
        "FWD305": "the measured pairing, rotary dim or base differs from what the model declares",
        "FWD306": "q/k change with position but no pairing keeps pair norms constant: not a rotation",
        "FWD307": "the model declares a rotary embedding but q and k do not change with position",
        "FWD308": "the rotary function on its own breaks the identity, the norms or position 0 = identity",
    }
    explain = """\
Skips, with the reason, when the model has no rotary embedding (q and k do not turn with position in the probe and
nothing declares one). Otherwise:
  probe: one token repeated, so q and k are the same vector at every position before rotation; at each attention call
    fwdcheck measures which dims rotate, the pairing (half = rotate_half, dim i with i + r/2, as GPT-NeoX and Llama;
    interleaved = dim 2i with 2i+1, as GPT-J and RoFormer), the frequency of each pair and the base they imply, and
    checks q_m . k_n depends on n - m only. The probe runs again with every position shifted: scores must not change.
  logits: when forward takes position_ids, shifting every position by an offset must leave the logits unchanged.
  component: for the reference model, or a `rotary_function` named in the config, the identity
    <R(m)q, R(n)k> = <q, R(n-m)k> on random q, k, norm preservation and R(0) = identity.
Why: RoPE applied to q but not k, q and k paired differently, or a position offset that reaches only q all train
without an error; the relative-position property is simply gone.
Limit: the identity compares q with k. A pairing that is consistently wrong (both q and k interleaved where the
checkpoint was trained with half) satisfies it perfectly. Only the declared settings can catch that: fwdcheck reports
the measured pairing, rotary dim and base and fails FWD305 when they differ from the config (the reference model's
`rope:`, a python model's `rope:` block).
How to fix: FWD301 -> apply the rotation to both q and k. FWD302 -> use one rotate function for both. FWD304 -> pass
the same positions (offset included) to q and k."""

    def run(self, model, session) -> CheckResult:
        tol = RELATIVE[session.dtype]
        self.noise = min(tol, 16 * torch.finfo(session.dtype).eps)  # below this a dim counts as still
        declared = model.rope
        findings: list[Finding] = []
        metrics: dict = {}
        data: dict = {"declared": declared.model_dump() if declared else None}

        probe = self._probe(model, session, tol, findings, data)
        component = None
        if model.rotary is not None:
            try:
                component = self._component(model, session, tol, findings, data)
            except Exception as exc:
                if not model.rotary_discovered:
                    raise  # a rotary_function the config names must work
                # found by naming convention only: a modeling file with another signature is no finding
                data["component"] = None
                data["component_note"] = f"rotary function found by convention could not be called: {exc}"
        rotates = probe is not None and (probe[0].rotates or probe[1].rotates)
        if not rotates and declared is None and component is None:
            raise SkipCheck("no rotary embedding: q and k do not turn with position and the model declares none")
        if declared is not None and probe is not None and not rotates:
            findings.append(Finding("FWD307", Status.FAIL, "the model declares a rotary embedding but q and k do "
                                    "not change with position at any attention call"))
        measured = probe[0] if rotates else component
        if declared is not None and measured is not None and measured.pairing:
            findings += self._against_declared(declared, measured, model)
        if model.accepts_position_ids:
            findings += self._logits_shift(model, session, metrics)
        else:
            data["logits_shift"] = "skipped: forward takes no position_ids"
        if measured is not None:
            metrics.update(pairing=measured.pairing, rotary_dim=measured.rotary_dim,
                           base=round(measured.base, 3) if measured.base else None)
        bad = [f for f in findings if f.status != Status.PASS]
        if bad:
            summary = f"{self.codes[bad[0].code]}"
        elif measured is not None and measured.pairing:
            summary = (f"relative identity holds; pairing {measured.pairing}, rotary dim {measured.rotary_dim}, "
                       f"base ~{measured.base:.4g}" if measured.base else f"relative identity holds; pairing "
                       f"{measured.pairing}")
        else:
            summary = "relative identity holds"
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    # -- the model's own attention path ------------------------------------------------------------------------------

    def _probe(self, model, session, tol, findings, data):
        """Returns (q rotation, k rotation) of the first usable attention call, or None when nothing was usable."""
        T = session.inputs.shape[1]
        shortest, longest = PROBE_LENGTH
        P = min(max(T, shortest), longest, model.max_positions or longest)
        if model.max_positions and model.max_positions - P < SHIFT and P > shortest:
            P = max(shortest, model.max_positions - SHIFT)  # leave room for the shifted probe
        token = session.inputs[:1, :1].expand(1, P).contiguous()  # (1, P): one token everywhere
        blocks = {f"{model.layer_stack}.{i}" for i in range(len(model.module.get_submodule(model.layer_stack)))} \
            if model.layer_stack else set()
        seen = session.observe(token, keep_tensors=True, keep_inputs_of=blocks)
        pairs = usable_qk(seen, model, tol)
        if not pairs:
            data["probe"] = "no attention call with position-independent input was observed"
            return None
        prefer = model.rope.pairing if model.rope else None
        results = []
        toeplitz = 0.0
        for where, q, k in pairs:
            q_rot, k_rot = analyze(q[0], tol, prefer, self.noise), analyze(k[0], tol, prefer, self.noise)  # head 0
            results.append((where, q_rot, k_rot))
            toeplitz = max(toeplitz, toeplitz_error(q[0].double() @ k[0].double().T))
        where0, q0, k0 = results[0]
        data["probe"] = {"calls": len(pairs), "q": asdict(q0), "k": asdict(k0), "toeplitz_error": toeplitz,
                         "head_dim": pairs[0][1].shape[-1]}
        specific = self._compare_qk(results, tol, P)
        findings += specific
        if toeplitz > tol and not specific and (q0.rotates or k0.rotates):
            findings.append(Finding("FWD303", Status.FAIL, f"q_m . k_n varies along diagonals by {toeplitz:.3g} of "
                                    f"its scale (tolerance {tol:g}): it depends on more than n - m", where0))
        if model.accepts_position_ids and (q0.rotates or k0.rotates):
            findings += self._probe_shift(model, session, token, pairs, tol, blocks, data)
        return q0, k0

    @staticmethod
    def _compare_qk(results, tol: float, positions: int) -> list[Finding]:
        findings = []
        for where, q, k in results:
            if q.rotates != k.rotates:
                still, moving = ("k", "q") if q.rotates else ("q", "k")
                findings.append(Finding("FWD301", Status.FAIL, f"{moving} is rotated by position but {still} is "
                                        f"not: the rotary embedding is missing on {still}", where))
            elif q.rotates and (q.pairing is None or k.pairing is None):
                findings.append(Finding("FWD306", Status.FAIL, "q/k change with position but no pairing keeps pair "
                                        f"norms constant (drift {max(q.norm_error, k.norm_error):.3g}): not a "
                                        "rotation", where))
            elif q.rotates and q.pairing != k.pairing:
                findings.append(Finding("FWD302", Status.FAIL, f"q is rotated with {q.pairing} pairing, k with "
                                        f"{k.pairing}: their dot product loses the relative property", where))
            elif q.rotates and not _same_frequencies(q, k, tol, positions):
                findings.append(Finding("FWD302", Status.FAIL, "q and k rotate at different frequencies (base "
                                        f"~{q.base or 0:.4g} vs ~{k.base or 0:.4g})", where))
        return _first_per_code(findings, len(results))

    def _probe_shift(self, model, session, token, pairs, tol, blocks, data) -> list[Finding]:
        P = token.shape[1]
        offset = min(SHIFT, (model.max_positions or P + SHIFT) - P)
        if offset <= 0:
            return []
        positions = torch.arange(offset, offset + P, device=token.device)[None]  # (1, P)
        shifted = usable_qk(session.observe(token, positions, keep_tensors=True, keep_inputs_of=blocks), model, tol)
        for (where, q, k), (_, q2, k2) in zip(pairs, shifted):
            before = q[0].double() @ k[0].double().T
            after = q2[0].double() @ k2[0].double().T
            change = float((after - before).abs().max()) / (float(before.abs().max()) + 1e-30)
            data["probe_shift"] = {"offset": offset, "score_change": change}
            if change > tol:
                q_moved = float((q2 - q).abs().max()) > tol * float(q.abs().max())
                k_moved = float((k2 - k).abs().max()) > tol * float(k.abs().max())
                who = "q moved and k did not" if q_moved and not k_moved else \
                    "k moved and q did not" if k_moved and not q_moved else "both moved, differently"
                return [Finding("FWD304", Status.FAIL, f"shifting every position by {offset} changes q . k by "
                                f"{change:.3g} of its scale ({who}): the offset reaches q and k differently", where)]
        return []

    # -- logits ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _logits_shift(model, session, metrics) -> list[Finding]:
        base = session.baseline()[:1]  # (1, T, V)
        sample = session.inputs[:1]
        T = sample.shape[1]
        offset = min(SHIFT, (model.max_positions or T + SHIFT) - T)
        if offset <= 0:
            return []
        positions = torch.arange(offset, offset + T, device=sample.device)[None]  # (1, T)
        shifted = session.logits(sample, positions)
        threshold = session.threshold(float(base.abs().max()), session.repeat_change())
        change = float(position_change(shifted, base).max())
        if change > threshold:  # run alone, the sample may differ from its batched self: compare like with like
            change = float(position_change(shifted, session.logits(sample)).max())
        metrics["logits_shift_change"] = change
        metrics["logits_shift_threshold"] = threshold
        if change > threshold:
            return [Finding("FWD304", Status.FAIL, f"shifting every position by {offset} changes the logits by "
                            f"{change:.3g} (threshold {threshold:.3g}): positions act absolutely, not relatively",
                            "logits")]
        return []

    # -- the rotary function alone -----------------------------------------------------------------------------------

    def _component(self, model, session, tol, findings, data) -> Rotation | None:
        probe = data.get("probe") if isinstance(data.get("probe"), dict) else {}
        D = model.dims.get("d_h") or probe.get("head_dim") or (model.rope.rotary_dim if model.rope else None)
        if not D:
            findings.append(Finding("FWD308", Status.WARN, "the rotary function was not tested alone: the head size "
                                    "is unknown (no attention call seen); set rope.rotary_dim", "rotary function"))
            return None
        P = 32
        g = torch.Generator().manual_seed(session.settings.seed)
        q, k = torch.randn(2, D, generator=g).to(session.device, session.dtype)
        positions = torch.arange(P, device=session.device)

        def rotate(x):  # the same vector at every position: (P, D) of R(m) x
            try:  # the user's own code: its exception is the model's error (exit 1), not fwdcheck's (exit 3)
                rotated = model.rotary(x.expand(1, 1, P, D).contiguous(), positions)
            except (Exception, SystemExit) as exc:
                raise ModelRaised(f"the rotary function raised {type(exc).__name__}: {exc}",
                                  where=model_frame(exc)) from exc
            return rotated[0, 0].double()

        Rq, Rk = rotate(q), rotate(k)
        # Some rotary embeddings scale cos and sin by an attention factor (longrope, yarn): R(m) = s * rotation.
        # A uniform s is no bug; divide it out and report it.
        ratios = Rq.norm(dim=-1) / q.double().norm()
        scale = float(ratios.mean())
        if abs(scale - 1) > tol and float((ratios - scale).abs().max()) <= tol * scale:
            Rq, Rk = Rq / scale, Rk / scale
            data["component_scale"] = scale
        lhs = Rq @ Rk.T  # <R(m)q, R(n)k>
        rhs = torch.empty_like(lhs)  # <q, R(n-m)k> for n >= m, <R(m-n)q, k> otherwise: no negative positions needed
        for m in range(P):
            for n in range(P):
                rhs[m, n] = Rq[0] @ Rk[n - m] if n >= m else Rq[m - n] @ Rk[0]
        identity = float((lhs - rhs).abs().max()) / (float(lhs.abs().max()) + 1e-30)
        norms = float((Rq.norm(dim=-1) - q.double().norm()).abs().max()) / float(q.double().norm())
        origin = float((Rq[0] - q.double()).abs().max()) / float(q.double().abs().max())
        rotation = analyze(Rq, tol, model.rope.pairing if model.rope else None, self.noise)
        data["component"] = {"identity_error": identity, "norm_error": norms, "position0_error": origin,
                             **asdict(rotation)}
        problems = [f"<R(m)q, R(n)k> - <q, R(n-m)k> reaches {identity:.3g}" if identity > tol else None,
                    f"norms change by {norms:.3g}" if norms > tol else None,
                    f"R(0) is not the identity ({origin:.3g})" if origin > tol else None]
        problems = [p for p in problems if p]
        if problems:
            findings.append(Finding("FWD308", Status.FAIL, f"the rotary function alone: {'; '.join(problems)}",
                                    "rotary function"))
        return rotation

    @staticmethod
    def _against_declared(declared, measured: Rotation, model) -> list[Finding]:
        wanted_dim = declared.rotary_dim or model.dims.get("d_h")
        differences = []
        if declared.pairing and measured.rotary_dim > 2 and measured.pairing != declared.pairing:
            differences.append(f"pairing {measured.pairing} (declared {declared.pairing})")
        if wanted_dim and measured.rotary_dim != wanted_dim and not _undetectable_tail(measured, declared, wanted_dim):
            differences.append(f"rotary dim {measured.rotary_dim} (declared {wanted_dim})")
        base = math.exp(measured.decay * (wanted_dim or measured.rotary_dim) / 2) if measured.decay else None
        if base and declared.base and abs(math.log(base / declared.base)) > 0.02:
            differences.append(f"base ~{base:.4g} (declared {declared.base:g})")
        if not differences:
            return []
        return [Finding("FWD305", Status.FAIL, "measured " + ", ".join(differences), "rotary embedding")]


def _undetectable_tail(measured: Rotation, declared, wanted_dim: int) -> bool:
    """A measured rotary dim below the declared one is no finding when the declared pairs it lacks turn too slowly
    to be seen within the probe at this precision (low frequencies in bfloat16)."""
    if measured.rotary_dim > wanted_dim or not measured.thetas:
        return False
    slowest_seen = min(abs(t) for t in measured.thetas if t) if any(measured.thetas) else 0.0
    first_missing = declared.base ** (-measured.rotary_dim / wanted_dim)  # theta of pair r/2 under the declaration
    return first_missing < slowest_seen


def usable_qk(observation, model, tol) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(where, q, k) per attention call whose block input is the same at every position, head 0 first:
    q and k as (heads, P, d_h). Calls in blocks whose input varies with position (learned absolute positions, or an
    earlier layer's NaN) cannot separate rotation from content and are left out."""
    inputs = {m.name: m.input_value for m in observation.modules if m.input_value is not None}
    found = []
    for call in observation.attention:
        if call.query is None or call.key is None or call.query.dim() < 3:
            continue
        found.append((call.module, call.query, call.key))
    for mm in observation.matmuls:
        if mm.kind == "scores" and mm.a is not None and mm.a.dim() >= 3:
            found.append((mm.module, mm.a, mm.b.transpose(-1, -2)))
    usable = []
    for where, q, k in found:
        block = model.block_of(where)
        x = inputs.get(block) if block else None
        if block is None and usable:
            continue  # without a layer stack only the first call can be trusted
        if x is not None and float((x - x[:, :1]).abs().max()) > tol * (float(x.abs().max()) + 1e-30):
            continue
        if not (torch.isfinite(q).all() and torch.isfinite(k).all()):
            continue
        heads_q = q.reshape(-1, *q.shape[-2:])  # (B*h, P, d_h); B is 1 in the probe
        heads_k = k.reshape(-1, *k.shape[-2:])
        usable.append((where, heads_q, heads_k))
    return usable


def _same_frequencies(q: Rotation, k: Rotation, tol: float, positions: int) -> bool:
    """Equal frequencies on every pair both measured well. Slow pairs barely turn within the probe: one side may
    see a pair the other rounds away, so extra pairs count only when they turned enough to be measured."""
    longer = q.thetas if len(q.thetas) > len(k.thetas) else k.thetas
    if any(well_measured(t, positions, tol) for t in longer[min(len(q.thetas), len(k.thetas)):]):
        return False
    pairs = [(a, b) for a, b in zip(q.thetas, k.thetas) if well_measured(a, positions, tol)
             and well_measured(b, positions, tol)]
    return all(abs(a - b) <= 10 * tol * max(abs(a), abs(b)) for a, b in pairs)


def _first_per_code(findings: list[Finding], calls: int) -> list[Finding]:
    """The same rotary bug repeats in every layer: keep its first occurrence and say how many calls share it."""
    first: dict[str, Finding] = {}
    count: dict[str, int] = {}
    for f in findings:
        first.setdefault(f.code, f)
        count[f.code] = count.get(f.code, 0) + 1
    for code, f in first.items():
        if count[code] > 1:
            f.where = f"{f.where} and {count[code] - 1} more of {calls} calls"
    return list(first.values())
