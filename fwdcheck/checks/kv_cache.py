"""kv-cache: decoding through the model's KV cache gives the logits of the full forward.

The same tokens run incrementally through the cache, one chain of four calls on the session's first rows (at most
two, rows beside each other as batched generation runs them):
  prefill         the first P tokens with the cache on (P = 4, or the widest sliding window the model declares
                  where it is narrower than the rows, so that the steps after it read a cache the window has cut:
                  the token at position W already drops key 0, and a cache that refuses a prefill longer than its
                  window, as litgpt's does, still takes it);
  token-by-token  positions P and P+1, one new token a call, as generation runs: a decode step that caches its key
                  at a slot it never advances shows only at the second;
  chunked         positions P+2 and P+3 in one call (speculative decoding, chunked prefill): the queries are fewer
                  than the keys, where a causal mask aligned top-left instead of bottom-right reads the wrong keys;
                  it reads what the prefill and the one-token steps cached.
Every position's logits must agree with the full forward's within the session's threshold: the session's own
logits (a causal model's logits at a prefix are those of the full rows' first positions), and, once a change goes
beyond what can pass unexamined, a fresh full forward of exactly the decoded tokens. Where they part, the first
position is reported and, replaying the run with forward hooks on the layer stack, the first layer whose output
parts. A chunk that parts while the one-token step agrees is decoded again straight after the prefill, to tell a
mask of several queries over the cache from a one-token step that cached the wrong keys.

Models it drives: Hugging Face transformers models (a DynamicCache with use_cache=True and the inputs generate
passes), the reference transformer, and python models whose config declares `cache:` (style hf: past_key_values in,
the cache back out; style gpt-fast: a setup method, then forward(input_ids, input_pos)). Anything else skips.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fwdcheck.checks.kv_cache_spec import SPEC
from fwdcheck.errors import DoesNotApply, ModelRaised, SkipCheck
from fwdcheck.model.calling import call_convention_hint
from fwdcheck.model.tested import ModelUnderTest, extract_logits, model_code, model_frame
from fwdcheck.observe.frames import first_tensor
from fwdcheck.observe.observer import ZeroAttentionDropout
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.compare import logit_scale, nonfinite_positions, position_change
from fwdcheck.run.session import Session

# Each call costs about a forward's reading of every weight whatever its length, the tokens little beside it: the
# check runs the fewest calls that show each class of bug. A prefill, the one-token path generation takes twice (a
# position off by one, rotary angles restarted at 0, a cache that hands back the wrong keys; a step that writes where
# the step before it wrote), and a chunk of two over the cache all filled (a mask aligned top-left; and what the
# one-token steps cached, read back).
PREFILL = 4  # tokens of the prefill: any prefill shows those bugs; a declared window asks for more
TOKENS = 2  # one-token steps: the second reads what the first cached, through the path that cached it
CHUNK = 2  # new tokens of the chunked call: the fewest that are fewer queries than keys
MIN_LENGTH = 2 + CHUNK  # a prefill of 1, one token and the chunk (rows of 4 tokens take one one-token step)
ROWS = 2  # the session's first rows, decoded side by side: a cache that mixes or drops rows shows with two


# ---------------------------------------------------------------------------------------------------------------------
# What runs: the lengths


@dataclass
class Plan:
    """Prefill the first `prefill` tokens; then positions `prefill` .. `prefill` + `tokens` - 1 one at a time, then
    the CHUNK positions after them in one call, each over the cache the calls before it filled."""

    prefill: int
    tokens: int = TOKENS

    @classmethod
    def for_length(cls, T: int, window: int | None = None) -> Plan:
        """The plan for rows of T tokens: a prefill of PREFILL tokens, or of a declared window narrower than the rows
        (the decoded tokens then read a cache the window has cut; a window of T or more cuts nothing in T tokens),
        as long as T leaves room for the decoded positions (TOKENS one-token steps where T allows, else one)."""
        wanted = max(PREFILL, window) if window is not None and window < T else PREFILL
        tokens = max(1, min(TOKENS, T - 1 - CHUNK))
        return cls(min(wanted, T - tokens - CHUNK), tokens)

    @property
    def decoded(self) -> int:
        """Positions decoded after the prefill: the one-token steps and the chunk."""
        return self.tokens + CHUNK

    @property
    def length(self) -> int:
        """Tokens of each row the run decodes: the prefill and the positions after it."""
        return self.prefill + self.decoded

    @property
    def parts(self) -> dict[str, tuple[int, int]]:
        """(start, length) of each part: the prefill, the one-token steps, the chunk."""
        return {
            "prefill": (0, self.prefill),
            "token-by-token": (self.prefill, self.tokens),
            "chunked": (self.prefill + self.tokens, CHUNK),
        }

    @property
    def steps(self) -> list[tuple[int, int]]:
        """(start, length) of each call after the prefill: the one-token steps, then the chunk."""
        return [(self.prefill + i, 1) for i in range(self.tokens)] + [self.parts["chunked"]]

    def positions(self, part: str) -> str:
        """'5-6': the positions a part decodes."""
        start, n = self.parts[part]
        return f"{start}-{start + n - 1}" if n > 1 else f"{start}"

    @property
    def calls(self) -> int:
        return 1 + len(self.steps)


# ---------------------------------------------------------------------------------------------------------------------
# How the model is run incrementally


def call_model(what: str, fn: Callable, *args, **kwargs) -> Any:
    """fn(*args, **kwargs); an exception from model code becomes ModelRaised naming the line that raised."""
    with model_code(f"{what} raised", frame=_model_line, hint=call_convention_hint):
        return fn(*args, **kwargs)


def _model_line(exc: BaseException) -> tuple[str, int, str] | None:
    """The line of model code that raised (model_frame); None when the call itself raised (an argument forward does
    not take): that is no line of the model's."""
    frame = model_frame(exc)
    return None if frame is not None and frame[0].startswith(__file__) else frame


