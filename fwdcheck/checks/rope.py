"""rope: rotated query . key must depend only on n - m; measure the pairing and the frequencies actually used.

Four views, each catching what the others cannot:
  probe (the model's own attention path): feed one token repeated, and hold the hidden state entering each attention
    module the same at every position; what q and k hold at the attention call is then the rotation alone. From it:
    which dims rotate, in which pairing (half: i with i + r/2; interleaved: 2i with 2i+1), at which frequencies,
    whether q and k agree, and whether q_m . k_n depends on n - m only. Run again with every position shifted: a
    relative encoding gives the same scores.
  logits (when forward takes position_ids): shifting every position by an offset must leave the logits unchanged,
    on a short row run alone at both sets of positions.
  component (the reference model, or a rotary function named in the config): the identity
    <R(m)q, R(n)k> = <q, R(n-m)k> on random vectors, norms preserved, position 0 the identity.
  axes (a multi-axis rotary embedding, M-RoPE, as the model's rotary_axes declares it): the probe once more per
    position axis, that axis walking and the others held; each section judged against its own axis (rope_axes.py).

The probe measures q and k only where it knows what they were computed from: a call counts when the input of the
module around it was held position-independent (or its block's input already was, or q and k turn as clean rotations
do, which content never does), and only the key slots that hold the probe's own positions are read, so a KV cache
longer than the input changes nothing. A check that measured nothing never passes: without a judged call or a logits
shift it skips, saying why.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from fwdcheck.checks.held_input import Hold, hold_points, relative_spread
from fwdcheck.checks.observed_qk import attention_qk, key_slots, merge_steps, written_slots
from fwdcheck.checks.rope_axes import AxisCall, axis_positions, judge_axes
from fwdcheck.checks.rope_spec import SPEC
from fwdcheck.checks.rotation import Rotation, analyze, same_turns, toeplitz_error, well_measured
from fwdcheck.errors import DoesNotApply, ModelRaised, SkipCheck, first_line
from fwdcheck.model.tested import ModelUnderTest, model_code
from fwdcheck.observe.records import Observation
from fwdcheck.result import Check, CheckResult, Finding, Status, first_per_code
from fwdcheck.run.compare import logit_scale, position_change, relative_error
from fwdcheck.run.session import Session
from fwdcheck.run.tolerances import TOLERANCES

# Enough positions to fit every pair's frequency (a pair is trusted once it turns by 20x the tolerance over the
# probe: at 32 positions in float32, theta > 6.5e-5, down to base 10000's slowest pair at head size 128); more only
# costs time, two observed forwards of this length.
PROBE_LENGTH = (16, 32)
# A model that declares no rotary embedding and holds no rotary function is first probed at the shorter length:
# whether q and k turn at all shows within 16 positions (one position turns the fastest pair by a radian), and most
# such models (learned or sinusoidal tables, ALiBi) turn nothing. One that does is probed again at the full length.
SHIFT = 17  # positions added in the shift tests; any offset works for a relative encoding


def one_side_unjudgeable(
    q: Rotation, k: Rotation, q_seen: torch.Tensor, k_seen: torch.Tensor, noise: float
) -> tuple[str | None, bool]:
    """Why a call where only one of q and k changes with position is no evidence that the other lacks its rotary
    embedding (FWD301), or None when it is; and whether position then enters absolutely.

    The changing one must turn as a rotation does: one that changes in a way no rotation does (a causal convolution
    over the sequence, a scale that grows with the position) is another position mechanism, not a rotary embedding
    applied to one side. And the still one must hold something in the dims the other rotates: a slice that is exactly
    zero (as initialised) turns without changing."""
    moving, still, still_seen = ("q", "k", k_seen) if q.rotates else ("k", "q", q_seen)
    turning = q if q.rotates else k
    if turning.pairing is None:
        return (
            f"{moving} changes with position in a way no rotation does and {still} does not (a convolution over "
            "the sequence, a position-dependent scale): no rotary embedding to judge",
            True,
        )
    rotated = still_seen.double()[:, turning.rotary_start : turning.rotary_start + turning.rotary_dim]
    if float(rotated.abs().max()) <= noise * (float(still_seen.double().abs().max()) + 1e-30):
        return (
            f"{still} is zero in the dims {moving} rotates ({turning.rotary_start}..."
            f"{turning.rotary_start + turning.rotary_dim - 1}): whether it is rotated cannot be seen",
            False,
        )
    return None, False


@dataclass
class QK:
    """One attention call as the probe saw it: q and k as (heads, P, d_h), the keys taken at the slots that hold the
    probe's positions; or, when the call cannot be judged, why."""

    where: str
    head_dim: int
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    rows: tuple[torch.Tensor, ...] = ()  # the position-free input rows q and k came from
    cached: bool = False  # the call read more key slots than it had queries: a KV cache
    held: bool = True  # its input was held (or already) the same at every position
    note: str | None = None  # why it was not judged; None when it was
    absolute: bool = False  # q or k changes with position in a way no rotation does: position enters absolutely

    @property
    def judged(self) -> bool:
        return self.note is None


