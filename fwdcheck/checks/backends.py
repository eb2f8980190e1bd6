"""backends: every attention implementation a model offers computes the same logits.

Two layers of the same question:
  implementations (Hugging Face models, the reference model, any model with a Hugging Face-style switch): the
    model's forward under `attn_implementation` eager and sdpa (flex_attention with `options: {backends: {flex:
    true}}`), switched as the code-path matrix switches it (the model's attention switch, ModelUnderTest.attention),
    on the session's first row at its whole length (the other implementations' forwards; the default's logits are
    the observation pass's until one differs) and, when forward takes attention_mask and position_ids, on a
    left-padded row (its real tokens only).
  SDPA kernels: each scaled_dot_product_attention call of one forward replayed under
    torch.nn.attention.sdpa_kernel with each kernel (math, flash, efficient, cuDNN); every kernel that runs on this
    device, dtype and call must give the math kernel's output. Kernels that cannot run are named, not judged.

The bar is Hugging Face's own eager-vs-SDPA test bar for the dtype (float32 atol 1e-6, rtol 1e-4; float16 5e-3;
bfloat16 1e-2; fwdcheck/run/tolerances.py), never below the session's threshold (its tolerance and noise floor).
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext, suppress

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fwdcheck.checks.backends_spec import SPEC
from fwdcheck.checks.equivalence_bar import tolerance
from fwdcheck.checks.sdpa_calls import RecordSdpa, SdpaCall
from fwdcheck.checks.short_row import short_row
from fwdcheck.errors import DoesNotApply, ModelRaised, ObservationFailed, SkipCheck
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.observe.masks import MASKED_BELOW
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.code_paths import CELL_LENGTH, LEFT_PADDING, CodePath, path_view
from fwdcheck.run.compare import logit_scale, position_change
from fwdcheck.run.session import Session
from fwdcheck.run.tolerances import TOLERANCES

# The SDPA kernels compared with the math kernel, by the names reports use.
KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
FLEX = "flex_attention"

# Tokens of the row whose SDPA calls are recorded for the kernels, when no forward of the implementations recorded
# them (the default path is SDPA's): a kernel that misreads a mask does so at any length of a few tokens, and a
# sliding window or chunk shows once the row is longer than it, so the row reaches past every declared one.
KERNEL_ROW = 16


def kernel_row_length(model: ModelUnderTest, session: Session) -> int:
    """The tokens of the row recorded for the kernels: KERNEL_ROW, longer than the widest window or chunk the model
    declares (by CELL_LENGTH keys a band or chunk drops), at least the session's shortest length, at most its own."""
    widest = model.windows.widest if model.windows is not None else None
    wanted = max(KERNEL_ROW, session.min_seq_len, (widest or 0) + CELL_LENGTH)
    return min(session.inputs.shape[1], wanted)


def switchable(model) -> tuple[list[str], str | None]:
    """The attention implementations the model can be switched between, the one it runs now first; or no list and
    why not. The switch is the model's capability (ModelUnderTest.attention): transformers' config._attn_implementation
    read, set_attn_implementation(name) called, on any model that offers them."""
    if model.attention is None:
        return [], (
            "the model has no attention switch (a Hugging Face-style config._attn_implementation and "
            "set_attn_implementation)"
        )
    return model.attention.ordered(), None


