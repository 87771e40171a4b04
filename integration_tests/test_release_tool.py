"""tools/release.py on a small git repository made here: two packages,
zerostack-alpha and zerostack-beta (which requires zerostack-alpha>=0.1,<0.2),
released once at 0.1.0 by the tool itself. Each test changes a copy of it and
runs a subcommand as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
}

pytest.importorskip("build", reason="release builds with `python -m build` (pip install build)")


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _tool(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/release.py", *args], cwd=repo, capture_output=True, text=True
    )  # fmt: skip


def _write_package(repo: Path, name: str, requires: list[str]) -> None:
    base = repo / "packages" / name
    (base / f"src/zerostack/{name}").mkdir(parents=True)
    (base / "tests").mkdir()
    deps = ", ".join(f'"{r}"' for r in requires)
    (base / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        f'[project]\nname = "zerostack-{name}"\ndynamic = ["version"]\n'
        f'description = "{name}"\nreadme = "README.md"\nrequires-python = ">=3.10"\n'
        'license = "Apache-2.0"\n'
        f"dependencies = [{deps}]\n\n"
        f'[tool.hatch.version]\npath = "src/zerostack/{name}/__about__.py"\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["src/zerostack"]\n'
    )
    (base / f"src/zerostack/{name}/__about__.py").write_text('__version__ = "0.1.0"\n')
    (base / f"src/zerostack/{name}/__init__.py").write_text("VALUE = 1\n")
    (base / "tests/test_value.py").write_text("def test_value():\n    pass\n")
    (base / "README.md").write_text(f"# zerostack-{name}\n")
    (base / "CHANGELOG.md").write_text("# Changelog\n\n## 0.1.0\n- First release.\n")


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """The repository with both packages released at 0.1.0 by `release`."""
    repo = tmp_path_factory.mktemp("released")
    _git(repo, "init", "-q")
    (repo / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "release.py", repo / "tools" / "release.py")
    (repo / ".gitignore").write_text("dist/\n__pycache__/\n")
    _write_package(repo, "alpha", [])
    _write_package(repo, "beta", ["zerostack-alpha>=0.1,<0.2"])
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "both packages")
    out = _tool(repo, "release")
    assert out.returncode == 0, out.stdout + out.stderr
    _git(repo, "add", "releases.json")
    _git(repo, "commit", "-qm", "release")
    return repo


@pytest.fixture
def repo(released: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(released, copy)
    return copy


def _set_version(repo: Path, name: str, version: str, heading: bool) -> None:
    about = repo / f"packages/{name}/src/zerostack/{name}/__about__.py"
    about.write_text(f'__version__ = "{version}"\n')
    if heading:
        log = repo / f"packages/{name}/CHANGELOG.md"
        log.write_text(log.read_text().replace("## 0.1.0", f"## {version}\n- A fix.\n\n## 0.1.0"))


def test_release_tags_and_records_every_new_package(released: Path) -> None:
    head = _git(released, "rev-parse", "HEAD~1")  # the release commit; HEAD adds releases.json
    records = json.loads((released / "releases.json").read_text())
    assert sorted(records) == ["zerostack-alpha", "zerostack-beta"]
    alpha = records["zerostack-alpha"][0]
    assert (alpha["version"], alpha["commit"], alpha["path"]) == ("0.1.0", head, "packages/alpha")
    assert alpha["files"]["src"] == _git(released, "rev-parse", f"{head}:packages/alpha/src")
    assert sorted(alpha["files"]) == ["pyproject.toml", "src"]  # tests, README, CHANGELOG not
    assert _git(released, "tag", "--list").split() == [
        "zerostack-alpha-v0.1.0",
        "zerostack-beta-v0.1.0",
    ]
    built = sorted(p.name for p in (released / "dist").iterdir())
    assert "zerostack_alpha-0.1.0.tar.gz" in built
    assert "zerostack_beta-0.1.0-py3-none-any.whl" in built


def test_check_passes_on_the_release(repo: Path) -> None:
    out = _tool(repo, "check")
    assert out.returncode == 0, out.stdout
    assert "ok   zerostack-alpha 0.1.0: unchanged since 0.1.0" in out.stdout


def test_check_fails_when_sources_change_without_a_new_version(repo: Path) -> None:
    # Uncommitted and untracked: check reads the working tree.
    (repo / "packages/alpha/src/zerostack/alpha/_new.py").write_text("X = 2\n")
    out = _tool(repo, "check")
    assert out.returncode == 1
    assert "FAIL zerostack-alpha 0.1.0: src changed since 0.1.0" in out.stdout
    assert "set __version__ there above 0.1.0 (0.2.0 for a public API change" in out.stdout
    assert "ok   zerostack-beta 0.1.0: unchanged since 0.1.0" in out.stdout


def test_check_passes_with_a_new_version_and_its_changelog_heading(repo: Path) -> None:
    (repo / "packages/alpha/src/zerostack/alpha/__init__.py").write_text("VALUE = 2\n")
    _set_version(repo, "alpha", "0.1.1", heading=True)
    out = _tool(repo, "check")
    assert out.returncode == 0, out.stdout
    assert "ok   zerostack-alpha 0.1.1: src changed since 0.1.0" in out.stdout


def test_check_fails_with_a_new_version_but_no_changelog_heading(repo: Path) -> None:
    _set_version(repo, "alpha", "0.1.1", heading=False)
    out = _tool(repo, "check")
    assert out.returncode == 1
    assert "packages/alpha/CHANGELOG.md has no '## 0.1.1' heading" in out.stdout


def test_check_fails_when_a_range_excludes_the_current_sibling(repo: Path) -> None:
    _set_version(repo, "alpha", "0.2.0", heading=True)
    out = _tool(repo, "check")
    assert out.returncode == 1
    assert (
        "packages/beta/pyproject.toml: zerostack-alpha>=0.1,<0.2 excludes the current "
        "zerostack-alpha 0.2.0" in out.stdout
    )


def test_tests_readme_and_changelog_need_no_new_version(repo: Path) -> None:
    (repo / "packages/alpha/tests/test_value.py").write_text("def test_value():\n    assert 1\n")
    (repo / "packages/alpha/README.md").write_text("# zerostack-alpha\n\nMore.\n")
    (repo / "packages/alpha/CHANGELOG.md").write_text("# Changelog\n\n## 0.1.0\n- Reworded.\n")
    out = _tool(repo, "check")
    assert out.returncode == 0, out.stdout


def test_ranges_and_compat_give_the_lowest_allowed_versions(repo: Path) -> None:
    _set_version(repo, "alpha", "0.2.0", heading=True)
    beta = repo / "packages/beta/pyproject.toml"
    beta.write_text(beta.read_text().replace("<0.2", "<0.3"))
    out = _tool(repo, "ranges")
    assert "    zerostack-alpha>=0.1,<0.3: lowest 0.1.0, current 0.2.0" in out.stdout
    out = _tool(repo, "compat")
    release = _git(repo, "rev-parse", "zerostack-alpha-v0.1.0")
    assert out.stdout.strip() == (
        f"zerostack-beta: packages/beta/tests with zerostack-alpha==0.1.0 ({release[:10]})"
    )
    beta.write_text(beta.read_text().replace(">=0.1", ">=0.2"))
    out = _tool(repo, "ranges")
    assert "    zerostack-alpha>=0.2,<0.3: lowest 0.2.0, current 0.2.0" in out.stdout
    assert "the unit sessions test exactly that" in _tool(repo, "compat").stdout


def test_release_dry_run_lists_the_changed_package_only(repo: Path) -> None:
    (repo / "packages/alpha/src/zerostack/alpha/__init__.py").write_text("VALUE = 2\n")
    _set_version(repo, "alpha", "0.1.1", heading=True)
    _git(repo, "commit", "-qam", "alpha 0.1.1")
    before = (repo / "releases.json").read_text()
    out = _tool(repo, "release", "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    head = _git(repo, "rev-parse", "HEAD")
    assert f"would tag zerostack-alpha-v0.1.1 at {head[:10]}" in out.stdout
    assert "zerostack-beta" not in out.stdout
    assert "twine upload dist/zerostack_alpha-0.1.1" in out.stdout
    assert (repo / "dist/zerostack_alpha-0.1.1-py3-none-any.whl").exists()
    assert (repo / "releases.json").read_text() == before
    assert "zerostack-alpha-v0.1.1" not in _git(repo, "tag", "--list")


def test_release_refuses_an_unreleased_heading_and_uncommitted_changes(repo: Path) -> None:
    _set_version(repo, "alpha", "0.1.1", heading=True)
    out = _tool(repo, "release", "--dry-run")
    assert out.returncode == 1
    assert "packages/ has uncommitted changes; commit them first" in out.stdout
    log = repo / "packages/alpha/CHANGELOG.md"
    log.write_text(log.read_text().replace("## 0.1.1", "## 0.1.1 (unreleased)"))
    _git(repo, "commit", "-qam", "alpha 0.1.1")
    out = _tool(repo, "release", "--dry-run")
    assert out.returncode == 1
    assert "'## 0.1.1 (unreleased)' says unreleased" in out.stdout


def test_check_keeps_the_docs_table_of_versions_current(repo: Path) -> None:
    page = repo / "docs/versions.md"
    page.parent.mkdir()
    begin, end = (
        f"<!-- {w}: python tools/release.py ranges --write-docs -->" for w in ("begin", "end")
    )
    page.write_text(f"# Versions\n\n{begin}\n{end}\n")
    out = _tool(repo, "check")
    assert out.returncode == 1
    assert "docs/versions.md: the table of versions is not the packages'" in out.stdout
    assert _tool(repo, "ranges", "--write-docs").returncode == 0
    assert (
        "| `zerostack-beta` | 0.1.0 | `zerostack-alpha>=0.1,<0.2` from 0.1.0 |" in page.read_text()
    )
    assert _tool(repo, "check").returncode == 0
