"""The one task runner. `nox -s tests` is what CI runs (see README)."""

from __future__ import annotations

import os
import tomllib
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
    "gemini-placement": ["transformers==5.24.0; python_version >= '3.11'"],
    "booster-api": ["transformers==5.24.0; python_version >= '3.11'"],
    "auto-offload-solver": ["transformers==5.24.0; python_version >= '3.11'"],
}

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _meta(folder: str) -> dict:
    return tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]


def _dist_to_folder() -> dict[str, str]:
    return {_meta(f)["name"]: f for f in PACKAGES}


def _requirements(folder: str) -> list[str]:
    meta = _meta(folder)
    extras = [r for group in meta.get("optional-dependencies", {}).values() for r in group]
    return [*meta.get("dependencies", []), *extras]


def _zerostack_deps(folder: str) -> list[str]:
    """The package's declared zerostack dependencies (extras included),
    transitively, as folders."""
    by_name = _dist_to_folder()
    seen: list[str] = []
    todo = [folder]
    while todo:
        for req in _requirements(todo.pop()):
            name = req.split(";")[0].split("[")[0]
            for op in "<>=!~ ":
                name = name.split(op)[0]
            dep = by_name.get(name.strip())
            if dep and dep not in seen:
                seen.append(dep)
                todo.append(dep)
    return seen


def _install_tensornvme(session: nox.Session) -> None:
    """tensornvme builds from source against the installed torch and needs
    liburing-dev/libaio-dev (.ci/run installs them). Built once per machine,
    then installed from .nox/_wheels. Without it the nvme tests run on the
    thread backend only, unless ZEROSTACK_REQUIRE_TENSORNVME=1 makes that fatal."""
    wheels = ROOT / ".nox" / "_wheels"
    failed = wheels / "tensornvme.failed"  # the decision, cached: not retried every session
    required = os.environ.get("ZEROSTACK_REQUIRE_TENSORNVME") == "1"
    if failed.exists() and not required:
        session.log(f"tensornvme skipped ({failed.read_text().strip()}); delete {failed} to retry")
        return
    if not list(wheels.glob("tensornvme-*.whl")):
        session.install("setuptools", "wheel", "packaging", "click")
        try:
            session.run(
                "pip", "wheel", "--no-build-isolation", "--no-deps", "tensornvme==0.1.0",
                "--wheel-dir", str(wheels), silent=True,
                env={"WITH_ROOT": "1", "LIBRARY_PATH": "/usr/lib/x86_64-linux-gnu"},
            )  # fmt: skip
        except nox.command.CommandFailed:
            if required:
                raise
            wheels.mkdir(parents=True, exist_ok=True)
            failed.write_text(
                "it did not build: apt-get install liburing-dev libaio-dev enables it; the nvme "
                "tests use the thread backend"
            )
            session.warn(f"tensornvme {failed.read_text()}")
            return
    session.install("packaging", "click", *[str(w) for w in wheels.glob("tensornvme-*.whl")])


def _install_packages(session: nox.Session, folders: list[str], env: dict | None = None) -> None:
    session.install(TORCH, "numpy")  # numpy: torch warns at import without it
    if "nvme-offload" in folders:
        _install_tensornvme(session)
    # zerostack-testing is a dev-only helper every suite uses; never a runtime dependency.
    paths = [f"packages/{f}" for f in dict.fromkeys(["testing", *folders])]
    session.install(*paths, env=CPU_ENV if env is None else env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", PACKAGES)
def unit(session: nox.Session, package: str) -> None:
    """One package's tests, with only that package and its declared zerostack
    dependencies installed (plus its TEST_REQUIREMENTS): an undeclared import
    fails here."""
    _install_packages(session, [*_zerostack_deps(package), package])
    if package in TEST_REQUIREMENTS:
        session.install(*TEST_REQUIREMENTS[package])
    session.run(
        "python", "-m", "pytest", f"packages/{package}/tests", "-m", "not gpu", *session.posargs
    )


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package tests (integration_tests/) with every package installed."""
    _install_packages(session, PACKAGES)
    session.run("python", "-m", "pytest", "integration_tests", "-m", "not gpu", *session.posargs)
    # The torchrun runner of the multi-GPU checks, in its CPU (gloo) mode.
    runner = ["torchrun", "--nproc-per-node"]
    script, ckpt = "integration_tests/multi_gpu.py", f"{session.create_tmp()}/multi_gpu.pt"
    session.run(*runner, "2", script, "parity", "--cpu", env=CPU_ENV)
    session.run(*runner, "2", script, "save", "--cpu", "--path", ckpt, env=CPU_ENV)
    session.run(*runner, "4", script, "load", "--cpu", "--path", ckpt, env=CPU_ENV)


@nox.session
def examples(session: nox.Session) -> None:
    """Every script in examples/ in its --smoke mode."""
    _install_packages(session, PACKAGES)
    session.install("tqdm", "transformers==5.24.0")  # the Booster demo is the seed's GPT-2 one
    for script in sorted((ROOT / "examples").glob("*.py")):
        session.run("python", str(script), "--smoke")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml, docs/) with warnings as errors; the
    API pages are read from the sources, so no package or torch is installed."""
    session.install("-r", "docs/requirements.txt")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def build(session: nox.Session) -> None:
    """sdist + wheel of every package; metadata checked with twine, and the
    wheels checked for the PEP 420 namespace and the compiled modules."""
    session.install("build", "twine")
    out = ROOT / "dist"
    for folder in PACKAGES:
        session.run("python", "-m", "build", f"packages/{folder}", "--outdir", str(out))
    session.run("twine", "check", "--strict", *[str(p) for p in sorted(out.iterdir())])
    session.run("python", "tools/check_wheels.py", str(out))


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """On a CUDA machine, in the current environment (its own CUDA torch):
    build the kernels in place, with CUDA, and run the tests marked gpu."""
    session.run("bash", "tools/gpu_check.sh", *session.posargs, external=True)


@nox.session
def train(session: nox.Session) -> None:
    """The main job: a small GPT trained through the Booster (GeminiPlugin,
    HybridAdam with half its states on disk), about a minute on a 2-core CPU;
    progress lines, a closing summary (tokens/s, peak memory, chunk
    placement) and a run directory with the memory picture."""
    # The CUDA kernel only where a GPU can run it: nvcc alone (a CPU machine
    # with the toolkit) would add minutes of compiling to a one-minute job.
    env = {} if Path("/dev/nvidia0").exists() else CPU_ENV
    _install_packages(session, PACKAGES, env=env)
    session.install("./packages/gemini-placement[plot]", env=env)  # matplotlib: the timeline PNG
    session.run("python", "examples/train_booster.py", *session.posargs)


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """What CI runs: lint, unit for every package, integration, examples, docs."""
    for name in ["lint", *[f"unit(package='{p}')" for p in PACKAGES], "integration", "examples"]:
        session.notify(name)
    session.notify("docs")
