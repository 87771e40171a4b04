"""Versions, sibling ranges and releases of the packages under packages/.

Each package has its own version (`src/zerostack/<name>/__about__.py`) and
CHANGELOG.md. `releases.json` at the repository root records every release:
per distribution, the version, the commit, and the git ids of what goes into
the package's build at that commit (its `src/` tree, `pyproject.toml`, and for
fused-adam `csrc/` and `hatch_build.py`). A package has changed since its last
release when those ids differ from the working tree's; that needs no history,
so it works in a shallow clone. Tests, README.md and CHANGELOG.md are not
compared: changing them needs no new version. docs/versions.md explains the
rules; docs/development.md shows the commands.

    python tools/release.py check               # `nox -s lint`
    python tools/release.py ranges
    python tools/release.py compat              # what `nox -s compat` tests
    python tools/release.py release --dry-run   # `nox -s release -- --dry-run`
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ROOT / "releases.json"
DIST = ROOT / "dist"
# docs/versions.md's table of which versions work together, written by `ranges --write-docs`.
DOCS_PAGE = ROOT / "docs" / "versions.md"
TABLE_BEGIN = "<!-- begin: python tools/release.py ranges --write-docs -->"
TABLE_END = "<!-- end: python tools/release.py ranges --write-docs -->"
# What a package folder holds besides its code: changing these needs no new version.
NOT_BUILT = {"tests", "README.md", "CHANGELOG.md"}


@dataclass(frozen=True)
class Package:
    folder: str  # packages/<folder>
    dist: str  # the distribution name, canonical (zerostack-chunk)
    version: Version  # what __about__.py says now
    about: str  # __about__.py, relative to the repository root
    requires: dict[str, SpecifierSet]  # sibling distribution -> the range it accepts
    extras: dict[str, str]  # sibling distribution -> the extra that asks for it, if one does

    @property
    def changelog(self) -> Path:
        return ROOT / "packages" / self.folder / "CHANGELOG.md"


def _git(*args: str, env: dict | None = None, binary: bool = False):
    out = subprocess.run(
        ["git", *args], cwd=ROOT, env=env, capture_output=True, check=False
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"git {' '.join(args)}: {out.stderr.decode().strip()}")
    return out.stdout if binary else out.stdout.decode().strip()


def packages() -> dict[str, Package]:
    """Every package under packages/, by distribution name."""
    metas = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        metas[pyproject.parent.name] = tomllib.loads(pyproject.read_text())
    names = {canonicalize_name(m["project"]["name"]) for m in metas.values()}
    found: dict[str, Package] = {}
    for folder, meta in metas.items():
        project = meta["project"]
        about = f"packages/{folder}/" + meta["tool"]["hatch"]["version"]["path"]
        text = (ROOT / about).read_text()
        version = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
        if version is None:
            raise SystemExit(f"{about}: no __version__ = '...' line")
        reqs = [(r, "") for r in project.get("dependencies", [])]
        for extra, group in project.get("optional-dependencies", {}).items():
            reqs += [(r, extra) for r in group]
        requires: dict[str, SpecifierSet] = {}
        extras: dict[str, str] = {}
        for text, extra in reqs:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name in names:
                requires[name] = requires.get(name, SpecifierSet()) & req.specifier
                if extra:
                    extras[name] = extra
        dist = canonicalize_name(project["name"])
        found[dist] = Package(folder, dist, Version(version[1]), about, requires, extras)
    return found


def load_releases() -> dict[str, list[dict]]:
    """releases.json: distribution -> its releases, oldest first."""
    return json.loads(RELEASES.read_text()) if RELEASES.exists() else {}


def last_release(releases: dict[str, list[dict]], dist: str) -> dict | None:
    done = releases.get(dist, [])
    return max(done, key=lambda r: Version(r["version"])) if done else None


def working_tree() -> str:
    """The git tree id of the working tree (tracked files and untracked ones
    git does not ignore), made in a temporary index: HEAD and the index are
    left alone, so `check` sees changes before they are committed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git("read-tree", "HEAD", env=env)
        _git("add", "--all", "--", "packages", env=env)
        return _git("write-tree", env=env)


def built_files(tree: str, folder: str) -> dict[str, str]:
    """The git ids of what goes into a package's build, in `tree` (a commit
    or a tree id): every entry of its folder but tests, README and CHANGELOG."""
    listing = _git("ls-tree", tree, f"packages/{folder}/")
    ids = {}
    for line in listing.splitlines():
        info, path = line.split("\t", 1)
        name = path.rsplit("/", 1)[-1]
        if name not in NOT_BUILT:
            ids[name] = info.split()[2]
    return ids


