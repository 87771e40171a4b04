"""The one task runner. `nox -s tests` is what CI runs (see README).

[Note: installs as from an index] Every session that needs zerostack
packages installs them the way a user does: each package is built once into
a wheel (.nox/_dist, rebuilt only when its sources change) and requested by
its distribution name with `pip install --find-links`, so pip resolves the
siblings from their declared requirements, and a session then checks that
exactly the expected zerostack distributions are installed. torch and numpy,
and transformers where a session needs it, are installed once per machine
(.nox/_linked) and hard-linked into each session's environment: unpacking and
byte-compiling torch took about 45 s per session on a 2-core machine,
linking it takes under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
# CPU runs take the local torch 2.13.0 CPU file; an unpinned torch would pull
# a multi-GB CUDA build. ZEROSTACK_TORCH overrides (e.g. "torch==2.14.1").
TORCH = os.environ.get("ZEROSTACK_TORCH", "torch==2.13.0")
# CPU sessions skip the CUDA kernel (it cannot run there); `build` and `gpu`
# compile it wherever nvcc is found.
CPU_ENV = {"ZEROSTACK_BUILD_CUDA": os.environ.get("ZEROSTACK_BUILD_CUDA", "0")}
# Test-only third-party requirements of a package's unit session; its tests
# importorskip them, so a bare install of the package still passes. transformers
# 5.24.0 (torch >= 2.6, Python >= 3.11) installs in ~15 s: pure-Python plus
# tokenizers, safetensors, hf-xet and regex wheels; torch is not among its deps.
TEST_REQUIREMENTS = {
    "zero-chunk": ["transformers==5.24.0; python_version >= '3.11'"],
    "gemini-placement": ["transformers==5.24.0; python_version >= '3.11'"],
    "booster-api": ["transformers==5.24.0; python_version >= '3.11'"],
    "auto-offload-solver": ["transformers==5.24.0; python_version >= '3.11'"],
}
# The examples, and the DeepSpeed program of docs/migration/deepspeed.md, train
# transformers' GPT-2 (tqdm, which two examples show, comes with it).
EXAMPLE_REQUIREMENTS = ["transformers==5.24.0"]
# The longest test sessions run pytest in worker processes (pytest-xdist).
# With two workers on the 2-core CI machine, pytest took 186 s for
# booster-api, 157 s for gemini-placement, 168 s for zero-shard and 126 s for
# integration (one process, in an earlier run: 309, 269, 257 and 219 s), and
# the whole test command 22 min 15 s (28 min 17 s before); 18 min 45 s from a
# fresh clone at 2a54ea3 (23 min 41 s at 0215a41), after the rows of a test
# ran in one spawn, the ranks froze torch's objects out of the optimizers'
# collections, and transformers was linked as torch is. Each multi-rank
# test spawns its ranks with a file rendezvous of its own. zero-chunk's tests
# are mostly spawns of 2 and 4 ranks: 87 s in one process on a loaded 2-core
# machine (its one timing test counts CPU time, not wall time). The short
# sessions stay in one process (the fused-adam session times a GIL-releasing
# kernel). ZEROSTACK_TEST_WORKERS sets the count (1: in-process, as `-- -n 0`
# does).
PARALLEL_TESTS = {"booster-api", "gemini-placement", "zero-shard", "zero-chunk", "integration"}


def _test_workers() -> int:
    text = os.environ.get("ZEROSTACK_TEST_WORKERS")
    if text is None:
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        return min(4, len(usable) if usable else os.cpu_count() or 1)
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"ZEROSTACK_TEST_WORKERS must be an int >= 1 (got {text!r})")
    return int(text)


TEST_WORKERS = _test_workers()
XDIST = "pytest-xdist==3.8.0"
# What CI runs, in order; `tests` requires them all (nox then reports each one).
CI_SESSIONS = ["lint", "unit", "compat", "integration", "examples", "build", "docs"]
WHEELHOUSE = ROOT / ".nox" / "_dist"  # See [Note: installs as from an index]
LINKED_HOME = ROOT / ".nox" / "_linked"
TENSORNVME_HOME = ROOT / ".nox" / "_wheels"
TENSORNVME = "tensornvme==0.1.0"
TENSORNVME_APT = "apt-get install -y liburing-dev libaio-dev cmake"

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _meta(folder: str) -> dict:
    return tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]


def _module_name(folder: str) -> str:
    """The package's import name under the namespace (fused_adam for fused-adam)."""
    return next((ROOT / "packages" / folder / "src/zerostack").iterdir()).name


