"""CHANGELOG.md's newest released version is the package's: fwdcheck.__version__ is the one source of truth
(pyproject.toml reads it), and a release that bumps it adds its `## [x.y.z]` section."""

from __future__ import annotations

import re
from pathlib import Path

import fwdcheck

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\](?: - (\d{4}-\d{2}-\d{2}))?\s*$", re.MULTILINE)


def test_newest_release_in_the_changelog_is_the_package_version():
    text = CHANGELOG.read_text(encoding="utf-8")
    releases = RELEASE.findall(text)
    assert releases, "CHANGELOG.md has no `## [x.y.z]` release heading"
    assert releases[0][0] == fwdcheck.__version__, (
        f"CHANGELOG.md's newest release is {releases[0][0]}, fwdcheck.__version__ is {fwdcheck.__version__}"
    )


def test_unreleased_comes_first():
    headings = re.findall(r"^## \[([^\]]+)\]", CHANGELOG.read_text(encoding="utf-8"), re.MULTILINE)
    assert headings[0] == "Unreleased", headings