@dataclass
class Look:
    """One probe forward: its attention calls, the observation, the rows each held module was given, and how far
    the modules' own rows were from those (when rows were replayed)."""

    calls: list[QK]
    seen: Observation
    rows: dict[str, tuple[torch.Tensor, ...]]
    moved: dict[str, float]


@dataclass
class Measured:
    """The rotations one judged call shows, with the q and k (P, d_h) of head 0 they were read from."""

    where: str
    q: Rotation
    k: Rotation
    toeplitz: float  # how far q_m . k_n is from depending on n - m alone, relative to its scale
    q_seen: torch.Tensor
    k_seen: torch.Tensor


@dataclass
class Probe:
    """What the one-token probe measured over every attention call."""

    calls: list[QK]
    q: Rotation | None = None  # of the first judged call that turns (or the first judged call)
    k: Rotation | None = None
    found: str | None = None  # how position reaches the model instead, when q and k do not turn

    @property
    def judged(self) -> list[QK]:
        return [c for c in self.calls if c.judged]

    @property
    def rotates(self) -> bool:
        return self.q is not None and self.k is not None and (self.q.rotates or self.k.rotates)  # set together

    def why_unjudged(self) -> str:
        if not self.calls:
            return "no attention call with q and k was observed"
        notes = sorted({c.note for c in self.calls if c.note})
        return f"none of {len(self.calls)} attention calls could be judged: {'; '.join(notes)}"