def _dist_to_folder() -> dict[str, str]:
    return {_meta(f)["name"]: f for f in PACKAGES}


def _req_name(req: str) -> str:
    return re.split(r"[\s;\[<>=!~]", req, maxsplit=1)[0].lower().replace("_", "-")


def _zerostack_extras(folder: str) -> list[str]:
    """The extras of a package that consist only of zerostack packages
    (fused-adam's `nvme`, zero-shard's `cpu-offload`)."""
    by_name = _dist_to_folder()
    groups = _meta(folder).get("optional-dependencies", {})
    return sorted(k for k, reqs in groups.items() if all(_req_name(r) in by_name for r in reqs))


def _zerostack_deps(folder: str, extras: bool = True) -> list[str]:
    """The package's declared zerostack dependencies, transitively, as
    folders; with `extras`, its zerostack-only extras' too (theirs never)."""
    by_name = _dist_to_folder()
    seen: list[str] = []
    todo = [(folder, extras)]
    while todo:
        current, with_extras = todo.pop()
        meta = _meta(current)
        reqs = list(meta.get("dependencies", []))
        for extra in _zerostack_extras(current) if with_extras else []:
            reqs += meta["optional-dependencies"][extra]
        for req in reqs:
            # An extra named in a requirement (zerostack-fused-adam[nvme]) counts.
            requested = re.search(r"\[([^\]]*)\]", req.split(";")[0])
            dep = by_name.get(_req_name(req))
            if dep and dep not in seen:
                seen.append(dep)
                todo.append((dep, False))
                if requested:
                    for extra in requested.group(1).split(","):
                        for r in _meta(dep)["optional-dependencies"][extra.strip()]:
                            sub = by_name.get(_req_name(r))
                            if sub and sub not in seen:
                                seen.append(sub)
                                todo.append((sub, False))
    return seen


def _python_facts(session: nox.Session, python: str) -> dict:
    code = (
        "import json, sys, sysconfig; print(json.dumps({'purelib': sysconfig.get_path('purelib'),"
        " 'tag': f'cp{sys.version_info[0]}{sys.version_info[1]}', 'exe': sys.executable}))"
    )
    out = session.run(python, "-c", code, silent=True, external=True)
    return json.loads(out.strip().splitlines()[-1])


def _dist_key(dist_info: str) -> str:
    return _req_name(dist_info.split("-")[0])


def _link_tree(src: Path, dst: Path) -> None:
    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:  # another filesystem
            shutil.copy2(s, d)

    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link, symlinks=True)
    else:
        link(str(src), str(dst))


def _install_linked(session: nox.Session, requirements: list[str], python: str) -> None:
    """`requirements` with their dependencies, installed once per machine into
    .nox/_linked and hard-linked into the environment of `python`; a
    distribution the environment already has is kept. See [Note: installs as
    from an index]."""
    facts = _python_facts(session, python)
    site = Path(facts["purelib"])
    present = {_dist_key(p.name) for p in site.glob("*.dist-info")}
    if all(_req_name(r) in present for r in requirements):
        return
    slug = re.sub(r"[^A-Za-z0-9.=]+", "_", "+".join(requirements)) + "-" + facts["tag"]
    home = LINKED_HOME / hashlib.sha256(slug.encode()).hexdigest()[:12]
    if not (home / "ready").exists():
        tmp = LINKED_HOME / f"{home.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        session.run(python, "-m", "pip", "install", "--quiet", "--target", str(tmp),
                    *requirements, external=True)  # fmt: skip
        (tmp / "ready").write_text(slug + "\n")
        shutil.rmtree(home, ignore_errors=True)
        tmp.rename(home)
    # Each distribution with its files (its RECORD), unless the environment
    # already has it (virtualenv seeds setuptools, which torch also requires).
    for info in home.glob("*.dist-info"):
        if _dist_key(info.name) in present:
            continue
        rows = (info / "RECORD").read_text().splitlines()
        tops = {r.split(",")[0].split("/")[0] for r in rows if r and not r.startswith("..")}
        for top in sorted(tops | {info.name}):
            if (home / top).exists() and not (site / top).exists():
                _link_tree(home / top, site / top)
    # Console scripts (torchrun, ...): the same, with this environment's python.
    bindir = Path(facts["exe"]).parent
    for script in (home / "bin").iterdir() if (home / "bin").exists() else []:
        if (bindir / script.name).exists():
            continue
        lines = script.read_text().splitlines(keepends=True)
        if lines and lines[0].startswith("#!"):
            lines[0] = f"#!{facts['exe']}\n"
        (bindir / script.name).write_text("".join(lines))
        (bindir / script.name).chmod(0o755)


