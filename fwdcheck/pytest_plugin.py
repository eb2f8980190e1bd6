"""pytest plugin (entry point `pytest11: fwdcheck`): fwdcheck configs as test items, and a `fwdcheck` fixture.

    pytest --fwdcheck configs/            # the configs under configs/, alone, as items: configs/gpt.yaml::rope
    pytest tests/ --fwdcheck configs/     # the tests named, and the configs
    pytest -m fwdcheck                    # only config items (each carries the `fwdcheck` marker): for when the
                                          # ini's fwdcheck_paths adds configs to the whole test suite

    def test_model(fwdcheck):             # the fixture is fwdcheck.check_model
        fwdcheck(MyModel()).raise_for_failures()

Under a directory, a file named as the `fwdcheck_files` ini option says (default `fwdcheck*.yaml *.fwdcheck.yaml`
and their .yml spellings, as pytest's `python_files` names test modules) is a config, and its errors are collection
errors; so is any other YAML file whose `model:` names a `source:` (a mistyped key in it is an error, never a config
dropped from the gate). Any other YAML file is collected only when it is a valid fwdcheck config, and otherwise left
alone (a Hydra-style `configs/train.yaml` with a `model:` key of its own is not an error: the run's summary names it;
a YAML file without a `model:` key is not named). A file
named directly is always read as a config. Each check the config selects is one item: it passes,
fails with the check's findings, or skips with the check's reason. A golden file beside the config (gpt.golden.json
for gpt.yaml, written by `fwdcheck run gpt.yaml --save-golden gpt.golden.json`) adds the item `golden`, which compares
the model with it as --expect-golden does. A config that does not validate is one collection
error line; a model that cannot be built fails each of its items with one line. Each config's model is built and run
once, for all of its items that are selected (like `fwdcheck run CONFIG --check ...` for a `-k` subset); with
pytest-xdist, `--dist loadfile` keeps a config's items on one worker, so that its model is built once there too.

A config's model runs as `fwdcheck run` runs it, in a supervised worker process under the config's timeout_s: a
model that calls os._exit, crashes or hangs fails its own items (FWD005, FWD004), never ends or hangs the session,
and its code is imported afresh for each config. A worker that does not end cleanly after its last check fails
every item of its config, as the "(end of run)" row fails `fwdcheck run`. The fixture is the Python API, in the
test's own process: the test hands it a model object it built there, and owns that process anyway.

Without --fwdcheck (or the `fwdcheck_paths` ini option) the plugin collects nothing and imports neither torch nor
fwdcheck's runner: only the fixture exists, and it imports fwdcheck when a test asks for it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

MARKER = "fwdcheck"
_MODEL_KEY = re.compile(r"^model\s*:", re.MULTILINE)
_MAX_CONFIG_BYTES = 1 << 20  # a YAML file larger than this under a --fwdcheck directory is data, not a config
CONFIG_FILES = ["fwdcheck*.yaml", "fwdcheck*.yml", "*.fwdcheck.yaml", "*.fwdcheck.yml"]  # the ini's fwdcheck_files


class FwdcheckWarning(UserWarning):
    """A check's `warn` status: the item passes (unless --fwdcheck-fail-on warn) and pytest lists the warning."""


# -- options ----------------------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fwdcheck", "fwdcheck: forward-pass checks of the models fwdcheck configs describe")
    group.addoption(
        "--fwdcheck",
        action="append",
        default=[],
        metavar="PATH",
        dest="fwdcheck_paths",
        help="collect the fwdcheck configs under PATH, a file or a directory (files named as the ini option "
        "fwdcheck_files says, and other YAML files that are valid configs); one test item per check. Repeatable.",
    )
    group.addoption(
        "--fwdcheck-fail-on",
        choices=("fail", "warn"),
        default="fail",
        dest="fwdcheck_fail_on",
        help="lowest check status that fails its item (default: fail; warnings are then reported as pytest warnings).",
    )
    group.addoption(
        "--fwdcheck-device",
        choices=("cpu", "cuda", "auto"),
        default=None,
        dest="fwdcheck_device",
        help="override every config's device.",
    )
    group.addoption(
        "--fwdcheck-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        dest="fwdcheck_dtype",
        help="override every config's dtype.",
    )
    parser.addini(
        "fwdcheck_paths",
        type="paths",
        default=[],
        help="config files or directories collected as if given with --fwdcheck (relative to the ini file)",
    )
    parser.addini(
        "fwdcheck_files",
        type="args",
        default=CONFIG_FILES,
        help="glob patterns of the file names that are fwdcheck configs under a --fwdcheck directory (their errors "
        f"are reported; other YAML files are collected only when they are valid configs); default: "
        f"{' '.join(CONFIG_FILES)}",
    )