def logits_of(output: Any, ids: torch.Tensor, what: str) -> torch.Tensor:
    logits = extract_logits(output)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        raise ModelRaised(
            f"{what} returned logits of shape {list(logits.shape)} for input_ids {list(ids.shape)}; "
            "the cached path must return every new position's logits [B, T_new, V]"
        )
    return logits.float()


class Decoder:
    """Runs a model incrementally: begin(rows, length) once, prefill, then step() for the tokens that follow."""

    label = ""

    def __init__(self, module: nn.Module):
        self.module = module

    def begin(self, rows: int, length: int) -> None:
        """Make room for `rows` sequences of `length` tokens (a preallocated cache); nothing by default."""

    def step(self, state: Any, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, Any]:
        """Logits [B, n, V] of ids [B, n] at positions start .. start + n - 1, after what `state` holds."""
        raise NotImplementedError


class PastKeyValues(Decoder):
    """Hugging Face style: forward(input_ids, past_key_values=cache, use_cache=True) returns the logits and the cache.

    With `new_cache` (a transformers model's) it runs as generate does: the cache made up front, the new tokens'
    position_ids, and, where forward still takes them (releases before 5), cache_position and an all-ones
    attention_mask. Other models get no cache on the first call and derive their positions from the cache
    themselves."""

    def __init__(
        self, module: nn.Module, new_cache: Callable[[nn.Module], Any] | None, positions_given: bool | None = None
    ):
        super().__init__(module)
        self.new_cache = new_cache
        transformers = new_cache is not None  # driven as generate drives it: the caller makes the cache up front
        try:
            params: Mapping[str, inspect.Parameter] = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            params = {}
        # transformers 5 renamed past_key_values to cache
        self.cache_arg = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        if transformers and not {"cache", "past_key_values"} & set(params):
            raise DoesNotApply(
                f"{type(module).__name__}.forward takes no past_key_values: no KV cache to decode through"
            )
        self.label = f"{self.cache_arg}=..., use_cache=True"
        # A model counting its own positions (RoBERTa's from padding_idx + 1) learns them from its cache, as under
        # generate: 0-based position_ids would move it.
        given = "position_ids" in params if positions_given is None else positions_given
        self.position_ids = transformers and given
        self.cache_position = transformers and "cache_position" in params
        # transformers 5 prepares every step's inputs in the model's own prepare_inputs_for_generation: which
        # tokens forward takes (CPM-Ant slices the cached prefix off itself), positions, masks, the cache's name.
        self.prepare = getattr(module, "prepare_inputs_for_generation", None) if _generate_slices(module) else None
        self.tokens: torch.Tensor | None = None  # (B, length): the tokens stepped so far, the same on every branch
        if self.prepare is not None:
            self.label = "cache=..., use_cache=True; inputs from prepare_inputs_for_generation, as generate"

    def begin(self, rows, length):
        self.tokens = None

    def _made_cache(self) -> Any:
        """The empty cache generate would make for the model; what its library raises making it (BLT's config,
        whose layers only its sub-configs hold) is the model's error, as it is under generate, not fwdcheck's."""
        assert self.new_cache is not None
        return call_model("making the cache as generate does (DynamicCache(config=...))", self.new_cache, self.module)

    def step(self, state, ids, start):
        if self.prepare is not None:
            return self._generate_step(state, ids, start)
        B, n = ids.shape
        kwargs: dict[str, Any] = {"use_cache": True}
        if state is None and self.new_cache is not None:
            state = self._made_cache()
        if state is not None:
            kwargs[self.cache_arg] = state
        positions = torch.arange(start, start + n, device=ids.device)
        if self.position_ids:  # generate: attention_mask.cumsum(-1) - 1, the new tokens' slice
            kwargs["position_ids"] = positions.expand(B, n)
        if self.cache_position:
            kwargs["cache_position"] = positions
            kwargs["attention_mask"] = torch.ones(B, start + n, dtype=torch.long, device=ids.device)
        what = f"forward({self.label}) at positions {start}-{start + n - 1}"
        output = call_model(what, self.module, ids, **kwargs)
        cache = returned_cache(output)
        if cache is None and self.new_cache is None:
            raise ModelRaised(
                f"{what} returned no cache (no .past_key_values, .cache, nor a (logits, cache) "
                "tuple); the config's `cache: {style: hf}` says it would"
            )
        return logits_of(output, ids, what), cache if cache is not None else state

    def _generate_step(self, state, ids, start):
        """One step as generate takes it: the tokens so far and the cache through the model's own
        prepare_inputs_for_generation, then forward; the new tokens' logits from what it returns."""
        B, n = ids.shape
        if self.tokens is None or self.tokens.shape[0] != B:
            self.tokens = ids.new_zeros(B, start + n)
        if self.tokens.shape[1] < start + n:
            self.tokens = torch.cat([self.tokens, ids.new_zeros(B, start + n - self.tokens.shape[1])], dim=1)
        self.tokens[:, start : start + n] = ids
        so_far = self.tokens[:, : start + n].clone()  # (B, start + n)
        if state is None and self.new_cache is not None:
            state = self._made_cache()  # None where the model makes its own cache, as generate leaves it
        what = f"forward({self.label}) at positions {start}-{start + n - 1}"
        inputs = call_model(
            f"prepare_inputs_for_generation at positions {start}-{start + n - 1}",
            self.prepare,
            so_far,
            next_sequence_length=n,
            cache=state,
            attention_mask=torch.ones_like(so_far),
            use_cache=True,
            is_first_iteration=start == 0,
        )
        given = inputs.get("input_ids")
        if given is None or not _suffix_of(given, so_far):
            raise SkipCheck(
                f"{type(self.module).__name__}.prepare_inputs_for_generation hands forward tokens that are not the "
                "sequence's (a mask token appended, as XLM generates): its next token is not read from the last "
                "token's logits, so there is no cached decoding to compare with the full forward"
            )
        for name in ("logits_to_keep", "num_logits_to_keep"):
            if inputs.get(name):  # generate keeps the last position's logits alone (a hybrid's config says 1); the
                inputs[name] = 0  # check compares every new token's, which 0 asks for
        output = call_model(what, self.module, **inputs)
        cache = returned_cache(output)
        if cache is None and state is None:  # generate then runs the whole sequence at every step (Reformer)
            raise SkipCheck(
                f"{what} returned no cache and generate makes none for it: {type(self.module).__name__} decodes "
                "without a KV cache, so there is no cached path to compare with the full forward"
            )
        logits = extract_logits(output)
        if logits.dim() == 3 and logits.shape[0] == B and logits.shape[1] >= n:
            logits = logits[:, -n:]  # the new tokens' (forward may return the prefix's too)
        return logits_of(logits, ids, what), cache if cache is not None else state