def changed_entries(pkg: Package, releases: dict, tree: str) -> list[str] | None:
    """What changed in a package's build since its last release (entries of
    its folder, e.g. ["src"]), or None when it was never released."""
    last = last_release(releases, pkg.dist)
    if last is None:
        return None
    now, then = built_files(tree, pkg.folder), last["files"]
    return sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))


def changelog_heading(pkg: Package) -> str | None:
    """The CHANGELOG.md line that heads the package's current version."""
    text = pkg.changelog.read_text() if pkg.changelog.exists() else ""
    match = re.search(rf"^## {re.escape(str(pkg.version))}(?:\s.*)?$", text, re.M)
    return match[0] if match else None


def next_versions(version: Version) -> str:
    """The two semantic bumps while at 0.x, as a hint."""
    major, minor, micro = (list(version.release) + [0, 0])[:3]
    if major == 0:
        return (
            f"{major}.{minor + 1}.0 for a public API change, {major}.{minor}.{micro + 1} otherwise"
        )
    return f"{major + 1}.0.0 for a breaking change, {major}.{minor + 1}.0 for a feature"


def known_versions(releases: dict, pkg: Package) -> list[Version]:
    """The versions of a package that exist: released ones and the current one."""
    return sorted({Version(r["version"]) for r in releases.get(pkg.dist, [])} | {pkg.version})


def show(spec: SpecifierSet) -> str:
    """A range as pyproject.toml writes it: lower bound first."""
    return ",".join(sorted(map(str, spec), key=lambda s: not s.startswith(">")))


def lowest_allowed(releases: dict, sibling: Package, spec: SpecifierSet) -> Version | None:
    allowed = [v for v in known_versions(releases, sibling) if spec.contains(v, prereleases=True)]
    return allowed[0] if allowed else None


def problems(pkgs: dict[str, Package], releases: dict, tree: str) -> dict[str, list[str]]:
    """What is wrong per package (folder -> messages, each with its fix)."""
    found: dict[str, list[str]] = {}
    for pkg in pkgs.values():
        wrong = found.setdefault(pkg.folder, [])
        last = last_release(releases, pkg.dist)
        entries = changed_entries(pkg, releases, tree)
        if last is not None and entries:
            released = Version(last["version"])
            what = ", ".join(entries)
            if pkg.version <= released:
                wrong.append(
                    f"packages/{pkg.folder}: {what} changed since {pkg.dist} {released} (commit {last['commit'][:10]}), "
                    f"but {pkg.about} says {pkg.version}; set __version__ there above "
                    f"{released} ({next_versions(released)})"
                )
        if (last is None or entries) and changelog_heading(pkg) is None:
            wrong.append(
                f"packages/{pkg.folder}/CHANGELOG.md has no '## {pkg.version}' heading; "
                f"put this version's entries under it (rename '## Unreleased' if they are there)"
            )
        for name, spec in sorted(pkg.requires.items()):
            sibling = pkgs[name]
            if not spec.contains(sibling.version, prereleases=True):
                wrong.append(
                    f"packages/{pkg.folder}/pyproject.toml: {name}{show(spec)} excludes the current "
                    f"{name} {sibling.version}; widen the range to hold it (and raise its lower "
                    f"bound if {pkg.dist} uses what {sibling.version} added)"
                )
    if DOCS_PAGE.exists() and docs_table_now() != docs_table(pkgs, releases):
        found["docs"] = [
            f"{DOCS_PAGE.relative_to(ROOT)}: the table of versions is not the packages' "
            "versions and ranges; rewrite it with `python tools/release.py ranges --write-docs`"
        ]
    return {k: v for k, v in found.items() if v}


def docs_table(pkgs: dict[str, Package], releases: dict) -> str:
    """The Markdown table of each package's version and the sibling versions it accepts."""
    rows = [
        "| package | version | zerostack siblings it accepts (lowest version tested) |",
        "|---|---|---|",
    ]
    order: list[str] = []  # each package after the siblings it requires
    while len(order) < len(pkgs):
        order.append(
            next(
                d for d in sorted(pkgs) if d not in order and pkgs[d].requires.keys() <= set(order)
            )
        )
    for pkg in [pkgs[d] for d in order]:
        cells = []
        for name, spec in sorted(pkg.requires.items()):
            extra = f" (extra `{pkg.extras[name]}`)" if name in pkg.extras else ""
            low = lowest_allowed(releases, pkgs[name], spec)
            cells.append(f"`{name}{show(spec)}`{extra} from {low or 'none'}")
        rows.append(f"| `{pkg.dist}` | {pkg.version} | {'<br>'.join(cells) or 'none'} |")
    return "\n" + "\n".join(rows) + "\n\n"  # blank lines: Markdown needs them around a table


