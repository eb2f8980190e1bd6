"""Checks are found through the entry-point group `fwdcheck.checks`, the built-ins included (as flake8 finds pyflakes).

Entry points are listed as cheap records and imported only when a check is used, so listing a hundred plugins imports
none of them and a plugin that fails to import breaks only itself: its check reports status `error` naming the plugin
(`dist[name]`), the other checks run, the exit code is 1.

A config (or `--check`) may also name a check class directly as `package.module:Class`, without registering it; the
module is imported as installed, or from the working directory.
"""

from __future__ import annotations

import difflib
import functools
import os
import sys
from contextlib import suppress
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from fwdcheck.config.validation_words import in_plain_words
from fwdcheck.errors import CheckLoadError, UsageError

if TYPE_CHECKING:  # pydantic is imported on use: listing the checks must stay cheap
    from pydantic import BaseModel

GROUP = "fwdcheck.checks"
BUILTIN_DIST = "fwdcheck"
LAST = 100  # Check.order of a check that declares none: after the built-ins
DIRECT = "direct"  # the distribution of a check named as module:Class, not registered


@dataclass(frozen=True)
class CheckEntry:
    name: str
    value: str  # "package.module:Class"
    distribution: str  # where it comes from, e.g. "fwdcheck 0.1.0"; "direct" for module:Class named in a config

    @property
    def label(self) -> str:
        """How messages name the check: `dist[name]` for a registered one, the reference itself for a direct one."""
        if self.distribution == DIRECT:
            return self.value
        return f"{self.distribution.split()[0]}[{self.name}]"

    def load(self):
        """The Check instance; CheckLoadError naming the plugin when it cannot be imported or built."""
        from fwdcheck.config.callables import (  # on use: it imports torch; listing must not
            on_sys_path,
            resolve_callable,
        )

        # A direct reference may name a module beside the user's files, as `python -m` would find it.
        is_direct = self.distribution == DIRECT
        search = [os.getcwd()] if is_direct else []
        try:
            with on_sys_path(search):
                cls = resolve_callable(self.value, what="class" if is_direct else "entry point")
                check = cls()
        except (Exception, SystemExit) as exc:  # SystemExit: a plugin calling sys.exit() at import breaks only itself
            reason = exc if not isinstance(exc, SystemExit) else f"SystemExit({exc.code!r}) while importing"
            raise CheckLoadError(f"check {self.label} failed to load: {reason}") from exc
        if not callable(getattr(check, "run", None)):  # a Check subclass, or any object that runs like one
            raise CheckLoadError(f"check {self.label} ({self.value}) has no run(model, session) method")
        collision = code_collision(self, dict(getattr(check, "codes", {})))
        if collision:
            raise CheckLoadError(f"check {self.label} {collision}")
        return check


@dataclass(frozen=True)
class CheckInfo:
    """What a check declares, and `fwdcheck list` and `explain` show of it. fwdcheck's own checks write theirs as one
    CheckInfo in a torch-free module beside each check (spec_of); a plugin's are its class attributes of these
    names."""

    description: str
    explain: str = ""
    codes: dict[str, str] = field(default_factory=dict)
    default: bool = True  # in the default selection (a config without `checks:`)
    order: int = LAST
    detail_view: str | None = None  # "module:function" drawing its data in the terminal
    options: str | None = None  # "module:Class" of its options model (pydantic, torch-free)
    flags: dict[str, str] = field(default_factory=dict)  # command-line flag -> the option it sets
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # command-line flag -> the file it reads or writes
    needs_values: bool = True  # False: runs on the meta device
    one_process: str | None = None  # why a distributed run cannot run it
    opens_distributed_runs: bool = False  # a distributed run starts with it
    former_keys: dict[str, str] = field(default_factory=dict)  # former top-level config key -> the option it sets
    ends_distributed_runs: str | None = None  # its code that, failed, ends a distributed run's checks
    applies_when: str = ""  # the models (or runs) it applies to, in words; "" when it applies to every model