def _generate_slices(module: nn.Module) -> bool:
    """Whether the model's generate is transformers 5's, whose prepare_inputs_for_generation is handed the whole
    sequence and the new tokens' count (an override may take them in **kwargs)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "GenerationMixin" and cls.__module__.startswith("transformers."):
            try:
                prepare = cls.__dict__.get("prepare_inputs_for_generation")
                return prepare is not None and "next_sequence_length" in inspect.signature(prepare).parameters
            except (AttributeError, TypeError, ValueError):
                return False
    return False


def _suffix_of(given: torch.Tensor, so_far: torch.Tensor) -> bool:
    """Whether the ids forward gets are the last tokens of the sequence so far."""
    return given.dim() == 2 and given.shape[1] <= so_far.shape[1] and torch.equal(given, so_far[:, -given.shape[1] :])


def returned_cache(output: Any) -> Any:
    for name in ("past_key_values", "cache"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if value is not None:
            return value
    if isinstance(output, (tuple, list)) and len(output) > 1:
        return output[1]
    return None


class InputPos(Decoder):
    """gpt-fast style: model.<setup>(max_batch_size, max_seq_length) allocates the cache, then forward(idx, input_pos)
    writes the tokens' keys and values at input_pos and reads the slots up to them. The state lives in the model's
    own modules: step() hands back None."""

    def __init__(self, module: nn.Module, setup: str):
        super().__init__(module)
        self.setup = getattr(module, setup, None)
        if not callable(self.setup):
            raise ModelRaised(
                f"the config's cache.setup names '{setup}', but {type(module).__name__} has no such method"
            )
        self.label = f"{setup}, then forward(input_ids, input_pos)"

    def begin(self, rows, length):
        call_model(f"{self.setup.__name__}({rows}, {length})", self.setup, rows, length)

    def step(self, state, ids, start):
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)  # input_pos [n]
        what = f"forward(input_ids, input_pos={start}..{start + ids.shape[1] - 1})"
        return logits_of(call_model(what, self.module, ids, positions), ids, what), None


def decoder_for(model) -> Decoder:
    """The way to run this model through its cache (its cache capability), or SkipCheck saying there is none
    fwdcheck knows."""
    cache = model.cache
    if cache is not None:
        if cache.style == "input_pos":
            return InputPos(model.module, cache.setup)
        given = model.positions.given if model.positions is not None else None
        return PastKeyValues(model.module, new_cache=cache.new_cache, positions_given=given)
    raise DoesNotApply(
        f"no KV-cache path fwdcheck knows how to drive in {type(model.module).__name__}: declare one in "
        "the model config, `cache: {style: hf}` (past_key_values) or `cache: {style: gpt-fast, setup: "
        "setup_caches}` (input_pos)"
    )


@contextmanager
def attributes_restored(module: nn.Module):
    """Every submodule's attributes, child modules and buffers put back as they were: a cache setup (gpt-fast's
    setup_caches, litgpt's set_kv_cache) hangs cache modules, masks and sizes on the model, which must not outlive
    the check. Containers are restored in place, so whatever refers to them still does."""
    saved = []
    for m in module.modules():
        state = vars(m)
        saved.append((state, dict(state), {k: copy.copy(v) for k, v in state.items() if isinstance(v, (dict, set))}))
    try:
        yield
    finally:
        for state, attributes, contents in saved:
            for name in [n for n in state if n not in attributes]:
                del state[name]
            state.update(attributes)
            for name, kept in contents.items():
                state[name].clear()
                state[name].update(kept)


# ---------------------------------------------------------------------------------------------------------------------
# The check


@dataclass
class Decoded:
    """Logits [R, n, V] of each part of a cached run (Plan.parts), in the order of the positions."""

    parts: dict[str, torch.Tensor]
    tokens: int = 0  # rows x positions run


@dataclass
class Changes:
    """Per row and position, the largest |change| of each part from the full forward's logits: [R, n] each."""

    parts: dict[str, torch.Tensor]

    @classmethod
    def of(cls, decoded: Decoded, truth: torch.Tensor, plan: Plan) -> Changes:
        """Against `truth`, the full forward's logits [R, L, V] of the decoded rows."""
        return cls(
            {
                name: position_change(decoded.parts[name], truth[:, start : start + n])
                for name, (start, n) in plan.parts.items()
            }
        )

    def largest(self) -> float:
        return max(float(c.max()) for c in self.parts.values())


