"""Checks are found through the entry-point group `fwdcheck.checks`, the built-ins included (as flake8 finds pyflakes).

Entry points are listed as cheap records and imported only when a check is used, so `fwdcheck list` of a hundred
plugins imports none of them and a plugin that fails to import breaks only itself.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.metadata import entry_points

from fwdcheck.errors import CheckLoadError, UsageError

GROUP = "fwdcheck.checks"
BUILTIN_ORDER = ("shape-ledger", "future-token", "mask-audit", "rope")


@dataclass(frozen=True)
class CheckEntry:
    name: str
    value: str  # "package.module:Class"
    distribution: str  # where it comes from, e.g. "fwdcheck 0.1.0"

    @property
    def label(self) -> str:
        return f"{self.distribution.split()[0]}[{self.name}]"

    def load(self):
        """The Check instance; CheckLoadError naming the plugin when it cannot be imported or built."""
        from fwdcheck.model import resolve_callable
        from fwdcheck.result import Check

        try:
            cls = resolve_callable(self.value, what=f"check {self.label}")
            check = cls()
        except Exception as exc:
            raise CheckLoadError(f"check {self.label} ({self.value}) failed to load: {exc}") from exc
        if not isinstance(check, Check) and not callable(getattr(check, "run", None)):
            raise CheckLoadError(f"check {self.label} ({self.value}) has no run(model, session) method")
        return check


def available() -> dict[str, CheckEntry]:
    """Every registered check by name, built-ins first in their documented order."""
    found: dict[str, CheckEntry] = {}
    for ep in entry_points(group=GROUP):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown"
        found.setdefault(ep.name, CheckEntry(ep.name, ep.value, dist))
    if not found:
        raise UsageError("no checks are registered: is fwdcheck installed (`pip install -e .`)?")
    order = {name: i for i, name in enumerate(BUILTIN_ORDER)}
    return dict(sorted(found.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))


def select(names: list[str] | None) -> list[CheckEntry]:
    """The entries for the given names (all when None); an unknown name is a usage error listing the known ones."""
    registered = available()
    if names is None:
        return list(registered.values())
    chosen = []
    for name in names:
        if ":" in name:  # a check class named directly, module:Class
            chosen.append(CheckEntry(name.split(":")[-1], name, "direct"))
            continue
        if name not in registered:
            close = difflib.get_close_matches(name, list(registered), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UsageError(f"unknown check '{name}'; {hint}known: {', '.join(registered)}")
        if registered[name] not in chosen:
            chosen.append(registered[name])
    return chosen
