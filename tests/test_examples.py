"""The CI examples and the pre-commit hooks do what they say: each YAML parses, and each `fwdcheck` command in it runs
on the toy config and exits 0.

The commands are read out of the files (GitHub `run:` steps, GitLab `script:` lists, pre-commit hook entries with their
args) and run as a subprocess from the repository root, as CI would. An option the installed `fwdcheck run --help` does
not list yet (the report options are being added) skips that command, naming the option; files the commands write go
to a temporary directory, not into the checkout. A command that reads a golden file (`--expect-golden`, the pull
request's step of a numeric-contract job) reads it from that directory, written first by the same config with
`--save-golden` as the base branch's step writes it: the same code on both sides, so it must pass.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
HOOKS = REPO / ".pre-commit-hooks.yaml"
TOY = "sample_configs/toy.yaml"
WRITES = {
    "--output",
    "-o",
    "--junit",
    "--json",
    "--markdown",
    "--html",
    "--svg",
    "--save-ledger",
    "--save-golden",
}  # take a PATH
READS = {"--expect-golden"}  # a PATH an earlier step of the same job wrote
TIMEOUT = 180


def fwdcheck_executable() -> list[str]:
    """The installed console script beside this interpreter (what CI's `fwdcheck` is), else `python -m fwdcheck`."""
    script = Path(sys.executable).parent / "fwdcheck"
    if script.exists():
        return [str(script)]
    found = shutil.which("fwdcheck")
    return [found] if found else [sys.executable, "-m", "fwdcheck"]


def environment() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}


# -- reading commands out of the files ---------------------------------------------------------------------------------