_ROOTS = pytest.StashKey[list]()  # the absolute config paths / directories to collect
_FOUND = pytest.StashKey[dict]()  # root -> configs collected under it
_LEFT_ALONE = pytest.StashKey[dict]()  # YAML file -> why it is not a fwdcheck config


def _roots(config: pytest.Config) -> list[Path]:
    return config.stash.get(_ROOTS, [])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a check of a fwdcheck config, collected by --fwdcheck")
    invocation = config.invocation_params.dir
    given = [("--fwdcheck", invocation / p) for p in config.getoption("fwdcheck_paths") or []]
    given += [("ini option fwdcheck_paths:", Path(p)) for p in config.getini("fwdcheck_paths") or []]
    roots = []
    for origin, path in given:
        path = Path(os.path.abspath(path))
        if not path.exists():
            raise pytest.UsageError(f"{origin} {_shown(path, invocation)}: no such file or directory")
        if path not in roots:
            roots.append(path)
    config.stash[_ROOTS] = roots
    config.stash[_FOUND] = {root: 0 for root in roots}
    config.stash[_LEFT_ALONE] = {}
    if not roots or config.getoption("pyargs", False):
        return
    if config.getoption("fwdcheck_paths") and config.args_source != pytest.Config.ArgsSource.ARGS:
        # `pytest --fwdcheck PATH` names what to collect, as `pytest PATH` would: the configs alone, not testpaths
        # or the working directory besides.
        config.args = [str(root) for root in roots]
    else:
        # Collect the configs beside the paths pytest was given, or beside testpaths when only the ini names
        # configs; pytest drops overlaps.
        config.args = [*config.args, *(str(root) for root in roots if not _covered(root, config.args, invocation))]


