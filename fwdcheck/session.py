"""Session: what all checks of one run share. Device, dtype, inputs, tolerances, the cached baseline forward, the
cached observation pass, and the guard that leaves the model exactly as it was found.

Checks ask the session for forwards instead of calling the model, so the baseline is computed once, every forward runs
in eval mode without gradients, and the model's state is restored however the run ends.

What a run costs is counted in forwards of the session's inputs, and the session keeps it low: the observation pass's
logits can stand in for the baseline (`reference()`, until a comparison against them moves), the noise floor is
measured only when asked, rows go through the model in forwards no larger than the baseline's, and a short prefix of
the first sample is run once for every check that compares at a short length (`prefix_logits`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals
from torch.nn.modules.dropout import _DropoutNd

from fwdcheck.config import RunConfig
from fwdcheck.errors import DeviceError, ModelRaised, UsageError, first_line
from fwdcheck.library_logs import kept_as_notes
from fwdcheck.model import ModelUnderTest, describe, model_failure, model_frame
from fwdcheck.observe import Observation, ZeroAttentionDropout, observing
from fwdcheck.overrides import Overrides
from fwdcheck.registry import check_options, selected
from fwdcheck.tolerances import TOLERANCES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SHORT_LENGTH = 16  # tokens of the short forwards checks share (session.short_length)
# Elements of one [.., V] difference computed at once by position_change: a slice of the vocabulary at a time, so that
# comparing logits needs a few MB beside them instead of another copy of them.
DIFFERENCE_BLOCK = 1 << 20


class Settings(RunConfig):
    """How one run checks the model: the config's run section with the caller's Overrides applied, and what only a
    run knows. The command line's worker, the pytest plugin and the Python API build it the same way
    (fwdcheck.runner.Run); a cell of the code-path matrix derives its own from it (code_paths.cell_settings)."""

    expect_ledger: dict | None = None  # a saved shape ledger the shape-ledger check compares with
    expect_golden: dict | None = None  # a golden file the golden check compares with
    max_rows: int | None = None  # rows per forward; default the baseline's batch size (at least 2)
    check_options: dict[str, Any] = {}  # check name -> its options, validated (Check.options_in)

    @classmethod
    def from_config(cls, config: RunConfig, overrides: Overrides | None = None) -> Settings:
        overrides = overrides or Overrides()
        run = overrides.applied(config)
        entries = selected(run.checks, run.distributed.nproc)
        return cls(**{name: getattr(run, name) for name in RunConfig.model_fields},
                   expect_ledger=overrides.expect_ledger, expect_golden=overrides.expect_golden,
                   check_options=check_options(run.options, overrides.options or {}, entries))

    @property
    def ignored(self) -> dict[str, str]:
        """Finding code -> the config's reason for ignoring it."""
        return {i.code: i.reason for i in self.ignore}


def resolve_device(requested: str) -> tuple[torch.device, str | None]:
    """The device to run on, and a note when the choice was not literally what was asked."""
    if requested == "meta":
        return torch.device("meta"), "meta device: shapes only, no weights allocated"
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "device auto: CUDA is available, using cuda"
        return torch.device("cpu"), "device auto: no CUDA device found, using cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"device '{requested}' requested but torch {torch.__version__} sees no CUDA device; "
                          "use `--device cpu` or `--device auto`")
    try:
        return torch.device(requested), None
    except RuntimeError as exc:
        raise DeviceError(f"device '{requested}' is not a valid torch device ({exc})") from None