class Backends(Check, declared=SPEC):
    name = "backends"

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        findings: list[Finding] = []
        data: dict = {}
        metrics: dict = {}
        implementations = self._offered(model, session, data)
        recorder = RecordSdpa()
        padded = (
            model.accepts("attention_mask")
            and model.accepts("position_ids")
            and session.inputs.shape[1] > LEFT_PADDING + 1
        )
        compared: list[str] = []
        if len(implementations) >= 2:
            compared = self._implementations(model, session, implementations, padded, recorder, findings, data, metrics)
        calls = recorder.calls or self._default_path_calls(model, session, recorder)
        if model.attention is None and not calls:
            raise DoesNotApply(
                f"{data['implementations']}, and no scaled_dot_product_attention call to compare kernels on"
            )
        kernels = self._kernels(calls, session, findings, data, metrics)
        return self._summarise(compared, kernels, len(calls), findings, data, metrics)

    @staticmethod
    def _default_path_calls(model: ModelUnderTest, session: Session, recorder: RecordSdpa) -> list[SdpaCall]:
        """The SDPA calls of one short row on the default path, when no forward of the implementations recorded them
        (the default path is SDPA's): those of the short row other checks observe (short_row.py), unless a declared
        window or chunk needs a longer row (or the observer cannot follow the model), which then runs here."""
        length = kernel_row_length(model, session)
        if length == session.short_length:
            with suppress(ObservationFailed):  # the observer cannot follow the model: the row runs recorded alone
                return short_row(model, session).sdpa
        row = session.inputs[:1, :length]  # (1, L)
        try:
            with recorder:
                session.logits(row)
        except ModelRaised as exc:
            session.logits(row)  # untouched: the model's own error where it raises here too
            raise ObservationFailed(
                f"recording SDPA's calls broke a forward that runs untouched ({exc}): fwdcheck's failure, not the "
                "model's; please report it"
            ) from exc
        return recorder.calls

    def _offered(self, model: ModelUnderTest, session: Session, data: dict) -> list[str]:
        """The attention implementations to compare, the one the model runs now first: flex_attention only when
        asked for (data["flex_attention"] says so otherwise); data["implementations"] says why there are not two."""
        implementations, no_switch = switchable(model)
        if FLEX in implementations or getattr(model.module, "_supports_flex_attn", False):
            implementations = [i for i in implementations if i != FLEX]
            if self.options_in(session).flex and no_switch is None:
                implementations.append(FLEX)
            else:
                data["flex_attention"] = (
                    "flex_attention not run: it compiles its kernel on first use (tens of seconds on CPU); "
                    "`options: {backends: {flex: true}}` (or --exhaustive) includes it"
                )
        if len(implementations) < 2:
            data["implementations"] = no_switch or f"only {implementations[0]} is offered"
        return implementations

    def _summarise(
        self,
        compared: list[str],
        kernels: dict[str, int],
        sdpa_calls: int,
        findings: list[Finding],
        data: dict,
        metrics: dict,
    ) -> CheckResult:
        """What was compared and how far apart, the first failing code first; SkipCheck when neither two
        implementations nor two SDPA kernels ran."""
        ran = [k for k, n in kernels.items() if n]
        if len(compared) < 2 and len(ran) < 2:
            why = data["implementations"] if len(compared) < 2 else ""
            kernel_why = (
                "no scaled_dot_product_attention call"
                if not sdpa_calls
                else f"only the {', '.join(ran) or 'no'} kernel runs here"
            )
            raise SkipCheck(f"nothing to compare: {why}; {kernel_why}".lstrip("; "))
        bad = [f for f in findings if f.status != Status.PASS]
        said = []
        if len(compared) >= 2:
            padding = " and a left-padded row" if isinstance(data["implementations"].get("left_padding"), int) else ""
            said.append(
                f"{' vs '.join(compared)} on the first row{padding}: max change "
                f"{metrics['implementation_change']:.3g} (bar {metrics['implementation_bar']:.3g})"
            )
        else:
            said.append(f"implementations not compared: {data['implementations']}")
        if len(ran) >= 2:
            said.append(
                f"SDPA kernels {' vs '.join(ran)} on {sdpa_calls} calls: max change {metrics['kernel_change']:.3g}"
            )
        summary = (self.codes[bad[0].code] + "; " if bad else "") + "; ".join(said)
        data["kernels_ran"] = kernels
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def key_number(self, result: CheckResult) -> str:
        """The largest change between implementations against its bar, else the kernels' largest change."""
        m = result.metrics
        if "implementation_change" in m:
            return f"{m['implementation_change']:.2g} / {m['implementation_bar']:.2g}"
        return f"{m['kernel_change']:.2g}" if "kernel_change" in m else ""

    # -- implementations ---------------------------------------------------------------------------------------------

    def _implementations(self, model, session, implementations, padded, recorder, findings, data, metrics) -> list[str]:
        """Logits of every implementation against the default one's; the implementations that ran."""
        default = implementations[0]
        # One row at the session's length: a path that breaks only past some length shows (the code-path matrix's
        # cells run every implementation on several rows, at a few tokens). The default implementation's logits of
        # it are the observation pass's of the same row beside the others, which cost no forward, while every
        # implementation agrees with them within the bar; once one does not, the default runs the row alone,
        # untouched, and every implementation is judged against that.
        rows = session.inputs[:1]  # (1, T)
        base = session.reference()[:1]  # (1, T, V)
        plain, pads = self._run_each(model, session, implementations, rows, padded, recorder, base, data)
        ran = list(plain)
        rtol, atol = TOLERANCES[session.dtype].backends
        scale = logit_scale(base)
        changes = {i: position_change(plain[i], base) for i in ran if i != default}  # (1, T) each
        if any(float(c.max()) > atol + rtol * scale for c in changes.values()):
            base = plain[default] = session.logits(rows)  # the default path on the row alone, no observer
            scale = logit_scale(base)
            changes = {i: position_change(plain[i], base) for i in ran if i != default}
        pad_changes = {i: position_change(pads[i], pads[default]) for i in pads if i != default}  # (1, T - P)
        largest = max([float(c.max()) for c in [*changes.values(), *pad_changes.values()]], default=0.0)
        needs_noise = largest > atol + rtol * scale and session.noise_matters(largest, scale)
        bar = tolerance(session, scale, *(session.floors(largest, scale) if needs_noise else (0.0, 0.0)))
        metrics.update(implementation_change=largest, implementation_bar=bar)
        data["implementations"] = {
            "default": default,
            "compared": ran,
            "tokens": list(rows.shape),
            "left_padding": LEFT_PADDING
            if padded
            else "not compared: forward takes no attention_mask and position_ids",
        }
        data["changes"] = {i: float(c.max()) for i, c in changes.items()}
        data["padded_changes"] = {i: float(c.max()) for i, c in pad_changes.items()}
        findings += _implementations_apart(default, changes, pad_changes, bar, data)
        return ran

    @staticmethod
    def _run_each(
        model: ModelUnderTest,
        session: Session,
        implementations: list[str],
        rows: torch.Tensor,
        padded: bool,
        recorder: RecordSdpa,
        base: torch.Tensor,
        data: dict,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The logits of every implementation: of `rows` [1, T] (the default's are `base`), and, when `padded`, of
        the real tokens of a left-padded row. The first SDPA forward is recorded for the kernels.
        An implementation that cannot run here (flex_attention without a compiler) is noted in data["not_run"]."""
        default = implementations[0]
        # The left-padded row: P pads before the first row's first tokens, at most CELL_LENGTH of them. A path that
        # drops, inverts or misreads the padding mask does so at any length of a few tokens (fwdcheck.run.code_paths),
        # and a short row keeps this comparison a small fraction of a forward.
        view = path_view(model, CodePath(None, None, "left-pad", 1)) if padded else None
        T = session.inputs.shape[1]
        real = min(T - LEFT_PADDING, max(CELL_LENGTH, session.min_seq_len - LEFT_PADDING))
        row = session.inputs[:1, :real]  # run only when padded
        plain: dict[str, torch.Tensor] = {default: base}
        pads: dict[str, torch.Tensor] = {}
        skipped = {}
        for implementation in implementations:
            record = implementation == "sdpa" and not recorder.calls
            try:
                with model.using_attention(implementation if implementation != default else None):
                    if implementation != default:
                        with recorder if record and not padded else nullcontext():
                            plain[implementation] = session.logits(rows)  # (1, T, V)
                    if padded:
                        with recorder if record else nullcontext():
                            pads[implementation] = session.logits(row, model=view)  # (1, real, V): real tokens
            except Exception as exc:
                if implementation != FLEX:
                    raise  # an implementation the model offers must run: ModelRaised is the model's error
                skipped[implementation] = f"{type(exc).__name__}: {exc}"  # flex needs a compiler this may lack
                plain.pop(implementation, None)
                pads.pop(implementation, None)
        if skipped:
            data["not_run"] = skipped
        return plain, pads

    # -- SDPA kernels ----------------------------------------------------------------------------------------------

    def _kernels(self, calls: list[SdpaCall], session, findings, data, metrics) -> dict[str, int]:
        """Replay each recorded call under every kernel; {kernel: calls it ran}, math first."""
        ran = {"math": 0, **{name: 0 for name in KERNELS}}
        worst: dict[str, tuple[float, float, int]] = {}  # kernel -> (change, bar, call) of its worst call
        for index, call in enumerate(calls):
            arguments = {**call.arguments, "dropout_p": 0.0}  # eval: dropout is the session's business
            reference = _replay(arguments, SDPBackend.MATH)
            if reference is None:
                continue
            ran["math"] += 1
            rows = _rows_with_keys(arguments, reference.shape)  # (..., L): query rows that read some key
            scale = float(reference[rows].abs().max()) if bool(rows.any()) else 0.0
            rtol, atol = TOLERANCES[session.dtype].backends
            bar = max(atol + rtol * scale, session.tolerance(scale))
            for name, backend in KERNELS.items():
                output = _replay(arguments, backend)
                if output is None:
                    continue
                ran[name] += 1
                change = (output - reference).abs()[rows]  # the rows that read some key
                value = float(change.max()) if change.numel() else 0.0
                value = float("inf") if math.isnan(value) else value  # NaN never passes
                if value > worst.get(name, (-1.0,))[0]:
                    worst[name] = (value, bar, index)
        metrics["kernel_change"] = max((w[0] for w in worst.values()), default=0.0)
        data["kernel_changes"] = {name: {"change": w[0], "bar": w[1], "call": w[2]} for name, w in worst.items()}
        data["sdpa_calls"] = len(calls)
        for name, (value, bar, index) in worst.items():
            if value > bar:
                call = calls[index]
                q = call.arguments["query"]
                findings.append(
                    Finding(
                        "FWD803",
                        Status.FAIL,
                        f"SDPA's {name} kernel differs from the math kernel "
                        f"by {value:.3g} (bar {bar:.3g}) on call {index + 1} of {len(calls)} "
                        f"(q {list(q.shape)}, {str(q.dtype).removeprefix('torch.')}, mask "
                        f"{_mask_kind(call.arguments)})",
                        call.source,
                        source=call.source,
                    )
                )
        return ran


def _replay(arguments: dict, backend: SDPBackend) -> torch.Tensor | None:
    """The call's output under one kernel alone, as float64; None when the kernel cannot run it."""
    with warnings.catch_warnings(), sdpa_kernel([backend]), torch.no_grad():
        warnings.simplefilter("ignore")  # torch explains at length why a kernel does not apply
        try:
            return F.scaled_dot_product_attention(**arguments).double()
        except RuntimeError:
            return None


def _rows_with_keys(arguments: dict, shape: torch.Size) -> torch.Tensor:
    """(..., L) bool over the output's query rows: True where the mask leaves the query at least one key."""
    mask, L = arguments.get("attn_mask"), shape[-2]
    S = arguments["key"].shape[-2]
    allowed = torch.ones(L, S, dtype=torch.bool, device=arguments["query"].device)
    if arguments.get("is_causal"):
        allowed = allowed.tril()
    if mask is not None:
        may = mask if mask.dtype == torch.bool else torch.isfinite(mask) & (mask > MASKED_BELOW)
        allowed = allowed & may
    return allowed.any(-1).expand(*shape[:-2], L)


def _mask_kind(arguments: dict) -> str:
    mask = arguments.get("attn_mask")
    if mask is None:
        return "is_causal" if arguments.get("is_causal") else "none"
    return f"{str(mask.dtype).removeprefix('torch.')} {list(mask.shape)}"


def _implementations_apart(
    default: str, changes: dict[str, torch.Tensor], pad_changes: dict[str, torch.Tensor], bar: float, data: dict
) -> list[Finding]:
    """FWD801 for an implementation whose logits of the session's first row differ from the default's beyond the bar;
    FWD802 for one that differs only on the real tokens of the left-padded row (data["padded_also_differs"] when
    both do)."""
    findings = []
    for implementation, change in changes.items():
        if float(change.max()) > bar:
            findings.append(
                Finding(
                    "FWD801",
                    Status.FAIL,
                    _message(default, implementation, change, bar, "the session's first row"),
                    _where(change, bar),
                )
            )
    for implementation, change in pad_changes.items():
        if float(change.max()) > bar and not any(f.code == "FWD801" and implementation in f.message for f in findings):
            findings.append(
                Finding(
                    "FWD802",
                    Status.FAIL,
                    _message(
                        default,
                        implementation,
                        change,
                        bar,
                        f"the real tokens of a row left-padded by {LEFT_PADDING}",
                    ),
                    _where(change, bar, "real token"),
                )
            )
        elif float(change.max()) > bar:
            data["padded_also_differs"] = True
    return findings


def _message(default: str, other: str, change: torch.Tensor, bar: float, inputs: str) -> str:
    moved = int((change > bar).sum())
    return (
        f"{other} and {default} give logits that differ by {float(change.max()):.3g} (bar {bar:.3g}) at "
        f"{moved} of {change.numel()} positions of {inputs}"
    )


def _where(change: torch.Tensor, bar: float, unit: str = "position") -> str:
    """The largest change's row and position, and the first position over the bar: change is (rows, T)."""
    row, position = divmod(int(change.flatten().argmax()), change.shape[-1])
    first = int((change > bar).nonzero()[0, 1])
    return f"row {row} {unit} {position} (first over the bar: {unit} {first})"