def _covered(path: Path, args: list[str], invocation: Path) -> bool:
    for arg in args:
        base = Path(os.path.abspath(invocation / arg.split("::")[0]))
        if "::" not in arg and (path == base or base in path.parents):
            return True
    return False


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    roots = _roots(config)
    if not roots:
        return None
    invocation = config.invocation_params.dir
    return [f"fwdcheck: configs under {', '.join(_shown(r, invocation) for r in roots)}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    invocation = config.invocation_params.dir
    for root, count in config.stash.get(_FOUND, {}).items():
        if count == 0:
            terminalreporter.write_line(
                f"fwdcheck: no configs found under {_shown(root, invocation)} "
                f"(a config is named {' or '.join(config.getini('fwdcheck_files'))}, or is a valid config)",
                yellow=True,
            )
    for path, why in config.stash.get(_LEFT_ALONE, {}).items():
        terminalreporter.write_line(
            f"fwdcheck: left alone {_shown(path, invocation)}: not a fwdcheck config ({why}); a config named "
            f"{' or '.join(config.getini('fwdcheck_files'))} is collected and its errors reported"
        )


# -- collection -------------------------------------------------------------------------------------------------------


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    roots = _roots(parent.config)
    if not roots or file_path.suffix not in (".yaml", ".yml"):
        return None
    path = Path(os.path.abspath(file_path))
    named = [r for r in roots if r == path]
    under = [r for r in roots if r in path.parents]
    if not named and not (under and (_named_as_config(path, parent.config) or _is_config(path, parent.config))):
        return None
    found = parent.config.stash[_FOUND]
    for root in named or under:
        found[root] = found.get(root, 0) + 1
    return ConfigFile.from_parent(parent, path=file_path)


def _named_as_config(path: Path, config: pytest.Config) -> bool:
    """Named as the ini's fwdcheck_files says: a config, whatever it holds (a broken one is a collection error)."""
    return any(fnmatch.fnmatch(path.name, pattern) for pattern in config.getini("fwdcheck_files"))


def _is_config(path: Path, config: pytest.Config) -> bool:
    """Another name: a config when its `model:` names a `source:` (what only a fwdcheck config says: its errors are
    collection errors, so that a typo never drops it from the gate), or when it validates. A mapping with a `model`
    key of another shape that does not validate is another tool's file (a Hydra config's `model:`), left alone and
    named in the run's summary; a YAML file without a `model` key is not named."""
    model = _model_section(path)
    if model is _NO_MODEL:
        return False
    if isinstance(model, dict) and "source" in model:
        return True
    from fwdcheck.config.schema import load_config
    from fwdcheck.errors import FwdcheckError, first_line

    try:
        load_config(path)
    except FwdcheckError as exc:
        config.stash[_LEFT_ALONE][path] = first_line(exc).removeprefix(f"{path}: ")
        return False
    return True


_NO_MODEL = object()


def _model_section(path: Path) -> Any:
    """The `model` value of a YAML mapping, read without fwdcheck (every config has one), or _NO_MODEL. A file that
    is not valid YAML but has a top-level `model:` line gives None: fwdcheck's reader says what is wrong with it."""
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            return _NO_MODEL
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return _NO_MODEL
    import yaml

    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        return None if _MODEL_KEY.search(text) else _NO_MODEL
    return document["model"] if isinstance(document, dict) and "model" in document else _NO_MODEL


def _shown(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


class ConfigFile(pytest.File):
    """One fwdcheck config: an item per selected check; the model is built and run once for all of them."""

    def collect(self):
        """The config read, the command line's options applied to it and its checks selected, each once: the items
        are the selection, and the run's plan (_run) is made of the items that are selected."""
        from fwdcheck.config.registry import DEFAULT, selected
        from fwdcheck.config.schema import load_config
        from fwdcheck.errors import FwdcheckError

        self.shown = _shown(Path(os.path.abspath(self.path)), self.config.invocation_params.dir)
        try:
            self.fwd_config = load_config(self.path)
            self.applied = self.overrides().applied(self.fwd_config)
            self.expected = self._expected_beside()
            # a file beside the config selects its check, as its flag does: after the config's own, as `--check`
            named = self.applied.checks if self.applied.checks is not None else [DEFAULT]
            beside = [self.beside[flag][0] for flag in self.expected]
            self.entries = selected([*named, *beside], self.applied.distributed.nproc)
        except FwdcheckError as exc:
            raise self.CollectError(self.message(exc)) from None
        self._outcome: Any = None
        for entry in self.entries:
            yield CheckItem.from_parent(self, name=entry.name, entry=entry)

    def overrides(self, **fields):
        """The command line's options for this config's run, as `fwdcheck run` would take them."""
        from fwdcheck.run.overrides import Overrides

        options = self.config.option
        return Overrides(
            device=options.fwdcheck_device, dtype=options.fwdcheck_dtype, fail_on=options.fwdcheck_fail_on, **fields
        )

    def _expected_beside(self) -> dict[str, dict]:
        """The files beside the config that checks compare with (Check.files' `beside`: gpt.golden.json beside
        gpt.yaml, as --expect-golden), each read and checked against the run it is for: flag -> document."""
        from fwdcheck.config.registry import file_flags

        self.beside: dict[str, tuple[str, str]] = {}  # flag -> (its check, the file as shown)
        expected = {}
        for flag, does in file_flags().items():
            path = Path(self.path).with_suffix(does.beside) if does.beside and does.reads else None
            if path is None or not path.exists():
                continue
            shown = _shown(Path(os.path.abspath(path)), self.config.invocation_params.dir)
            expected[flag] = does.call("reads", path, shown)
            does.call("fits", expected[flag], self.applied, shown)
            self.beside[flag] = (does.check, shown)
        return expected

    def line_of(self, check: str) -> int:
        """0-based line naming the check in the config's `checks:`, or of `checks:` / the top (0) when not named."""
        try:
            lines = Path(self.path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            return 0
        named = re.compile(rf"(^|[\s\[,'\"-]){re.escape(check)}($|[\s\],'\"#])")
        start = next((i for i, line in enumerate(lines) if line.startswith("checks")), None)
        if start is None:
            return 0
        return next((i for i in range(start, len(lines)) if named.search(lines[i])), start)

    def message(self, exc: BaseException) -> str:
        """fwdcheck's one-line message, naming the config as the user wrote its path."""
        return str(exc).replace(str(self.path), self.shown)

    def repr_failure(self, excinfo):
        from fwdcheck.errors import FwdcheckError

        if isinstance(excinfo.value, FwdcheckError):  # e.g. no checks registered: one line, not our traceback
            return self.message(excinfo.value)
        return super().repr_failure(excinfo)

    def outcome(self):
        """The Report for this config's selected items, or the error that stopped the run; computed once."""
        if self._outcome is None:
            try:
                self._outcome = self._run()
            except Exception as exc:  # kept and raised by every item, so the model is not rebuilt for each
                self._outcome = exc
        return self._outcome

    def _run(self):
        """The run, as `fwdcheck run` makes it: in a supervised worker process (fwdcheck/process/supervisor.py), under
        the config's timeout_s, so that a model that exits, crashes or hangs ends its own items and not the session.
        Each config's code is imported in its own worker: two configs' `models.py` are two modules. A Ctrl-C during the
        run ends the worker with its partial report, and then the session, as pytest ends on one."""
        from fwdcheck.process.events import Job
        from fwdcheck.process.heard import END_OF_RUN
        from fwdcheck.process.supervisor import run_supervised
        from fwdcheck.run.plan import RunPlan

        # The items a -k or a node id selects, as `fwdcheck run CONFIG --check ...` would run them: the checks
        # selected at collection, kept, not selected again.
        chosen = {item.name for item in self.session.items if item.parent is self}
        entries = [e for e in self.entries if e.name in chosen] or self.entries
        names = [e.name for e in entries]
        job = Job(
            config=str(self.path),
            factory=None,
            plan=RunPlan.made(
                self.applied.model_copy(update={"checks": names}),
                entries,
                self.overrides(checks=names, expected=self.expected),
            ),
            sys_path=[p for p in sys.path if p],
        )
        report = run_supervised(job, timeout_s=self.fwd_config.timeout_s)
        if report.interrupted:
            raise KeyboardInterrupt
        # a check's result in the order of its item's entry (a module:Class check names its result its own way), and
        # the "(end of run)" row of a worker that did not end cleanly
        checked = [r for r in report.results if r.name != END_OF_RUN]
        results = dict(zip((e.name for e in entries), checked, strict=False))
        results.update({r.name: r for r in report.results if r.name == END_OF_RUN})
        return report, results


class CheckFailed(Exception):
    """A check did not pass; the item's failure text is its findings."""

    def __init__(self, text: str, headline: str):
        super().__init__(headline)
        self.text = text
        self.headline = headline


class _Crash:
    def __init__(self, message: str, path: str):
        self.message = message
        self.path = path
        self.lineno = 0


class FindingsRepr:
    """The failure text of a check: plain lines, with the headline as pytest's one-line summary (and JUnit message)."""

    def __init__(self, text: str, headline: str, path: str):
        self.text = text
        self.reprcrash = _Crash(headline, path)

    def toterminal(self, tw) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


class CheckItem(pytest.Item):
    def __init__(self, *, entry, **kwargs):
        super().__init__(**kwargs)
        self.entry = entry
        self.add_marker(MARKER)

    @property
    def rerun_flags(self) -> str:
        """How `fwdcheck run` reruns this item: the flags of the files beside the config its check compares with, or
        --check NAME."""
        beside = [f"{flag} {shown}" for flag, (check, shown) in self.file.beside.items() if check == self.name]
        return " ".join(beside) or f"--check {self.name}"

    @property
    def file(self) -> ConfigFile:
        return self.parent  # type: ignore[return-value]

    def runtest(self) -> None:
        from fwdcheck.process.heard import END_OF_RUN
        from fwdcheck.result import Status

        outcome = self.file.outcome()
        if isinstance(outcome, BaseException):
            raise outcome
        report, results = outcome
        result = results[self.name]
        end = results.get(END_OF_RUN)
        if end is not None and end.status == Status.ERROR and result.status not in (Status.FAIL, Status.ERROR):
            # the worker did not end cleanly after the last check: no result it streamed is a verdict
            raise CheckFailed(self.failure_text(report, end), self.headline(end))
        if result.status == Status.SKIP:
            _skip(f"{self.name}: {result.summary}")
        failing = result.status in (Status.FAIL, Status.ERROR) or (
            result.status == Status.WARN and report.fail_on == "warn"
        )
        if failing:
            raise CheckFailed(self.failure_text(report, result), self.headline(result))
        if result.status == Status.WARN:
            warnings.warn(FwdcheckWarning(f"{self.file.shown}::{self.name}: {self.headline(result)}"), stacklevel=1)

    def headline(self, result) -> str:
        from fwdcheck.result import Status

        shown = [f for f in result.findings if f.status not in (Status.PASS, Status.SKIP)]
        codes = ", ".join(dict.fromkeys(f.code for f in shown))
        return f"{result.status.value}: {codes + ': ' if codes else ''}{result.summary}"

    def failure_text(self, report, result) -> str:
        from fwdcheck.result import Status

        lines = [f"fwdcheck {self.name} on {self.file.shown}: {result.status.value} - {result.summary}"]
        for f in result.findings:
            if f.status in (Status.PASS, Status.SKIP):
                continue
            lines.append(f"  {f.code} {f.status.value}: {f.message}")
            if f.where:
                lines.append(f"      at {f.where}")
            source = getattr(f, "source", None)
            if source and source != f.where:
                lines.append(f"      code {source}")
        if result.internal_error and result.data.get("traceback"):
            lines += [
                "",
                "internal error (a bug in fwdcheck or in the check's plugin); traceback:",
                result.data["traceback"].rstrip(),
            ]
        env = report.environment
        lines += [
            "",
            f"config:  {self.file.shown}",
            f"model:   {report.model.get('label', '?')} · {env.get('device')} {env.get('dtype')} · "
            f"B={env.get('batch_size')} T={env.get('seq_len')} seed={env.get('seed')}",
            f"rerun:   fwdcheck run {self.file.shown} {self.rerun_flags}",
        ]
        if self.entry.distribution != "direct":
            lines.append(f"explain: fwdcheck explain {self.name}")
        return "\n".join(lines)

    def repr_failure(self, excinfo, style=None):
        from fwdcheck.errors import FwdcheckError

        if isinstance(excinfo.value, CheckFailed):
            return FindingsRepr(excinfo.value.text, excinfo.value.headline, str(self.path))
        if isinstance(excinfo.value, FwdcheckError):  # the model could not be built or placed: one line
            text = self.file.message(excinfo.value)
            message = f"fwdcheck: {text if text.startswith(self.file.shown) else f'{self.file.shown}: {text}'}"
            return FindingsRepr(message, message, str(self.path))
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        # The domain heads the failure section. Not the node id's tail: pytest would show its '.' as '::' under -v.
        return self.path, self.file.line_of(self.name), f"{self.name} in {self.file.shown}"


def _skip(reason: str):
    """Skip, reported at the item (config::check) rather than at this line of the plugin."""
    try:
        exc = pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:  # a pytest without the keyword
        exc = pytest.skip.Exception(reason)
    raise exc


# -- fixture ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def fwdcheck():
    """fwdcheck.check_model: `fwdcheck(model, checks=None, batch_size=2, seq_len=8, ...) -> Report`.

    def test_model(fwdcheck):
        fwdcheck(MyModel(), vocab_size=32000).raise_for_failures()
    """
    from fwdcheck.api import check_model

    return check_model
