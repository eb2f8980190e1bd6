"""The randomness of a forward: every functional form of dropout (the ones the train path zeroes), and the random
draws model code makes itself (`torch.rand_like` in a forward), which no switch of fwdcheck's can turn off.

Dropout modules (nn.Dropout and its kin, nn.RNN/LSTM/GRU's `dropout`) are zeroed by their probability
(fwdcheck/run/model_state.py); what is called as a function is zeroed here, by calling it as in eval (its `training`
argument False): the identity for every dropout, the mean slope for `rrelu`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fwdcheck.observe.locations import model_line


@dataclass(frozen=True)
class RandomForm:
    """A function that draws at random when told it is training: its name as reported, where its `training` flag
    is (position, keyword) and the flag's default, and where its probability is (None: it has none)."""

    name: str
    training_at: int
    training_keyword: str
    training_default: bool
    p_at: int | None = 1


def _forms() -> dict[Any, RandomForm]:
    forms: dict[Any, RandomForm] = {
        F.dropout: RandomForm("F.dropout", 2, "training", True),
        F.alpha_dropout: RandomForm("F.alpha_dropout", 2, "training", False),
        F.feature_alpha_dropout: RandomForm("F.feature_alpha_dropout", 2, "training", False),
        F.dropout1d: RandomForm("F.dropout1d", 2, "training", True),
        F.dropout2d: RandomForm("F.dropout2d", 2, "training", True),
        F.dropout3d: RandomForm("F.dropout3d", 2, "training", True),
        F.rrelu: RandomForm("F.rrelu", 3, "training", False, p_at=None),
    }
    # the ATen forms model code may call directly (torch.dropout(x, p, train)), in place or not
    for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout"):
        for suffix in ("", "_"):
            function = getattr(torch, name + suffix, None)
            if function is not None:
                forms[function] = RandomForm(f"torch.{name}{suffix}", 2, "train", True)
    return forms


RANDOM_FORMS = _forms()


def _argument(args: tuple, kwargs: dict, at: int, keyword: str, default: Any) -> Any:
    return args[at] if len(args) > at else kwargs.get(keyword, default)


def live(func: Any, args: tuple, kwargs: dict) -> tuple[RandomForm, float] | None:
    """(the form, its probability) when this call of a functional dropout draws at random: training with p > 0
    (rrelu: training, its probability read as 1); None for any other call."""
    form = RANDOM_FORMS.get(func)
    if form is None or not _argument(args, kwargs, form.training_at, form.training_keyword, form.training_default):
        return None
    p = 1.0 if form.p_at is None else float(_argument(args, kwargs, form.p_at, "p", 0.5))
    return (form, p) if p > 0 else None


def as_in_eval(func: Any, args: tuple, kwargs: dict) -> Any:
    """The call of a functional dropout made as in eval mode (training False): no draw, the input unchanged."""
    form = RANDOM_FORMS[func]
    if len(args) > form.training_at:
        args = (*args[: form.training_at], False, *args[form.training_at + 1 :])
    else:
        kwargs = {**kwargs, form.training_keyword: False}
    return func(*args, **kwargs)


# The functions that draw at random (torch's random sampling and its in-place forms), named when model code calls
# them in a forward: a draw fwdcheck cannot turn off.
RANDOM_DRAWS = frozenset(
    getattr(owner, name)
    for owner, names in (
        (
            torch,
            (
                "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
                "multinomial", "normal", "poisson",
            ),
        ),
        (
            torch.Tensor,
            (
                "bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "geometric_", "log_normal_",
                "cauchy_", "random_", "multinomial",
            ),
        ),
    )
    for name in names
    if hasattr(owner, name)
)  # fmt: skip


class RandomDraws(TorchFunctionMode):
    """Inside, the random draws model code makes are recorded: (function name, 'path:line') of each call site.
    Functional dropout is not a draw of the model's own: it is zeroed on the train path, so it is not recorded."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str | None]] = []
        self._lines: dict[tuple[str, int], str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_DRAWS:
            site = (getattr(func, "__name__", str(func)), model_line(sys._getframe(1), self._lines))
            if site not in self.seen:
                self.seen.append(site)
        return func(*args, **kwargs)