@dataclass
class Compared:
    """The cached run and its changes from the full forward's logits, with the threshold they are judged by."""

    decoded: Decoded
    changes: Changes
    truth: torch.Tensor  # the full forward's logits [R, L, V] the changes are from
    fresh: bool  # whether `truth` is a forward of exactly the decoded tokens, not the session's logits
    scale: float  # the full forward's largest |logit|
    noise: float | None  # the noise floor; None: not measured, since nothing moved beyond the tolerance
    tolerance: float
    threshold: float
    chunk_after_prefill: torch.Tensor | None = None  # [R, CHUNK]: the chunk decoded straight after the prefill


class KVCache(Check, declared=SPEC):
    name = "kv-cache"

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        if not model.causal:
            raise DoesNotApply(f"{model.pattern.describe()}: only a causal model decodes incrementally")
        decoder = decoder_for(model)
        plan = self._plan(model, session)
        rows = session.inputs[:ROWS, : plan.length]  # (R, L): the session's first rows, cut to what is decoded
        compared = self._compare(decoder, model, session, plan, rows)
        parted = {name: first_parting(c, compared.threshold) for name, c in compared.changes.parts.items()}
        if parted["chunked"] is not None and parted["token-by-token"] is None:
            # the chunk alone parts: the mask of its queries over the cache, or what the one-token step cached
            compared.chunk_after_prefill = self._chunk_after_prefill(decoder, model, session, plan, rows, compared)
        findings = self._findings(compared, plan)
        failing = [f for f in findings if f.status == Status.FAIL]
        if failing:
            layer = self._first_layer(decoder, model, session, plan, rows, compared.changes, compared.threshold)
            if layer:
                for finding in failing:
                    finding.where = f"{finding.where}; {layer}"
        return self._summarise(decoder, plan, rows, compared, findings)

    @staticmethod
    def _plan(model: ModelUnderTest, session: Session) -> Plan:
        """The prefill and the decoded positions at the session's length, the prefill longer than a declared window;
        SkipCheck when the sequence is too short, or the model refuses one-token forwards."""
        T = session.inputs.shape[1]
        if T < MIN_LENGTH:
            raise SkipCheck(
                f"seq_len {T} is too short: decoding needs a prefill and {1 + CHUNK} positions after it "
                f"(seq_len >= {MIN_LENGTH})"
            )
        if session.min_seq_len > 1:
            raise SkipCheck(
                f"the model refuses sequences shorter than {session.min_seq_len} tokens: one-token "
                "decoding steps cannot run"
            )
        return Plan.for_length(T, model.windows.widest if model.windows is not None else None)

    def _compare(
        self, decoder: Decoder, model: ModelUnderTest, session: Session, plan: Plan, rows: torch.Tensor
    ) -> Compared:
        """The cached run against the full forward's logits: the session's at the decoded positions (a causal
        model's logits of a prefix are those of the whole rows' first positions), and, once a change goes beyond
        what can pass unexamined, those of a fresh untouched forward of exactly the decoded tokens (a model whose
        logits depend on the row's length is judged at the length it decoded), with the noise floor where it can
        change the verdict. SkipCheck when the full forward's logits hold NaN or Inf."""
        R, L = rows.shape
        truth = session.reference()[:R, :L]  # (R, L, V)
        fresh = tuple(rows.shape) == tuple(session.inputs.shape) and session.reference_untouched
        if nonfinite_positions(truth) and not fresh:
            truth, fresh = session.logits(rows), True
        if nonfinite_positions(truth):
            raise SkipCheck(
                "the full forward's logits hold NaN or Inf: there is nothing to compare the cached "
                "decoding with (shape-ledger and future-token report the NaN)"
            )
        decoded = self._decode(decoder, model, session, plan, rows)
        changes = Changes.of(decoded, truth, plan)
        scale = logit_scale(truth)
        if session.noise_matters(changes.largest(), scale) and not fresh:
            truth, fresh = session.logits(rows), True  # (R, L, V): the untouched forward of the decoded tokens
            scale = logit_scale(truth)
            changes = Changes.of(decoded, truth, plan)
        # Decoding one token at a time reorders the arithmetic: the model's rounding is allowed beside the noise.
        noise, rounding = session.floors(changes.largest(), scale)
        measured = session.noise_matters(changes.largest(), scale)
        return Compared(
            decoded,
            changes,
            truth,
            fresh,
            scale,
            noise if measured else None,
            session.tolerance(scale),
            session.threshold(scale, noise, rounding),
        )

    def _summarise(
        self, decoder: Decoder, plan: Plan, rows: torch.Tensor, compared: Compared, findings: list[Finding]
    ) -> CheckResult:
        """Each part's largest change and the run's size in the metrics; the failing codes, or what matched."""
        threshold, noise = compared.threshold, compared.noise
        largest = {name: float(c.max()) for name, c in compared.changes.parts.items()}
        metrics = {
            "max_change": max(largest.values()),
            "threshold": threshold,
            "tolerance": compared.tolerance,
            "logit_scale": compared.scale,
            "prefill_max_change": largest["prefill"],
            "token_max_change": largest["token-by-token"],
            "chunked_max_change": largest["chunked"],
            "prefill": plan.prefill,
            "decoded": plan.decoded,
            "rows": rows.shape[0],
            "calls": plan.calls,
            "tokens_run": compared.decoded.tokens,
        }
        if compared.chunk_after_prefill is not None:
            metrics["chunk_after_prefill_max_change"] = float(compared.chunk_after_prefill.max())
        if noise is not None:
            metrics["noise_floor"] = noise
        data = {
            "cache_call": decoder.label,
            "chunks": [CHUNK],
            "full_forward": (
                "a forward of the decoded tokens"
                if compared.fresh
                else "the session's logits at the decoded positions (a causal model's prefix)"
            ),
            "noise_floor": "measured"
            if noise is not None
            else ("not measured: nothing moved beyond the tolerance, where no noise floor can change the verdict"),
        }
        failing = [f for f in findings if f.status == Status.FAIL]
        if failing:
            summary = "; ".join(dict.fromkeys(self.codes[f.code] for f in failing))
        else:
            summary = (
                f"prefill {plan.prefill}, then positions {plan.positions('token-by-token')} one token at a time and "
                f"{plan.positions('chunked')} as one chunk over the cache: max change "
                f"{metrics['max_change']:.2g} vs threshold {threshold:.2g}"
            )
        return CheckResult.from_findings(self.name, findings, summary, metrics=metrics, data=data)

    def key_number(self, result: CheckResult) -> str:
        """The largest change of any decoded position against the threshold it was judged by."""
        metrics = result.metrics
        if "max_change" not in metrics:
            return ""
        return f"{metrics['max_change']:.2g} / {metrics['threshold']:.2g}"

    # -- running ----------------------------------------------------------------------------------------------------

    def _decode(self, decoder: Decoder, model, session, plan: Plan, rows: torch.Tensor) -> Decoded:
        """The cached run over the rows, in row groups no larger than the baseline's: the prefill, the one-token
        steps, the chunk, each call over the cache the ones before it filled."""
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in plan.parts}
        for start in range(0, rows.shape[0], session.max_rows):
            group = rows[start : start + session.max_rows]
            prefill, *tokens, chunk = self._replay(decoder, model, session, plan.prefill, plan.steps, group)
            for name, logits in zip(plan.parts, (prefill, torch.cat(tokens, dim=1), chunk), strict=True):
                parts[name].append(logits)
        session.forward_tokens += rows.numel()
        return Decoded({name: torch.cat(chunks) for name, chunks in parts.items()}, rows.numel())

    def _chunk_after_prefill(
        self, decoder: Decoder, model, session, plan: Plan, rows: torch.Tensor, compared: Compared
    ) -> torch.Tensor:
        """Per row and position, the change [R, CHUNK] of the chunk decoded straight after the prefill (positions
        prefill .. prefill + CHUNK - 1) from the full forward's: the same mask over the cache, without what a
        one-token step cached."""
        step = (plan.prefill, CHUNK)
        logits = [
            self._replay(decoder, model, session, plan.prefill, [step], rows[start : start + session.max_rows])[1]
            for start in range(0, rows.shape[0], session.max_rows)
        ]
        session.forward_tokens += rows.shape[0] * (plan.prefill + CHUNK)
        return position_change(torch.cat(logits), compared.truth[:, plan.prefill : plan.prefill + CHUNK])

    def _replay(
        self,
        decoder: Decoder,
        model,
        session,
        prefill: int,
        steps: list[tuple[int, int]],
        rows: torch.Tensor,
        until: int | None = None,
    ) -> list[torch.Tensor]:
        """The prefill of the rows' first `prefill` tokens, then each (start, n) of `steps` over the cache the
        calls before it filled (up to position `until`): logits [B, n, V] of each call, in order."""
        dropout_off = ZeroAttentionDropout() if session.force_zero_dropout else nullcontext()
        length = max([prefill] + [start + n for start, n in steps])
        with torch.no_grad(), dropout_off, attributes_restored(model.module):
            decoder.begin(rows.shape[0], length)
            logits, state = decoder.step(None, rows[:, :prefill], 0)
            out = [logits]
            for start, n in steps:
                if until is not None and start > until:
                    break
                logits, state = decoder.step(state, rows[:, start : start + n], start)
                out.append(logits)
        return out

    # -- judging ----------------------------------------------------------------------------------------------------

    def _findings(self, compared: Compared, plan: Plan) -> list[Finding]:
        """One finding per cause: the prefill (FWD503); the one-token step (FWD501), which says whether the chunk
        after it parts too; the chunk alone (FWD502), where only the queries-fewer-than-keys path is wrong, or
        FWD501 when the same chunk straight after the prefill agrees (the one-token step cached the wrong keys);
        NaN (FWD504)."""
        findings = []
        changes, threshold = compared.changes, compared.threshold
        parted = {name: first_parting(change, threshold) for name, change in changes.parts.items()}
        for name, (offset, _) in plan.parts.items():
            parting = parted[name]
            if parting is None or (name == "chunked" and parted["token-by-token"] is not None):
                continue
            row, index = parting
            position = offset + index
            change = changes.parts[name]
            nonfinite = nonfinite_positions(compared.decoded.parts[name])
            if nonfinite:
                row, index = nonfinite[0]
                findings.append(
                    Finding(
                        "FWD504",
                        Status.FAIL,
                        f"{name} decoding gives NaN or Inf at "
                        f"{len(nonfinite)} position(s) where the full forward is finite",
                        f"{name}, sample {row}, position {offset + index}",
                    )
                )
                continue
            value = float(change[row, index])
            moved = int((change > threshold).any(0).sum())
            base = (
                f"position {position}'s logits differ from the full forward by {value:.3g} (threshold "
                f"{threshold:.3g}); {moved} of {change.shape[1]} positions part"
            )
            after_prefill = compared.chunk_after_prefill
            cached_wrong = after_prefill is not None and bool((after_prefill <= threshold).all())
            code, message = _parted(name, base, plan, parted["chunked"], cached_wrong)
            findings.append(Finding(code, Status.FAIL, message, f"{name}, sample {row}, position {position}"))
        if not findings:
            findings.append(
                Finding(
                    "FWD501",
                    Status.PASS,
                    f"positions {plan.positions('token-by-token')} one token at a time match the full forward "
                    f"(max change {float(changes.parts['token-by-token'].max()):.2g})",
                )
            )
            findings.append(
                Finding(
                    "FWD502",
                    Status.PASS,
                    f"positions {plan.positions('chunked')} as one chunk of {CHUNK} over the cache match it (max "
                    f"change {float(changes.parts['chunked'].max()):.2g})",
                )
            )
        return findings

    # -- where it parts ---------------------------------------------------------------------------------------------

    def _first_layer(
        self, decoder: Decoder, model, session, plan: Plan, rows: torch.Tensor, changes: Changes, threshold: float
    ) -> str | None:
        """The first block of the layer stack whose output parts from the full forward's at the first parting
        position of the first failing part: one hooked full forward of that row's decoded tokens, and a replay of
        the cached run up to that position. None when the model has no layer stack or no block output parts beyond
        rounding."""
        stack = model.layer_stack
        if stack is None:
            return None
        name, row, position = None, 0, 0
        for part, (offset, _) in plan.parts.items():
            first = first_parting(changes.parts[part], threshold)
            if first is not None:
                name, row, position = part, first[0], offset + first[1]
                break
        if name is None:
            return None
        blocks = list(model.module.get_submodule(stack))
        sample = rows[row : row + 1]  # (1, L)
        full = self._block_outputs(blocks, lambda: session.logits(sample))  # per block, per call: (1, n, C)
        steps = [] if name == "prefill" else plan.steps
        cached = self._block_outputs(
            blocks, lambda: self._replay(decoder, model, session, plan.prefill, steps, sample, position)
        )
        if full is None or cached is None:
            return None
        starts = [0] + [start for start, _ in steps if start <= position]
        call, start = len(starts) - 1, starts[-1]
        for i, (whole, calls) in enumerate(zip(full, cached, strict=True)):
            if len(whole) != 1 or len(calls) <= call:
                return None  # a block called more or less often than once per forward: no position to line up
            expected, got = whole[0][0, position], calls[call][0, position - start]  # (C,)
            scale = float(expected.abs().max())
            change = float((got - expected).abs().max())
            if not change <= session.threshold(scale, 0.0):
                return f"first parts at {stack}.{i} (output changed by {change:.3g})"
        return None

    @staticmethod
    def _block_outputs(blocks: list[nn.Module], run: Callable) -> list[list[torch.Tensor]] | None:
        """run() with a forward hook on each block: each block's hidden-state outputs, per call, as float32."""
        seen: list[list[torch.Tensor]] = [[] for _ in blocks]
        handles = []

        def keep(i):
            def hook(module, args, output):
                hidden = first_tensor(output)
                if hidden is not None and hidden.dim() == 3:
                    seen[i].append(hidden.detach().to(torch.float32, copy=True))  # its own: buffers get reused

            return hook

        try:
            handles = [block.register_forward_hook(keep(i)) for i, block in enumerate(blocks)]
            run()
        finally:
            for handle in handles:
                handle.remove()
        return seen


