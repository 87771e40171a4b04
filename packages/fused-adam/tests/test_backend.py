"""SIMD selection, threads, the GIL and the fused copy-out."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from zerostack.fused_adam import (
    CPUAdam,
    HybridAdam,
    available_simd_levels,
    backend_info,
    set_cpu_schedule,
    set_simd_level,
)


def test_backend_info_reports_level_and_threads():
    info = backend_info()
    assert info["cpu_simd"] in info["cpu_simd_available"]
    assert info["cpu_simd_available"][-1] == "scalar"
    assert info["cpu_threads"] == torch.get_num_threads()


def _fresh_backend_info(key: str, **env: str | None) -> subprocess.CompletedProcess:
    """``backend_info()[key]`` printed by a fresh process with ``env``
    set over this one's (None: unset)."""
    code = f"from zerostack.fused_adam import backend_info; print(backend_info()[{key!r}])"
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)


@pytest.mark.parametrize("level", available_simd_levels())
def test_environment_variable_forces_the_level(level):
    out = _fresh_backend_info("cpu_simd", ZEROSTACK_CPU_ADAM_SIMD=level)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == level


def test_environment_variable_with_unknown_level_fails():
    code = "import zerostack.fused_adam"
    env = {**os.environ, "ZEROSTACK_CPU_ADAM_SIMD": "sse9"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "ZEROSTACK_CPU_ADAM_SIMD='sse9'" in out.stderr
    assert "unknown SIMD level 'sse9'" in out.stderr


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_environment_variable_sets_the_schedule(schedule):
    out = _fresh_backend_info("cpu_schedule", ZEROSTACK_CPU_ADAM_SCHEDULE=schedule)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == schedule


def test_the_schedule_is_dynamic_unless_set_and_rejects_unknown():
    out = _fresh_backend_info("cpu_schedule", ZEROSTACK_CPU_ADAM_SCHEDULE=None)
    assert out.stdout.strip() == "dynamic", out.stderr
    with pytest.raises(ValueError, match="unknown schedule 'guided'"):
        set_cpu_schedule("guided")


def test_set_simd_level_rejects_unknown():
    with pytest.raises(ValueError, match="unknown SIMD level 'neon'"):
        set_simd_level("neon")


def test_step_releases_the_gil():
    n = 2**25
    p = torch.zeros(n)
    p.grad = torch.ones(n)
    opt = CPUAdam([p])
    opt.step()  # allocate the state outside the timed part
    done = threading.Event()

    def work():
        for _ in range(6):
            opt.step()
        done.set()

    worker = threading.Thread(target=work)
    t0 = time.perf_counter()
    worker.start()
    # Each wake-up of this loop needs the GIL: while a step that held it ran,
    # the loop could not come back from wait() at all.
    ticks = 0
    while not done.wait(0.001):
        ticks += 1
    worker.join()
    elapsed = time.perf_counter() - t0
    assert elapsed > 0.03, "the step was too short to judge"
    assert ticks >= 0.25 * elapsed / 0.001 - 5, (ticks, elapsed)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_copy_out_writes_the_updated_param(simd_level, pdt, out_dtype, offset):
    # Aligned buffers take the streaming-store path, misaligned ones the plain one.
    p = torch.randn(4099).to(pdt)
    out = torch.full((4099 + offset,), 7.0, dtype=out_dtype)[offset:]
    opt = HybridAdam([p], lr=0.1, weight_decay=0.01)
    opt.set_copy_out(p, out)
    for _ in range(3):
        p.grad = torch.randn(4099).to(pdt)
        opt.step()
        # Both are roundings of the same fp32 value: equal to out's precision.
        torch.testing.assert_close(
            out, p.to(out_dtype), rtol=0, atol=0
        ) if pdt == torch.float32 else None
        if pdt != torch.float32:
            tol = dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(out.float(), p.float(), **tol)
    opt.set_copy_out(p, None)
    frozen = out.clone()
    p.grad = torch.randn(4099).to(pdt)
    opt.step()
    assert torch.equal(out, frozen)


def test_cpu_threads_per_rank_under_torchrun(monkeypatch, caplog):
    import logging
    import os

    from zerostack.fused_adam import _kernels

    monkeypatch.delenv("ZEROSTACK_CPU_THREADS", raising=False)
    monkeypatch.setattr(_kernels, "_logged_threads", [])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    # torchrun's default: OMP_NUM_THREADS=1 for each of 4 local ranks -> 16 / 4.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with caplog.at_level(logging.INFO, logger="zerostack.fused_adam"):
        assert _kernels.cpu_threads() == 4
    assert "4 threads per rank (16 cores / 4 ranks" in caplog.text
    assert backend_info()["cpu_threads"] == 4
    # An explicit choice wins; a user's own thread count is followed.
    monkeypatch.setenv("ZEROSTACK_CPU_THREADS", "2")
    assert _kernels.cpu_threads() == 2
    monkeypatch.delenv("ZEROSTACK_CPU_THREADS")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert _kernels.cpu_threads() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not under torchrun: torch's count
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert _kernels.cpu_threads() == 1
    monkeypatch.setenv("ZEROSTACK_CPU_THREADS", "zero")
    with pytest.raises(
        ValueError, match=r"ZEROSTACK_CPU_THREADS must be an int >= 1 \(got 'zero'\)"
    ):
        _kernels.cpu_threads()


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_first_moments_match_torch_to_a_few_ulp(simd_level, betas):
    # 1 - beta is formed in double, as torch does: in float, 1 - 0.999f is
    # 1.3e-5 off, which every second moment carried.
    torch.manual_seed(0)
    p = torch.randn(1000)
    ref = p.clone().requires_grad_()
    grad = torch.randn(1000)
    p.grad, ref.grad = grad.clone(), grad.clone()
    opt = CPUAdam([p], lr=1e-3, betas=betas, weight_decay=0.0)
    torch_opt = torch.optim.Adam([ref], lr=1e-3, betas=betas, foreach=False)
    opt.step()
    torch_opt.step()
    tol = 4 * torch.finfo(torch.float32).eps
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[p][key], torch_opt.state[ref][key], rtol=tol, atol=0)