class Rope(Check, declared=SPEC):
    name = "rope"

    def key_number(self, result: CheckResult) -> str:
        """A failed position shift by how far it moved the logits; otherwise the base the probe found."""
        m = result.metrics
        if result.status != Status.PASS and m.get("logits_shift_change", 0.0) > m.get("logits_shift_threshold", 0.0):
            return f"{m['logits_shift_change']:.2g} / {m['logits_shift_threshold']:.2g}"
        return f"base {m['base']:.4g}" if m.get("base") else ""

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        # Tables rounded in a less precise dtype than the run's (a model made in bfloat16, run in float32) turn q and
        # k by angles rounded in that dtype: the rotation is judged at that dtype's tolerance, and the note blames
        # the tables, not the rotation, for what their rounding moves.
        tables, rounded_in = rounded_tables(model.module, session.dtype)
        judged_in = rounded_in or session.dtype
        self.coarse = TOLERANCES[judged_in].logits if rounded_in else None
        tol = TOLERANCES[judged_in].rotation
        self.noise = min(tol, 16 * torch.finfo(session.dtype).eps)  # below this a dim counts as still
        declared = model.rope
        findings: list[Finding] = []
        metrics: dict = {}
        data: dict = {
            "declared": declared.model_dump() if declared else None,
            "declared_from": model.origins.get("rope"),
        }

        probe = self._screened_probe(model, session, tol, findings, data)
        component = self._rotary_alone(model, session, tol, findings, data)
        self._judge_presence(model, probe, component, findings)
        measured = probe.q if probe.rotates else component
        if declared is not None and measured is not None and measured.pairing:
            findings += _against_declared(declared, measured, model)
        shift_measured = self._logits_shift_if_sound(model, session, probe, findings, metrics, data)
        if rounded_in is not None:
            dtype = str(rounded_in).removeprefix("torch.")
            data["rounded_tables"] = {"buffers": tables, "dtype": dtype}
            shown = ", ".join(tables[:3]) + (f" and {len(tables) - 3} more" if len(tables) > 3 else "")
            session.notes.append(
                f"rope: buffers {shown} hold values rounded in {dtype} in a {session.settings.dtype} run (a model "
                f"made in {dtype}, cast up): the rotation was judged at {dtype}'s tolerance ({tol:g}), and what "
                "that rounding moves is the tables', not the rotation's (run in the model's own dtype, or build "
                "the tables in float32)"
            )
        return self._summarise(probe, component, measured, shift_measured, findings, metrics, data)

    def _rotary_alone(
        self, model: ModelUnderTest, session: Session, tol: float, findings: list[Finding], data: dict
    ) -> Rotation | None:
        """The rotary function tested alone (_component), when the model has one to call; None when it has none,
        or one found by convention cannot be called."""
        if model.rotary is None:
            return None
        try:
            return _component(model, session, tol, self.noise, findings, data)
        except Exception as exc:
            if not model.rotary_discovered:
                raise  # a rotary_function the config names must work
            # found by naming convention only: a modeling file with another signature is no finding
            data["component"] = None
            data["component_note"] = f"rotary function found by convention could not be called: {exc}"
            return None

    @staticmethod
    def _judge_presence(
        model: ModelUnderTest, probe: Probe, component: Rotation | None, findings: list[Finding]
    ) -> None:
        """A model whose q and k do not turn: FWD307 when it claims a rotary embedding, else SkipCheck (no rotary
        embedding, or nothing measured), unless another finding already fails it."""
        # Naming a rotary function is a declaration too; one found by convention in a modeling file is not.
        claims_rope = model.rope is not None or (model.rotary is not None and not model.rotary_discovered)
        failing = any(f.status != Status.PASS for f in findings)
        if probe.judged and not probe.rotates:
            if claims_rope:
                findings.append(
                    Finding(
                        "FWD307",
                        Status.FAIL,
                        "the model declares a rotary embedding but q and k "
                        f"do not change with position at any of {len(probe.judged)} attention "
                        f"calls; found instead: {probe.found}"
                        + (f"; declared by {model.origins['rope']}" if model.origins.get("rope") else ""),
                        "rotary embedding",
                    )
                )
            elif not failing:
                raise DoesNotApply(
                    f"no rotary embedding: q and k do not turn with position at any of "
                    f"{len(probe.judged)} attention calls and the model declares none; {probe.found}"
                )
        if not probe.judged and not claims_rope and component is None and not failing:
            raise SkipCheck(f"not measured: {probe.why_unjudged()}, and the model declares no rotary embedding")

    def _logits_shift_if_sound(
        self,
        model: ModelUnderTest,
        session: Session,
        probe: Probe,
        findings: list[Finding],
        metrics: dict,
        data: dict,
    ) -> bool:
        """The logits shift (_logits_shift), unless it cannot say anything here (no position_ids, positions that
        also enter absolutely, a KV cache longer than the input): whether it was measured."""
        if not model.accepts_position_ids:
            data["logits_shift"] = "skipped: forward takes no position_ids"
        elif data.get("absolute_positions"):
            data["logits_shift"] = (
                f"skipped: positions also enter absolutely ({data['absolute_positions']}); the "
                "logits are not expected to stay the same"
            )
        elif any(c.cached for c in probe.calls):
            data["logits_shift"] = (
                "skipped: attention reads a KV cache with more key slots than queries; shifted "
                "positions would read what the cache holds before them"
            )
        else:
            findings += self._logits_shift(model, session, metrics, data)
            return "logits_shift_change" in metrics
        return False

    def _summarise(
        self,
        probe: Probe,
        component: Rotation | None,
        measured: Rotation | None,
        shift_measured: bool,
        findings: list[Finding],
        metrics: dict,
        data: dict,
    ) -> CheckResult:
        """The measured pairing, rotary dim and base; the first failing code, or what holds. SkipCheck when at most
        the rotary function alone was tested: how the model uses it was not measured."""
        if measured is not None:
            metrics.update(
                pairing=measured.pairing,
                rotary_dim=measured.rotary_dim,
                base=round(measured.base, 3) if measured.base else None,
            )
        metrics["judged_calls"] = len(probe.judged)
        bad = [f for f in findings if f.status != Status.PASS]
        if bad:
            summary = f"{self.codes[bad[0].code]}"
        elif not probe.judged and not shift_measured:
            shift = data.get("logits_shift") or "shift skipped: no positions left to shift to"
            alone = "; the rotary function alone satisfies the identity" if component is not None else ""
            raise SkipCheck(f"not measured in the model: {probe.why_unjudged()}; logits {shift}{alone}")
        elif not probe.judged:
            summary = (
                f"relative identity holds at the logits (every position shifted); attention not probed: "
                f"{probe.why_unjudged()}"
            )
        elif measured is not None and measured.pairing:
            summary = (
                f"relative identity holds; pairing {measured.pairing}, rotary dim {measured.rotary_dim}"
                f"{_slice(measured)}, base ~{measured.base:.4g}"
                if measured.base
                else f"relative identity holds; pairing {measured.pairing}"
            )
        elif probe.rotates:
            summary = (
                "relative identity holds; q and k turn and scale with position (xPos-like): no pairing keeps "
                "their norms"
            )
        else:
            summary = "relative identity holds"
        if not bad and model_axes(data):
            summary += f"; {model_axes(data)}"
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    # -- the model's own attention path ------------------------------------------------------------------------------

    def _screened_probe(self, model, session, tol, findings, data) -> Probe:
        """The probe, first at the shorter length where the model claims no rotary embedding (PROBE_LENGTH's
        comment); kept when q and k turn nowhere, else made again at the full length."""
        if model.rope is not None or model.rotary is not None or model.rotary_axes is not None:
            return self._probe(model, session, tol, findings, data)
        screen_findings: list[Finding] = []
        screen_data: dict = {}
        probe = self._probe(model, session, tol, screen_findings, screen_data, longest=PROBE_LENGTH[0])
        if probe.rotates:
            return self._probe(model, session, tol, findings, data)
        findings += screen_findings
        data.update(screen_data)
        return probe

    def _probe(self, model, session, tol, findings, data, longest: int = PROBE_LENGTH[1]) -> Probe:
        """q and k rotations of the judged attention calls, with the findings they support; the probe at most
        `longest` positions. At fewer than the full length (a screen) a rotation is only found: the shift and the
        axes are left to the probe at the full length."""
        T = session.inputs.shape[1]
        shortest = PROBE_LENGTH[0]
        screen = longest < PROBE_LENGTH[1]
        P = min(max(T, shortest), longest, model.max_positions or longest)
        if model.max_positions and model.max_positions - P < SHIFT and P > shortest:
            P = max(shortest, model.max_positions - SHIFT)  # leave room for the shifted probe
        token = session.inputs[:1, :1]
        points = hold_points(model, session)
        hold = Hold(set(points.values()), P)
        stack = model.layer_stack
        blocks = {f"{stack}.{i}" for i in range(len(model.module.get_submodule(stack)))} if stack else set()
        tables = {n for n, m in model.module.named_modules() if isinstance(m, nn.Embedding)}
        with hold.installed(model.module):
            look = self._look(model, session, token, None, P, tol, points, hold, blocks | tables)
            calls, seen = look.calls, look.seen
            probe = Probe(calls)
            data["head_dim"] = calls[0].head_dim if calls else None  # a shape: known judged or not
            results = self._measure(probe.judged, tol, model.rope.pairing if model.rope else None)
            toeplitz = max((r.toeplitz for r in results), default=0.0)
            data["probe_calls"] = [
                {"where": c.where, "judged": c.judged, "note": c.note, "cached": c.cached, "held": c.held}
                for c in calls
            ]
            data["held"] = {name: round(spread, 6) for name, spread in hold.spread.items()}
            absolute = next((c for c in calls if c.absolute), None)
            if absolute is not None:  # the logits are then not expected to stay the same under a shift
                data["absolute_positions"] = f"at '{absolute.where}' {absolute.note}"
            judged = probe.judged
            if not judged:
                data["probe"] = probe.why_unjudged()
                return probe
            first = next((r for r in results if r.q.rotates or r.k.rotates), results[0])
            where0, probe.q, probe.k = first.where, first.q, first.k
            if not probe.rotates:
                probe.found = position_found(seen, hold, points, tables, tol)
            data["probe"] = {
                "calls": len(judged),
                "q": asdict(probe.q),
                "k": asdict(probe.k),
                "toeplitz_error": toeplitz,
                "head_dim": judged[0].head_dim,
            }
            specific = _compare_qk(results, tol, P)
            findings += specific
            if toeplitz > tol and not specific and probe.rotates:
                findings.append(
                    Finding(
                        "FWD303",
                        Status.FAIL,
                        f"q_m . k_n varies along diagonals by {toeplitz:.3g} "
                        f"of its scale (tolerance {tol:g}): it depends on more than n - m",
                        where0,
                        module=where0,
                    )
                )
            if screen and probe.rotates:
                return probe
            if model.accepts_position_ids and probe.rotates:
                findings += self._probe_shift(model, session, token, look, P, tol, points, hold, blocks, data)
            if model.rotary_axes is not None and probe.rotates:
                findings += self._axes(model, session, token, look, results, P, tol, points, hold, blocks, data)
        return probe

    def _axes(self, model, session, token, look, results, P, tol, points, hold, blocks, data) -> list[Finding]:
        """Each section of a multi-axis rotary embedding against its own axis (rope_axes): the probe once more per
        axis, from the same held rows, with position_ids [axes, 1, P] walking that axis and holding the others."""
        axes = model.rotary_axes
        shape = f"[{len(axes.names)}, 1, {P}]"
        if not model.accepts_position_ids:
            data["axes"] = (
                f"not judged: forward takes no position_ids, so its {', '.join(axes.names)} axes cannot be driven apart"
            )
            return []
        if axes.own_layout:
            data["axes"] = f"not judged: {axes.own_layout}, which fwdcheck does not model"
            return []
        turning = [r for r in results if r.q.rotates and r.k.rotates and r.q.pairing and r.q.pairing == r.k.pairing]
        if not turning:
            data["axes"] = "not judged: no attention call turns q and k as one rotation with every axis together"
            return []
        declared = (model.rope.rotary_dim if model.rope else None) or model.dims.get("d_h")
        calls = [AxisCall(r.where, r.q, r.k, _declared_pairs(r.q, declared)) for r in turning]
        held_at = max(0, min(SHIFT, (model.max_positions or P + SHIFT) - P))
        before = {c.where: c for c in look.calls if c.judged}
        seen = []
        for axis in range(len(axes.names)):
            positions = axis_positions(axes, axis, P, held_at, token.device)
            try:
                again = self._look(model, session, token, None, P, tol, points, hold, blocks, look.rows, positions)
            except ModelRaised as exc:
                data["axes"] = f"not judged: forward refused position_ids {shape} ({first_line(exc)})"
                return []
            seen.append(
                {
                    c.where: (c.q[0], c.k[0])
                    for c in again.calls
                    if c.q is not None and c.k is not None and c.where in before and _same_rows(before[c.where], c, tol)
                }
            )
        return _first_per_code(judge_axes(axes, calls, seen, P, held_at, tol, data), len(calls))

    def _measure(self, calls: list[QK], tol: float, prefer: str | None) -> list[Measured]:
        """The rotation of q and of k (head 0 of each) at every judged call, and how far q_m . k_n is from depending
        on n - m alone."""
        results = []
        for c in calls:
            assert c.q is not None and c.k is not None  # kept for every judged call
            q, k = analyze(c.q[0], tol, prefer, self.noise), analyze(c.k[0], tol, prefer, self.noise)
            if q.pairing and k.pairing and q.pairing != k.pairing:
                # A pair of small magnitude can leave both pairings within the rounding on one side: the pairings
                # differ only when no pairing fits both.
                for pairing in (q.pairing, k.pairing):
                    again = analyze(c.q[0], tol, pairing, self.noise), analyze(c.k[0], tol, pairing, self.noise)
                    if again[0].pairing == again[1].pairing == pairing:
                        q, k = again
                        break
            if not c.held and any(r.rotates and r.pairing is None for r in (q, k)):
                # Nothing held its input, and q or k changes with position in a way no rotation does: that may be
                # the content of each position (a learned table added before it), no finding either way.
                c.note = "its input could not be held the same at every position"
                continue
            if q.rotates != k.rotates:
                c.note, c.absolute = one_side_unjudgeable(q, k, c.q[0], c.k[0], self.noise)
                if c.note:
                    continue
            error = toeplitz_error(c.q[0].double() @ c.k[0].double().T)  # head 0 of q with kv head 0
            results.append(Measured(c.where, q, k, error, c.q[0], c.k[0]))
        return results

    def _look(self, model, session, token, offset, P, tol, points, hold, keep, replay=None, positions=None) -> Look:
        """One observed forward of the token repeated at positions offset..offset+P-1 (the model's own when offset
        is None; `positions` as given, when given), the held modules given `replay`'s rows when there are any.

        Where a call reads more key slots than it has queries (a KV cache), a second forward with another token at
        the same positions tells which slots the probe wrote: exactly those change, whatever the cache layout."""
        ids = token.expand(1, P).contiguous()
        if positions is None and offset is not None:
            positions = torch.arange(offset, offset + P, device=ids.device)[None]  # (1, P)
        hold.start(replay)
        seen = session.observe(ids, positions, keep_tensors=True, keep_inputs_of=keep)
        rows, moved = dict(hold.rows), dict(hold.moved)
        raw = attention_qk(seen)
        written: list[list[int] | None] = [None] * len(raw)
        if any(k.shape[-2] != q.shape[-2] for _, q, k, *_ in raw):
            other = (token + 1) % model.vocab_size
            hold.start()  # its own rows: replayed ones would make both tokens write the same keys
            again = attention_qk(session.observe(other.expand(1, P).contiguous(), positions, keep_tensors=True))
            if [w for w, *_ in again] == [w for w, *_ in raw]:
                written = [written_slots(a[2], b[2]) for a, b in zip(raw, again, strict=True)]
        inputs = {m.name: m.input_value for m in seen.modules if m.input_value is not None}
        calls = []
        for where, q, k, query_positions, slots in merge_steps(raw, written, P):
            call = QK(where, head_dim=q.shape[-1], cached=k.shape[-2] != q.shape[-2])
            if q.shape[-2] != P:
                call.note = f"{q.shape[-2]} queries for a probe of {P} positions"
            elif call.cached:
                keys = key_slots(P, k.shape[-2], query_positions, slots)
                if keys is None:
                    call.note = f"cannot tell which of its {k.shape[-2]} key slots hold the probe's {P} positions"
                else:
                    k = k.index_select(-2, torch.as_tensor(keys, device=k.device))  # (.., P, d_h)
            if call.judged and not (torch.isfinite(q).all() and torch.isfinite(k).all()):
                call.note = "q or k is not finite"
            point, block = points.get(where), model.block_of(where)
            if not call.judged:
                pass
            elif point in rows:
                call.rows = rows[point]
            elif block in inputs and relative_spread(inputs[block]) <= tol:
                call.rows = (inputs[block][0, 0],)  # its block's input is already position-free
            else:
                call.held = False  # judged only if q and k turn out still or clean rotations (see _probe)
            if call.judged:
                call.q = q.reshape(-1, *q.shape[-2:])  # (B*h, P, d_h); B is 1 in the probe
                call.k = k.reshape(-1, *k.shape[-2:])
            calls.append(call)
        return Look(calls, seen, rows, moved)

    def _probe_shift(self, model, session, token, look, P, tol, points, hold, blocks, data) -> list[Finding]:
        offset = min(SHIFT, (model.max_positions or P + SHIFT) - P)
        if offset <= 0:
            return []
        calls = look.calls
        again = self._look(model, session, token, offset, P, tol, points, hold, blocks, replay=look.rows)
        shifted = again.calls
        # Position that enters the residual stream absolutely (a learned or sinusoidal table) moves the first held
        # module's own input under the shift: the logits are then not expected to stay the same.
        first = next((points[c.where] for c in calls if c.judged and c.where in points), None)
        if first is not None and again.moved.get(first, 0.0) > tol:
            data["absolute_positions"] = f"the input of '{first}' changes when every position is shifted"
        if [c.where for c in shifted] != [c.where for c in calls]:
            data["probe_shift"] = "skipped: the shifted probe ran other attention calls"
            return []
        compared, worst = 0, 0.0
        for before, after in zip(calls, shifted, strict=True):
            if not (before.judged and after.judged):
                continue
            # Held calls were given the same rows; a call judged by its block's input may have been given another
            # (with a KV cache the shifted queries also read what earlier runs left there): no finding about the
            # rotation can come from different content. Not compare.relative_error, whose inf for a NaN row would skip
            # the call as different content: a row that cannot be compared is no reason to judge less.
            if not _same_rows(before, after, tol):
                continue
            compared += 1
            q, k, q2, k2 = before.q, before.k, after.q, after.k
            assert q is not None and k is not None and q2 is not None and k2 is not None  # kept for judged calls
            scores, shifted_scores = q[0].double() @ k[0].double().T, q2[0].double() @ k2[0].double().T
            change = relative_error(shifted_scores, scores)
            worst = max(worst, change)
            data["probe_shift"] = {"offset": offset, "score_change": worst, "calls": compared}
            if change > tol:
                q_moved, k_moved = relative_error(q2, q) > tol, relative_error(k2, k) > tol
                who = (
                    "q moved and k did not"
                    if q_moved and not k_moved
                    else "k moved and q did not"
                    if k_moved and not q_moved
                    else "both moved, differently"
                )
                return [
                    Finding(
                        "FWD304",
                        Status.FAIL,
                        f"shifting every position by {offset} changes q . k by "
                        f"{change:.3g} of its scale ({who}): the offset reaches q and k differently",
                        before.where,
                        module=before.where,
                    )
                ]
        if not compared:
            data["probe_shift"] = "skipped: no call computed q and k from the same input in both probes"
        return []

    # -- logits ------------------------------------------------------------------------------------------------------

    def _logits_shift(self, model, session, metrics, data) -> list[Finding]:
        """The first sample's first session.short_length tokens run alone at positions offset.., against the same
        tokens run alone at 0..: a relative encoding gives the same logits. The unshifted forward is the session's
        shared short prefix (future-token's prefix ladder runs it too), so the shift costs one short row."""
        T = session.short_length
        offset = min(SHIFT, (model.max_positions or T + SHIFT) - T)
        if offset <= 0:
            return []
        sample = session.inputs[:1, :T]
        base = session.prefix_logits(T)  # (1, T, V)
        positions = torch.arange(offset, offset + T, device=sample.device)[None]  # (1, T)
        versions = buffer_versions(model.module)
        shifted = session.logits(sample, positions)
        if buffer_versions(model.module) != versions:
            # A forward that writes its own buffers keeps state between calls (a KV cache): the shifted positions
            # also read what earlier forwards left there, so the comparison would not be of a shift alone.
            data["logits_shift"] = "skipped: forward writes its buffers (a cache kept between calls)"
            return []
        change = float(position_change(shifted, base).max())
        scale = logit_scale(base)
        # The noise floor (two more forwards of the session's inputs) and the model's rounding are measured only
        # when they can change the verdict: below the tolerance nothing is a finding whatever they are.
        threshold = session.threshold(scale, *session.floors(change, scale))
        if self.coarse is not None:  # tables rounded in a less precise dtype move the logits by their rounding
            rtol, atol = self.coarse
            threshold = max(threshold, atol + rtol * scale)
        metrics["logits_shift_change"] = change
        metrics["logits_shift_threshold"] = threshold
        data["logits_shift_length"] = T
        if change > threshold:
            return [
                Finding(
                    "FWD304",
                    Status.FAIL,
                    f"shifting every position by {offset} changes the logits by "
                    f"{change:.3g} (threshold {threshold:.3g}): positions act absolutely, not relatively",
                    "logits",
                )
            ]
        return []