def info(entry: CheckEntry) -> CheckInfo:
    """A check's description, explanation, finding codes and the rest of its declaration, without importing the check
    where it can be helped: importing a check imports torch, seconds that `list` and `explain` need not spend.
    fwdcheck's own checks' are imported from their spec modules (spec_of); a registered plugin's are read from its
    module's source when the class writes them as literals. Otherwise (a computed attribute, an inherited one, a
    module:Class named directly) the check is loaded."""
    declared = spec_of(entry)
    if declared is None and entry.distribution != DIRECT:
        declared = _literal_info(entry)
    if declared is not None:
        return declared
    check = entry.load()
    attributes: dict[str, Any] = {"description": check.description}
    for name, default in _INFO_DEFAULTS.items():
        value, kinds = getattr(check, name, default), _INFO_FIELDS[name]
        # a mapping declared as any Mapping is read as a dict, an order as an int, a flag's truth as a bool
        attributes[name] = (
            dict(value) if dict in kinds else int(value) if int in kinds else bool(value) if bool in kinds else value
        )
    return CheckInfo(**attributes)


SPEC_OF = "_spec"  # fwdcheck.checks.golden:Golden is declared by fwdcheck.checks.golden_spec:SPEC
BUILTIN_PACKAGE = "fwdcheck.checks."


def spec_of(entry: CheckEntry) -> CheckInfo | None:
    """What one of fwdcheck's own checks declares: `fwdcheck.checks.NAME:Class` is declared by the CheckInfo `SPEC`
    of `fwdcheck.checks.NAME_spec`, a torch-free module imported as any other (the class reads it: `class
    Class(Check, declared=SPEC)`). None for any other check, or a built-in without one (it is then loaded)."""
    import importlib

    module = entry.value.partition(":")[0]
    if not module.startswith(BUILTIN_PACKAGE):
        return None
    try:
        declared = getattr(importlib.import_module(module + SPEC_OF), "SPEC", None)
    except ImportError:
        return None
    return declared if isinstance(declared, CheckInfo) else None


def _literal_info(entry: CheckEntry) -> CheckInfo | None:
    """A plugin's declaration when its class body writes it as literals, read off the module's source (not imported:
    listing a hundred plugins imports none of them); None otherwise."""
    import importlib.util

    module_name, _, class_name = entry.value.partition(":")
    try:
        spec = importlib.util.find_spec(module_name)
        origin = spec.origin if spec else None
        stat = os.stat(origin) if origin else None
    except (ImportError, ValueError, OSError):  # its package does not import: load() names the problem
        return None
    if stat is None:
        return None
    version = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)  # ctime: a copy that kept the mtime
    return _literal_classes(origin, version).get(class_name)


def read_builtin_declarations() -> None:
    """Import what fwdcheck's own checks declare (their spec modules), as select() reads it, importing no plugin: what
    a fork server does once for the workers it forks (fwdcheck/process/forkserver.py)."""
    for entry in _registered():
        if _is_builtin(entry):
            spec_of(entry)


@functools.lru_cache(maxsize=256)
def _literal_classes(path: str, version: tuple) -> dict[str, CheckInfo]:
    """The CheckInfo of each class in a plugin's file whose attributes are literals: the file parsed once per version
    of it (selecting the checks asks for each one's order and default more than once)."""
    import ast

    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read())
    except (SyntaxError, ValueError, OSError):
        return {}
    found: dict[str, CheckInfo] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            values = _literal_attributes(node)
            if _declares_literally(values):
                fields = {name: values[name] for name in _INFO_FIELDS if name in values}
                found.setdefault(node.name, CheckInfo(**fields))
    return found


