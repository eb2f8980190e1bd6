"""rope-precision: the rotary angles of long positions, computed in the run's dtype, against float64.

The classic: inv_freq, or position * inv_freq, computed in bfloat16 or float16. bfloat16 holds integers exactly only
up to 256 and float16 up to 2048, and the product m * theta of a long position rounds to the dtype's spacing at m:
at position ~2k in float16 the fastest pair's angle is off by up to half a radian, its cosine by up to ~1. The
relative identity <R(m)q, R(n)k> = <q, R(n-m)k> then fails where the model reads long contexts, while short
sequences (every test a model usually gets) look perfect.

The rotary function is run alone (the reference model's own `rotary`, Hugging Face's rotary_emb with
apply_rotary_pos_emb, a config's `rotary_function`: what fwdcheck/checks/rope.py tests), not the model: a few dozen
positions, so 128k costs nothing. Each long position runs twice: in the run's dtype and in float64; whatever the
implementation computes in its input's dtype is exact in the float64 run, and whatever it computes in float32 on
purpose (as transformers does, autocast disabled) is the same in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fwdcheck.checks.rope_precision_spec import SPEC
from fwdcheck.checks.rotation import Rotation, analyze, pair_indices
from fwdcheck.errors import DoesNotApply, ModelRaised, SkipCheck
from fwdcheck.model.tested import ModelUnderTest, Rotary, model_code
from fwdcheck.result import Check, CheckResult, Finding, Status, first_per_code
from fwdcheck.run.compare import relative_error
from fwdcheck.run.session import Session
from fwdcheck.run.tolerances import TOLERANCES

POSITIONS = (1024, 8192, 32768, 131072)  # the long positions measured, capped at the model's maximum
WINDOW = 8  # positions ending at each long one: the relative identity is checked over their pairs
SHORT = 32  # positions 0.. that say which dims rotate, paired how
# An angle may be off by this much (radians) before it counts: ~1 degree, several times what rounding cos and sin
# to bfloat16 costs, far below the radians a half-precision position or product loses at 1k.
ANGLE_BAR = 0.02


def angle_bar(position: int) -> float:
    """The largest angle error that is not a finding at this position: ANGLE_BAR, plus what float32 arithmetic
    itself loses there (m * theta rounded to float32's spacing at m, theta <= 1): 0.03 rad at 128k. Correct code
    computes in float32, and a float32 run must not fail."""
    return ANGLE_BAR + position * 2.0**-22


def wrapped(angle: torch.Tensor) -> torch.Tensor:
    """Angles brought into [-pi, pi): the difference of two angles, whatever turn each is on."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def long_positions(cap: int | None) -> list[int]:
    """The long positions measured: POSITIONS capped at the model's maximum, each with a window of positions before
    it; SkipCheck when the cap leaves none."""
    positions = sorted({min(p, cap - 1) for p in POSITIONS} if cap else set(POSITIONS))
    positions = [p for p in positions if p >= WINDOW]
    if not positions:
        raise SkipCheck(f"the model's maximum positions ({cap}) leave no long position to measure")
    return positions


@dataclass
class RotaryAlone:
    """The model's rotary function, called on its own on the session's device."""

    function: Rotary
    head_size: int  # D
    device: torch.device

    def rotate(self, x: torch.Tensor, at: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x (D,) turned to every position of `at` by the model's function in `dtype`: (len(at), D) float64."""
        batch = x.to(self.device, dtype).expand(1, 1, len(at), self.head_size).contiguous()  # (1, 1, T, D)
        with model_code("the rotary function raised"):  # the model's code: what it raises is the model's error
            out = self.function(batch, at.to(self.device))
        return out[0, 0].double().cpu()


class RopePrecision(Check, declared=SPEC):
    name = "rope-precision"

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        rotary = self._rotary_alone(model, session)
        if model.max_positions is None:  # the positions a model is meant for: past them no precision is promised
            raise DoesNotApply(
                "the model declares no context length (max_position_embeddings, or `max_positions:` in the model "
                "section): the long positions its rotary angles must hold are not known"
            )
        positions = long_positions(model.max_positions)
        g = torch.Generator().manual_seed(session.settings.inputs.seed)
        q, k = torch.randn(2, rotary.head_size, generator=g, dtype=torch.float64)
        reference_dtype = self._reference_dtype(rotary, model, session, q)
        turn = self._pairing(rotary, model, q, reference_dtype)
        rows = self._measure(rotary, turn, (q, k), positions, session.dtype, reference_dtype)
        findings = self._judge(rows, session.dtype)
        return self._summarise(model, session, rows, findings, turn, reference_dtype)

    @staticmethod
    def _rotary_alone(model: ModelUnderTest, session: Session) -> RotaryAlone:
        """The rotary function to run alone, with the head size it turns; SkipCheck when there is none, or the size
        is unknown."""
        # The rotation as the layers apply it, in their precision, where the model exposes it; else its function.
        rotary = model.rotary_in_layers or model.rotary
        if rotary is None:
            why = (
                "the model declares rotary settings but fwdcheck found no rotary function to call alone"
                if model.rope is not None
                else "no rotary embedding"
            )
            raise DoesNotApply(f"{why} (name one with `rotary_function:` in the config)")
        D = model.dims.get("d_h") or (model.rope.rotary_dim if model.rope else None)
        if not D:
            raise SkipCheck("the head size is unknown: the rotary function cannot be run alone")
        return RotaryAlone(rotary, D, session.device)

    @staticmethod
    def _reference_dtype(rotary: RotaryAlone, model: ModelUnderTest, session: Session, q: torch.Tensor) -> torch.dtype:
        """float64, or float32 when the rotary function cannot run in float64; SkipCheck when a function found by
        convention cannot be called at all, or a float32 run has no more precise reference."""
        short = torch.arange(SHORT)
        try:
            rotary.rotate(q, short[:2], session.dtype)
        except ModelRaised as exc:
            if not model.rotary_discovered:
                raise  # a rotary function the config names must run
            # found by naming convention only: a modeling file with another signature is no finding
            raise SkipCheck(
                f"the rotary function found by convention cannot be called alone ({exc}); name one "
                "with `rotary_function:` in the config"
            ) from None
        try:
            rotary.rotate(q, short[:2], torch.float64)
        except ModelRaised as exc:
            if session.dtype == torch.float32:
                raise SkipCheck(
                    f"the rotary function does not run in float64 ({exc}); a float32 run has no more precise reference"
                ) from None
            return torch.float32
        return torch.float64

    @staticmethod
    def _pairing(rotary: RotaryAlone, model: ModelUnderTest, q: torch.Tensor, reference_dtype: torch.dtype) -> Rotation:
        """Which dims rotate, paired how: from q turned through the short positions at the reference precision.
        SkipCheck when the function alone does not rotate pairs of dims."""
        tol = TOLERANCES[torch.float32].rotation
        turn = analyze(
            rotary.rotate(q, torch.arange(SHORT), reference_dtype), tol, model.rope.pairing if model.rope else None
        )
        if not turn.rotates or turn.pairing is None:
            raise SkipCheck(
                "the rotary function alone does not rotate pairs of dims at positions 0..31"
                + ("" if not turn.rotates else f" (pair norms drift by {turn.norm_error:.3g})")
            )
        return turn

    @staticmethod
    def _measure(
        rotary: RotaryAlone,
        turn: Rotation,
        qk: tuple[torch.Tensor, torch.Tensor],
        positions: list[int],
        dtype: torch.dtype,
        reference_dtype: torch.dtype,
    ) -> list[dict]:
        """Per long position, in the run's dtype against the reference one: the largest angle error over the pairs
        and the relative identity's error over the window ending there, NaN as inf (it never passes), each with the
        bar it is judged against (data.positions)."""
        q, k = qk
        short = torch.arange(SHORT)
        windows = torch.cat([torch.arange(p - WINDOW + 1, p + 1) for p in positions])  # (len(positions) * WINDOW,)
        assert turn.pairing is not None  # _pairing skips a rotation without one
        first, second = pair_indices(turn.pairing, turn.rotary_dim)
        probe = torch.zeros(rotary.head_size, dtype=torch.float64)
        probe[first] = 1.0  # each pair (1, 0): turned, it reads (cos, sin) of the pair's angle

        def angles(dtype: torch.dtype) -> torch.Tensor:
            turned = rotary.rotate(probe, windows, dtype)  # (N, D)
            return torch.atan2(turned[:, second], turned[:, first])  # (N, r/2)

        low, exact = angles(dtype), angles(reference_dtype)
        angle_error = wrapped(low - exact).abs().amax(-1).view(len(positions), WINDOW)  # (positions, WINDOW)
        # The relative identity over each window, against float64 at short distances (n - m in 0..WINDOW-1).
        q_low, k_low = rotary.rotate(q, windows, dtype), rotary.rotate(k, windows, dtype)  # (N, D) each
        q_short, k_short = (
            rotary.rotate(q, short[:WINDOW], reference_dtype),
            rotary.rotate(k, short[:WINDOW], reference_dtype),
        )
        offsets = torch.arange(WINDOW)
        distance = offsets[None, :] - offsets[:, None]  # (W, W): n - m
        # <q, R(n-m)k> for n >= m, <R(m-n)q, k> otherwise: no negative positions needed
        ahead = q_short[0] @ k_short.T  # (W,): <q, R(d)k>
        behind = q_short @ k_short[0]  # (W,): <R(d)q, k>
        expected = torch.where(distance >= 0, ahead[distance.clamp(min=0)], behind[(-distance).clamp(min=0)])
        rows = []
        for i, position in enumerate(positions):
            window = slice(i * WINDOW, (i + 1) * WINDOW)
            scores = q_low[window] @ k_low[window].T  # (W, W): <R(m)q, R(n)k>
            identity = relative_error(scores, expected)  # inf for NaN: it never passes
            angle = float(angle_error[i].max())
            angle = float("inf") if math.isnan(angle) else angle
            bar = angle_bar(position)
            rows.append(
                {
                    "position": position,
                    "angle_error": angle,
                    "angle_bar": bar,
                    "identity_error": identity,
                    "identity_bar": TOLERANCES[dtype].rotation + 2 * bar,
                }
            )
        return rows

    def _judge(self, rows: list[dict], dtype: torch.dtype) -> list[Finding]:
        """FWD901 and FWD902 at the first (shortest) position failing each, saying how many longer ones fail too."""
        findings = []
        name = str(dtype).removeprefix("torch.")
        for row in rows:
            position, angle, bar = row["position"], row["angle_error"], row["angle_bar"]
            if angle > bar:
                findings.append(
                    Finding(
                        "FWD901",
                        Status.FAIL,
                        f"at position {position} the rotary angles in {name} "
                        f"are off by up to {angle:.3g} rad from float64 (bar {bar:.3g}): inv_freq or "
                        "position * inv_freq is computed in low precision",
                        "rotary embedding",
                    )
                )
            if row["identity_error"] > row["identity_bar"]:
                findings.append(
                    Finding(
                        "FWD902",
                        Status.FAIL,
                        f"at positions {position - WINDOW + 1}..{position} "
                        f"<R(m)q, R(n)k> differs from <q, R(n-m)k> by {row['identity_error']:.3g} of its scale in "
                        f"{name} (bar {row['identity_bar']:.3g})",
                        "rotary embedding",
                    )
                )
        return first_per_code(findings, more=_longer_positions)

    def _summarise(
        self,
        model: ModelUnderTest,
        session: Session,
        rows: list[dict],
        findings: list[Finding],
        turn: Rotation,
        reference_dtype: torch.dtype,
    ) -> CheckResult:
        """Every position's errors in the data, the worst angle in the metrics and the summary."""
        data = {
            "positions": rows,
            "pairing": turn.pairing,
            "rotary_dim": turn.rotary_dim,
            "reference_dtype": str(reference_dtype).removeprefix("torch."),
            "buffers": half_buffers(model),
        }
        worst = max(rows, key=lambda r: r["angle_error"])
        metrics = {
            "max_angle_error": worst["angle_error"],
            "at_position": worst["position"],
            "max_identity_error": max(r["identity_error"] for r in rows),
        }
        summary = (
            f"angles off by up to {worst['angle_error']:.3g} rad at position {worst['position']} "
            f"(bar {worst['angle_bar']:.3g}); positions {', '.join(str(r['position']) for r in rows)} in "
            f"{str(session.dtype).removeprefix('torch.')} vs {data['reference_dtype']}"
        )
        if findings:
            summary = f"{self.codes[findings[0].code]}; {summary}"
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def key_number(self, result: CheckResult) -> str:
        """The largest angle error, in radians."""
        value = result.metrics.get("max_angle_error")
        return f"{value:.2g} rad" if value is not None else ""


def _longer_positions(first: Finding, more: int) -> None:
    """The first (shortest) position failing a code stands for it, saying how many longer positions fail too."""
    first.message += f"; {more} longer position(s) fail too"


def half_buffers(model) -> list[str]:
    """Floating buffers of rotary modules held in half precision during the run: read as held, not judged."""
    return [
        f"{name} ({str(buffer.dtype).removeprefix('torch.')})"
        for name, buffer in model.module.named_buffers()
        if ("rotary" in name or "rope" in name) and buffer.dtype in (torch.bfloat16, torch.float16)
    ]