# -- what the probe's calls show, and the rotary function alone ------------------------------------------------------


def _compare_qk(results: list[Measured], tol: float, positions: int) -> list[Finding]:
    """FWD301, FWD302 and FWD306 at each judged call: q and k must both turn, with one pairing and the same
    frequencies; the same bug in every layer is reported once."""
    findings = []
    for r in results:
        where, q, k, toeplitz = r.where, r.q, r.k, r.toeplitz
        if q.rotates != k.rotates:
            still, moving = ("k", "q") if q.rotates else ("q", "k")
            findings.append(
                Finding(
                    "FWD301",
                    Status.FAIL,
                    f"{moving} is rotated by position but {still} is not: the rotary embedding is missing on {still}",
                    where,
                    module=where,
                )
            )
        elif q.rotates and (q.pairing is None or k.pairing is None):
            if toeplitz > tol:  # a scaled rotation (xPos) keeps no pair norm but still gives relative scores
                findings.append(
                    Finding(
                        "FWD306",
                        Status.FAIL,
                        "q/k change with position but no pairing keeps "
                        f"pair norms constant (drift {max(q.norm_error, k.norm_error):.3g}) "
                        f"and q . k depends on more than n - m ({toeplitz:.3g}): not a "
                        "rotation",
                        where,
                        module=where,
                    )
                )
        elif q.rotates and q.pairing != k.pairing:
            findings.append(
                Finding(
                    "FWD302",
                    Status.FAIL,
                    f"q is rotated with {q.pairing} pairing, k with "
                    f"{k.pairing}: their dot product loses the relative property",
                    where,
                    module=where,
                )
            )
        elif q.rotates and not _same_frequencies(q, k, r.q_seen, r.k_seen, tol):
            findings.append(
                Finding("FWD302", Status.FAIL, _frequency_difference(q, k, tol, positions), where, module=where)
            )
    return _first_per_code(findings, len(results))


