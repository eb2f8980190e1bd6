"""Run the selected checks on one model and collect a Report. Loaders build, checks judge, renderers show."""

from __future__ import annotations

import dataclasses
import inspect
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from fwdcheck.config.registry import CheckEntry
from fwdcheck.config.schema import Config, RunConfig
from fwdcheck.errors import (
    WAITED_FOR_A_RANK,
    CheckLoadError,
    DoesNotApply,
    ModelRaised,
    Own,
    SkipCheck,
    UsageError,
    interrupts_heard,
)
from fwdcheck.model.sources import load_model
from fwdcheck.model.tested import ModelUnderTest, model_code
from fwdcheck.model.zero_weights import woken
from fwdcheck.observe.locations import code_location
from fwdcheck.report import Report
from fwdcheck.result import DOES_NOT_APPLY, CheckResult, Finding, Status, worst
from fwdcheck.run.code_paths import (
    RAN_ALONE,
    CodePath,
    LogitsAnchor,
    Verdicts,
    cell_length,
    cell_settings,
    path_cells,
    path_view,
    plain_view,
    rows_ran_alone,
    runs_per_code_path,
    verdict_from_logits,
    verdicts_for,
)
from fwdcheck.run.image_run import image_cell, with_image_cell
from fwdcheck.run.limits import CheckTimeout, time_limit
from fwdcheck.run.matrix import (
    CellRun,
    merge_cells,
    not_judged_where_refused,
    observed_signature,
    same_logits_verdict,
)
from fwdcheck.run.model_state import ParameterWatch
from fwdcheck.run.plan import RunPlan
from fwdcheck.run.session import Session
from fwdcheck.run.settings import Settings

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Run:
    """One run, built the same way by the command line's worker, a distributed run's ranks, the pytest plugin and
    the Python API: its plan (fwdcheck/run/plan.py), resolved once by the process that validated it, and the
    settings the checks see."""

    plan: RunPlan
    settings: Settings

    @classmethod
    def build(cls, plan: RunPlan) -> Run:
        return cls(plan, Settings.of(plan))

    @property
    def config(self) -> RunConfig:
        """The plan's config, the overrides in it: a loader reads `meta` here."""
        return self.plan.config

    @property
    def entries(self) -> list[CheckEntry]:
        return list(self.plan.entries)

    @property
    def fail_on(self) -> str:
        return self.plan.fail_on

    def load(self) -> ModelUnderTest:
        """The model the config names (a Config's `model:` section), its lazy modules materialised."""
        model = load_model(cast(Config, self.config))  # only a run of a whole Config loads its model
        materialize_lazy(model, self.settings)
        return model

    def check(
        self,
        model: ModelUnderTest,
        *,
        config_path=None,
        progress: Callable[[str], None] | None = None,
        on_result: Callable[[CheckResult], None] | None = None,
    ) -> Report:
        if self.config.distributed.nproc > 1:
            raise UsageError(
                f"a distributed run (distributed.nproc {self.config.distributed.nproc}) starts processes "
                "of its own: run it with `fwdcheck run`"
            )
        return run_model(
            model,
            self.settings,
            self.entries,
            config_path=config_path,
            fail_on=self.fail_on,
            progress=progress,
            on_result=on_result,
        )