def _field_kinds(hint: Any) -> tuple[type, ...]:
    """The types a value of a CheckInfo field may have, from its annotation: `dict[str, str]` -> (dict,),
    `str | None` -> (str, NoneType)."""
    import types
    import typing

    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(kind for arg in typing.get_args(hint) for kind in _field_kinds(arg))
    return (typing.get_origin(hint) or hint,)


def _info_fields() -> tuple[dict[str, tuple[type, ...]], dict[str, Any]]:
    """What CheckInfo reads off a plugin's check, read off CheckInfo itself: each field's types and its default. One
    list (CheckInfo's fields) says what a check declares; the built-ins' spec modules are CheckInfos, and the literal
    reader and the loaded check's both follow it."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(CheckInfo)
    fields = dataclasses.fields(CheckInfo)
    kinds = {f.name: _field_kinds(hints[f.name]) for f in fields}
    defaults = {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in fields
        if f.name != "description"  # the one a check must declare
    }
    return kinds, defaults


# What CheckInfo reads off a plugin's class body: the types each literal may have, and each field's default
# (description has none: a check declares it).
_INFO_FIELDS, _INFO_DEFAULTS = _info_fields()


def _literal_attributes(node) -> dict[str, Any]:
    """The class attributes assigned a literal (`name = ...` or `name: T = ...`); a computed one is left out."""
    import ast

    values = {}
    for statement in node.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        if isinstance(target, ast.Name):
            with suppress(ValueError):  # ValueError: computed, not a literal
                values[target.id] = ast.literal_eval(value)
    return values


def _declares_literally(values: dict[str, Any]) -> bool:
    """Whether a class's literals make a whole CheckInfo: a description, and every other field it gives well typed
    (a file flag's declaration a mapping)."""
    return (
        isinstance(values.get("description"), str)
        and all(isinstance(values[name], kind) for name, kind in _INFO_FIELDS.items() if name in values)
        and all(isinstance(does, dict) for does in values.get("files", {}).values())
    )


def available() -> dict[str, CheckEntry]:
    """Every registered check by name, built-ins first in their documented order.

    A plugin registering a name fwdcheck already uses does not replace the built-in; between two plugins with the
    same name, the first distribution on sys.path wins (as Python's own imports do)."""
    found: dict[str, CheckEntry] = {}
    for entry in _registered():
        known = found.get(entry.name)
        if known is None or (_is_builtin(entry) and not _is_builtin(known)):
            found[entry.name] = entry
    if not found:
        raise UsageError("no checks are registered: is fwdcheck installed (`pip install -e .`)?")
    return dict(sorted(found.items(), key=lambda item: (_order(item[1]), item[0])))


def _registered() -> list[CheckEntry]:
    """An entry for each entry point of the group, in the order importlib.metadata lists them (nothing imported).
    Read once per state of the import path: scanning every distribution's metadata costs some 15 ms, and a run asks
    for the registered checks several times (the selection, each check's options)."""
    return list(_entries_on(_import_path_state()))


def _import_path_state() -> tuple[tuple[str, int | None], ...]:
    """sys.path, and when each of its directories last changed: a distribution installed or a dist-info directory
    added on the path changes one or the other."""
    state: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:  # not there (yet): its appearance changes the state
            state.append((entry, None))
    return tuple(state)


@functools.lru_cache(maxsize=8)
def _entries_on(path_state: tuple) -> tuple[CheckEntry, ...]:
    return tuple(
        CheckEntry(ep.name, ep.value, f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown")
        for ep in entry_points(group=GROUP)
    )


def _order(entry: CheckEntry) -> int:
    """A check's declared order, read without importing it: a plugin whose order is not a literal (or that does
    not load) goes after the built-ins, as listing must not import a hundred plugins to sort them."""
    declared = spec_of(entry) or _literal_info(entry)
    return declared.order if declared is not None else LAST


def view_of(name: str) -> str | None:
    """The detail view (Check.detail_view) of the registered check of this name, if it names one."""
    entry = available().get(name)
    if entry is None:
        return None
    try:
        return info(entry).detail_view
    except CheckLoadError:
        return None


def _is_builtin(entry: CheckEntry) -> bool:
    return entry.distribution.split()[0] == BUILTIN_DIST and entry.value.startswith("fwdcheck.")


def direct(reference: str) -> CheckEntry:
    """An entry for a check class named as `package.module:Class`; a malformed reference is a usage error."""
    module, colon, attr = reference.partition(":")
    if (
        not (module and attr)
        or ":" in attr
        or any(not part.isidentifier() for part in [*module.split("."), *attr.split(".")])
    ):
        raise UsageError(f"check '{reference}' is not of the form 'package.module:Class'")
    return CheckEntry(reference, reference, DIRECT)


def in_default_selection(entry: CheckEntry) -> bool:
    """Whether a check runs when a config names none. A plugin that fails to load counts as default, so its error
    is reported instead of the check silently not running."""
    try:
        return info(entry).default
    except CheckLoadError:
        return True


def applicability() -> list[tuple[str, str]]:
    """Each registered check and the models it applies to, in words: "every model", the check's own `applies_when`
    for a default one, "when asked: ..." for one outside the default selection (from its declaration too)."""
    rows = []
    for name, entry in available().items():
        try:
            about = info(entry)
        except CheckLoadError as exc:
            rows.append((name, str(exc)))
            continue
        applies = about.applies_when or "every model"
        rows.append((name, applies if about.default else f"not in the default: {applies}"))
    return rows


# Words a `checks:` list may use beside check names: the default selection, and every registered check.
DEFAULT, ALL = "default", "all"


def selected(names: list[str] | None, nproc: int = 1) -> list[CheckEntry]:
    """select(names), and in a distributed run (nproc > 1) the checks that open one (Check.opens_distributed_runs:
    the sharding check, as a sharded model is first of all compared with the unsharded one) first, named or not."""
    entries = select(names)
    if nproc > 1:
        opening = distributed_openers()
        entries = [*opening, *(e for e in entries if e not in opening)]
    return entries


def distributed_openers() -> list[CheckEntry]:
    """The registered checks a distributed run starts with (Check.opens_distributed_runs)."""
    return [entry for entry in available().values() if _declared(entry, "opens_distributed_runs", False)]


def distributed_ending_codes(entries: list[CheckEntry]) -> dict[str, str]:
    """Each of these checks that declares a code ending a distributed run's checks (Check.ends_distributed_runs: the
    sharding check's, for a sharded model that raises where the unsharded one runs) -> that code."""
    codes = {entry.name: _declared(entry, "ends_distributed_runs", None) for entry in entries}
    return {name: code for name, code in codes.items() if code is not None}


def former_keys() -> dict[str, list[tuple[str, str]]]:
    """Each top-level config key of a former release that registered checks still read (Check.former_keys) -> the
    (check, option) pairs it sets."""
    found: dict[str, list[tuple[str, str]]] = {}
    for entry in available().values():
        for key, option in _declared(entry, "former_keys", {}).items():
            found.setdefault(key, []).append((entry.name, option))
    return found


def _declared(entry: CheckEntry, attribute: str, otherwise: Any) -> Any:
    """One declaration of a check, or `otherwise` when its declarations do not load (its error shows when it runs)."""
    try:
        return getattr(info(entry), attribute)
    except CheckLoadError:
        return otherwise


def select(names: list[str] | None) -> list[CheckEntry]:
    """The entries for the given names (the default selection when None); an unknown name is a usage error listing
    the known ones. `default` stands for the checks that run when none are named, `all` for every registered one."""
    registered = available()
    if names is None:
        names = [DEFAULT]
    chosen = []
    for name in names:
        if name == ALL:
            entries = list(registered.values())
        elif name == DEFAULT:
            entries = [entry for entry in registered.values() if in_default_selection(entry)]
        elif ":" in name:  # a check class named directly, module:Class
            entries = [direct(name)]
        elif name in registered:
            entries = [registered[name]]
        else:
            close = difflib.get_close_matches(name, [*registered, DEFAULT, ALL], n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UsageError(f"unknown check '{name}'; {hint}known: {', '.join(registered)} (or {DEFAULT}, {ALL})")
        chosen += [entry for entry in entries if entry not in chosen]
    return chosen


# ---------------------------------------------------------------------------------------------------------------------
# What checks declare for the core: their options (a section of the config each), their flags, their finding codes


def options_model(entry: CheckEntry) -> type[BaseModel] | None:
    """The check's options model (Check.options, a pydantic model in a torch-free module), or None."""
    import pkgutil

    reference = info(entry).options
    if reference is None:
        return None
    try:
        model: type[BaseModel] = pkgutil.resolve_name(reference)
    except Exception as exc:  # a plugin whose options do not import breaks only itself
        raise CheckLoadError(f"check {entry.label}: its options model '{reference}' does not import: {exc}") from exc
    return model


def check_options(
    configured: dict[str, dict[str, Any] | None], flagged: dict[str, dict], entries: list[CheckEntry]
) -> dict[str, BaseModel]:
    """Each check's options, validated: the config's `options:` section under the check's name, the command line's
    flags on top. Every selected check that has an options model gets one (its defaults when nothing is said); a
    section for a check that is not registered is a usage error with a did-you-mean, as is a wrong option."""
    from pydantic import ValidationError

    registered = available()
    by_name = {entry.name: entry for entry in entries}
    for name in [*configured, *flagged]:
        if name not in by_name:
            if name not in registered and ":" not in name:
                close = difflib.get_close_matches(name, list(registered), n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise UsageError(f"options.{name}: no such check; {hint}known: {', '.join(registered)}")
            by_name[name] = registered[name] if name in registered else direct(name)
    validated = {}
    for name, entry in by_name.items():
        given = {**(configured.get(name) or {}), **(flagged.get(name) or {})}
        try:
            model = options_model(entry)
        except CheckLoadError:
            if given:  # options for a check that cannot load: nothing can take them
                raise
            continue  # its own error is reported when it runs, beside the checks that do
        if model is None:
            if given:
                raise UsageError(f"options.{name}: the check {entry.label} takes no options")
            continue
        try:
            validated[name] = model.model_validate(given)
        except ValidationError as exc:
            raise UsageError(_options_problems(name, model, exc)) from None
    return validated


def _options_problems(check: str, model: type[BaseModel], exc) -> str:
    """Every problem of a check's options on one line, each named by its place in the config."""
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(["options", check, *map(str, error["loc"])])
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(error["loc"][-1]), list(model.model_fields), n=1)
            valid = f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(model.model_fields) or 'none'}"
            problems.append(f"{where}: unknown key; {valid}")
        else:
            got = error.get("input")
            shown = f" (got {got!r})" if not isinstance(got, (dict, list)) else ""
            text = error["msg"].removeprefix("Value error, ") if error["type"] == "value_error" else None
            problems.append(f"{where}: {text or in_plain_words(error)}{shown}")
    return "; ".join(problems)


@dataclass(frozen=True)
class Flag:
    """A command-line flag a check contributes (Check.flags): the options it sets, and how it is typed and helped
    from the first declaring check's options model. Several checks may declare one flag (`--exhaustive`: each
    check's thorough variant); it then sets each one's option."""

    flag: str
    targets: tuple[tuple[str, str], ...]  # (check name, option field)
    annotation: object  # the option's type
    help: str


def command_line_flags() -> list[Flag]:
    """The flags every registered check contributes, in check order; a check whose declarations do not load
    contributes none (its own error shows when it runs)."""
    found: dict[str, Flag] = {}
    for entry in available().values():
        try:
            flags = info(entry).flags
            model = options_model(entry) if flags else None
        except CheckLoadError:
            continue
        for flag, option in flags.items():
            field_info = getattr(model, "model_fields", {}).get(option)
            if field_info is None:
                continue  # a flag naming no option of the check sets nothing: not offered
            said = f"{entry.name}: {field_info.description or option}"
            if flag in found:
                known = found[flag]
                found[flag] = Flag(
                    flag, (*known.targets, (entry.name, option)), known.annotation, f"{known.help}; {said}"
                )
            else:
                found[flag] = Flag(flag, ((entry.name, option),), field_info.annotation, said)
    return list(found.values())


@dataclass(frozen=True)
class FileFlag:
    """A `fwdcheck run` flag through which a check reads or writes a file (Check.files): `--expect-golden PATH`
    reads a golden file before any model loads, `--save-golden PATH` writes one from the report after the run."""

    flag: str
    check: str  # the declaring check's name
    help: str
    reads: str | None = None  # "module:function" (path, label) -> document
    fits: str | None = None  # "module:function" (document, run_config, label): refuses a file made for another run
    writes: str | None = None  # "module:function" (result, report) -> text, or None
    selects: bool = False  # True: the flag adds the check to the selection; False: the check must be in it
    beside: str | None = None  # the suffix of a reading flag's file beside a config (gpt.golden.json for gpt.yaml)
    needs_values: bool = True  # the check's: refused on the meta device

    def call(self, role: str, *args: Any) -> Any:
        """Call the function the flag names for `role` ("reads", "fits", "writes"); None when it names none."""
        import pkgutil

        reference = getattr(self, role)
        return pkgutil.resolve_name(reference)(*args) if reference else None


def file_flags() -> dict[str, FileFlag]:
    """The file flags every registered check declares, in check order; a flag two checks declare is the first
    one's (built-ins before plugins), and a check whose declarations do not load contributes none."""
    found: dict[str, FileFlag] = {}
    for entry in available().values():
        try:
            about = info(entry)
        except CheckLoadError:
            continue
        for flag, does in about.files.items():
            if flag in found or not isinstance(flag, str) or not flag.startswith("--"):
                continue
            found[flag] = FileFlag(
                flag,
                entry.name,
                str(does.get("help", "")),
                does.get("reads"),
                does.get("fits"),
                does.get("writes"),
                bool(does.get("selects", False)),
                does.get("beside"),
                about.needs_values,
            )
    return found


OWN_PREFIX = "FWD"  # fwdcheck's own finding codes and its built-in checks'


def code_owners() -> dict[str, tuple[CheckEntry, str]]:
    """Every finding code a registered check declares -> (the check, its meaning). A plugin's code is refused (its
    check fails to load, naming the collision) when it takes fwdcheck's prefix or a code another check declares."""
    owners: dict[str, tuple[CheckEntry, str]] = {}
    for entry in available().values():
        try:
            codes = info(entry).codes
        except CheckLoadError:
            continue
        for code, meaning in codes.items():
            owners.setdefault(code, (entry, meaning))
    return owners


def code_collision(entry: CheckEntry, codes: dict[str, str]) -> str | None:
    """Why a check's codes cannot be told apart from another's, or None: a plugin may not use fwdcheck's FWD prefix,
    nor a code that a registered check declares. A check is never in collision with itself, named either way
    (registered, or as module:Class)."""
    if not entry.value.startswith("fwdcheck."):
        own = sorted(code for code in codes if code.upper().startswith(OWN_PREFIX))
        if own:
            return (
                f"declares {own[0]}: the {OWN_PREFIX} prefix is fwdcheck's own; give the plugin's codes a prefix "
                "of their own"
            )
    owners = code_owners() if codes else {}
    for code in codes:
        owner = owners.get(code)
        if owner is not None and owner[0].value != entry.value:
            return (
                f"declares {code}, which {owner[0].label} already declares; give the plugin's codes a prefix "
                "of their own"
            )
    return None