def _same_rows(before: QK, after: QK, tol: float) -> bool:
    """Whether two probes computed a call's q and k from the same position-free rows."""
    return len(before.rows) == len(after.rows) and all(
        float((a - b).abs().max()) <= tol * (float(a.abs().max()) + 1e-30)
        for a, b in zip(before.rows, after.rows, strict=True)
    )


def _declared_pairs(q: Rotation, declared_dim: int | None) -> int:
    """The rotary pairs the sections lay out over: the measured ones, or the declared ones where interleaved pairs
    past the measured slice turn too slowly to be seen (their dims then look still)."""
    measured = q.rotary_dim // 2
    if declared_dim and q.pairing == "interleaved" and q.rotary_start == 0 and declared_dim // 2 > measured:
        return declared_dim // 2
    return measured


def model_axes(data: dict) -> str:
    """The summary's words for a multi-axis rotary judged per axis without a finding; '' when it was not."""
    axes = data.get("axes")
    if not isinstance(axes, dict):
        return f"multi-axis sections {axes}" if axes else ""
    sections = "; ".join(
        f"{name} {','.join(map(str, v['pairs'])) or 'none judged'}" for name, v in axes["sections"].items()
    )
    slow = axes["not_judged_pairs"]
    too_slow = f"; pairs {','.join(map(str, slow))} too slow to judge" if slow else ""
    return f"each M-RoPE section turns with its own axis ({axes['layout']}, pairs: {sections}{too_slow})"