def shell_lines(script: str) -> list[str]:
    """Shell lines of a `run:` block: continuations joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def github_commands(document: dict) -> list[str]:
    return [
        line
        for job in document["jobs"].values()
        for step in job.get("steps", [])
        for line in shell_lines(step.get("run", ""))
    ]


def gitlab_commands(document: dict) -> list[str]:
    lines = []
    for name, job in document.items():
        if isinstance(job, dict) and not name.startswith("."):
            for key in ("before_script", "script", "after_script"):
                for entry in job.get(key, []) or []:
                    lines += shell_lines(entry)
    return lines


def hooks() -> dict[str, dict]:
    return {hook["id"]: hook for hook in yaml.safe_load(HOOKS.read_text())}


def precommit_commands(document: dict) -> list[str]:
    """The command pre-commit runs for each hook of ours: its entry, then the args (the config's, else the hook's)."""
    ours = hooks()
    lines = []
    for repo in document["repos"]:
        for hook in repo["hooks"]:
            manifest = hook if repo["repo"] == "local" else ours[hook["id"]]  # a local hook is its own manifest
            args = hook.get("args", manifest.get("args", []))
            lines.append(" ".join([manifest["entry"], *map(shlex.quote, args)]))
    return lines


def fwdcheck_only(lines: list[str]) -> list[str]:
    return [line for line in lines if shlex.split(line)[0] == "fwdcheck"]


EXAMPLE_FILES = {
    "github-actions.yml": github_commands,
    "gitlab-ci.yml": gitlab_commands,
    "pre-commit-config.yaml": precommit_commands,
}
COMMANDS = [
    (name, command)
    for name, read in EXAMPLE_FILES.items()
    for command in fwdcheck_only(read(yaml.safe_load((EXAMPLES / name).read_text())))
]
UNIQUE = {command: sorted({n for n, c in COMMANDS if c == command}) for _, command in COMMANDS}  # each run once


# -- what `fwdcheck run --help` offers --------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def run_options() -> dict[str, tuple[bool, set[str] | None]]:
    """Each option of `fwdcheck run`, parsed from its --help: (takes a value, its choices or None for any value).

    Reads the option rows of rich's table (`│ --format  <rich|json>  ...`) or of click's plain help
    (`  -o, --output PATH  ...`); the description column, which may mention other options, is not read."""
    proc = subprocess.run(
        [*fwdcheck_executable(), "run", "--help"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=environment(),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    options: dict[str, tuple[bool, set[str] | None]] = {}
    for line in proc.stdout.splitlines():
        body = line.strip().strip("│|").strip()
        if not body.startswith("-"):
            continue
        names, metavar = [], None
        for column in re.split(r"\s{2,}", body)[:3]:
            for part in column.replace(",", " ").split():
                if re.fullmatch(r"--?[A-Za-z][\w-]*", part):
                    names.append(part)
                elif metavar is None and re.fullmatch(r"<[^>]+>|\[[^]]+\]|[A-Z][A-Z_]*", part):
                    metavar = part
        choices = re.fullmatch(r"[<\[]([\w-]+(?:\|[\w-]+)+)[>\]]", metavar or "")
        for name in names:
            options[name] = (metavar not in (None, "<bool>"), set(choices.group(1).split("|")) if choices else None)
    assert "--format" in options and "--output" in options, proc.stdout  # the parser still reads this help
    return options


def missing_option(tokens: list[str]) -> str | None:
    """The first option (or option value) of a `fwdcheck run ...` command that this fwdcheck does not offer."""
    options = run_options()
    i = 2
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if name.startswith("-"):
            if name not in options:
                return name
            takes_value, choices = options[name]
            if takes_value and not eq:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            if choices is not None and value not in choices:
                return f"{name} {value}"
        i += 1
    return None


def redirect_outputs(tokens: list[str], directory: Path) -> tuple[list[str], list[Path]]:
    """The command with every file-writing option pointed into `directory`; the files it will write."""
    out, written = [], []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, value = token.partition("=")
        if name in WRITES or name in READS:
            if not eq:
                i += 1
                value = tokens[i]
            target = directory / Path(value).name
            if name in WRITES:
                written.append(target)
            out += [name, str(target)]
        else:
            out.append(token)
        i += 1
    return out, written


def run_fwdcheck(tokens: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[Path]]:
    assert tokens[:2] == ["fwdcheck", "run"], tokens
    missing = missing_option(tokens)
    if missing:
        pytest.skip(f"`fwdcheck run --help` does not offer {missing} yet")
    command, written = redirect_outputs(tokens, tmp_path)
    if "--expect-golden" in command:
        golden = command[command.index("--expect-golden") + 1]
        saving = subprocess.run(
            [*fwdcheck_executable(), "run", tokens[2], "--save-golden", golden, "-q"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=environment(),
            cwd=REPO,
        )
        assert saving.returncode == 0, saving.stdout + saving.stderr
    proc = subprocess.run(
        [*fwdcheck_executable(), *command[1:]],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=environment(),
        cwd=REPO,
    )
    return proc, written


def assert_written(files: list[Path]) -> None:
    for path in files:
        assert path.exists() and path.stat().st_size > 0, f"{path.name} was not written"
        if path.suffix == ".json":
            document = json.loads(path.read_text())
            if "fwdcheck_golden" in document:  # a golden file (--save-golden), not a report
                assert document["outputs"] and document["parameters"], path.name
            else:
                assert document["exit_code"] == 0
        elif path.suffix == ".xml":
            ET.parse(path)  # well-formed


# -- the examples -----------------------------------------------------------------------------------------------------


def test_every_example_parses_and_has_commands():
    for name in EXAMPLE_FILES:
        document = yaml.safe_load((EXAMPLES / name).read_text())
        assert isinstance(document, dict), name
    found = {name for name, _ in COMMANDS}
    assert found == set(EXAMPLE_FILES), "each example runs fwdcheck at least once"
    assert all(TOY in command for _, command in COMMANDS)


def test_github_workflow_shape():
    document = yaml.safe_load((EXAMPLES / "github-actions.yml").read_text())
    steps = document["jobs"]["fwdcheck"]["steps"]
    runs = " ".join(step.get("run", "") for step in steps)
    assert "download.pytorch.org/whl/cpu" in runs  # CPU torch, not the CUDA download
    # one run writes every format: the annotations, the JSON report and JUnit XML
    (run,) = [step["run"] for step in steps if "fwdcheck run" in step.get("run", "")]
    assert "--format github" in run and "--junit fwdcheck.xml" in run and "--json fwdcheck.json" in run
    upload = next(step for step in steps if str(step.get("uses", "")).startswith("actions/upload-artifact"))
    assert "fwdcheck.json" in upload["with"]["path"] and "!cancelled()" in upload["if"]  # uploaded when a check fails
    assert True in document or "on" in document  # YAML 1.1 reads the key `on` as True
    contract = document["jobs"]["numeric-contract"]
    assert contract["if"] == "github.event_name == 'pull_request'"
    steps = contract["steps"]
    checkouts = [i for i, step in enumerate(steps) if str(step.get("uses", "")).startswith("actions/checkout")]
    saving = next(i for i, step in enumerate(steps) if "--save-golden" in step.get("run", ""))
    expecting = next(i for i, step in enumerate(steps) if "--expect-golden" in step.get("run", ""))
    # the base first (its own checkout), the golden file outside the checkout, then the pull request's head
    assert steps[checkouts[0]]["with"]["ref"] == "${{ github.event.pull_request.base.sha }}"
    assert checkouts[0] < saving < checkouts[1] < expecting and "$RUNNER_TEMP" in steps[saving]["run"]


def test_gitlab_job_shape():
    job = yaml.safe_load((EXAMPLES / "gitlab-ci.yml").read_text())["fwdcheck"]
    assert job["artifacts"]["reports"]["junit"] == "fwdcheck.xml"
    assert job["artifacts"]["when"] == "always"
    assert any("download.pytorch.org/whl/cpu" in line for line in job["before_script"])
    contract = yaml.safe_load((EXAMPLES / "gitlab-ci.yml").read_text())["fwdcheck-contract"]
    script = contract["script"]
    saving = next(i for i, line in enumerate(script) if "--save-golden" in line)
    expecting = next(i for i, line in enumerate(script) if "--expect-golden" in line)
    assert script.index("cd /tmp/target") < saving < script.index('cd "$CI_PROJECT_DIR"') < expecting
    assert contract["rules"] == [{"if": '$CI_PIPELINE_SOURCE == "merge_request_event"'}]


@pytest.mark.slow
def test_options_missing_from_help_are_named():
    assert missing_option(["fwdcheck", "run", TOY, "--fail-on", "warn", "--exhaustive", "-o", "x"]) is None
    assert missing_option(["fwdcheck", "run", TOY, "--no-such-option", "1"]) == "--no-such-option"
    assert missing_option(["fwdcheck", "run", TOY, "--format=nope"]) == "--format nope"
    assert missing_option(["fwdcheck", "run", TOY, "--fail-on", "sometimes"]) == "--fail-on sometimes"


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", list(UNIQUE), ids=[f"{'+'.join(n)}:{c.split(' ', 2)[-1]}" for c, n in UNIQUE.items()]
)
def test_example_command_passes_on_the_toy_config(command, tmp_path):
    proc, written = run_fwdcheck(shlex.split(command), tmp_path)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    assert_written(written)


# -- the pre-commit hooks ---------------------------------------------------------------------------------------------


def test_hook_manifest():
    ours = hooks()
    assert set(ours) == {"fwdcheck", "fwdcheck-system"}
    for hook in ours.values():
        assert hook["entry"] == "fwdcheck run"
        assert hook["pass_filenames"] is False and hook["require_serial"] is True
        assert hook["name"] and hook["description"]
        assert isinstance(hook["args"], list) and hook["args"]
        assert set(hook["types_or"]) == {"python", "yaml"}
        # only keys pre-commit's manifest schema knows
        assert set(hook) <= {
            "id",
            "name",
            "entry",
            "language",
            "files",
            "exclude",
            "types",
            "types_or",
            "exclude_types",
            "additional_dependencies",
            "args",
            "always_run",
            "fail_fast",
            "pass_filenames",
            "description",
            "language_version",
            "log_file",
            "minimum_pre_commit_version",
            "require_serial",
            "stages",
            "verbose",
        }
    assert ours["fwdcheck"]["language"] == "python"
    assert ours["fwdcheck-system"]["language"] == "system"


def test_the_pre_commit_example_can_be_used_as_written():
    """No `rev:` naming a tag that does not exist (v0.1.0 did not): as written it is a `repo: local` hook of the
    installed fwdcheck, every key one pre-commit's schema knows; the remote variant is a comment saying what rev
    must name."""
    document = yaml.safe_load((EXAMPLES / "pre-commit-config.yaml").read_text())
    tags = subprocess.run(["git", "tag"], capture_output=True, text=True, cwd=REPO).stdout.split()
    for repo in document["repos"]:
        assert repo["repo"] == "local" or repo["rev"] in tags, repo
    (local,) = [r for r in document["repos"] if r["repo"] == "local"]
    for hook in local["hooks"]:
        assert hook["entry"] == "fwdcheck run" and hook["language"] == "system" and hook["pass_filenames"] is False
        assert set(hook) <= set(hooks()["fwdcheck-system"]) | {"id", "name", "entry", "language", "stages"}
    assert "rev: COMMIT-OR-TAG" in (EXAMPLES / "pre-commit-config.yaml").read_text()


@pytest.mark.slow
def test_hook_entry_runs_on_the_toy_config(tmp_path):
    """What pre-commit executes: the entry, then the args, here the toy config in place of the default one."""
    hook = hooks()["fwdcheck-system"]
    args = [TOY if arg.endswith((".yaml", ".yml")) else arg for arg in hook["args"]]
    proc, _ = run_fwdcheck([*shlex.split(hook["entry"]), *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "passed (exit 0)" in proc.stdout


@pytest.mark.slow
def test_hook_default_config_missing_is_a_usage_error(tmp_path):
    """A repository without fwdcheck.yaml gets exit 2 and one line naming the file, not a traceback."""
    hook = hooks()["fwdcheck"]
    proc = subprocess.run(
        [*fwdcheck_executable(), *shlex.split(hook["entry"])[1:], *hook["args"]],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=environment(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "fwdcheck.yaml" in proc.stderr and "Traceback" not in proc.stderr