def _install_torch(session: nox.Session, python: str = "python") -> None:
    """torch and numpy (torch warns at import without it), linked in (see
    _install_linked)."""
    _install_linked(session, [TORCH, "numpy"], python)


def _install_test_requirements(session: nox.Session, requirements: list[str]) -> None:
    """Third-party test or example requirements (transformers), linked in as
    torch is: unpacking and byte-compiling transformers took about 15 s per
    session on a 2-core machine. One whose marker excludes this Python is
    left out by pip, and so here."""
    if requirements:
        _install_linked(session, requirements, "python")


def _source_key(folder: str, env: dict) -> str:
    """A hash of what goes into a package's wheel: its files but the tests,
    and the build settings."""
    h = hashlib.sha256(json.dumps(sorted(env.items())).encode())
    base = ROOT / "packages" / folder
    skip_dirs = {"tests", "__pycache__", "build", "dist", ".pytest_cache"}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(
            d for d in dirnames if d not in skip_dirs and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            if name.endswith((".so", ".o", ".pyc")):
                continue
            path = Path(dirpath) / name
            h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _builder(session: nox.Session) -> str:
    """The python of an environment holding every package's build requirements
    (hatchling, pybind11), made once: one build environment for all the
    wheels instead of one per wheel (pip's isolation). The `build` session
    still builds each package in isolation, from its sdist."""
    requires = sorted(
        {
            r
            for f in PACKAGES
            for r in tomllib.loads((ROOT / "packages" / f / "pyproject.toml").read_text())[
                "build-system"
            ]["requires"]
        }
    )
    venv = ROOT / ".nox" / f"_builder-{hashlib.sha256(repr(requires).encode()).hexdigest()[:8]}"
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        shutil.rmtree(venv, ignore_errors=True)
        session.run(sys.executable, "-m", "virtualenv", "--quiet", str(venv), external=True)
        session.run(str(python), "-m", "pip", "install", "--quiet", *requires, external=True)
        (venv / "ready").touch()
    return str(python)


def _build_wheels(session: nox.Session, sources: list[str], out: Path, env: dict) -> None:
    """Wheels of package folders into `out` (emptied first), in one pip call
    in the shared build environment."""
    shutil.rmtree(out, ignore_errors=True)
    session.run(_builder(session), "-m", "pip", "wheel", "--quiet", "--no-deps",
                "--no-build-isolation", "--wheel-dir", str(out), *sources, env=env,
                external=True)  # fmt: skip


def _wheel_dirs(session: nox.Session, folders: list[str], env: dict) -> list[Path]:
    """One folder per package holding its wheel, built from this tree when
    its sources changed since the last build (one pip call for all)."""
    dirs = {f: WHEELHOUSE / f"{f}-{_source_key(f, env)}" for f in folders}
    stale = [f for f, d in dirs.items() if not list(d.glob("*.whl"))]
    if stale:
        tmp = WHEELHOUSE / "_partial"
        _build_wheels(session, [f"packages/{f}" for f in stale], tmp, env)
        for f in stale:
            name = _meta(f)["name"].replace("-", "_")
            for old in WHEELHOUSE.glob(f"{f}-*"):
                shutil.rmtree(old)
            dirs[f].mkdir(parents=True)
            for wheel in tmp.glob(f"{name}-*.whl"):
                wheel.rename(dirs[f] / wheel.name)
        shutil.rmtree(tmp, ignore_errors=True)
    return list(dirs.values())


def _tensornvme_missing() -> list[str]:
    """What tensornvme's source build needs and this machine lacks."""

    def dirs(*names: str) -> list[str]:
        return [d for n in names for d in os.environ.get(n, "").split(":") if d]

    include = [
        *dirs("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH"),
        "/usr/local/include",
        "/usr/include",
    ]
    libs = [*dirs("LIBRARY_PATH"), "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
    missing = [
        h for h in ("liburing.h", "libaio.h") if not any(Path(d, h).exists() for d in include)
    ]
    if not any(Path(d, "liburing.a").exists() for d in libs):
        missing.append("liburing.a")
    return missing + [tool for tool in ("cmake", "make", "g++") if shutil.which(tool) is None]


def _install_tensornvme(session: nox.Session) -> None:
    """tensornvme (the uring/aio backends of nvme-offload) builds from source
    against the installed torch: built once per machine and torch, then
    installed from .nox/_wheels. Where it cannot be built, one line says why
    and the NVMe tests run on the thread backend; ZEROSTACK_REQUIRE_TENSORNVME=1
    (CI) makes that an error."""
    required = os.environ.get("ZEROSTACK_REQUIRE_TENSORNVME") == "1"
    home = TENSORNVME_HOME / re.sub(r"[^A-Za-z0-9.]+", "_", TORCH)
    failed = home / "tensornvme.failed"  # the decision, cached: not retried every session
    wheels = list(home.glob("tensornvme-*.whl"))
    if not wheels:
        missing = _tensornvme_missing()
        reason = (
            f"needs {', '.join(missing)}: `{TENSORNVME_APT}` enables it"
            if missing
            else failed.read_text().strip()
            if failed.exists()
            else None
        )
        if reason is None:
            home.mkdir(parents=True, exist_ok=True)
            session.install("setuptools", "wheel", "packaging", "click")
            env = {"WITH_ROOT": "1", "LIBRARY_PATH": "/usr/lib/x86_64-linux-gnu"}
            # --no-cache-dir: pip would reuse a wheel it built against another torch.
            log = session.run("python", "-m", "pip", "wheel", "--no-cache-dir", "--no-deps",
                              "--no-build-isolation", TENSORNVME, "--wheel-dir", str(home),
                              env=env, silent=True, success_codes=list(range(256)))  # fmt: skip
            wheels = list(home.glob("tensornvme-*.whl"))
            if not wheels:
                (home / "build.log").write_text(str(log))
                reason = f"its build failed (log: {home / 'build.log'}; delete {failed} to retry)"
                failed.write_text(reason)
        if not wheels:
            if required:
                session.error(f"ZEROSTACK_REQUIRE_TENSORNVME=1, but tensornvme {reason}")
            session.log(f"tensornvme skipped, {reason}; the NVMe tests use the thread backend")
            return
    session.install("packaging", "click", *[str(w) for w in wheels])


def _spec(folder: str) -> str:
    """The requirement that asks pip for a package with its zerostack-only extras."""
    extras = _zerostack_extras(folder)
    return _meta(folder)["name"] + (f"[{','.join(extras)}]" if extras else "")


def _check_installed(session: nox.Session, python: str, expected: list[str]) -> None:
    """Exactly the `expected` zerostack distributions (folders) are installed."""
    out = session.run(python, "-m", "pip", "list", "--format=json", silent=True, external=True)
    listed = json.loads(out.strip().splitlines()[-1])
    have = {_req_name(d["name"]) for d in listed if _req_name(d["name"]).startswith("zerostack")}
    want = {_meta(f)["name"] for f in expected}
    if have != want:
        session.error(
            f"zerostack distributions installed {sorted(have)}, expected {sorted(want)}: "
            f"undeclared {sorted(have - want)}, missing {sorted(want - have)}"
        )


def _install_packages(
    session: nox.Session,
    requested: list[str],
    env: dict | None = None,
    testing: bool = True,
    oldest: dict[str, tuple[str, Path]] | None = None,
) -> None:
    """Install the `requested` packages (folders; each with its zerostack-only
    extras) as a user would from an index, plus zerostack-testing, the dev-only
    helper every suite uses. `oldest` (folder -> (version, the folder of its
    wheel)) asks for those siblings at that version instead of this tree's.
    See [Note: installs as from an index]."""
    env = CPU_ENV if env is None else env
    _install_torch(session)
    closure = list(dict.fromkeys(f for r in requested for f in [*_zerostack_deps(r), r]))
    if testing:
        closure = list(dict.fromkeys(["testing", *closure]))
    if "nvme-offload" in closure:
        _install_tensornvme(session)
    oldest = oldest or {}
    dirs = [*_wheel_dirs(session, closure, env), *(d for _, d in oldest.values())]
    links = [a for d in dirs for a in ("--find-links", str(d))]
    names = [_meta(f)["name"] for f in PACKAGES]
    # A reused environment: the new wheels carry the same versions, so drop the old ones.
    session.run("python", "-m", "pip", "uninstall", "--yes", "--quiet", *names, silent=True)
    specs = dict.fromkeys(_spec(f) for f in [*(["testing"] if testing else []), *requested])
    specs.update(dict.fromkeys(f"{_meta(f)['name']}=={v}" for f, (v, _) in oldest.items()))
    session.install(*links, *specs)
    _check_installed(session, "python", closure)


# mypy reads torch's annotations from the torch this session links in (see
# _install_torch); the packages' sources are checked in place, not installed.
MYPY = "mypy==2.4.1"


def _check_not_importable(session: nox.Session, module: str) -> None:
    """`module` does not import in the session's environment (e.g. a dev-only
    package that what the session runs must not need)."""
    code = (
        f"import importlib.util, sys; spec = importlib.util.find_spec({module!r}); "
        f"sys.exit(spec and f'{module} is importable (from {{spec.origin or "
        f"list(spec.submodule_search_locations)}}), but this session must run without it')"
    )
    session.run("python", "-c", code)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository,
    tools/check_words.py (no internal vocabulary in code, docs and errors),
    tools/check_function_length.py (no function over 80 lines in packages/),
    tools/release.py check (a package changed since its last release has a
    new version and a changelog heading for it), and mypy ([tool.mypy] in
    pyproject.toml) over every package's sources and over
    tools/typing_check.py, a user's script over the public API, so that a
    signature a user's type checker would reject fails here."""
    session.install("ruff", MYPY)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_words.py")
    session.run("python", "tools/check_function_length.py")
    _install_torch(session)
    sources = [str(ROOT / "packages" / f / "src") for f in PACKAGES]
    session.run(
        "mypy", *sources, "tools/typing_check.py", env={"MYPYPATH": os.pathsep.join(sources)}
    )
    session.install("packaging")  # tools/release.py: versions bumped with their changes
    session.run("python", "tools/release.py", "check")


@nox.session
@nox.parametrize("package", PACKAGES)
def unit(session: nox.Session, package: str) -> None:
    """One package's tests, with only that package and its declared zerostack
    dependencies (and zerostack-only extras) installed, resolved by pip from
    the wheels as from an index, plus its TEST_REQUIREMENTS: an undeclared
    import fails here."""
    _install_packages(session, [package])
    _install_test_requirements(session, TEST_REQUIREMENTS.get(package, []))
    _pytest(session, package, f"packages/{package}/tests", "-m", "not gpu")


def _pytest(session: nox.Session, name: str, *args: str) -> None:
    """pytest over ``args``, in TEST_WORKERS processes where ``name`` is in
    PARALLEL_TESTS (the session's own arguments come last, so ``-- -n 0``
    runs in-process).

    OpenMP threads that sleep when idle (``OMP_WAIT_POLICY=PASSIVE``, unless
    set) in the pytest processes too, as zerostack.testing.spawn gives its
    ranks (see its [Note: OpenMP threads that sleep]): torch's spinning
    threads in one process take the cores the other worker and the ranks
    need. On a loaded 2-core machine the low-precision training test of
    packages/testing/tests/test_tolerance.py took 18.5-21.5 s spinning and
    4.7-5.0 s with PASSIVE."""
    workers = ["-n", str(TEST_WORKERS)] if TEST_WORKERS > 1 and name in PARALLEL_TESTS else []
    if workers:
        session.install(XDIST)
    # The slowest tests in the log, to see where CI's time goes.
    session.run(
        "python", "-m", "pytest", *args, "--durations=15", *workers, *session.posargs,
        env={"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")},
    )  # fmt: skip


def _release_tool():
    """tools/release.py as a module: it decides what is released and what
    `compat` tests."""
    spec = importlib.util.spec_from_file_location("release_tool", ROOT / "tools" / "release.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _released_wheel_dir(session: nox.Session, record: dict) -> Path:
    """The folder holding the wheel of a released version, built once from
    its release commit (git archive of the package folder)."""
    out = WHEELHOUSE / "_released" / f"{Path(record['path']).name}-{record['version']}"
    out = out.with_name(f"{out.name}-{record['commit'][:10]}")
    if not list(out.glob("*.whl")):
        src = Path(session.create_tmp()).resolve() / "released"
        shutil.rmtree(src, ignore_errors=True)
        folder = _release_tool().export_release(record, src)
        _build_wheels(session, [str(folder)], out, CPU_ENV)
    return out


@nox.session
def compat(session: nox.Session) -> None:
    """Each package's tests with its zerostack siblings at the lowest versions
    its ranges allow (`python tools/release.py compat` lists them), each built
    from its release commit as recorded in releases.json. Where every lowest
    version is the current one the unit sessions test exactly that, and this
    session says so and stops."""
    plan = _release_tool().compat_plan()
    if not plan:
        session.log("every sibling range's lowest version is the current one: unit covers it")
        return
    for case in plan:
        oldest = {
            folder: (str(version), _released_wheel_dir(session, record))
            for folder, version, record in case.oldest.values()
        }
        session.log(f"{case.dist} with " + ", ".join(f"{f} {v}" for f, (v, _) in oldest.items()))
        _install_packages(session, [case.folder], oldest=oldest)
        _install_test_requirements(session, TEST_REQUIREMENTS.get(case.folder, []))
        _pytest(session, case.folder, f"packages/{case.folder}/tests", "-m", "not gpu")


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package tests (integration_tests/) with every package installed,
    the torchrun runner of the multi-GPU checks in its CPU (gloo) mode, and
    benchmarks/scale.py's smoke."""
    _install_packages(session, PACKAGES)
    # docs/migration/deepspeed.md trains transformers' GPT-2.
    _install_test_requirements(session, EXAMPLE_REQUIREMENTS)
    session.install("build", "twine")  # test_release_tool.py releases two small packages
    _pytest(session, "integration", "integration_tests", "-m", "not gpu")
    runner = ["torchrun", "--nproc-per-node"]
    script, ckpt = "integration_tests/multi_gpu.py", f"{session.create_tmp()}/multi_gpu.pt"
    env = {**CPU_ENV, "OMP_NUM_THREADS": "1"}  # torchrun's default, set here: it warns otherwise
    session.run(*runner, "2", script, "parity", "--cpu", env=env)
    session.run(*runner, "2", script, "save", "--cpu", "--path", ckpt, env=env)
    session.run(*runner, "4", script, "load", "--cpu", "--path", ckpt, env=env)
    # The scale benchmark's CPU smoke (the GPU run is tools/device.sh scale).
    for fraction in ("0", "1"):
        session.run(
            "python", str(ROOT / "benchmarks/scale.py"), "--smoke", "--nvme-fraction", fraction
        )


@nox.session
def examples(session: nox.Session) -> None:
    """Every script in examples/ in its --smoke mode, with what a user
    installs for them: the `zerostack` meta-package (resolved with the
    zerostack packages it declares) and transformers. The dev-only
    zerostack-testing is not installed, and the session checks that
    zerostack.testing does not import."""
    _install_packages(session, ["booster-api"], testing=False)
    _install_test_requirements(session, EXAMPLE_REQUIREMENTS)
    _check_not_importable(session, "zerostack.testing")
    for script in sorted((ROOT / "examples").glob("[!_]*.py")):  # _gpt2.py: their model
        session.run("python", str(script), "--smoke")
    # ColossalAI's auto-offload demo writes offload_logs/ where it runs.
    with session.chdir(session.create_tmp()):
        session.run("python", str(ROOT / "examples/auto_offload/train_gpt_offload.py"), "--smoke")


RELIABILITY_TESTS = [
    "packages/gemini-placement/tests/test_gemini_debug_collectives.py",
    "integration_tests/test_dead_peer.py",
    "packages/booster-api/tests/test_checkpoint_atomic.py",
    "packages/booster-api/tests/test_checkpoint_integrity.py",
    "packages/booster-api/tests/test_checkpoint_kill_points.py",  # the full sweep here
    "packages/booster-api/tests/test_checkpoint_records.py",
    "packages/booster-api/tests/test_checkpoint_save_errors.py",
    "packages/gemini-placement/tests/test_gemini_failures.py",
    "packages/zero-shard/tests/test_offload_overlap.py",
    "packages/booster-api/tests/test_determinism.py",
    "integration_tests/test_nvme_wrappers.py",
    # User actions take effect: hyperparameters on the user's optimizer, and
    # recovery after an exception in forward or backward.
    "packages/gemini-placement/tests/test_gemini_hyperparameters.py",
    "packages/zero-shard/tests/test_zero_hyperparameters.py",
    "packages/gemini-placement/tests/test_gemini_recovery.py",
    "packages/zero-shard/tests/test_zero_recovery.py",
    "packages/booster-api/tests/test_booster_recovery.py",
    "packages/booster-api/tests/test_user_contract.py",
    "integration_tests/test_exit_code.py",  # 60 torchrun launches of a finished job
]


@nox.session
def reliability(session: nox.Session) -> None:
    """The reliability suite of docs/reliability.md on the CPU: every
    package's bad-input table, collective mismatch, a dead peer, crash-safe
    checkpoints, determinism, offload-tier faults, user actions taking
    effect (hyperparameters, recovery after an exception), then the
    1,000-step soak of every plugin (`-- --steps 200` for a shorter one). Not
    in CI: its quick parts run in the unit and integration sessions."""
    _install_packages(session, PACKAGES)
    session.install("matplotlib")  # the soak's curves
    # auto-offload's table plans a transformers GPT-2 (it skips without it).
    _install_test_requirements(session, TEST_REQUIREMENTS["auto-offload-solver"])
    for folder in PACKAGES:  # one run per package: each has its own conftest
        table = f"packages/{folder}/tests/test_bad_inputs.py"
        if (ROOT / table).exists():
            session.run("python", "-m", "pytest", "-q", table)
    for test in RELIABILITY_TESTS:
        session.run(
            "python", "-m", "pytest", "-q", test, "-m", "not gpu",
            env={"ZEROSTACK_RELIABILITY_FULL": "1"},  # kill points: every plugin and layout
        )  # fmt: skip
    out = session.create_tmp()
    session.run("python", "integration_tests/soak.py", "--out", f"{out}/soak", *session.posargs)
    session.log(f"soak curves and CSVs: {out}/soak")


def _readme_install_snippet(session: nox.Session, folder: str) -> str:
    """The python block of a package README's Install section."""
    text = (ROOT / "packages" / folder / "README.md").read_text()
    section = re.search(r"^## Install\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    block = section and re.search(r"^```python\n(.*?)^```", section.group(1), re.S | re.M)
    if not block:
        session.error(
            f"packages/{folder}/README.md: no ```python block under '## Install' (the first "
            "check of an install, which this session runs; see another package's README)"
        )
    return block.group(1)


def _check_wheel_contents(session: nox.Session, out: Path) -> None:
    """Every wheel keeps the PEP 420 namespace (no zerostack/__init__.py), its
    __about__.py and its py.typed (PEP 561: a user's type checker reads the
    package's annotations only with it); fused-adam's carries its compiled CPU
    kernel."""
    problems = []
    for folder in PACKAGES:
        name = _meta(folder)["name"].replace("-", "_")
        wheels = sorted(out.glob(f"{name}-*.whl"))
        if len(wheels) != 1:
            problems.append(f"{name}: {len(wheels)} wheels in {out}, expected 1")
            continue
        files = zipfile.ZipFile(wheels[0]).namelist()
        if "zerostack/__init__.py" in files:
            problems.append(f"{wheels[0].name}: ships zerostack/__init__.py (breaks the namespace)")
        module = _module_name(folder)
        for required in ("__about__.py", "py.typed"):
            if f"zerostack/{module}/{required}" not in files:
                problems.append(f"{wheels[0].name}: no zerostack/{module}/{required}")
        if folder == "fused-adam" and not any(
            f.startswith("zerostack/fused_adam/_adam_cpu") and f.endswith(".so") for f in files
        ):
            problems.append(f"{wheels[0].name}: the compiled CPU kernel is missing")
    if problems:
        session.error("; ".join(problems))


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml, docs/) with warnings as errors; the
    API pages are read from the sources, so no package or torch is installed."""
    session.install("-r", "docs/requirements.txt")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def build(session: nox.Session) -> None:
    """sdist + wheel of every package into dist/, checked with twine and for
    the PEP 420 namespace and the compiled modules; then, for every package,
    a fresh environment gets only `pip install --find-links dist <name>` (its
    README's command), must hold exactly its declared zerostack dependencies,
    and runs its imports and the python block of its README's Install section."""
    session.install("build", "twine")
    out = ROOT / "dist"
    for old in out.glob("zerostack*"):
        old.unlink()
    for folder in PACKAGES:
        session.run("python", "-m", "build", f"packages/{folder}", "--outdir", str(out))
    session.run("twine", "check", "--strict", *[str(p) for p in sorted(out.glob("zerostack*"))])
    _check_wheel_contents(session, out)
    tmp = Path(session.create_tmp()).resolve()
    for folder in PACKAGES:
        venv = tmp / f"venv-{folder}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run(sys.executable, "-m", "virtualenv", "--quiet", str(venv), external=True)
        python = str(venv / "bin" / "python")
        _install_torch(session, python)  # the user's torch build, installed first
        name = _meta(folder)["name"]
        session.run(python, "-m", "pip", "install", "--quiet", "--find-links", str(out), name,
                    external=True)  # fmt: skip
        _check_installed(session, python, [folder, *_zerostack_deps(folder, extras=False)])
        module = "zerostack." + _module_name(folder)
        snippet = tmp / f"{folder}_install.py"
        snippet.write_text(
            f"from {module} import *  # noqa: F403\n" + _readme_install_snippet(session, folder)
        )
        with session.chdir(tmp):  # not the repository: only the installed packages import
            session.run(python, str(snippet), external=True)


@nox.session
def release(session: nox.Session) -> None:
    """Release every package changed since its last release, through
    `python tools/release.py release`: versions, CHANGELOG headings and ranges
    checked, sdist + wheel built into dist/ and checked with twine, HEAD
    tagged `<distribution>-v<version>`, the release recorded in releases.json,
    and the upload command printed (there is no index to upload to).
    `nox -s release -- --dry-run` tags and records nothing. Not in CI."""
    session.install("build", "twine", "packaging")
    session.run("python", "tools/release.py", "release", *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """On a CUDA machine, in the current environment (its own CUDA torch):
    build the kernels in place, with CUDA, and run the tests marked gpu."""
    session.run("bash", "tools/device.sh", "gpu-tests", *session.posargs, external=True)


@nox.session(python=False)
def multi_gpu(session: nox.Session) -> None:
    """On a box with several GPUs, in the current environment (its own CUDA
    torch, the packages importable): the multi-rank checks over NCCL under
    torchrun on every visible GPU (ZeRO-1/2 and Gemini parity against DDP,
    fp16 overflow and clipping cases; Gemini's state saved at N ranks and
    loaded at 1 and N). Fails when fewer than 2 GPUs are visible; the gloo
    variant runs in `integration`."""
    count = int(
        session.run(
            "python", "-c", "import torch; print(torch.cuda.device_count())", silent=True,
            external=True,
        ).strip()
    )  # fmt: skip
    if count < 2:
        session.error(f"multi_gpu needs at least 2 visible GPUs (found {count})")
    script, ckpt = "integration_tests/multi_gpu.py", f"{session.create_tmp()}/multi_gpu.pt"
    run = ["torchrun", "--nproc-per-node"]
    session.run(*run, str(count), script, "parity", external=True)
    session.run(*run, str(count), script, "save", "--path", ckpt, external=True)
    for n in sorted({1, count}):
        session.run(*run, str(n), script, "load", "--path", ckpt, external=True)


@nox.session
def train(session: nox.Session) -> None:
    """The main job: a small GPT-2 trained through the Booster (GeminiPlugin,
    HybridAdam with half its states on disk), about a minute on a 2-core CPU;
    progress lines, a closing summary (tokens/s, peak memory, chunk
    placement) and a run directory with the memory picture."""
    # The CUDA kernel only where a GPU can run it: nvcc alone (a CPU machine
    # with the toolkit) would add minutes of compiling to a one-minute job.
    env = {} if Path("/dev/nvidia0").exists() else CPU_ENV
    _install_packages(session, ["booster-api"], env=env, testing=False)  # as the examples
    _install_test_requirements(session, EXAMPLE_REQUIREMENTS)
    _check_not_importable(session, "zerostack.testing")
    session.install("./packages/gemini-placement[plot]", env=env)  # matplotlib: the timeline PNG
    session.run("python", "examples/train_booster.py", *session.posargs)


@nox.session(python=False, requires=CI_SESSIONS)
def tests(session: nox.Session) -> None:
    """What CI runs: lint, unit for every package, compat, integration,
    examples, build and docs, each its own session (nox lists each result;
    this one only runs when all of them passed)."""
    session.log(f"every session passed: {', '.join(CI_SESSIONS)}")