def _component(model, session, tol, noise, findings, data) -> Rotation | None:
    """The rotary function alone on random q, k (FWD308: the identity <R(m)q, R(n)k> = <q, R(n-m)k>, norms kept,
    R(0) the identity), and the rotation it applies; below `noise` a dim counts as still."""
    D = model.dims.get("d_h") or data.get("head_dim") or (model.rope.rotary_dim if model.rope else None)
    if not D:
        findings.append(
            Finding(
                "FWD308",
                Status.WARN,
                "the rotary function was not tested alone: the head size "
                "is unknown (no attention call seen); set rope.rotary_dim",
                "rotary function",
            )
        )
        return None
    P = 32
    g = torch.Generator().manual_seed(session.settings.inputs.seed)
    q, k = torch.randn(2, D, generator=g).to(session.device, session.dtype)
    positions = torch.arange(P, device=session.device)

    def rotate(x):  # the same vector at every position: (P, D) of R(m) x
        # the user's own code: its exception is the model's error (exit 1), not fwdcheck's (exit 3)
        with model_code("the rotary function raised"):
            rotated = model.rotary(x.expand(1, 1, P, D).contiguous(), positions)
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
    identity = relative_error(rhs, lhs)
    norms = relative_error(Rq.norm(dim=-1), q.double().norm())
    origin = relative_error(Rq[0], q.double())
    rotation = analyze(Rq, tol, model.rope.pairing if model.rope else None, noise)
    data["component"] = {
        "identity_error": identity,
        "norm_error": norms,
        "position0_error": origin,
        **asdict(rotation),
    }
    checked = [
        f"<R(m)q, R(n)k> - <q, R(n-m)k> reaches {identity:.3g}" if identity > tol else None,
        f"norms change by {norms:.3g}" if norms > tol else None,
        f"R(0) is not the identity ({origin:.3g})" if origin > tol else None,
    ]
    problems = [p for p in checked if p]
    if problems:
        findings.append(
            Finding("FWD308", Status.FAIL, f"the rotary function alone: {'; '.join(problems)}", "rotary function")
        )
    return rotation