def docs_table_now() -> str | None:
    """The table docs/versions.md holds between its markers, or None."""
    text = DOCS_PAGE.read_text() if DOCS_PAGE.exists() else ""
    found = re.search(rf"{re.escape(TABLE_BEGIN)}\n(.*?){re.escape(TABLE_END)}", text, re.S)
    return found[1] if found else None


def check(args: argparse.Namespace) -> int:
    """Every package whose build changed since its last release has a higher
    version and a CHANGELOG heading for it, and every sibling range holds the
    sibling's current version. Prints each problem with its fix; exit 1 if any."""
    pkgs, releases, tree = packages(), load_releases(), working_tree()
    wrong = problems(pkgs, releases, tree)
    for pkg in pkgs.values():
        last = last_release(releases, pkg.dist)
        entries = changed_entries(pkg, releases, tree)
        state = (
            "never released"
            if last is None
            else f"{', '.join(entries)} changed since {last['version']}"
            if entries
            else f"unchanged since {last['version']}"
        )
        mark = "FAIL" if pkg.folder in wrong else "ok"
        print(f"{mark:4} {pkg.dist} {pkg.version}: {state}")
        for message in wrong.get(pkg.folder, []):
            print(f"     - {message}")
    for message in wrong.get("docs", []):
        print(f"FAIL {message}")
    if wrong:
        print(f"{len(wrong)} thing(s) to fix; docs/versions.md says what a bump means")
    return 1 if wrong else 0


def ranges(args: argparse.Namespace) -> int:
    """Each package's requirements on its siblings, the lowest version each
    range allows (among released versions and the current one) and the current
    one. --write-docs writes them as the table of docs/versions.md instead."""
    pkgs, releases = packages(), load_releases()
    if args.write_docs:
        if docs_table_now() is None:
            raise SystemExit(f"ranges: {DOCS_PAGE} lacks the lines {TABLE_BEGIN} and {TABLE_END}")
        text = DOCS_PAGE.read_text()
        start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN) + 1
        table = docs_table(pkgs, releases)
        DOCS_PAGE.write_text(text[:start] + table + text[text.index(TABLE_END) :])
        print(f"wrote the table of {DOCS_PAGE.relative_to(ROOT)}")
        return 0
    for pkg in pkgs.values():
        print(f"{pkg.dist} {pkg.version}")
        for name, spec in sorted(pkg.requires.items()):
            low = lowest_allowed(releases, pkgs[name], spec)
            print(f"    {name}{show(spec)}: lowest {low or 'none'}, current {pkgs[name].version}")
    return 0


@dataclass(frozen=True)
class CompatCase:
    folder: str  # the package whose tests run
    dist: str
    # sibling distribution -> (its folder, the lowest allowed version, its release record)
    oldest: dict[str, tuple[str, Version, dict]]


def compat_plan() -> list[CompatCase]:
    """The packages whose ranges allow an older sibling than the current one,
    with those oldest siblings: what `nox -s compat` installs and tests."""
    pkgs, releases = packages(), load_releases()
    cases = []
    for pkg in pkgs.values():
        oldest = {}
        for name, spec in sorted(pkg.requires.items()):
            low = lowest_allowed(releases, pkgs[name], spec)
            if low is not None and low != pkgs[name].version:
                record = next(r for r in releases[name] if Version(r["version"]) == low)
                oldest[name] = (pkgs[name].folder, low, record)
        if oldest:
            cases.append(CompatCase(pkg.folder, pkg.dist, oldest))
    return cases


def compat(args: argparse.Namespace) -> int:
    """Lists what `nox -s compat` tests: each package with the siblings its
    ranges allow at their lowest, where that is older than the current one."""
    plan = compat_plan()
    if not plan:
        print("every sibling range's lowest version is the sibling's current one: "
              "the unit sessions test exactly that")  # fmt: skip
    for case in plan:
        pins = ", ".join(f"{n}=={v} ({r['commit'][:10]})" for n, (_, v, r) in case.oldest.items())
        print(f"{case.dist}: packages/{case.folder}/tests with {pins}")
    return 0