@dataclass
class ModelState:
    """Everything a run may touch on the model, taken before and put back after.

    Tensors go back by object: `.to()` swaps a parameter's `.data` and reassigns buffers, and the originals are kept.
    A forward may also write its tensors in place. Buffers are where models keep what they legitimately write (a KV
    cache, a step counter) and are small beside the weights, so their contents are copied and written back.
    Parameters are not copied (that would double the model's memory): `ParameterWatch` tells which ones a forward
    wrote. Hooks and attributes the model adds to its own modules during the run (transformers installs
    output-capturing hooks the first time `output_attentions` is asked for, and marks the model as hooked) are
    removed, so that a second run finds the model as the first one did."""

    training: dict[nn.Module, bool] = field(default_factory=dict)
    dropout_p: dict[_DropoutNd, float] = field(default_factory=dict)
    # (owner, kind, name, original data, the .grad tensor, its original data)
    tensors: list[tuple[nn.Module, str, str, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list)
    buffer_contents: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (name, buffer, copy)
    parameters: dict[tuple[nn.Module, str], nn.Parameter] = field(default_factory=dict)  # the objects themselves
    hooks: list[tuple[dict, dict]] = field(default_factory=list)  # (a module's hook dict, a copy of its entries)
    attributes: dict[nn.Module, set[str]] = field(default_factory=dict)  # each module's attribute names

    @classmethod
    def take(cls, model: nn.Module) -> ModelState:
        state = cls()
        for module in model.modules():
            state.training[module] = module.training
            if isinstance(module, _DropoutNd):
                state.dropout_p[module] = module.p
            for name, p in module._parameters.items():
                if p is not None:
                    grad = p.grad
                    state.tensors.append((module, "param", name, p.data, grad, grad.data if grad is not None else None))
                    state.parameters[module, name] = p
            for name, b in module._buffers.items():
                if b is not None:
                    state.tensors.append((module, "buffer", name, b, None, None))
            # _forward_hooks, _forward_pre_hooks, their with_kwargs and always_called companions, backward and
            # state-dict hooks: every dict of hooks a module keeps, whatever this torch version names them
            state.hooks += [(hooks, hooks.copy()) for key, hooks in vars(module).items()
                            if "_hooks" in key and isinstance(hooks, dict)]
            state.attributes[module] = set(vars(module))
        state.buffer_contents = [(name, b, b.clone()) for name, b in model.named_buffers() if readable(b)]
        return state

    def restore(self) -> list[str]:
        """Put everything back; the names of the buffers whose contents the run had written in place."""
        for hooks, entries in self.hooks:
            if hooks != entries:
                hooks.clear()
                hooks.update(entries)
        for module, names in self.attributes.items():
            for added in set(vars(module)) - names:
                delattr(module, added)
        for module, kind, name, original, grad, grad_data in self.tensors:
            if kind == "param":
                # A move to another kind of tensor (the meta device) replaced the Parameter object: put it back.
                param = module._parameters[name] = self.parameters[module, name]
                param.data = original  # .to() swapped .data (of the grad too); the original storages are intact
                if grad is not None:
                    assert grad_data is not None  # taken with the grad
                    grad.data = grad_data
                param.grad = grad
            else:
                module._buffers[name] = original
        written = []
        for name, buffer, contents in self.buffer_contents:
            if not same_bytes(buffer, contents):
                written.append(name)
                with torch.no_grad():
                    if buffer.shape == contents.shape:
                        buffer.copy_(contents)  # into its own storage, where the model and its views find it
                    else:  # resized in place
                        buffer.set_(contents)  # type: ignore[call-overload]  # documented; the stubs list storages only
        for module, p in self.dropout_p.items():
            module.p = p
        for module, training in self.training.items():
            module.training = training
        return written


def readable(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes can be read: it has values (not on the meta device) in ordinary strided memory."""
    return tensor.device.type != "meta" and tensor.layout == torch.strided and not tensor.is_quantized


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal says NaN differs from itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes. A sharded tensor's (a DTensor, in a distributed run) are those of the whole tensor,
    gathered from every rank (which reads them at the same point): FSDP2 swaps a module's sharded parameters for the
    gathered ones around a forward, and the same values must read the same."""
    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return whole.detach().reshape(-1).view(torch.uint8)  # reshape copies only a tensor that is not contiguous


# 64-bit words per block of a fingerprint's position-weighted sum: 2 KiB, as fast to sum as the whole tensor at once.
FINGERPRINT_BLOCK = 256


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 that change when any byte of the tensor changes: the sum of its bytes read as 64-bit words, and the
    sum of its blocks of words each weighted by its position, so that values moved elsewhere show too. Integer sums
    wrap around: exact, and the same whatever order the reduction takes. One read of the tensor, at the speed of a
    plain sum; a rearrangement of words inside one 2 KiB block, which no arithmetic write makes, is what it misses."""
    data = _bytes(tensor)
    try:
        words = data.view(torch.int64)
    except RuntimeError:  # a size or an offset that is not a multiple of 8 bytes: byte by byte
        words = data.long()
    whole = len(words) // FINGERPRINT_BLOCK * FINGERPRINT_BLOCK
    sums = torch.cat([words[:whole].view(-1, FINGERPRINT_BLOCK).sum(1), words[whole:]])  # (blocks + rest,)
    positions = torch.arange(1, len(sums) + 1, device=sums.device)
    return torch.stack([sums.sum(), (sums * positions).sum()])


class ParameterWatch:
    """Which parameters a forward wrote in place. A forward in eval mode has no reason to change the model's weights,
    and every forward after such a write runs a different model than the one checked. Copies of the parameters would
    double the model's memory, so each one is held as its fingerprint; reading them all costs about what a forward
    spends reading the weights."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.prints = self._take()

    def written(self) -> list[str]:
        """The parameters whose contents changed since the watch began or was last asked."""
        now = self._take()
        changed = [name for name, now_print in now.items() if self.prints.get(name, now_print) != now_print]
        self.prints = now
        return changed

    def _take(self) -> dict[str, tuple[int, int]]:
        named = [(name, p) for name, p in self.module.named_parameters() if readable(p)]
        if not named:
            return {}
        prints = torch.stack([fingerprint(p).cpu() for _, p in named]).tolist()
        return {name: tuple(values) for (name, _), values in zip(named, prints, strict=True)}


def _switches() -> list[tuple[str, Callable[[], Any], Callable[[Any], object]]]:
    """(name, read, set) of the process-wide settings model code is known to flip: TF32 and matmul precision,
    cuDNN's, the thread count, deterministic algorithms, grad mode, the default dtype and device, the SDPA backends.
    In the order they are put back: the matmul precision and the fp32_precision settings (torch 2.9 and later) first,
    since the older TF32 flags read them."""
    backends = torch.backends

    def attribute(owner: Any, path: str, name: str):
        return f"{path}.{name}", lambda: getattr(owner, name), lambda value: setattr(owner, name, value)

    found: list[tuple[str, Callable[[], Any], Callable[[Any], object]]] = [
        ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision,
         torch.set_float32_matmul_precision)]
    for path, owner in [("torch.backends", backends), ("torch.backends.cuda.matmul", backends.cuda.matmul),
                        ("torch.backends.cudnn", backends.cudnn), ("torch.backends.mkldnn", backends.mkldnn)]:
        for sub in ("", "matmul", "conv", "rnn"):
            inner = getattr(owner, sub, None) if sub else owner
            if inner is not None and hasattr(inner, "fp32_precision"):
                found.append(attribute(inner, f"{path}.{sub}" if sub else path, "fp32_precision"))
    found += [attribute(backends.cuda.matmul, "torch.backends.cuda.matmul", "allow_tf32"),
              *(attribute(backends.cudnn, "torch.backends.cudnn", name)
                for name in ("allow_tf32", "benchmark", "deterministic", "enabled")),
              ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
              ("torch.are_deterministic_algorithms_enabled() (warn_only)",
               lambda: (torch.are_deterministic_algorithms_enabled(),
                        torch.is_deterministic_algorithms_warn_only_enabled()),
               lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
              ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
              ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
              # no default device reads as the CPU; putting it back as None installs no device context
              ("torch.get_default_device()", torch.get_default_device,
               lambda device: torch.set_default_device(None if device == torch.device("cpu") else device))]
    for kernel in ("flash", "mem_efficient", "math", "cudnn"):
        found.append((f"torch.backends.cuda.{kernel}_sdp_enabled()", getattr(backends.cuda, f"{kernel}_sdp_enabled"),
                      getattr(backends.cuda, f"enable_{kernel}_sdp")))
    found.append(attribute(module_globals, "torch.nn.modules.module", "_global_is_full_backward_hook"))
    return found


@dataclass
class GlobalState:
    """The process-wide settings a forward may flip, and the global module hooks it may register
    (`nn.modules.module.register_module_forward_hook` and the like); taken before a run and put back after it."""

    switches: dict[str, tuple[Any, Callable[[], Any], Callable[[Any], object]]] = field(default_factory=dict)
    hooks: list[tuple[str, dict, dict]] = field(default_factory=list)  # (name, the global dict, a copy of it)

    @classmethod
    def take(cls) -> GlobalState:
        state = cls()
        for name, read, put in _switches():
            try:
                state.switches[name] = (read(), read, put)
            except RuntimeError:  # unreadable as it stands (torch refuses TF32 flags set through both APIs): kept out
                continue
        state.hooks = [(f"torch.nn.modules.module.{name}", hooks, hooks.copy())
                       for name, hooks in vars(module_globals).items()
                       if name.startswith("_global_") and isinstance(hooks, dict)]
        return state

    def restore(self) -> list[str]:
        """Put everything back; a note for each setting or global hook dict the run changed."""
        notes = []
        for name, (value, read, put) in self.switches.items():
            try:
                now = read()
            except RuntimeError:
                now = "unreadable"
            if now != value:
                put(value)
                if "fp32_precision" not in name:  # the state behind the TF32 flags and matmul precision, named instead
                    notes.append(f"the model changed {name} during the run ({value} -> {now}); put back")
        for name, hooks, entries in self.hooks:
            if hooks != entries:
                hooks.clear()
                hooks.update(entries)
                notes.append(f"the model registered global module hooks during the run ({name}); removed")
        return notes


class Session:
    def __init__(self, model: ModelUnderTest, settings: Settings):
        self.model = model
        self.settings = settings
        self.device, device_note = resolve_device("meta" if settings.meta else settings.device)
        self.dtype = DTYPES[settings.dtype]
        self.notes: list[str] = [device_note] if device_note else []
        if settings.inputs.seq_len > (model.max_positions or settings.inputs.seq_len):
            raise UsageError(f"inputs.seq_len {settings.inputs.seq_len} exceeds the model's maximum positions "
                             f"{model.max_positions}")
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
            self.inputs = self.random_ids((B, T))
        except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:  # sizes torch cannot allocate
            raise UsageError(f"inputs: batch_size {B} x seq_len {T} token ids cannot be allocated "
                             f"({type(exc).__name__}: {first_line(exc)})") from None
        self._cache: dict[str, object] = {}  # baseline, repeat, observation: computed once, shared by all checks
        self._observed: torch.Tensor | None = None  # the observation pass's logits, while they may stand in
        self.forward_tokens = 0  # rows x positions run, for benchmarks
        self.refused_lengths: set[int] = set()  # lengths the model raised at while a longer one ran (found out)
        self.unpadded: ModelUnderTest | None = None  # for a left-padded path view: the same path without padding
        self._moved = self._cast = False  # whether active() put the model on the device or dtype as a copy

    # -- lifetime -------------------------------------------------------------------------------------------------

    @contextmanager
    def active(self) -> Iterator[Session]:
        """Eval mode, nn.Dropout at p=0, the model on the session's device and dtype; the model (ModelState) and the
        process's settings (GlobalState) put back on exit, and what the model's library logs meanwhile kept as notes."""
        module = self.model.module
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        state = ModelState.take(module)
        process = GlobalState.take()
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.callback(lambda: self.notes.extend(process.restore()))
            stack.callback(lambda: self._restore(state))
            stack.enter_context(kept_as_notes(self.model.library_loggers, self.notes))
            try:  # eval() runs model code too (an overridden train()): what it raises is the model's error
                module.eval()
            except BaseException as exc:
                if not model_failure(exc):
                    raise
                raise ModelRaised(f"the model cannot be put in eval mode: {describe(exc)}",
                                  frame=model_frame(exc)) from exc
            for dropout in state.dropout_p:
                dropout.p = 0.0
            self._place(module)
            self.inputs = self.inputs.to(self.device)
            yield self

    def _restore(self, state: ModelState) -> None:
        written = state.restore()
        if written:
            shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
            self.notes.append(f"the forward wrote buffer{'s' if len(written) > 1 else ''} {shown} in place (where "
                              "models keep caches and counters); the contents were put back as found")

    def _place(self, module: nn.Module) -> None:
        tensors = [*module.parameters(), *module.buffers()]
        needs_move = any(t.device != self.device for t in tensors)
        needs_cast = any(t.is_floating_point() and t.dtype != self.dtype for t in tensors)
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

    def logits(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
               model: ModelUnderTest | None = None) -> torch.Tensor:
        """Logits [N, T, V] as float32, in row chunks of at most max_rows, dropout forced off where needed."""
        model = model or self.model
        chunks = []
        for start in range(0, ids.shape[0], self.max_rows):
            rows = ids[start:start + self.max_rows]
            positions = position_ids[start:start + self.max_rows] if position_ids is not None else None
            chunks.append(self._forward(rows, positions, model))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def output(self, ids: torch.Tensor, **kwargs: Any) -> Any:
        """The model's raw output for ids [N, T] with keyword arguments of its own (labels, document ids, a 4-D mask;
        ModelUnderTest.call): one forward of all N rows together (a loss is over the whole batch), under
        torch.no_grad(), dropout forced off where needed, model exceptions as ModelRaised."""
        with torch.no_grad(), (ZeroAttentionDropout() if self.force_zero_dropout else nullcontext()):
            output = self.model.call(ids, **kwargs)
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
            rows = ids[start:start + self.max_rows]
            if len(rows) == 1 and (N > 1 or self.inputs.shape[0] > 1):
                rows = torch.cat([rows, self.inputs[:1]])
            logits = self._forward(rows, None, self.model)  # (n, T, V)
            out += [position_change(logits[i], reference[against[start + i]])
                    for i in range(min(self.max_rows, N - start))]
            del logits
        return torch.stack(out)  # (N, T)

    def row_counts(self, n: int) -> list[int]:
        """The row counts of the forwards changes() runs for n rows."""
        counts = [min(self.max_rows, n - start) for start in range(0, n, self.max_rows)]
        return [max(c, 2) if n > 1 or self.inputs.shape[0] > 1 else c for c in counts]

    def _forward(self, rows: torch.Tensor, positions: torch.Tensor | None, model: ModelUnderTest) -> torch.Tensor:
        with torch.no_grad(), (ZeroAttentionDropout() if self.force_zero_dropout else nullcontext()):
            logits = model.logits(rows, positions).float()
        self.forward_tokens += rows.numel()
        return logits

    def _once(self, key: str, compute):
        """compute() on the first call; every later call gets its value, or the ModelRaised it raised, again."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except ModelRaised as exc:
                self._cache[key] = exc
        value = self._cache[key]
        if isinstance(value, ModelRaised):
            raise value
        return value

    def baseline(self) -> torch.Tensor:
        """Logits of the session's inputs from the untouched model, computed once and shared by every check."""

        def compute():
            # First learn whether dropout is live in eval: then every comparison runs with it forced off. ModelRaised:
            # the observer cannot follow this model; the plain forward below says whether it runs at all.
            with suppress(ModelRaised):
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
            with suppress(ModelRaised):
                self.observation()
            if self._observed is not None:
                return self._observed
        return self.baseline()

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

        def compute():
            return self.logits(self.inputs[:1, :length])

        return self._once(f"prefix {length}", compute) if length == self.short_length else compute()

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

    def observe(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None, keep_tensors: bool = False,
                keep_inputs_of: Collection[str] = frozenset()) -> Observation:
        """One forward under the attention observer. Its logits are dropped (the mode can change code paths): it
        tells what the model did, not what it computes untouched. Only the session's own observation pass keeps
        them, as a reference that stands while untouched forwards agree with it (see reference())."""
        return self._observe(ids, position_ids, keep_tensors, keep_inputs_of)[0]

    def _observe(self, ids, position_ids, keep_tensors, keep_inputs_of) -> tuple[Observation, torch.Tensor]:
        seq_len = ids.shape[1] + self.model.padding  # what the module itself sees
        with torch.no_grad(), observing(self.model.module, seq_len, keep_tensors, False, keep_inputs_of) as seen:
            logits = self.model.logits(ids, position_ids)
        self.forward_tokens += ids.numel()
        return seen, logits

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
            ids = torch.randint(0, vocab, shape, generator=self._generator)
        else:
            shift = torch.randint(1, max(vocab, 2), tuple(differ_from.shape), generator=self._generator)
            ids = (differ_from.cpu() + shift) % vocab
        return ids.to(self.device if hasattr(self, "device") else "cpu")

    def tolerance(self, scale: float) -> float:
        """The dtype's tolerance for logits of this magnitude: atol + rtol * max|logit|."""
        return self.atol + self.rtol * scale

    def threshold(self, scale: float, noise_floor: float) -> float:
        """A change counts when it exceeds both the dtype tolerance and noise_factor times the measured noise."""
        return max(self.tolerance(scale), self.settings.tolerance.noise_factor * noise_floor)

    @property
    def baseline_tokens(self) -> int:
        return self.inputs.numel()


def position_change(new: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row and position, the largest |change| over the vocabulary; inf where either side is not finite.

    NaN survives the subtraction and amax, and so does inf (inf - inf is NaN), so one pass over the difference finds
    both; NaN is then reported as inf so that no comparison can pass it. The difference is taken a slice of the
    vocabulary at a time (torch.maximum keeps NaN), so it never holds another [N, T, V] beside the logits."""
    V = new.shape[-1]
    positions = max(1, max(new[..., 0].numel(), reference[..., 0].numel()))
    step = max(1, DIFFERENCE_BLOCK // positions)
    change = None
    for start in range(0, V, step):
        part = (new[..., start:start + step] - reference[..., start:start + step]).abs_().amax(-1)  # (N, T)
        change = part if change is None else torch.maximum(change, part)
    assert change is not None  # a vocabulary of at least one
    return change.nan_to_num_(nan=float("inf"))


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


def nonfinite_positions(logits: torch.Tensor) -> list[tuple[int, int]]:
    """(row, position) pairs whose logits hold NaN or Inf. Read off each position's largest and smallest logit
    (amax keeps NaN; +inf is the largest, -inf the smallest), so no mask as large as the logits is made."""
    bad = ~(torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1)))
    return [tuple(x) for x in bad.nonzero().tolist()]


def logit_scale(logits: torch.Tensor) -> float:
    """The largest |logit|, which tolerances scale with; without the copy that logits.abs() would make."""
    return max(abs(float(logits.amax())), abs(float(logits.amin())))