def _against_declared(declared, measured: Rotation, model) -> list[Finding]:
    """FWD305: the measured pairing, rotary dim and base against those the model declares."""
    wanted_dim = declared.rotary_dim or model.dims.get("d_h")
    differences = []
    if declared.pairing and measured.rotary_dim > 2 and measured.pairing != declared.pairing:
        differences.append(f"pairing {measured.pairing} (declared {declared.pairing})")
    tail = bool(wanted_dim) and _undetectable_tail(measured, declared, wanted_dim)
    if wanted_dim and measured.rotary_dim != wanted_dim and not tail:
        differences.append(f"rotary dim {measured.rotary_dim} (declared {wanted_dim})")
    # The base from the frequencies' decay over the rotated pairs: the declared width when only pairs too slow to
    # see are missing, else the measured one (a rotary dim that differs is its own finding, not the base's).
    base = math.exp(measured.decay * (wanted_dim if tail else measured.rotary_dim) / 2) if measured.decay else None
    if base and declared.base and abs(math.log(base / declared.base)) > 0.02:
        differences.append(f"base ~{base:.4g} (declared {declared.base:g})")
    if not differences:
        return []
    origin = model.origins.get("rope")
    declared_by = f"; declared by {origin}" if origin else ""
    return [Finding("FWD305", Status.FAIL, "measured " + ", ".join(differences) + declared_by, "rotary embedding")]