def _parted(name: str, base: str, plan: Plan, chunked: tuple[int, int] | None, cached_wrong: bool) -> tuple[str, str]:
    """(code, message) of a part of the cached run whose logits part from the full forward's: `base` says where and
    by how much; `chunked`, where the chunk parts (None: it agrees), for the one-token step's message;
    `cached_wrong`, whether the chunk that parts agrees when decoded straight after the prefill."""
    P = plan.prefill
    if name == "prefill":
        return (
            "FWD503",
            f"the prefill of {P} tokens with the cache on: {base}. The cache flag changes how "
            "the prompt is computed (or the full forward reads future tokens: see future-token)",
        )
    if name == "token-by-token":
        also = (
            f"the chunk of {CHUNK} after it parts too, from position {P + plan.tokens + chunked[1]}"
            if chunked is not None
            else f"the chunk of {CHUNK} after it agrees"
        )
        return (
            "FWD501",
            f"decoding one token at a time after a prefill of {P}: {base}; {also}. Check the "
            "position the new tokens get (the cache length: not one more, nor restarted at 0 for the "
            "rotary embedding) and what the cache hands back",
        )
    if cached_wrong:
        return (
            "FWD501",
            f"the chunk of {CHUNK} decoded after the one-token steps at {plan.positions('token-by-token')}: {base}, "
            "while those positions agree, and so does the same chunk decoded straight after the prefill: a one-token "
            "step "
            "caches the wrong keys or values (does not append them, stores them before rotation or at another "
            "slot)",
        )
    return (
        "FWD502",
        f"decoding a chunk of {CHUNK} over the cache after a prefill of {P} and {plan.tokens} tokens: {base}, "
        "while one token at a time agrees: the mask of several new queries over the cached keys is likely aligned "
        "top-left (tril over (T_new, T_total) without the past_len offset, or is_causal=True with a "
        "cache) instead of bottom-right",
    )


def first_parting(change: torch.Tensor, threshold: float) -> tuple[int, int] | None:
    """(row, index) of the earliest position whose change exceeds the threshold (NaN counts), or None."""
    parted = ~(change <= threshold)  # (B, n)
    if not bool(parted.any()):
        return None
    index = int(parted.any(0).nonzero()[0])
    row = int(parted[:, index].nonzero()[0])
    return row, index