# A fresh interpreter whose CUDA kernel cannot load (as in a CPU-only wheel),
# where the first import of zerostack.fused_adam happens while an object is
# being built: the object must be freed once dropped.
_FIRST_IMPORT = r"""
import gc, sys, weakref
sys.modules["zerostack.fused_adam._adam_cuda"] = None  # its import raises ImportError

class Owner:
    def __init__(self):
        import zerostack.fused_adam  # noqa: F401  (the first import, from this frame)

ref = weakref.ref(Owner())
gc.collect()
from zerostack.fused_adam import _kernels
print(_kernels.cuda_kernel_available(), type(_kernels._cuda_error).__name__, ref() is None)
"""


def test_a_kernel_that_failed_to_load_keeps_no_frame_of_the_first_importer():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # The error is kept as text: kept whole, its traceback's frames held the Owner.
    assert done.stdout.split() == ["False", "str", "True"], done.stdout


def test_a_kernel_that_was_never_built_says_so_not_what_python_guesses():
    from zerostack.fused_adam import _kernels

    # Python's text for a missing submodule blames "a circular import".
    guess = ImportError("cannot import name '_adam_gone' (most likely due to a circular import)")
    text = _kernels._import_error("_adam_gone", guess)
    assert text.startswith("no compiled module _adam_gone in ") and "circular" not in text
    present = ImportError("undefined symbol: foo")
    assert _kernels._import_error("_adam_cpu", present) == "undefined symbol: foo"


def test_a_kernel_built_for_another_python_says_so(monkeypatch):
    from zerostack.fused_adam import _kernels

    monkeypatch.setattr(
        _kernels.os, "listdir", lambda _: ["_adam_cuda.cpython-39-x86_64-linux-gnu.so"]
    )
    monkeypatch.setattr(_kernels, "EXTENSION_SUFFIXES", [".cpython-312-x86_64-linux-gnu.so", ".so"])
    text = _kernels._import_error("_adam_cuda", ImportError("circular import"))
    assert "built for another Python (found _adam_cuda.cpython-39-x86_64-linux-gnu.so)" in text