def _slice(measured: Rotation) -> str:
    """' (dims a..b of the head)' when the rotated slice does not start the head (multi-head latent attention)."""
    if not measured.rotary_start:
        return ""
    return f" (dims {measured.rotary_start}..{measured.rotary_start + measured.rotary_dim - 1} of the head)"


def _undetectable_tail(measured: Rotation, declared, wanted_dim: int) -> bool:
    """A measured rotary dim below the declared one is no finding when the declared pairs it lacks turn too slowly
    to be seen within the probe at this precision (low frequencies in bfloat16)."""
    if measured.rotary_dim > wanted_dim or not measured.thetas or not declared.base:
        return False
    slowest_seen = min(abs(t) for t in measured.thetas if t) if any(measured.thetas) else 0.0
    first_missing = declared.base ** (-measured.rotary_dim / wanted_dim)  # theta of pair r/2 under the declaration
    return first_missing < slowest_seen


def rounded_tables(module: nn.Module, run_dtype: torch.dtype) -> tuple[list[str], torch.dtype | None]:
    """The model's floating buffers whose values were all rounded in a dtype less precise than the run's
    (bfloat16, else float16), and that dtype; ([], None) when there are none. A table counts when it holds values
    that are not whole numbers and more than a few distinct ones: a mask of 0 and -inf, or positions counted as
    floats, are exact in every dtype and say nothing of how the model was made."""
    coarser = [d for d in (torch.bfloat16, torch.float16) if torch.finfo(d).eps > torch.finfo(run_dtype).eps]
    for dtype in coarser:
        names = []
        for name, buffer in module.named_buffers():
            if not buffer.is_floating_point() or buffer.dtype == dtype or buffer.device.type == "meta":
                continue
            values = buffer.detach().flatten()
            values = values[torch.isfinite(values)]
            if values.numel() < 8 or bool((values == values.round()).all()):
                continue
            if bool((values.to(dtype).to(values.dtype) == values).all()) and values.unique().numel() > 8:
                names.append(name)
        if names:
            return names, dtype
    return [], None


def buffer_versions(module: nn.Module) -> list[int | None]:
    """Each buffer's version counter, which every in-place write advances (None for an inference tensor: it keeps
    none, and cannot be written outside inference mode anyway)."""
    versions: list[int | None] = []
    for buffer in module.buffers():
        try:
            versions.append(buffer._version)
        except RuntimeError:
            versions.append(None)
    return versions


def position_found(seen, hold: Hold, points: dict[str, str], tables: set[str], tol: float) -> str:
    """How position reaches a model whose q and k do not turn: said in the skip or FWD307."""
    # Every token is the same, so a table whose indices vary reads something else: the positions. One whose indices
    # are all one value (the token embedding; token types, all 0) does not.
    learned = [
        m.name
        for m in seen.modules
        if m.name in tables and m.input_value is not None and bool((m.input_value != m.input_value.flatten()[0]).any())
    ]
    if learned:
        return (
            f"absolute positions from a learned table ('{learned[0]}' reads the positions) added to the residual "
            "stream, which is not RoPE"
        )
    first = next((points[c.module] for c in seen.attention if c.module in points), None)
    if first is not None and hold.spread.get(first, 0.0) > tol:
        return (
            "the hidden state entering attention varies with position when every token is the same (an absolute "
            "encoding such as sinusoids added to the residual stream, or tokens mixed with their neighbours), "
            "which is not RoPE"
        )
    return "no position encoding reaches q and k"


def _frequency_difference(q: Rotation, k: Rotation, tol: float, positions: int) -> str:
    """FWD302's message for q and k of one pairing that do not turn alike: in opposite directions, or how fast."""
    pairs = [
        (a, b)
        for a, b in zip(q.thetas, k.thetas, strict=False)
        if well_measured(a, positions, tol) and well_measured(b, positions, tol)
    ]
    if pairs and all(a * b < 0 and abs(abs(a) - abs(b)) <= 10 * tol * abs(a) for a, b in pairs):
        return (
            "q and k rotate in opposite directions (q by +m theta, k by -m theta): the sign of the angle or of "
            "sin differs between them"
        )
    return f"q and k rotate at different frequencies (base ~{q.base or 0:.4g} vs ~{k.base or 0:.4g})"


def _same_frequencies(q: Rotation, k: Rotation, q_seen: torch.Tensor, k_seen: torch.Tensor, tol: float) -> bool:
    """Whether q and k turn by the same angle, pair by pair, at every position (their pairing agrees), over the
    slice either rotates (rotation.same_turns)."""
    start = min(q.rotary_start, k.rotary_start)
    rotary_dim = max(q.rotary_start + q.rotary_dim, k.rotary_start + k.rotary_dim) - start
    assert q.pairing is not None  # the caller took the rotations without a pairing apart (FWD306)
    return same_turns(q_seen, k_seen, q.pairing, rotary_dim, start, tol)


def _first_per_code(findings: list[Finding], calls: int) -> list[Finding]:
    """The same rotary bug repeats in every layer: keep its first occurrence and say how many calls share it."""

    def more(first: Finding, others: int) -> None:
        first.where = f"{first.where} and {others} more of {calls} calls"

    return first_per_code(findings, more)
