"""Session: what all checks of one run share. Device, dtype, inputs, tolerances, the cached baseline forward, the
cached observation pass, and the guard that leaves the model exactly as it was found.

Checks ask the session for forwards instead of calling the model, so the baseline is computed once, every forward runs
in eval mode without gradients (or, in a session of the train path, in train() mode with dropout zeroed and gradients
recorded: fwdcheck/run/train_path.py), and the model's state is restored however the run ends.

What a run costs is counted in forwards of the session's inputs, and the session keeps it low: the observation pass's
logits can stand in for the baseline (`reference()`, until a comparison against them moves), the noise floor and
the model's rounding (fwdcheck/run/rounding.py) are measured only when a change could need them, rows go through the
model in forwards no larger than the baseline's, and a short prefix of the first sample is run once for every check
that compares at a short length (`prefix_logits`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from fwdcheck.errors import DeviceError, ModelRaised, ObservationFailed, UsageError, first_line
from fwdcheck.model.library_logs import kept_as_notes
from fwdcheck.model.tested import ModelUnderTest, model_code
from fwdcheck.observe.dropouts import RandomDraws
from fwdcheck.observe.observer import ZeroAttentionDropout, compiled_eagerly, observing
from fwdcheck.observe.records import Observation

# position_change, nonfinite_positions and logit_scale are documented for checks here (docs/writing-checks.md): they
# live in fwdcheck/run/compare.py, as do the settings and the model's state in settings.py and model_state.py.
from fwdcheck.run.compare import logit_scale, nonfinite_positions, position_change  # noqa: F401
from fwdcheck.run.model_state import GlobalState, KeptBuffers, ModelState
from fwdcheck.run.rounding import ROUNDING_FACTOR, float64_twin, rounding_bound
from fwdcheck.run.settings import DTYPES, Settings, own_dtype, resolve_device
from fwdcheck.run.tolerances import TOLERANCES
from fwdcheck.run.train_path import eval_path, gradients_or_not

SHORT_LENGTH = 16  # tokens of the short forwards checks share (session.short_length)


class Session:
    def __init__(
        self, model: ModelUnderTest, settings: Settings, train: bool = False, inputs: torch.Tensor | None = None
    ):
        """`inputs`: the token ids [B, T] the session's checks start from, when given (else drawn from the seed at
        inputs.batch_size x inputs.seq_len)."""
        self.model = model
        self.settings = settings
        # The train path: every forward in train() mode, dropout zeroed, gradients recorded while the model can
        # record them (`gradients_refused` says why not, once a forward with them raised and one without ran).
        self.train = train
        self.gradients_refused: str | None = None
        self.device, device_note = resolve_device("meta" if settings.meta else settings.device)
        self.dtype = DTYPES[settings.dtype]
        self.notes: list[str] = [device_note] if device_note else []
        if settings.inputs.seq_len > (model.max_positions or settings.inputs.seq_len):
            raise UsageError(
                f"inputs.seq_len {settings.inputs.seq_len} exceeds the model's maximum positions {model.max_positions}"
            )
        rtol, atol = TOLERANCES[self.dtype].logits
        self.rtol = settings.tolerance.rtol if settings.tolerance.rtol is not None else rtol
        self.atol = settings.tolerance.atol if settings.tolerance.atol is not None else atol
        # Rows per forward: no more than the baseline runs, so that no forward of a check needs more memory than the
        # model's own forward of the session's inputs (two for batch size 1: a row beside another is what shows
        # samples reading each other).
        self.max_rows = settings.max_rows or max(settings.inputs.batch_size, 2)
        self.force_zero_dropout = False  # set when the observation pass saw dropout live in eval mode
        self._generator = torch.Generator().manual_seed(settings.inputs.seed)
        B, T = settings.inputs.batch_size, settings.inputs.seq_len
        try:
            self.inputs = self.random_ids((B, T)) if inputs is None else inputs.to(self.device)
        except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:  # sizes torch cannot allocate
            raise UsageError(
                f"inputs: batch_size {B} x seq_len {T} token ids cannot be allocated "
                f"({type(exc).__name__}: {first_line(exc)})"
            ) from None
        self._cache: dict[str, object] = {}  # baseline, repeat, observation: computed once, shared by all checks
        self._observed: torch.Tensor | None = None  # the observation pass's logits, while they may stand in
        self.forward_tokens = 0  # rows x positions run, for benchmarks
        self.refused_lengths: set[int] = set()  # lengths the model raised at while a longer one ran (found out)
        self.unpadded: ModelUnderTest | None = None  # for a left-padded path view: the same path without padding
        # Rows of the short length run alone, untouched, with their logits [1, L, V] (row_logits): the eval path's
        # logits on those tokens, which the train path's cell may be held to without running them again.
        self.ran_alone: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._moved = self._cast = False  # whether active() put the model on the device or dtype as a copy
        # The train path: the buffers as its first forward found them, put back after every forward (_run)
        self._kept: KeptBuffers | None = None

    # -- lifetime -------------------------------------------------------------------------------------------------

    @contextmanager
    def active(self) -> Iterator[Session]:
        """Eval mode (train mode for the train path), nn.Dropout at p=0, the model on the session's device and dtype;
        the model (ModelState) and the process's settings (GlobalState) put back on exit, and what the model's library
        logs meanwhile kept as notes."""
        module = self.model.module
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        state = ModelState.take(module)
        process = GlobalState.take()
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.callback(lambda: self.notes.extend(process.restore()))
            stack.callback(lambda: self._restore(state))
            stack.enter_context(kept_as_notes(self.model.library_loggers, self.notes))
            # torch.compile'd model code (compiled at import, as torchtitan compiles flex_attention and
            # create_block_mask) runs eagerly in every check: the same math, without a compile for every new shape
            # (206 s for a first CPU forward); the compile check compiles on purpose (compiled_as_compiled)
            stack.enter_context(compiled_eagerly())
            # eval() runs model code too (an overridden train()): what it raises is the model's error
            with model_code("the model cannot be put in eval mode:"):
                module.eval()
            if self.train:
                with model_code("the model cannot be put in train mode:"):
                    module.train()
            state.zero_dropout()
            self._place(module)
            self.inputs = self.inputs.to(self.device)
            yield self

    def _restore(self, state: ModelState) -> None:
        written = state.restore()
        if written:
            shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
            self.notes.append(
                f"the forward wrote buffer{'s' if len(written) > 1 else ''} {shown} in place (where "
                "models keep caches and counters); the contents were put back as found"
            )

    def _place(self, module: nn.Module) -> None:
        tensors = [*module.parameters(), *module.buffers()]
        needs_move = any(t.device != self.device for t in tensors)
        # no dtype named: a model in dtypes fwdcheck runs in runs as it was handed over, its float32 buffers (rotary
        # tables) included (Settings.in_own_dtype chose the tolerances)
        as_handed_over = not self.settings.dtype_declared and own_dtype(module) is not None
        needs_cast = not as_handed_over and any(t.is_floating_point() and t.dtype != self.dtype for t in tensors)
        self._moved, self._cast = needs_move, needs_cast
        if not (needs_move or needs_cast):
            return
        try:
            module.to(device=self.device, dtype=self.dtype if needs_cast else None)
        except (RuntimeError, TypeError) as exc:
            raise DeviceError(f"cannot put the model on {self.device} as {self.settings.dtype}: {exc}") from None
        if needs_cast:
            self.notes.append(f"model cast to {self.settings.dtype} for the run (restored afterwards)")

    def runs_on_copy(self, tensor: torch.Tensor) -> bool:
        """Whether the run works on a copy of this tensor of the model (moved to the session's device or cast to its
        dtype), the model's own tensor left untouched by whatever the forward writes."""
        return self._moved or (self._cast and tensor.is_floating_point())

    # -- forwards -------------------------------------------------------------------------------------------------

    def logits(
        self, ids: torch.Tensor, position_ids: torch.Tensor | None = None, model: ModelUnderTest | None = None
    ) -> torch.Tensor:
        """Logits [N, T, V] as float32, in row chunks of at most max_rows, dropout forced off where needed."""
        model = model or self.model
        chunks = []
        for start in range(0, ids.shape[0], self.max_rows):
            rows = ids[start : start + self.max_rows]
            positions = position_ids[start : start + self.max_rows] if position_ids is not None else None
            chunks.append(self._forward(rows, positions, model))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def output(self, ids: torch.Tensor, **kwargs: Any) -> Any:
        """The model's raw output for ids [N, T] with keyword arguments of its own (labels, document ids, a 4-D mask;
        ModelUnderTest.call): one forward of all N rows together (a loss is over the whole batch), as the session's path
        runs forwards (_run), model exceptions as ModelRaised."""
        output = self._run(lambda: self.model.call(ids, **kwargs))
        self.forward_tokens += ids.numel()
        return output

    def changes(self, ids: torch.Tensor, reference: torch.Tensor, against: list[int]) -> torch.Tensor:
        """Per row and position, the largest |change| of the logits of `ids` [N, T] from reference[against[i]]
        (position_change of every row), inf where either is not finite.

        The rows run in forwards of at most max_rows, and each forward's logits are reduced as they come back: the
        [N, T, V] logits of all rows, several times the baseline's when the vocabulary is large, are never held.
        A row left over alone runs beside a row of the session's inputs, whose logits are dropped: one row alone
        is a code path of its own (batch size 1), not for rows meant to run beside others, as every row is but the
        one of a session of one row."""
        N = ids.shape[0]
        out = []
        for start in range(0, N, self.max_rows):
            rows = ids[start : start + self.max_rows]
            if len(rows) == 1 and (N > 1 or self.inputs.shape[0] > 1):
                rows = torch.cat([rows, self.inputs[:1]])
            logits = self._forward(rows, None, self.model)  # (n, T, V)
            out += [
                position_change(logits[i], reference[against[start + i]]) for i in range(min(self.max_rows, N - start))
            ]
            del logits
        return torch.stack(out)  # (N, T)

    def row_counts(self, n: int) -> list[int]:
        """The row counts of the forwards changes() runs for n rows."""
        counts = [min(self.max_rows, n - start) for start in range(0, n, self.max_rows)]
        return [max(c, 2) if n > 1 or self.inputs.shape[0] > 1 else c for c in counts]

    def _forward(self, rows: torch.Tensor, positions: torch.Tensor | None, model: ModelUnderTest) -> torch.Tensor:
        logits = self._run(lambda: model.logits(rows, positions).float())
        self.forward_tokens += rows.numel()
        return logits

    def _run(self, forward):
        """forward() as the session's path runs it: without gradients, dropout forced off where needed; on the train
        path with gradients and dropout zeroed, and, when the model raises with gradients but runs without them
        (a kernel without a backward), from then on without them (`gradients_refused` says why)."""
        if not self.train:
            with torch.no_grad(), ZeroAttentionDropout() if self.force_zero_dropout else nullcontext():
                return forward()
        # What a train-mode forward updates as it runs (spectral norm's vectors, BatchNorm's running statistics, a
        # step counter) is put back after each one: every forward of the path starts from the same model, and two
        # identical forwards differ only by randomness.
        kept = self._kept = self._kept or KeptBuffers(self.model.module)

        def from_the_model_as_found():  # a try with gradients that raised may have written some of it
            kept.put_back()
            return forward()

        try:
            with ZeroAttentionDropout():
                if self.gradients_refused is None:
                    result, self.gradients_refused = gradients_or_not(from_the_model_as_found)
                    return result
                with torch.no_grad():
                    return forward()
        finally:
            kept.put_back()

    @property
    def updated_state(self) -> set[str]:
        """The buffers (dotted names) the train path's forwards wrote as they ran, each put back after it: state
        the model updates as it trains (spectral norm's vectors, running statistics, a step counter)."""
        return self._kept.updated if self._kept is not None else set()

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Inside, a train path's session runs its forwards in eval mode without gradients (dropout zeroed): the
        logits the train path must reproduce. Outside a train path, nothing changes."""
        if not self.train:
            yield
            return
        self.train = False
        try:
            with eval_path(self.model.module):
                yield
        finally:
            self.train = True

    def eval_logits(self) -> torch.Tensor:
        """The train path's session inputs' logits [B, T, V] in eval mode (computed once); the reference itself
        outside a train path."""
        if not self.train:
            return self.reference()

        def compute():
            with self.evaluating():
                return self.logits(self.inputs)

        return self._once("eval", compute)

    def shared(self, key: str, compute):
        """A pass several checks share (fwdcheck/checks/short_row.py), computed by the first that asks; every later
        call gets its value, or what the model raised on it, again."""
        return self._once(f"shared: {key}", compute)

    def _once(self, key: str, compute):
        """compute() on the first call; every later call gets its value, or the ModelRaised (or ObservationFailed)
        it raised, again."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except (ModelRaised, ObservationFailed) as exc:
                self._cache[key] = exc
        value = self._cache[key]
        if isinstance(value, (ModelRaised, ObservationFailed)):
            raise value
        return value

    def baseline(self) -> torch.Tensor:
        """Logits of the session's inputs from the untouched model, computed once and shared by every check."""

        def compute():
            # First learn whether dropout is live in eval: then every comparison runs with it forced off. ModelRaised:
            # the observer cannot follow this model; the plain forward below says whether it runs at all.
            with suppress(ModelRaised, ObservationFailed):
                self.observation()
            logits = self.logits(self.inputs)
            self._observed = None  # from now on the untouched logits are the reference
            return logits

        return self._once("baseline", compute)

    def reference(self) -> torch.Tensor:
        """The logits of the session's inputs that comparisons start from: the untouched baseline once it has been
        computed, before that the observation pass's logits of the same inputs when the pass saw nothing that makes
        them differ on purpose (dropout live in eval), else the baseline, computed now.

        Observed logits save a forward but ran under the observer, which can change code paths (torch's
        TransformerEncoder fast path). A check that compares untouched forwards against them is still sound when
        every comparison stays within tolerance: each compared position of an untouched forward then agrees with
        logits computed without the tokens that forward changed. On any change beyond the tolerance it must ask for
        `baseline()` and judge against that (`reference_untouched` says which one it got)."""
        if "baseline" not in self._cache:
            with suppress(ModelRaised, ObservationFailed):
                self.observation()
            if self._observed is not None:
                return self._observed
        return self.baseline()

    def change_from_reference(self, logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Per row and position, the largest change of `logits` [B, T, V] (of the session's inputs, another way)
        from the reference's, and the reference's logit scale: against the untouched baseline once a change goes
        beyond what can pass unexamined (see reference())."""
        reference = self.reference()  # (B, T, V)
        scale = logit_scale(reference)
        change = position_change(logits, reference)  # (B, T)
        if self.noise_matters(float(change.max()), scale) and not self.reference_untouched:
            reference = self.baseline()
            scale = logit_scale(reference)
            change = position_change(logits, reference)
        return change, scale

    @property
    def reference_untouched(self) -> bool:
        """Whether reference() is the untouched baseline."""
        return "baseline" in self._cache or self._observed is None

    @property
    def observed_logits(self) -> torch.Tensor | None:
        """The observation pass's logits while they stand in for the baseline (see reference()); None before the
        pass, after the baseline replaced them, or when the pass saw dropout live in eval."""
        return self._observed

    def repeat_change(self) -> float:
        """Largest |change| of the logits when the identical input runs again: 0 for a deterministic model.
        Two untouched forwards (the baseline, if not yet computed, and the repeat); only the number is kept."""

        def compute():
            baseline = self.baseline()
            return float(self.changes(self.inputs, baseline, list(range(baseline.shape[0]))).max())

        return self._once("repeat", compute)

    def rounding_change(self) -> float:
        """Largest |change| of the logits of the session's inputs between the run's dtype and a float64 twin of the
        model (fwdcheck/run/rounding.py): what any reordering of the forward's arithmetic may move them by. 0.0, with a
        note saying why, when no twin can run: the tolerance and the run-to-run noise then stand alone."""

        def compute():
            baseline = self.baseline()
            twin = float64_twin(self.model, self.device)
            if isinstance(twin, str):
                self.notes.append(f"rounding not measured: {twin}")
                return 0.0
            try:  # what the model makes as it runs, in the twin's precision
                exact = self._twin_logits(twin, torch.float64)
            except ModelRaised as exc:
                self.notes.append(f"rounding not measured: the model does not run in float64 ({first_line(exc)})")
                return 0.0
            change = float(position_change(baseline, exact).max())
            if not math.isfinite(change):  # the twin overflowed or broke where the model did not: no measurement
                self.notes.append("rounding not measured: the float64 twin's logits are not finite")
                return 0.0
            scale = logit_scale(baseline)
            dtypes = {baseline.dtype, *(p.dtype for p in self.model.module.parameters() if p.is_floating_point())}
            bound = rounding_bound(scale, *dtypes)
            if change <= bound:
                return change
            # Tensors the model draws in the default dtype (torch.randn) come out otherwise in float64: the twin
            # again with the default dtype as the run has it draws the run's own values.
            try:
                again = float(position_change(baseline, self._twin_logits(twin, torch.get_default_dtype())).max())
            except ModelRaised:
                again = math.inf
            if again <= bound:
                self.notes.append(
                    "rounding measured with torch's default dtype left as the run's: with it at float64 the twin "
                    f"drew other random tensors than the run (its logits {change:.3g} away)"
                )
                return again
            self.notes.append(
                f"rounding not used: the float64 twin's logits differ from the run's by {change:.3g}, "
                f"{change / scale:.2g} of the logits' scale, more than rounding can be ({bound:.3g}): the twin "
                "computed something else (an input that changes from call to call, a tensor built in the default "
                "dtype), so it raises no threshold"
            )
            return 0.0

        return self._once("rounding", compute)

    def _twin_logits(self, twin: ModelUnderTest, default: torch.dtype) -> torch.Tensor:
        """The float64 twin's logits of the session's inputs, run with torch's default dtype set to `default`."""
        before = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            return self.logits(self.inputs, model=twin)
        finally:
            torch.set_default_dtype(before)

    def floors(self, largest_change: float, scale: float) -> tuple[float, float]:
        """(run-to-run noise, rounding) for judging changes up to `largest_change`: measured only when they could
        change a verdict (noise_matters), else 0.0 each."""
        if not self.noise_matters(largest_change, scale):
            return 0.0, 0.0
        return self.repeat_change(), self.rounding_change()

    def noise_matters(self, largest_change: float, scale: float) -> bool:
        """Whether the noise floor, not yet measured, could change a verdict given the largest change seen among
        forwards whose compared positions read the same tokens.

        The threshold is max(tolerance, noise_factor x noise): below the tolerance nothing is a finding whatever
        the noise. The noise floor also has findings of its own, non-determinism (noise over the tolerance) and
        coarse comparisons (noise_factor x noise over 10 x the tolerance); those forwards are draws of the same
        noise as an identical repeat, so a noise floor that could matter shows among them first."""
        tolerance = self.tolerance(scale)
        factor = self.settings.tolerance.noise_factor
        return not largest_change <= tolerance * min(1.0, 10.0 / factor)  # NaN matters too

    def prefix_logits(self, length: int) -> torch.Tensor:
        """Logits [1, length, V] of the first sample's first `length` tokens run alone. Those of `short_length`,
        the one length several checks compare at, are computed once (a refusal too); other lengths each time."""

        if length != self.short_length:
            return self.logits(self.inputs[:1, :length])
        return self._once(f"prefix {length}", lambda: self.row_logits(self.inputs[0, :length]))

    def row_logits(self, row: torch.Tensor) -> torch.Tensor:
        """Logits [1, L, V] of one row [L] run alone. Rows of the short length run untouched on the eval path are
        kept with their logits (`ran_alone`)."""
        logits = self.logits(row[None])
        known = any(torch.equal(row, other) for other, _ in self.ran_alone)
        if not self.train and len(row) == self.short_length and not known:
            self.ran_alone.append((row, logits))
        return logits

    def observation(self) -> Observation:
        """The observation pass over the session's inputs, run once. Its logits are kept as the reference
        (see reference()) unless the pass saw dropout live in eval mode: those logits are dice, and every comparison
        then runs with dropout forced off."""

        def compute():
            seen, logits = self._observe(self.inputs, None, False, frozenset())
            self.force_zero_dropout = bool(seen.active_dropout)
            if not self.force_zero_dropout and "baseline" not in self._cache:
                self._observed = logits.float()
            return seen

        return self._once("observation", compute)

    def observe(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        keep_tensors: bool = False,
        keep_inputs_of: Collection[str] = frozenset(),
        under: TorchFunctionMode | None = None,
    ) -> Observation:
        """One forward under the attention observer. Its logits are dropped (the mode can change code paths): it
        tells what the model did, not what it computes untouched. Only the session's own observation pass keeps
        them, as a reference that stands while untouched forwards agree with it (see reference()). `under`: a
        torch function mode of a check's own the forward runs under too, outside the observer (RecordSdpa); what
        raises under either is the observation's doing when the forward runs untouched. Eval path only: a train
        path's forward that raises with gradients runs again without them, and the mode would see both."""
        assert under is None or not self.train, "observe(under=...) runs on the eval path"
        return self._observe(ids, position_ids, keep_tensors, keep_inputs_of, under)[0]

    def _observe(self, ids, position_ids, keep_tensors, keep_inputs_of, under=None) -> tuple[Observation, torch.Tensor]:
        seq_len = ids.shape[1] + self.model.padding + self.model.held_prefix  # what the module itself sees

        def observed() -> tuple[Observation, torch.Tensor]:
            # on the train path dropout is zeroed inside the observer, which sees the calls as they then run
            with (
                under if under is not None else nullcontext(),
                observing(self.model.module, seq_len, keep_tensors, False, keep_inputs_of, tokens=ids) as seen,
                ZeroAttentionDropout() if self.train else nullcontext(),
            ):
                logits = self.model.logits(ids, position_ids)
            return seen, logits

        try:
            seen, logits = self._run(observed) if self.train else self._without_gradients(observed)
        except ModelRaised as exc:
            # Observed, the model runs under a torch function mode and hooks. If it runs untouched, what raised is
            # the observation, not the model: that is never reported as the model's error.
            # the same forward, all rows at once: raises the model's own error if it fails too
            self._run(lambda: self.model.logits(ids, position_ids))
            raise ObservationFailed(
                f"fwdcheck's observation pass broke a forward that runs untouched ({exc}): fwdcheck's failure, "
                "not the model's; please report it"
            ) from exc
        self.forward_tokens += ids.numel()
        return seen, logits

    def random_draws(self) -> list[tuple[str, str | None]]:
        """The random draws the model makes itself in one forward of the session's first row on the session's path
        (torch.rand_like, Tensor.bernoulli_, ...: (function, 'path:line') of each call site), which no zeroing of
        dropout turns off; [] when it makes none, or cannot run so observed. Computed once."""

        def compute() -> list[tuple[str, str | None]]:
            draws = RandomDraws()
            with draws:
                self._run(lambda: self.model.logits(self.inputs[:1]))
            return draws.seen

        try:
            return self._once("random draws", compute)
        except (ModelRaised, ObservationFailed):
            return []

    @staticmethod
    def _without_gradients(observed):
        """The eval path's observation pass: without gradients, dropout as the model has it (the pass is what tells
        whether dropout is live in eval)."""
        with torch.no_grad():
            return observed()

    # -- sequence lengths -------------------------------------------------------------------------------------------

    @property
    def min_seq_len(self) -> int:
        """The shortest sequence a check may hand the model: inputs.min_seq_len when declared, raised past every
        length the model was seen to refuse while a longer one ran; 1 when nothing says otherwise. Checks that run
        shorter forwards than the baseline (a probe at another T, a prefix) start here."""
        found = max(self.refused_lengths, default=0) + 1
        return max(self.settings.inputs.min_seq_len or 1, found)

    @property
    def short_length(self) -> int:
        """The length of the short forwards checks share (rope's position shift, mask-audit's batch-size-1 pass, one
        rung of future-token's prefix ladder): 16 tokens, enough for chunked or windowed attention to show, never
        more than seq_len nor less than the model accepts."""
        return min(self.inputs.shape[1], max(SHORT_LENGTH, self.min_seq_len))

    def refused_length(self, length: int) -> None:
        """Record that the model raised at this sequence length while a longer one ran: code that asserts T > 1
        refuses T = 1 and nothing else, and the checks after should not try it again."""
        if length < self.inputs.shape[1]:
            self.refused_lengths.add(length)

    # -- inputs and tolerances --------------------------------------------------------------------------------------

    def random_ids(self, shape: tuple[int, ...], differ_from: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids drawn from the session's own generator; with differ_from, every id differs from it."""
        vocab = self.model.vocab_size
        if differ_from is None:
            ids = torch.randint(0, vocab, shape, generator=self._generator, device="cpu")
        else:
            shift = torch.randint(1, max(vocab, 2), tuple(differ_from.shape), generator=self._generator, device="cpu")
            ids = (differ_from.cpu() + shift) % vocab
        return ids.to(self.device if hasattr(self, "device") else "cpu")

    def tolerance(self, scale: float) -> float:
        """The dtype's tolerance for logits of this magnitude: atol + rtol * max|logit|."""
        return self.atol + self.rtol * scale

    def threshold(self, scale: float, noise_floor: float, rounding: float = 0.0) -> float:
        """A change counts when it exceeds the dtype tolerance, noise_factor times the measured run-to-run noise, and
        ROUNDING_FACTOR times the model's measured rounding (rounding_change)."""
        factor = self.settings.tolerance.noise_factor
        return max(self.tolerance(scale), factor * noise_floor, ROUNDING_FACTOR * rounding)

    @property
    def baseline_tokens(self) -> int:
        return self.inputs.numel()


def prefix_lengths(T: int, shortest: int = 1, longest: int = SHORT_LENGTH) -> list[int]:
    """The prefix ladder: k = 1 (the one-token path many models special-case for decoding), 2 (the shortest with a
    past) and `longest` (the short length other checks share, so the rung costs them nothing), none above T/4
    (future-token's cuts cover T/2 and T-1) nor below the shortest length the model accepts, which joins the
    ladder itself; when that is longer than T/4, the shortest length alone, if it is still a prefix.

    A length-dependent bug (a mask or position table built for another length, a bias counted from the end) shows
    at any prefix: each rung is a forward whose fixed cost, reading every weight, dwarfs its tokens', so the ladder
    keeps the lengths that are code paths of their own rather than every power of two."""
    rungs = sorted({k for k in (1, 2, longest, shortest) if shortest <= k <= max(T // 4, 1)})
    return rungs or ([shortest] if shortest < T else [])
