"""grad-causality: on the path that trains, no earlier position's output has a gradient from a later position's input
embedding, and no sample's output has one from another sample's.

Exact where future-token is behavioural. future-token perturbs tokens and compares logits within a tolerance, in
eval mode without gradients; this check runs the model in train() mode (every dropout forced to zero) with gradients
enabled, makes the token embedding's output a leaf of the autograd graph (a forward hook on the embedding module),
and backpropagates. The gradient of logits at positions < k with respect to the embeddings at positions >= k is a
sum of products through the graph: for a causal model every path from a later input to an earlier output crosses a
masked attention weight that is exactly 0.0 (exp of -inf, of finfo.min, of any float32 below about -104), and its
backward multiplies by it, so the gradient is exactly 0.0. Any nonzero bit is a path: a leak whatever its size (a
1e-7 mix of a future hidden state, far below a perturbation's tolerance), a mask dropped only when gradients are
enabled or only in train mode (`if self.training:`), a kernel whose backward reads what its forward did not. There is
no threshold to tune and no noise floor to measure.

What runs, for a correct model: one forward of the session's inputs (B rows, cut to a quarter of their length, at
least 16 tokens) and one backward. Row b's loss is a random projection of its logits at positions < k_b, with the
cuts k = T-1, 1, T/2 given to the rows in turn (as future-token's cuts: every position against the last token,
position 0 against every later one, the first half against the second). The one backward asks for the gradient of
the summed losses with respect to the embeddings alone: no weight's gradient is computed, which is most of a
training step's backward (grad-reach asks for those).
The embeddings of row b at positions >= k_b must get exactly zero: from row b itself (a later
token read) and from every other row (samples read each other: row 0's outputs before T-1 reach row 1's positions
from 1 on, where row 1's own loss reaches nothing). Only when something is nonzero does the check take the rows
apart (one backward per row: its own later positions are a position leak, another row's embeddings a batch leak) and
draw the leak map of the first leaking row (one backward per query position, at most MAP_QUERIES of them), and
find where the leak enters: one more forward keeping every module's output, then one backward from each output in
the order the modules completed, until the first whose earlier positions get gradient from later embeddings.

The model is left as found: mode, buffers a train-mode forward writes (running statistics, counters), hooks, and
every parameter's .grad (never written: gradients are asked for with torch.autograd.grad, not accumulated) are put
back by ModelState.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fwdcheck.checks.grad_causality_spec import SPEC
from fwdcheck.checks.grad_causality_view import GradientMap
from fwdcheck.checks.gradients import logits_with_graph
from fwdcheck.checks.train_apart import first_module_apart, train_apart
from fwdcheck.checks.wording import listed, span
from fwdcheck.errors import DoesNotApply, ModelRaised, SkipCheck, first_line
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.observe.frames import output_tensor
from fwdcheck.observe.locations import code_location
from fwdcheck.result import Check, CheckResult, Finding, Status
from fwdcheck.run.compare import logit_scale, nonfinite_positions, position_change
from fwdcheck.run.model_state import ModelState
from fwdcheck.run.session import Session
from fwdcheck.run.train_path import train_path

MAP_QUERIES = 32  # query positions the leak map backpropagates from, one backward each (on a leak only)
MAX_LOCATE = 64  # module outputs backpropagated from, in turn, to find where a leak enters (on a leak only)


def cuts_for(B: int, T: int) -> list[int]:
    """Row b's cut: the first position whose embedding must get no gradient from row b's loss. T-1, 1 and T/2 in
    turn (future-token's cuts), repeated over the rows."""
    cuts = list(dict.fromkeys(k for k in (T - 1, 1, T // 2) if 1 <= k < T))
    return [cuts[b % len(cuts)] for b in range(B)]


def caller_line(model: ModelUnderTest, name: str) -> str | None:
    """'path:line' of the forward of the module that calls `name`, where `name` is one of torch's own layers (an
    nn.Linear: its file is torch's, and the code to look at feeds it); None for a module with code of the model's
    (the report names its class) or a caller with none."""
    modules = dict(model.module.named_modules())
    if not type(modules[name]).__module__.startswith("torch."):
        return None
    caller = modules.get(name.rpartition(".")[0])
    if caller is None:
        return None
    try:
        forward = type(caller).forward
        path, line = inspect.getsourcefile(forward), inspect.getsourcelines(forward)[1]
    except (OSError, TypeError):
        return None
    return code_location(path, line) if path and not type(caller).__module__.startswith("torch.") else None


def token_embedding(model: ModelUnderTest) -> tuple[str, nn.Module] | None:
    """The module that turns token ids into vectors: the model's own accessor (transformers' get_input_embeddings),
    else the nn.Embedding with one row per token of the vocabulary, else the first nn.Embedding; None if none."""
    named = {module: name for name, module in model.module.named_modules()}
    getter = getattr(model.module, "get_input_embeddings", None)
    if callable(getter):
        try:
            embedding = getter()
        except Exception:  # a model's accessor may not be implemented (NotImplementedError): look at the modules
            embedding = None
        if isinstance(embedding, nn.Module) and embedding in named:
            return named[embedding], embedding
    tables = [(name, m) for name, m in model.module.named_modules() if isinstance(m, nn.Embedding)]
    for name, table in tables:
        if table.num_embeddings == model.vocab_size:
            return name, table
    return tables[0] if tables else None


@dataclass
class Leaves:
    """The embedding's outputs of one forward, each replaced by a leaf that requires grad: the backward stops there."""

    shape: tuple[int, ...]  # (B, T): the ids' shape, which every output must lead with
    leaves: list[torch.Tensor] = field(default_factory=list)
    refused: list[list[int]] = field(default_factory=list)  # shapes of outputs that do not lead with (B, T)

    def hook(self, module: nn.Module, args: tuple, output: object) -> object:
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        if tuple(output.shape[:2]) != self.shape:
            self.refused.append(list(output.shape))
            return None
        leaf = output.detach().requires_grad_(True)
        self.leaves.append(leaf)
        return leaf.clone()  # not the leaf itself: model code may add to its embeddings in place (x += pos)


@dataclass
class Graph:
    """One forward with gradients: the logits [B, T, V] and the embedding leaves they were computed from."""

    logits: torch.Tensor
    leaves: Leaves
    outputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (module, output) as each completed

    def gradients(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient of `loss` at the embeddings, [B, T, d] summed over the embedding's calls (0.0 where it does
        not reach). Only the leaves are asked for: autograd computes no weight's gradient. The graph is kept."""
        grads = torch.autograd.grad(loss, self.leaves.leaves, retain_graph=True, allow_unused=True)
        per_call = [
            g.float() if g is not None else torch.zeros_like(leaf, dtype=torch.float32)
            for g, leaf in zip(grads, self.leaves.leaves, strict=True)
        ]
        return torch.stack(per_call).sum(0) if len(per_call) > 1 else per_call[0]


def reached(grad: torch.Tensor) -> torch.Tensor:
    """Per position of a [..., T, d] gradient: whether a finite nonzero value reached it. NaN or Inf is no evidence
    of a path (0.0 times NaN is NaN: a NaN anywhere in the backward spreads through masked weights too): FWD123."""
    return ((grad != 0) & grad.isfinite()).any(-1)


# The rows are cut to a quarter of the session's length, at least SHORTEST tokens: a leak into earlier positions
# through the gradient is exact, any nonzero bit, and shows at any length (the cuts at T - 1, 1 and T/2 over the
# rows), while a forward with gradients and its backward cost two forwards' tokens; a default check runs in every
# default run. A quarter keeps its cost a fixed share of a forward at any length (about half a forward), and a train
# path that breaks only past some length is seen up to T/4 of the session's (a leak in eval past it is
# future-token's, over the whole rows).
SHORTEST = 16


def rows_length(session: Session) -> int:
    """Tokens of the rows the check runs: a quarter of the session's, at least SHORTEST and the shortest length the
    model takes (inputs.min_seq_len, or learned from a refusal), at most the session's."""
    T = session.inputs.shape[1]
    return min(T, max(SHORTEST, T // 4, session.min_seq_len))


class GradCausality(Check, declared=SPEC):
    name = "grad-causality"

    def key_number(self, result: CheckResult) -> str:
        m = result.metrics
        if "leaked_pairs" in m and m["leaked_pairs"]:
            return f"{m['leaked_pairs']} pairs"
        if m.get("max_gradient_after_cut") is not None:
            return f"{m['max_gradient_after_cut']:.2g} / 0"
        return ""

    def run(self, model: ModelUnderTest, session: Session) -> CheckResult:
        if not model.causal:
            raise DoesNotApply(f"{model.pattern.describe()}: later positions may reach earlier ones by design")
        found = token_embedding(model)
        if found is None:
            raise DoesNotApply(
                "no token embedding to hook (no get_input_embeddings(), no nn.Embedding): the gradient at the "
                "inputs has nowhere to be read"
            )
        embedding_name, embedding = found
        # The eval path first (the session's shared logits): a model whose forward raises there too is the model's
        # error, as every check reports it, not a train path it cannot run
        session.reference()
        ids = session.inputs[:, : rows_length(session)]  # (B, T): T a quarter of the session's, at least 16
        B, T = ids.shape
        cuts = cuts_for(B, T)
        generator = torch.Generator().manual_seed(session.settings.inputs.seed)
        state = ModelState.take(model.module)
        try:
            with train_path(model.module):
                try:
                    graph = self._forward(model, session, embedding_name, embedding, ids)
                except ModelRaised as exc:  # as the code-path matrix's train cell: no verdict on a path it cannot run
                    raise SkipCheck(f"the model cannot run in train mode (dropout off): {exc}") from None
                train_logits = graph.logits.detach().float().clone()  # (B, T, V): the train path's, compared below
                losses = self._losses(graph, cuts, generator)
                try:
                    at_embeddings = graph.gradients(torch.stack(losses).sum())  # (B, T, d)
                except RuntimeError as exc:  # no backward for some operation (integer-only, a kernel without one)
                    raise SkipCheck(f"the backward cannot run: {first_line(exc)}") from None
                findings, metrics, data = self._judge_screen(at_embeddings, cuts, graph, losses, T)
                calls = len(graph.leaves.leaves)
                if "leak_row" in metrics:  # where the leak enters: one more forward, on a leak only
                    del graph, losses  # the screen's graph and gradients freed first
                    row = metrics["leak_row"]
                    entry = self._entry(model, session, embedding_name, embedding, ids, row, cuts[row])
                    self._say_entry(model, findings, *entry)
        finally:
            written = state.restore()
            if written:
                session.notes.append(
                    f"grad-causality: the train-mode forward wrote {listed(written)} in place; put back as found"
                )
        findings += self._train_apart(model, session, train_logits, metrics, written)
        metrics["cuts"] = cuts
        data["notes"] = [
            f"train() mode, dropout forced to zero, gradients at the output of {embedding_name} "
            f"({calls} call{'s' if calls != 1 else ''}); "
            f"row cuts {', '.join(f'{b}:{k}' for b, k in enumerate(cuts))}"
            + ("" if B > 1 else "; batch of one: samples not compared")
        ]
        return CheckResult.from_findings(
            self.name, findings, self._summary(findings, metrics, B), metrics=metrics, data=data
        )

    # -- the train path against eval ---------------------------------------------------------------------------------

    def _train_apart(
        self, model, session, train_logits: torch.Tensor, metrics: dict, updated: list[str]
    ) -> list[Finding]:
        """The train path's logits against eval's (dropout off on both), judged as future-token judges a change
        (fwdcheck/checks/train_apart.py); `updated`: the buffers the train-mode forward wrote."""
        if nonfinite_positions(session.reference()):
            return []  # eval's own logits hold NaN or Inf: nothing to hold the train path to (future-token says so)
        T = train_logits.shape[1]
        if T == session.inputs.shape[1]:
            change, scale = session.change_from_reference(train_logits)  # (B, T)
        else:
            change, scale = self._prefix_change(session, train_logits)
        locate = lambda: self._first_apart(model, session, T)  # noqa: E731 -- run only when they part
        return train_apart("FWD126", model, session, change, scale, locate, metrics, updated)

    @staticmethod
    def _prefix_change(session, train_logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The train path's logits of the rows' first T tokens against eval's: the reference's at those positions
        (a causal model's do not depend on what follows), and once they part beyond what passes unexamined, an
        untouched eval forward of the same T tokens, so that a model reading later tokens is not said to compute
        otherwise in training."""
        T = train_logits.shape[1]
        reference = session.reference()[:, :T]  # (B, T, V)
        scale = logit_scale(reference)
        change = position_change(train_logits, reference)  # (B, T)
        if session.noise_matters(float(change.max()), scale):
            reference = session.logits(session.inputs[:, :T])  # (B, T, V)
            scale = logit_scale(reference)
            change = position_change(train_logits, reference)
        return change, scale

    def _first_apart(self, model, session, T: int) -> str | None:
        """One eval and one train forward of the first row's first T tokens, every module's output kept."""
        row = session.inputs[:1, :T]  # (1, T)
        state = ModelState.take(model.module)
        try:
            return first_module_apart(model, lambda: session.logits(row), lambda: self._train_forward(model, row))
        finally:
            state.restore()

    @staticmethod
    def _train_forward(model, row):
        with train_path(model.module):
            return model.forward(row)

    # -- measure ------------------------------------------------------------------------------------------------------

    def _forward(self, model, session, embedding_name, embedding, ids, keep_outputs: bool = False) -> Graph:
        """One forward of `ids` with gradients, the embedding's outputs made leaves; with keep_outputs, every
        module's output [B, T, ...] that carries gradient kept as the module completes (to find where a leak
        enters)."""
        leaves = Leaves(tuple(ids.shape))
        outputs: list[tuple[str, torch.Tensor]] = []

        def keep(name: str, output: object) -> None:
            tensor = output_tensor(output)
            if tensor is not None and tensor.requires_grad and tuple(tensor.shape[:2]) == tuple(ids.shape):
                outputs.append((name, tensor))

        handles = [embedding.register_forward_hook(leaves.hook)]
        for name, module in model.module.named_modules() if keep_outputs else ():
            if module is not model.module and module is not embedding:
                handles.append(module.register_forward_hook(lambda _, __, out, name=name: keep(name, out)))
        logits = logits_with_graph(model, session, ids, handles)  # (B, T, V)
        if not leaves.leaves:
            why = (
                f"its outputs were {leaves.refused}, not [B, T, d] for ids {list(ids.shape)}"
                if leaves.refused
                else "it was not called with the token ids"
            )
            raise SkipCheck(f"the token embedding {embedding_name} gives nothing to hook: {why}")
        if not logits.requires_grad:
            raise SkipCheck(
                f"the logits carry no gradient back to the output of {embedding_name}: the forward has no "
                "differentiable path from the embeddings (detached, integer-only, or run under no_grad)"
            )
        return Graph(logits, leaves, outputs)

    @staticmethod
    def _losses(graph: Graph, cuts: list[int], generator: torch.Generator) -> list[torch.Tensor]:
        """Row b's loss: its logits at positions < cuts[b] in one random direction over the vocabulary, shared by
        its positions (a leak's gradient cancels only for directions of measure zero, and B x V draws cost nothing
        beside B x T x V)."""
        B, _, V = graph.logits.shape
        projection = torch.randn(B, 1, V, generator=generator).to(graph.logits.device)
        return [(graph.logits[b, : cuts[b]].float() * projection[b]).sum() for b in range(B)]

    # -- judge --------------------------------------------------------------------------------------------------------

    def _judge_screen(self, grad, cuts, graph, losses, T) -> tuple[list[Finding], dict, dict]:
        """The screen's gradient at the embeddings: exactly zero at row b's positions >= k_b."""
        B = grad.shape[0]
        metrics: dict = {}
        data: dict = {}
        after = torch.cat([grad[b, cuts[b] :].flatten() for b in range(B)])
        metrics["max_gradient_after_cut"] = float(after.abs().max()) if after.numel() else 0.0
        before = torch.cat([grad[b, : cuts[b]].flatten() for b in range(B)])
        metrics["max_gradient_before_cut"] = float(before.abs().max())
        nonfinite = (~grad.isfinite()).any(-1)  # (B, T)
        findings: list[Finding] = []
        if bool(nonfinite.any()):
            rows, positions = nonfinite.nonzero(as_tuple=True)
            metrics["nonfinite_positions"] = int(nonfinite.sum())
            findings.append(
                Finding(
                    "FWD123",
                    Status.FAIL,
                    f"the gradient at the input embeddings is NaN or Inf at {int(nonfinite.sum())} (row, position) "
                    "pairs: the backward of the logits is broken there, and those positions cannot be judged",
                    where=f"row {int(rows[0])} position {int(positions[0])}",
                )
            )
        if not any(bool(reached(grad[b, cuts[b] :]).any()) for b in range(B)):
            metrics["leaked_pairs"] = 0
            return findings, metrics, data
        findings += self._locate(graph, losses, cuts, T, metrics, data)
        return findings, metrics, data

    def _locate(self, graph, losses, cuts, T, metrics, data) -> list[Finding]:
        """Take the rows apart: row b's loss alone reaching its own positions >= k_b is a position leak, reaching
        another row a batch leak. Then the leak map of the first row with a position leak."""
        B = len(cuts)
        findings: list[Finding] = []
        position_rows: list[int] = []
        batch_pairs: list[tuple[int, int]] = []  # (reading row, row read)
        for b in range(B):
            grad = graph.gradients(losses[b])
            later = reached(grad[b, cuts[b] :])
            if bool(later.any()):
                position_rows.append(b)
            batch_pairs += [(b, other) for other in range(B) if other != b and bool(reached(grad[other]).any())]
        if batch_pairs:
            reader, read = batch_pairs[0]
            findings.append(
                Finding(
                    "FWD122",
                    Status.FAIL,
                    f"samples read each other: {len(batch_pairs)} (row, other row) pair"
                    f"{'s' if len(batch_pairs) > 1 else ''} with a nonzero gradient, e.g. row {reader}'s logits "
                    f"before position {cuts[reader]} from row {read}'s embeddings",
                    where=f"row {reader} <- row {read}",
                )
            )
            metrics["batch_pairs"] = len(batch_pairs)
        if not position_rows:
            metrics["leaked_pairs"] = 0
            return findings
        row = metrics["leak_row"] = position_rows[0]
        shown_map, pairs, largest = self._leak_map(graph, row, T)
        metrics["leaked_pairs"] = len(pairs)
        metrics["max_leaked_gradient"] = largest
        data["gradient_map"] = shown_map
        shown = ", ".join(f"({q}, {k})" for q, k in pairs[:6]) + (" ..." if len(pairs) > 6 else "")
        queries = sorted({q for q, _ in pairs})
        findings.append(
            Finding(
                "FWD121",
                Status.FAIL,
                f"earlier logits have a nonzero gradient (up to {largest:.3g}; the bar is exactly 0) from later "
                f"tokens' embeddings at {len(pairs)} (query, later position) pairs of row {row}: {shown}"
                if pairs
                else f"row {row}'s logits before position {cuts[row]} have a nonzero gradient from its later "
                "tokens' embeddings (the map's queries show none: the leak reaches queries beyond them)",
                where=f"row {row} queries {span(queries)}" if queries else f"row {row}",
            )
        )
        return findings

    def _entry(self, model, session, embedding_name, embedding, ids, row: int, cut: int) -> tuple[str | None, int]:
        """The first module, in the order modules complete, whose output at row's positions < cut has a nonzero
        gradient from the row's embeddings at positions >= cut, and how many were tried. One more forward keeping
        every module's output, then one backward from each output in turn (each through the part of the graph
        before it) until one shows the leak, at most MAX_LOCATE."""
        graph = self._forward(model, session, embedding_name, embedding, ids, keep_outputs=True)
        generator = torch.Generator().manual_seed(0)
        tried = graph.outputs[:MAX_LOCATE]
        for name, output in tried:
            direction = torch.randn(output.shape[2:], generator=generator).to(output.device)
            grad = graph.gradients((output[row, :cut].float() * direction).sum())
            if bool(reached(grad[row, cut:]).any()):
                return name, len(tried)
        return None, len(tried)

    @staticmethod
    def _say_entry(model: ModelUnderTest, findings: list[Finding], module: str | None, tried: int) -> None:
        leak = next(f for f in findings if f.code == "FWD121")
        if module is None:
            leak.message += f"; no module's output among the first {tried} shows it (the leak is after them)"
            return
        leak.module = module
        leak.source = caller_line(model, module)
        leak.message += (
            f"; first seen at the output of {module} (no module that completed before it shows it: the leak is in "
            "it, or in the code between it and the module before)"
        )

    def _leak_map(self, graph: Graph, row: int, T: int) -> tuple[GradientMap, list[tuple[int, int]], float]:
        """One backward per query position q (the first MAP_QUERIES): the gradient of row's logits at q, in a random
        direction over the vocabulary, at every position's embedding; per position its largest magnitude (inf for
        NaN or Inf). The (query, later position) pairs with a finite nonzero gradient are the leak."""
        queries = range(min(T - 1, MAP_QUERIES))
        generator = torch.Generator().manual_seed(0)
        V = graph.logits.shape[-1]
        magnitude = torch.zeros(len(queries), T)  # (query, key)
        for q in queries:
            direction = torch.randn(V, generator=generator).to(graph.logits.device)
            grad = graph.gradients((graph.logits[row, q].float() * direction).sum())
            per_key = grad[row].abs().amax(-1)  # (T,)
            magnitude[q] = torch.where(grad[row].isfinite().all(-1), per_key, torch.inf).cpu()
        pairs = [(q, k) for q in queries for k in range(q + 1, T) if 0 < magnitude[q, k] < torch.inf]
        largest = max((float(magnitude[q, k]) for q, k in pairs), default=0.0)
        return GradientMap(row=row, length=T, gradient=magnitude.tolist()), pairs, largest

    def _summary(self, findings: list[Finding], metrics: dict, B: int) -> str:
        bad = [f for f in findings if f.status != Status.PASS]
        if bad:
            return bad[0].message
        samples = " and from other samples" if B > 1 else ""
        return f"earlier logits get exactly 0.0 gradient from later tokens{samples} (cuts {metrics['cuts']})"