def export_release(record: dict, dest: Path) -> Path:
    """A released package's folder as it was at its release commit, written
    under `dest` (git archive); returns the folder."""
    commit, path = record["commit"], record["path"]
    present = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True
    )  # fmt: skip
    if present.returncode:
        raise SystemExit(
            f"compat: this clone lacks commit {commit} ({path} as released); "
            "fetch the history (git fetch --unshallow --tags) and run it again"
        )
    data = _git("archive", "--format=tar", commit, path, binary=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(dest, filter="data")
    return dest / path


def _build(pkg: Package) -> list[Path]:
    """sdist and wheel of a package into dist/ (isolated, as `nox -s build`)."""
    stem = pkg.dist.replace("-", "_")
    for old in DIST.glob(f"{stem}-*"):
        old.unlink()
    subprocess.run(
        [sys.executable, "-m", "build", f"packages/{pkg.folder}", "--outdir", str(DIST)],
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return sorted(DIST.glob(f"{stem}-{pkg.version}[.-]*"))


def release(args: argparse.Namespace) -> int:
    """Releases every package whose build changed since its last release (and
    every package never released): checks versions, CHANGELOG headings and
    ranges, builds its sdist and wheel into dist/, runs twine check, tags HEAD
    `<distribution>-v<version>` and records the release in releases.json, then
    says what it would upload. --dry-run does all but tag and record."""
    pkgs, releases, tree = packages(), load_releases(), working_tree()
    if _git("rev-parse", f"{tree}:packages") != _git("rev-parse", "HEAD:packages"):
        print("release: packages/ has uncommitted changes; commit them first (a release tags HEAD)")
        return 1
    todo = [p for p in pkgs.values() if changed_entries(p, releases, tree) != []]
    if not todo:
        print("release: no package changed since its last release; nothing to do")
        return 0
    wrong = problems(pkgs, releases, tree)
    for pkg in todo:
        heading = changelog_heading(pkg)
        if heading and "unreleased" in heading.lower():
            wrong.setdefault(pkg.folder, []).append(
                f"packages/{pkg.folder}/CHANGELOG.md: '{heading}' says unreleased; "
                f"write '## {pkg.version}' with the release date instead"
            )
        tag = f"{pkg.dist}-v{pkg.version}"
        if _git("tag", "--list", tag):
            wrong.setdefault(pkg.folder, []).append(
                f"packages/{pkg.folder}: tag {tag} exists; set a new version in {pkg.about}"
            )
    if wrong:
        for messages in wrong.values():
            for message in messages:
                print(f"release: {message}")
        return 1
    files = [f for pkg in todo for f in _build(pkg)]
    subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
                   cwd=ROOT, check=True)  # fmt: skip
    head = _git("rev-parse", "HEAD")
    verb = "would tag" if args.dry_run else "tagged"
    for pkg in todo:
        tag = f"{pkg.dist}-v{pkg.version}"
        if not args.dry_run:
            _git("tag", tag, head)
        print(f"{verb} {tag} at {head[:10]}")
        entry = {
            "version": str(pkg.version),
            "commit": head,
            "path": f"packages/{pkg.folder}",
            "files": built_files(head, pkg.folder),
        }
        releases.setdefault(pkg.dist, []).append(entry)
    if args.dry_run:
        print(f"would record {len(todo)} release(s) in releases.json")
    else:
        write_releases(releases)
        print("recorded in releases.json: commit it (git add releases.json; git commit)")
    names = " ".join(str(f.relative_to(ROOT)) for f in files)
    print(f"would upload (no package index is configured here): twine upload {names}")
    return 0


def write_releases(releases: dict[str, list[dict]]) -> None:
    RELEASES.write_text(json.dumps(dict(sorted(releases.items())), indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (check, ranges, compat, release):
        doc = command.__doc__ or ""
        one = sub.add_parser(command.__name__, help=doc.split(".")[0], description=doc)
        one.set_defaults(run=command)
        if command is release:
            one.add_argument("--dry-run", action="store_true", help="build and check only")
        if command is ranges:
            one.add_argument("--write-docs", action="store_true", help="the docs/versions.md table")
    args = parser.parse_args(argv)
    if shutil.which("git") is None:
        raise SystemExit("release.py needs git on PATH")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
