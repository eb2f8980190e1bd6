"""The README is a front page and the documentation site builds strictly: a broken link or anchor, a page left out
of the navigation, or a generated page that is stale fails here (CI runs this file with the rest of the suite)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import docs_pages
from tests.doc_sections import DOCS, README, ROOT, read_section, replace_section

FRONT_PAGE_LINES = 250
DEFAULT_CHECKS = (
    *("shape-ledger", "future-token", "mask-audit", "rope", "kv-cache", "packing", "label-shift", "grad-causality"),
    *("backends", "rope-precision", "attention-stats"),
)


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    built = build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    assert (tmp_path / "site" / "codes" / "index.html").is_file()


@pytest.mark.parametrize(
    "broken, said",
    [
        ("[cost](cost.md#no-such-anchor)", "does not contain an anchor '#no-such-anchor'"),
        ("[gone](no-such-page.md)", "the target is not found"),
    ],
)
@pytest.mark.slow
def test_a_broken_link_fails_the_build(tmp_path, broken, said):
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    limits = copy / "docs" / "limits.md"
    limits.write_text(limits.read_text(encoding="utf-8") + f"\n{broken}\n", encoding="utf-8")
    built = build(copy, tmp_path / "site")
    assert built.returncode != 0 and said in built.stderr, built.stderr


def test_every_page_is_in_the_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    listed = {page for entry in nav for page in entry.values()}
    assert listed == {path.name for path in DOCS.glob("*.md")}


def test_the_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < FRONT_PAGE_LINES
    # every link it makes to a file of the repository leads to one
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links to the docs"
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, missing
    assert {f"docs/{path.name}" for path in DOCS.glob("*.md")} - {"docs/index.md"} <= set(targets)


def test_the_site_gives_the_readme_s_commands():
    """The front page of the site shows the install and test commands exactly as the README (and CI) have them."""
    commands = re.findall(r"```bash\n(.*?)\n```", read_section_of(README, "## Set up and run"), re.S)
    assert len(commands) >= 2
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for command in commands:
        assert f"```bash\n{command}\n```" in index


def read_section_of(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


@pytest.mark.parametrize("page", list(docs_pages.PAGES), ids=lambda p: p.name)
def test_generated_page_is_current(page):
    assert page.read_text(encoding="utf-8") == docs_pages.page_text(page), (
        f"run `python -m tests.docs_pages --write` and commit {page.relative_to(ROOT)}"
    )


def test_the_checks_table_of_the_site_is_the_readme_s():
    assert read_section(docs_pages.CHECKS_PAGE, "checks") == docs_pages.checks_section(), (
        "run `python -m tests.docs_pages --write` and commit docs/checks.md"
    )


def test_the_codes_page_lists_every_code_explain_knows():
    from fwdcheck.config.registry import _is_builtin, code_owners
    from fwdcheck.errors import OWN_CODES

    page = docs_pages.codes_section()
    known = [code for code, (entry, _) in code_owners().items() if _is_builtin(entry)] + list(OWN_CODES)
    assert len(known) > 40
    for code in known:
        assert f"| `{code}` |" in page, code


def test_the_config_reference_lists_every_key():
    from fwdcheck.config.schema import Config, HFModel, Inputs

    page = docs_pages.config_section()
    for model in (Config, HFModel, Inputs):
        for name, field in model.model_fields.items():
            if not field.exclude:
                assert f"| `{field.alias or name}`" in page, (model.__name__, name)
    assert "source_path" not in page  # set by fwdcheck, refused in a file


def test_a_stale_section_is_told_apart():
    """The comparison the staleness tests rest on: a section rewritten is no longer what the page holds."""
    text = (DOCS / "compatibility.md").read_text(encoding="utf-8")
    rewritten = replace_section(text, "compat", "| model |\n| --- |")
    assert rewritten != text and "<!-- sweep:start -->" in rewritten
    with pytest.raises(ValueError):
        replace_section("no markers here", "compat", "x")


def test_the_broken_configs_are_the_bugs_the_default_checks_catch():
    """docs/reference-model.md says sample_configs/broken holds a config for each bug a default run catches (some
    default check fails), and lists every bug the reference model can plant."""
    from fwdcheck.config.bugs import BUGS

    text = (DOCS / "reference-model.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| .* \| ([^|]+) \|$", text, re.M))
    assert set(rows) == set(BUGS)
    caught_by_default = {
        bug for bug, fails in rows.items() if set(re.findall(r"[a-z][a-z-]+[a-z]", fails)) & set(DEFAULT_CHECKS)
    }
    assert caught_by_default == set(BUGS) - {"heads-swapped"}  # only a golden file sees heads swapped
    assert {path.stem for path in (ROOT / "sample_configs" / "broken").glob("*.yaml")} == caught_by_default


def test_the_starter_config_says_what_an_omitted_checks_key_runs():
    from fwdcheck.config.registry import select
    from fwdcheck.model.sources import starter_config

    line = next(row for row in starter_config("reference", "x").splitlines() if row.startswith("# checks:"))
    listed = re.search(r"\[(.*?)\]", line).group(1).split(", ")
    # the default selection, and a check outside it added: what an omitted key runs is the first word
    assert listed[0] == "default" and select(listed[:1]) == select(None)
    assert not set(listed[1:]) & {entry.name for entry in select(None)} and select(listed[1:])
    assert "omitted: the default checks, each where it applies" in line and "every registered check" not in line


def test_the_checks_table_lists_every_built_in_check_and_which_run_by_default():
    from fwdcheck.config.registry import _is_builtin, available, info

    rows = re.findall(r"^\| `([a-z-]+)`( \([^)]*\))? \|", read_section(README, "checks"), re.M)
    assert rows, "the README's checks table"
    builtins = {name: entry for name, entry in available().items() if _is_builtin(entry)}
    assert {name for name, _ in rows} == set(builtins)
    for name, remark in rows:
        assert info(builtins[name]).default == (remark == ""), (name, remark)


def test_the_pages_a_user_reads_name_no_seed_notes():
    """The README once called the toy "the seed notes' toy configuration": notes a user of the package never sees."""
    pages = [README, *DOCS.glob("*.md"), *(ROOT / "sample_configs").rglob("*.yaml")]
    assert [p.name for p in pages if "seed notes" in p.read_text(encoding="utf-8")] == []


def test_the_front_pages_checks_table_is_a_line_per_check_linking_to_its_details():
    """The README says what each check verifies in a line and links to how it is checked (docs/checks.md, a section
    per check), instead of a column of whole paragraphs; every built-in check has both."""
    from fwdcheck.config.registry import _is_builtin, available

    rows = [line for line in read_section(README, "checks").splitlines() if line.startswith("| `")]
    details = (DOCS / "checks.md").read_text(encoding="utf-8")
    named = []
    for row in rows:
        name = row.split("`")[1]
        named.append(name)
        verifies, how = [cell.strip(" |") for cell in row.split(" | ")[1:3]]
        assert len(verifies) <= 160, (name, verifies)
        assert how == f"[how](docs/checks.md#{name})", (name, how)
        assert f"\n### {name}\n" in details, name
    assert set(named) == {e.name for e in available().values() if _is_builtin(e)}