def run_model(
    model: ModelUnderTest,
    settings: Settings,
    entries: list[CheckEntry],
    *,
    config_path=None,
    fail_on: str = "fail",
    progress: Callable[[str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """Every check on one session, then the per-path checks over the code-path matrix; the model is restored when
    this returns, however it returns. `on_result` is told each check's default-path result as soon as it is known
    (the CLI's worker streams them to its supervisor, which keeps them if the process dies later). A KeyboardInterrupt
    the model raises itself, no SIGINT behind it, is the model's error (FWD002); a Ctrl-C ends the run."""
    with interrupts_heard():
        return _run_model(model, settings, entries, config_path, fail_on, progress, on_result)


def _run_model(model, settings, entries, config_path, fail_on, progress, on_result) -> Report:
    materialize_lazy(model, settings)  # the API's model (a loaded one is already)
    settings, own_dtype_note = settings.in_own_dtype(model.module)
    session = Session(model, settings)
    if own_dtype_note:
        session.notes.append(own_dtype_note)
    cells = path_cells(model, settings.code_paths, settings.inputs.batch_size)
    results: list[CheckResult] = []
    interrupted = False
    try:
        # One placement of the model for the whole run: the cells' sessions find it on the device and in eval mode.
        with session.active(), woken(model, settings.inputs.seed, session.notes):
            # Did the forwards write the weights? A fingerprint pass reads every parameter (about a short forward's
            # cost), so it runs once after every forward of the run (the default path's and the matrix's), not after
            # every check.
            watch = ParameterWatch(model.module)
            for entry in entries:
                if progress:
                    progress(f"{entry.name}")
                results.append(run_one(entry, model, session))
                if on_result:
                    on_result(results[-1])
            if any(per_code_path(entry) for entry in entries):
                cells = with_image_cell(cells, image_cell(model, settings, session))
            if cells:
                results = run_code_paths(entries, results, model, settings, cells, session, progress)
            written = watch.written()
            ran = [r for r in results if r.status != Status.SKIP]
            if written and ran:  # on the first check that ran: the write is the model's, whichever check saw it
                during = " during the run's checks" + (" (the default path or the code-path matrix)" if cells else "")
                report_parameter_writes(ran[0], written, session, during)
    except ModelRaised as exc:  # the model could not be prepared (eval() raised): no check can run on it
        results += [CheckResult(e.name, Status.ERROR, str(exc), [model_raised(exc)]) for e in entries[len(results) :]]
    except KeyboardInterrupt:  # Ctrl-C: the model is restored by now; report what ran, mark the rest
        interrupted = True
        if cells and len(results) == len(entries):
            session.notes.append("interrupted during the code-path matrix: the results cover the default path only")
        results += [
            CheckResult(e.name, Status.ERROR, "interrupted before it finished") for e in entries[len(results) :]
        ]
    for result in results:
        result.apply_ignores(settings.ignored)
        for finding in result.findings:
            finding.source = finding.source or locate(finding, model)
    return Report(
        results=results,
        model=model_summary(model),
        environment=environment_summary(settings, str(session.device)),
        notes=[*model.extra.get("notes", []), *session.notes],
        config_path=str(config_path) if config_path else None,
        fail_on=fail_on,
        interrupted=interrupted,
    )


def materialize_lazy(model: ModelUnderTest, settings: Settings) -> None:
    """Lazy modules (nn.LazyLinear and the like) hold no parameters until their first forward, which infers their
    sizes: one forward of one row of the run's length, in eval mode and without gradients, materialises them, and
    from then on they are counted, moved and compared as any other. The caller's random state is kept. A module
    cannot be made lazy again: the model handed over stays materialised, and the report says so. A forward that
    raises here is the model's error (ModelRaised)."""
    import torch
    from torch.nn.parameter import is_lazy

    lazy = [name for name, p in model.module.named_parameters() if is_lazy(p)]
    if not lazy:
        return
    ready = next((p for p in model.module.parameters() if not is_lazy(p)), None)
    device = ready.device if ready is not None else torch.device("cpu")
    ids = torch.zeros(1, settings.inputs.seq_len, dtype=torch.long, device=device)  # (1, T) of token 0
    training = model.module.training
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), torch.no_grad():
        try:
            with model_code("the model cannot be put in eval mode:"):
                model.module.eval()
            model.forward(ids)
        finally:
            with model_code("the model cannot be put back in training mode:"):
                model.module.train(training)
    shown = ", ".join(lazy[:4]) + (f" and {len(lazy) - 4} more" if len(lazy) > 4 else "")
    model.extra.setdefault("notes", []).append(
        f"lazy parameters ({shown}) were materialised by a forward of 1 x {settings.inputs.seq_len} tokens before "
        "the run, and are counted from then on (a lazy module stays materialised)"
    )


def model_summary(model: ModelUnderTest) -> dict:
    """The report's `model` section."""
    parameters = sum(p.numel() for p in model.module.parameters())
    return {
        "label": model.label,
        "source": model.source,
        "parameters": parameters,
        "vocab_size": model.vocab_size,
        "max_positions": model.max_positions,
        "causal": model.causal,
        "attention_pattern": model.pattern.describe(),
        "dims": dict(model.dims),
    }


def environment_summary(settings: Settings, device: str) -> dict:
    """The report's `environment` section."""
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "dtype": settings.dtype,
        "seed": settings.inputs.seed,
        "batch_size": settings.inputs.batch_size,
        "seq_len": settings.inputs.seq_len,
    }


def model_raised(exc: ModelRaised) -> Finding:
    """FWD002, pointing at the line of model code that raised when there is one."""
    source = code_location(exc.frame[0], exc.frame[1]) if exc.frame else None
    return Finding(Own.MODEL_RAISED, Status.ERROR, str(exc), exc.where, source=source)


def locate(finding: Finding, model: ModelUnderTest) -> str | None:
    """'file:line' for a finding the check gave no source: the class of the module it concerns (a finding about the
    module as a whole, not about one call in it)."""
    module = dict(model.module.named_modules()).get(finding.module) if finding.module else None
    if module is None:
        return None
    try:
        source, line = inspect.getsourcefile(type(module)), inspect.getsourcelines(type(module))[1]
        return code_location(source, line) if source is not None else None
    except (TypeError, OSError):
        return None


def run_code_paths(
    entries: list[CheckEntry],
    results: list[CheckResult],
    model: ModelUnderTest,
    settings: Settings,
    cells: list[CodePath],
    session: Session,
    progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """The checks that declare per_code_path, once per cell, each merged into one result that lists every cell. A
    check that skipped or could not run on the default path is left as it is. Cells outside, checks inside: a cell's
    session (its observation pass, its baseline) is shared by every per-path check."""
    chosen = [
        i
        for i, (entry, result) in enumerate(zip(entries, results, strict=True))
        if result.status not in (Status.SKIP, Status.ERROR) and per_code_path(entry)
    ]
    if not chosen:
        return results
    per_path = [entries[i] for i in chosen]
    runs = []
    verdicts = verdicts_for(model)  # what the cells run so far vouch for, which a later cell may share
    for number, cell in enumerate(cells, 1):
        if progress:
            progress(f"code path {number}/{len(cells)}: {cell.label}")
        rows = None
        if cell.train and verdicts is not None:
            rows = eval_rows_for_train(cell, per_path, [results[i] for i in chosen], model, settings, session, verdicts)
        runs.append(run_path(cell, per_path, model, settings, session, verdicts, inputs=rows))
    merged = list(results)
    for j, i in enumerate(chosen):
        merged[i] = merge_cells(results[i], [(run, run.results[j]) for run in runs])
    return merged


def eval_rows_for_train(
    cell: CodePath,
    entries: list[CheckEntry],
    default_results: list[CheckResult],
    model: ModelUnderTest,
    settings: Settings,
    session: Session,
    verdicts: Verdicts,
) -> torch.Tensor | None:
    """The train path's inputs [B, L]: rows the run's session ran alone on the eval path (code_paths.rows_ran_alone),
    with an anchor in `verdicts` for every check whose verdict follows from logits and that passed on the default
    path, whose logits of those rows it judged; None when the session ran too few rows, or shorter ones than the
    cell's length."""
    found = rows_ran_alone(session, cell.batch_size, cell_length(settings, model, cell, session.min_seq_len))
    if found is None:
        return None
    rows, logits = found
    for entry, result in zip(entries, default_results, strict=True):
        if result.status == Status.PASS and _declares(entry, verdict_from_logits):
            verdicts.anchors.append(LogitsAnchor(RAN_ALONE, entry.name, result, rows, logits))
    return rows


def run_path(
    cell: CodePath,
    entries: list[CheckEntry],
    model: ModelUnderTest,
    settings: Settings,
    session: Session,
    verdicts: Verdicts | None = None,
    inputs: torch.Tensor | None = None,
) -> CellRun:
    """One cell as a run does it, given the run's own session: at the cell's short length, and again at
    inputs.seq_len if the model raised there. A model may refuse short sequences (a length it needs at least,
    undeclared); the default run showed that it takes inputs.seq_len, so the path gets a verdict all the same.
    `verdicts`: what the cells run so far vouch for, which this cell may share; `inputs`: the cell's rows, when given
    (eval_rows_for_train)."""
    run = run_cell(
        cell,
        entries,
        model,
        settings,
        shortest=session.min_seq_len,
        max_rows=session.max_rows,
        verdicts=verdicts,
        inputs=inputs,
    )
    if run.seq_len < settings.inputs.seq_len and (_model_raised(run) or run.refused):
        again = run_cell(
            cell,
            entries,
            model,
            settings,
            shortest=settings.inputs.seq_len,
            max_rows=session.max_rows,
            verdicts=verdicts,
        )
        again.forward_tokens = [a + b for a, b in zip(run.forward_tokens, again.forward_tokens, strict=True)]
        again.note = "; ".join(
            filter(None, [f"the model raised at T={run.seq_len}; the cell ran at T={again.seq_len}", again.note])
        )
        return not_judged_where_refused(again)
    return not_judged_where_refused(run)


def _model_raised(run: CellRun) -> bool:
    """Whether some check of the cell could not run at all because the model raised (FWD002)."""
    return any(f.code == Own.MODEL_RAISED for result in run.results for f in result.findings)


def per_code_path(entry: CheckEntry) -> bool:
    return _declares(entry, runs_per_code_path)


def _declares(entry: CheckEntry, reads: Callable[[object], bool]) -> bool:
    """What a check declares on its class, as `reads` reads it off the check. It loaded for the default run; if it
    no longer does, it declares nothing (it runs once, and in full), as it did."""
    try:
        return reads(entry.load())
    except CheckLoadError:
        return False


def run_cell(
    cell: CodePath,
    entries: list[CheckEntry],
    model: ModelUnderTest,
    settings: Settings,
    *,
    shortest: int = 1,
    max_rows: int | None = None,
    verdicts: Verdicts | None = None,
    inputs: torch.Tensor | None = None,
) -> CellRun:
    """Every given check on one cell, in one session: the model's forward takes the cell's path, on inputs of the
    cell's batch size and length (code_paths.cell_settings). A left-padded cell also holds the same path without
    padding, whose logits the real tokens must reproduce. `shortest` and `max_rows` are the run's own session's.

    With `verdicts` (what the cells run so far vouch for) the cell's observation pass runs first: a cell that saw
    exactly what an earlier one saw takes that cell's verdicts, a check whose verdict follows from logits takes its
    pass on a cell with the same logits (code_paths.py says why both hold), and what this cell runs in full is added
    to them."""
    own, inputs = _settings_and_rows(cell, model, settings, shortest, max_rows, inputs)
    results: list[CheckResult] = []
    tokens: list[int] = []
    signature, anchors, note = None, [], None
    try:
        view = path_view(model, cell)
        session = Session(view, own, train=cell.train, inputs=inputs)
        if view.padding:
            session.unpadded = plain_view(model, cell)
        with model.using_attention(cell.attn_implementation), session.active():
            started = time.perf_counter()
            digest = _digest_wanted(cell, verdicts)
            signature = observed_signature(session) if digest else None
            if cell.train:
                session.reference()  # the train path's first forward: ModelRaised when the model cannot train
            same = verdicts.by_signature.get(signature) if signature and verdicts is not None else None
            if same is not None:
                return _same_path(cell, own, entries, session, same, time.perf_counter() - started)
            logits = _vouched_logits(session, verdicts, signature, digest)
            anchors = _check_cell(cell, entries, view, session, verdicts, logits, results, tokens)
            if session.gradients_refused:
                note = f"run without gradients: with them the model raised {session.gradients_refused}"
    except Exception as exc:  # the cell could not be set up (switching the implementation, its inputs)
        if cell.train and isinstance(exc, ModelRaised):
            return _train_refused(cell, entries, own, exc)
        message = f"{type(exc).__name__}: {exc}"
        for entry in entries[len(results) :]:
            results.append(CheckResult(entry.name, Status.ERROR, message))
            tokens.append(0)
        signature, anchors = None, []
    run = CellRun(cell, own.inputs.seq_len, results, tokens, note=note)
    if signature and verdicts is not None:
        verdicts.by_signature.setdefault(signature, run)
        verdicts.anchors += anchors
    return run


def _settings_and_rows(
    cell: CodePath,
    model: ModelUnderTest,
    settings: Settings,
    shortest: int,
    max_rows: int | None,
    inputs: torch.Tensor | None,
) -> tuple[Settings, torch.Tensor | None]:
    """The cell's settings (its batch size and length) and the rows it runs: the given ones, which make the cell as
    long as they are, when they are of its shape; else None, and the cell draws its own from the seed."""
    if inputs is not None:
        shortest = max(shortest, inputs.shape[1])
    own = cell_settings(settings, model, cell, shortest, max_rows)
    if inputs is not None and tuple(inputs.shape) != (own.inputs.batch_size, own.inputs.seq_len):
        inputs = None  # not the cell's shape (a model's positions end sooner)
    return own, inputs


def _digest_wanted(cell: CodePath, verdicts: Verdicts | None) -> bool:
    """Whether the cell's observation pass is digested: only where it can be shared, with an earlier cell or by a
    later one (the train path's cell comes last); else the observation pass runs for the checks alone."""
    return verdicts is not None and (not cell.train or bool(verdicts.by_signature))


def _same_path(
    cell: CodePath, own: Settings, entries: list[CheckEntry], session: Session, same: CellRun, spent: float
) -> CellRun:
    """A cell that took the same code path as an earlier one: that cell's verdicts, the time and tokens of the
    shared observation pass on the first check."""
    results = [dataclasses.replace(r, duration_s=spent if i == 0 else 0.0) for i, r in enumerate(same.results)]
    tokens = [session.forward_tokens] + [0] * (len(entries) - 1)
    return CellRun(
        cell,
        own.inputs.seq_len,
        results,
        tokens,
        note=f"the same code path as {same.cell.label} (the same calls, masks and logits): its verdict",
        shares=same.cell.label,
    )


def _vouched_logits(
    session: Session, verdicts: Verdicts | None, signature: str | None, digest: bool
) -> torch.Tensor | None:
    """The observation pass's logits, while they are the model's (not dice: dropout live in eval mode), where the
    pass could vouch for them (a digest was taken of it, or none was wanted) and they hold values; None without
    verdicts, which alone keep logits."""
    observed = session.observed_logits if verdicts is not None and (signature or not digest) else None
    return observed if observed is not None and not observed.is_meta else None


def _check_cell(
    cell: CodePath,
    entries: list[CheckEntry],
    view: ModelUnderTest,
    session: Session,
    verdicts: Verdicts | None,
    logits: torch.Tensor | None,
    results: list[CheckResult],
    tokens: list[int],
) -> list[LogitsAnchor]:
    """Each check on the cell, its result and forward tokens appended as it ends (a cell that raises halfway keeps
    the ones before): a check whose verdict follows from logits takes a pass on the same logits when `verdicts`
    hold one. Returns the passes later cells may take."""
    anchors = []
    observed = session.forward_tokens  # the observation pass run before: on the first check, which asks first
    for entry in entries:
        before = session.forward_tokens
        follows_logits = logits is not None and _declares(entry, verdict_from_logits)
        shared = (
            verdicts.same_logits(entry.name, session, logits)
            if follows_logits and verdicts is not None and logits is not None
            else None
        )
        result = same_logits_verdict(entry, shared, cell.train) if shared else run_one(entry, view, session)
        results.append(result)
        tokens.append(session.forward_tokens - before + observed)
        observed = 0
        if follows_logits and logits is not None and not shared and result.status == Status.PASS:
            anchors.append(LogitsAnchor(cell.label, entry.name, result, session.inputs, logits))
    return anchors


def _train_refused(cell: CodePath, entries: list[CheckEntry], own: Settings, exc: ModelRaised) -> CellRun:
    """The train path's cell when train() or a train-mode forward raised: the model cannot run the path, no
    verdict on it."""
    why = f"the model cannot run in train mode (dropout off): {exc}"
    results = [CheckResult(entry.name, Status.SKIP, why) for entry in entries]
    return CellRun(cell, own.inputs.seq_len, results, [0] * len(entries), note=why, refused=True)


def run_one(entry: CheckEntry, model: ModelUnderTest, session: Session) -> CheckResult:
    """One check, whatever happens: skip raised, model errors and fwdcheck's own errors become results."""
    start = time.perf_counter()
    try:
        check = entry.load()
        if session.device.type == "meta" and getattr(check, "needs_values", True):
            raise SkipCheck(
                "needs values; on the meta device only shapes exist: run on a shrunk config (`fwdcheck shrink CONFIG`)"
            )
        with time_limit(session.settings.timeout_s):
            result = check.run(model, session)
        if not isinstance(result, CheckResult):  # a plugin's bug: its own error, not the end of the run
            raise TypeError(
                f"{type(check).__name__}.run() returned "
                f"{'None' if result is None else type(result).__name__}, not a CheckResult"
            )
        if result.status != Status.SKIP and callable(getattr(check, "key_number", None)):
            result.key_number = str(check.key_number(result) or "")
    except CheckTimeout as timeout:
        message = f"timed out after {timeout.seconds:g} s (timeout_s in the config); " + (
            f"waiting in a collective: {WAITED_FOR_A_RANK}" if timeout.in_collective else "a forward that hangs?"
        )
        result = CheckResult(entry.name, Status.ERROR, message, [Finding(Own.TIMED_OUT, Status.ERROR, message)])
    except DoesNotApply as absent:
        result = CheckResult(entry.name, Status.SKIP, DOES_NOT_APPLY + str(absent))
    except SkipCheck as skip:
        result = CheckResult(entry.name, Status.SKIP, str(skip))
    except CheckLoadError as exc:
        result = CheckResult(
            entry.name, Status.ERROR, str(exc), [Finding(Own.CHECK_NOT_LOADED, Status.ERROR, str(exc))]
        )
    except ModelRaised as exc:
        result = CheckResult(entry.name, Status.ERROR, str(exc), [model_raised(exc)])
    except Exception as exc:  # a bug of fwdcheck's (or of a plugin's), not of the model: exit 3
        message = f"internal error in check {entry.label}: {type(exc).__name__}: {exc}"
        result = CheckResult(
            entry.name,
            Status.ERROR,
            message,
            [Finding(Own.INTERNAL_ERROR, Status.ERROR, message)],
            data={"traceback": traceback.format_exc()},
            internal_error=True,
        )
    result.duration_s = time.perf_counter() - start
    return result


def report_parameter_writes(result: CheckResult, written: list[str], session: Session, during: str = "") -> None:
    """FWD006 on the result of the check whose forwards wrote these parameters in place (none: nothing to say)."""
    if not written or any(f.code == Own.WROTE_PARAMETERS for f in result.findings):
        return
    parameters = dict(session.model.module.named_parameters())
    if all(session.runs_on_copy(parameters[name]) for name in written):
        after = "the model's own values are intact: the run worked on a copy"
    else:
        after = (
            "they stay as written (fwdcheck keeps fingerprints of parameters, not copies): reload the model "
            "before using it"
        )
    shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    message = (
        f"the forward wrote parameter{'s' if len(written) > 1 else ''} {shown} in place{during}: a forward in "
        f"eval mode should not change the weights, and the forwards after it ran another model; {after}"
    )
    result.findings.append(Finding(Own.WROTE_PARAMETERS, Status.FAIL, message, written[0].rpartition(".")[0] or None))
    result.status = worst([result.status, Status.FAIL])
