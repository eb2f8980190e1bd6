"""How fwdcheck calls a model's forward, in one place: the module's own call convention, the config's `forward:`
adapter, and what a call-convention failure tells the user.

The adapter contract. `forward: "package.module:function"` in the model section (`forward=` in check_model) names

    def function(model, input_ids, **extras): ...

which every check calls instead of `model(input_ids, **extras)`: the plain forward, the code-path matrix, packing and
label-shift alike. `input_ids` are the token ids [B, T]; `extras` are the keyword arguments a check passes, each
only by the check that needs it, under the name the model's capability declares:

    position_ids=[B, T]                        any check, where forward takes position_ids
    <loss.argument>=labels [B, T]              label-shift (`loss: {argument: labels}`)
    <packing.argument>=[B, T] ids or a mask    packing (`packing: {form: document_ids, argument: document_ids}`)

It returns what the checks read from a forward: the logits [B, T, V], or an object, a mapping or a tuple that
carries them (and the loss at `loss.output`, when label-shift asks with labels).

An adapter takes the extras its signature names, or all of them with a `**extras` parameter. One that says it drops
them (`**_`, `**_kwargs`: an underscore name) or does not name a check's extra is a logits adapter: that check calls
the module's own forward with its extras, as it would without an adapter, rather than hand the adapter documents or
labels it would silently drop. kv-cache drives the module by its declared cache protocol (`cache:`), and compares
with the full forward, the adapter's.

Without an adapter the module is called `module(input_ids, **extras)`, or `module(input_ids=..., **extras)` when
its forward takes no positional argument (`forward(self, *, input_ids)`, or `tokens` / `idx` keyword-only).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn as nn

from fwdcheck.model.call_convention import adapter_hint, call_for, is_call_convention

# What the ids may be called by a forward that takes them by keyword only, in the order they are tried.
ID_KEYWORDS = ("input_ids", "tokens", "idx", "input", "ids", "x")

# What Python says when a call does not fit forward's signature (torch's "takes 1 positional argument but 2 were
# given", "got an unexpected keyword argument", "missing 1 required positional argument", ...).
_CONVENTION = re.compile(
    r"forward\(\) (takes|got an unexpected|got multiple|missing \d+ required)|takes no (keyword )?arguments"
)


def call_forward(module: nn.Module, adapter: Callable[..., Any] | None, input_ids: torch.Tensor, **extras: Any) -> Any:
    """One call of the model's forward with the token ids and a check's extras, by the config's adapter when it
    names one, else by the module's own convention (see the module's docstring)."""
    if adapter is not None:
        return adapter(module, input_ids, **extras)
    keyword = ids_keyword(module)
    if keyword is not None:
        return module(**{keyword: input_ids}, **extras)
    return module(input_ids, **extras)


def adapter_takes(adapter: Callable[..., Any], extras: Collection[str]) -> bool:
    """Whether the adapter takes these extras: each one by name, or all by a `**extras` parameter whose name does
    not start with an underscore (`**_` says it drops them)."""
    try:
        parameters = inspect.signature(adapter).parameters
    except (TypeError, ValueError):
        return False
    named = {
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD and not p.name.startswith("_") for p in parameters.values())
    return all(name in named for name in extras) or passes_on


def ids_keyword(module: nn.Module) -> str | None:
    """The keyword forward takes its token ids by when it takes no positional argument (`forward(self, *,
    input_ids)`); None when it takes them positionally, or its signature cannot be read."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return None
    keywords = [p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    named = next((name for name in ID_KEYWORDS if any(p.name == name for p in keywords)), None)
    required = [p.name for p in keywords if p.default is inspect.Parameter.empty]
    return named or (required[0] if required else None)


def call_convention_hint(exc: BaseException) -> str:
    """For an exception that says a call did not fit forward's signature, what to do about it: the `forward:`
    adapter, with the call it would make (fwdcheck/model/call_convention.py words it for every such finding and for
    `fwdcheck explain FWD002`); "" for any other exception."""
    if not isinstance(exc, TypeError) or not (_CONVENTION.search(str(exc)) or is_call_convention(exc)):
        return ""
    return adapter_hint(call_for(exc))
