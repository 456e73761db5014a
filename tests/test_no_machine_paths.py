"""No file in the repository names a folder of the machine it was made on.

Artefacts, recipes, docs and code are read on other machines: an absolute path of the author's
machine there is either a broken link or a leak. Paths are recorded relative to the repository.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("README.md", "benchmarks/", "recipes/", "docs/", "poise_trl/", "tests/", ".ci/")

# A home, workspace or temporary folder followed by a path. The lookbehind keeps URLs
# (https://host/work/...) and relative paths (runs/tmp/...) out.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|root|tmp|Users|home/[\w.-]+)/[\w.-]+")

# Paths that are the subject of a test, not a record of a machine: (file, path) -> why. Written in
# pieces, here and below, so this file does not match its own pattern.
ROOT = "/"
ALLOWED = {
    ("tests/test_sandbox.py", f"{ROOT}tmp/poise-sandbox-sentinel"):
        "a hostile program tries to write the host's /tmp; the test asserts the file never appears",
}


def machine_paths(text: str) -> list[str]:
    return [match.group(0) for match in MACHINE_PATH.finditer(text)]


def repository_files() -> list[str]:
    """Tracked files plus new ones git does not ignore, so a path is caught before it is committed."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [name for name in listed if name.startswith(CHECKED) and (REPO_ROOT / name).is_file()]


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (weights, plots)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_machine_path_pattern():
    found = machine_paths(f'"recipe": "{ROOT}work/main/recipes/toy/dapo.yaml", {ROOT}home/alice/x, '
                          f"{ROOT}root/.cache/y, {ROOT}tmp/pytest-1/z, {ROOT}Users/bob/w")
    assert found == [f"{ROOT}work/main", f"{ROOT}home/alice/x", f"{ROOT}root/.cache", f"{ROOT}tmp/pytest-1",
                     f"{ROOT}Users/bob"]
    assert machine_paths("recipes/toy/dapo.yaml runs/tmp/x https://example.com/work/page ~/work/x /tmp") == []


@pytest.mark.skipif(not (REPO_ROOT / ".git").exists() or shutil.which("git") is None,
                    reason="needs a git checkout (the files to check are git's list)")
def test_no_absolute_machine_path_in_repository_files():
    found = []
    for name in repository_files():
        text = read_text(REPO_ROOT / name)
        found += [f"{name}: {path}" for path in machine_paths(text or "") if (name, path) not in ALLOWED]
    assert found == [], "record paths relative to the repository (e.g. Path(__file__).parent / ...)"


def test_allowed_paths_are_still_there():
    """An allowance whose path left its file is stale: drop it rather than keep a blind spot."""
    for name, path in ALLOWED:
        assert path in (REPO_ROOT / name).read_text(), f"{path} is no longer in {name}: remove it from ALLOWED"
