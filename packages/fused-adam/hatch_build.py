"""Build hook: compiles the CPU Adam kernel (g++ + pybind11, always) and the
CUDA Adam kernel (nvcc, where it is found) into the wheel.

Neither kernel includes a torch header, so the build needs no torch and one
build serves every torch version. The file also runs as a script, for
machines without hatchling (the GPU machine): ``python hatch_build.py``
compiles both modules into ``src/zerostack/fused_adam/``.

Environment:
    ZEROSTACK_BUILD_CUDA   "1" forces the CUDA kernel (error when nvcc is
                           missing), "0" skips it; unset: build when nvcc is found.
    ZEROSTACK_CUDA_ARCHS   semicolon list of SM versions, default "80;90";
                           PTX for the last one is embedded too.
    CXX, NVCC              compilers (default g++, nvcc on PATH or $CUDA_HOME/bin).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # running as a script where hatchling is absent
    BuildHookInterface = object  # type: ignore[assignment,misc]

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
PKG_REL = "zerostack/fused_adam"

# ZS_LEVEL -> the only ISA flags that level's object is compiled with.
# Never -march=native: the wheel must run on any x86-64.
SIMD_LEVELS = {
    0: [],
    1: ["-mavx2", "-mfma", "-mf16c"],
    2: ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
}


def _log(msg: str) -> None:
    print(f"[zerostack-fused-adam build] {msg}", file=sys.stderr, flush=True)


def _includes() -> list[str]:
    import pybind11

    return [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}"]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"zerostack-fused-adam build: command failed ({proc.returncode}):\n"
            f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        )


def compile_cpu(out_dir: Path) -> Path:
    """Compile the CPU kernel into ``out_dir``; return the module's path."""
    with tempfile.TemporaryDirectory(prefix="zerostack-fused-adam-obj-") as obj_dir:
        return _compile_cpu(out_dir, Path(obj_dir))


def _compile_cpu(out_dir: Path, obj_dir: Path) -> Path:
    cxx = os.environ.get("CXX", "g++")
    # -ffp-contract=off: no fused multiply-add but the ones adam_math.h writes (the
    # CUDA kernel's bits, see there).
    base = [
        cxx, "-O3", "-std=c++17", "-ffp-contract=off", "-fPIC", "-fvisibility=hidden", "-Wall",
        *_includes(),
    ]  # fmt: skip
    jobs = []
    for level, flags in SIMD_LEVELS.items():
        obj = obj_dir / f"adam_cpu_kernel_l{level}.o"
        src = CSRC / "adam_cpu_kernel.cpp"
        jobs.append((obj, [*base, f"-DZS_LEVEL={level}", *flags, "-c", str(src), "-o", str(obj)]))
    binding = obj_dir / "adam_cpu.o"
    jobs.append(
        (binding, [*base, "-pthread", "-c", str(CSRC / "adam_cpu.cpp"), "-o", str(binding)])
    )
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_run, [cmd for _, cmd in jobs]))
    target = out_dir / f"_adam_cpu{sysconfig.get_config_var('EXT_SUFFIX')}"
    _run([cxx, "-shared", "-pthread", *[str(o) for o, _ in jobs], "-o", str(target)])
    _log(f"CPU kernel built in {time.perf_counter() - start:.1f}s -> {target.name}")
    return target


def find_nvcc() -> str | None:
    explicit = os.environ.get("NVCC")
    if explicit:
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def compile_cuda(out_dir: Path) -> Path | None:
    """Compile the CUDA kernel when asked for or when nvcc is found."""
    want = os.environ.get("ZEROSTACK_BUILD_CUDA", "auto").strip().lower()
    if want in ("0", "false", "off", "no"):
        _log("CUDA kernel skipped (ZEROSTACK_BUILD_CUDA=0)")
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        if want in ("1", "true", "on", "yes"):
            raise RuntimeError(
                "zerostack-fused-adam build: ZEROSTACK_BUILD_CUDA=1 but nvcc was not found; "
                "put nvcc on PATH or set NVCC / CUDA_HOME"
            )
        _log("nvcc not found: building without the CUDA kernel (FusedAdam will be unavailable)")
        return None
    archs = [a.strip() for a in os.environ.get("ZEROSTACK_CUDA_ARCHS", "80;90").split(";") if a]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    target = out_dir / f"_adam_cuda{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = [
        nvcc, "-O3", "-std=c++17", "-fmad=false", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",
        "-cudart", "static", *gencode, *_includes(),
        str(CSRC / "adam_cuda.cu"), "-o", str(target),
    ]  # fmt: skip
    start = time.perf_counter()
    _run(cmd)
    _log(f"CUDA kernel built for sm_{','.join(archs)} in {time.perf_counter() - start:.1f}s")
    return target


def build_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    built = [compile_cpu(out_dir)]
    cuda = compile_cuda(out_dir)
    if cuda is not None:
        built.append(cuda)
    return built


class CustomBuildHook(BuildHookInterface):
    """Hatchling hook: put the compiled modules into the wheel."""

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version == "editable":
            # Editable installs import from src/, so the modules go there.
            build_all(ROOT / "src" / PKG_REL)
            return
        self._tmp = tempfile.mkdtemp(prefix="zerostack-fused-adam-")
        for path in build_all(Path(self._tmp)):
            build_data["force_include"][str(path)] = f"{PKG_REL}/{path.name}"

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    for p in build_all(ROOT / "src" / PKG_REL):
        print(p)
