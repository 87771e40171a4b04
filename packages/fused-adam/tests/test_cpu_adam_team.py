"""CPU Adam's own thread team (csrc/adam_cpu.cpp, [Note: CPU Adam's threads
sleep between calls]): every width and schedule gives the serial bits, calls
from two threads at once and from a forked child finish with the same bits,
and the team's threads use no CPU between calls."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import HYPER, make_grads, make_params

from zerostack.fused_adam import CPUAdam, backend_info, set_cpu_schedule

SIZES = [5 * 2**16 + 3, 7, 2**16, 3 * 2**16 + 1]  # 10 blocks of 2^16, and tails


def _steps(sizes: list[int], steps: int = 3) -> list[torch.Tensor]:
    params = make_params(sizes, torch.float32)
    opt = CPUAdam(params, **HYPER)
    for step in range(steps):
        for p, g in zip(params, make_grads(params, torch.float32, step), strict=True):
            p.grad = g
        opt.step()
    return params


@pytest.fixture
def threads_and_schedule():
    before = torch.get_num_threads(), backend_info()["cpu_schedule"]
    yield
    torch.set_num_threads(before[0])
    set_cpu_schedule(before[1])


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
def test_every_width_gives_the_serial_bits(threads_and_schedule, schedule):
    torch.set_num_threads(1)
    serial = _steps(SIZES)
    set_cpu_schedule(schedule)
    # More threads than blocks (16 > 10) and than this machine's cores, a width
    # that shrinks after a wider call (helpers left out of it), and back up.
    for threads in (2, 3, 16, 2, 5):
        torch.set_num_threads(threads)
        for a, b in zip(serial, _steps(SIZES), strict=True):
            assert torch.equal(a, b), (schedule, threads)


def test_two_threads_calling_at_once_get_the_serial_bits(threads_and_schedule):
    torch.set_num_threads(2)
    serial = [_steps(SIZES, steps=4), _steps([3 * 2**16], steps=4)]
    out: list = [None, None]

    def run(k: int, sizes: list[int]) -> None:
        out[k] = _steps(sizes, steps=4)

    workers = [
        threading.Thread(target=run, args=(0, SIZES)),
        threading.Thread(target=run, args=(1, [3 * 2**16])),
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert not w.is_alive()
    for got, want in zip(out, serial, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def _child(queue) -> None:
    # torch's own OpenMP team does not survive fork() (a parallel torch op in
    # the child hangs): torch one thread, CPU Adam two.
    torch.set_num_threads(1)
    os.environ["ZEROSTACK_CPU_THREADS"] = "2"
    queue.put([p.tolist()[:5] for p in _steps(SIZES)])


def test_a_forked_child_steps_with_a_team_of_its_own(threads_and_schedule):
    # The parent's helpers do not exist in the child: a child that waited for
    # them would hang (the join below would time out).
    torch.set_num_threads(2)
    want = [p.tolist()[:5] for p in _steps(SIZES)]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert got == want


def test_the_team_uses_no_cpu_between_calls(threads_and_schedule):
    # An OpenMP team spins after each call (about 3 ms of CPU a helper on the
    # 2-core CI machine, much more on a server); these helpers sleep.
    torch.set_num_threads(2)
    params = make_params([4 * 2**20], torch.float32)
    params[0].grad = make_grads(params, torch.float32, 0)[0]
    opt = CPUAdam(params, **HYPER)
    idle = 0.0
    for _ in range(5):
        opt.step()
        c0 = time.process_time()
        time.sleep(0.1)
        idle += time.process_time() - c0
    assert idle < 0.005, f"{idle * 1e3:.1f} ms of CPU while idle"


_STRESS = r"""
import random, sys, threading, time
import torch
from zerostack.fused_adam import _kernels

cpu = _kernels._require_cpu()
BLOCK = 2**16


def call(seed, width):
    g = torch.Generator().manual_seed(seed)
    n = (seed % 19 + 3) * BLOCK + seed % 7
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    cpu.adam_step(
        params=[p.data_ptr()], grads=[grad.data_ptr()], exp_avgs=[m.data_ptr()],
        exp_avg_sqs=[v.data_ptr()], outs=[], numels=[n], param_dtype=0, grad_dtype=0,
        out_dtype=-1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
        bias_correction1=0.1, bias_correction2=0.001, adamw_mode=True, grad_scale=1.0,
        num_threads=width,
    )
    return p


def caller(k, deadline, bad):
    rng = random.Random(k)
    while time.perf_counter() < deadline:
        seed = rng.randrange(10**6)
        if not torch.equal(call(seed, rng.randint(1, 24)), call(seed, 1)):
            bad.append(seed)


cpu.set_schedule(sys.argv[1])
bad, deadline = [], time.perf_counter() + float(sys.argv[2])
workers = [threading.Thread(target=caller, args=(k, deadline, bad)) for k in range(2)]
for w in workers:
    w.start()
for w in workers:
    w.join()
print("bad", bad)
"""


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
def test_two_callers_with_random_widths_never_hang_and_match_one_thread(tmp_path, schedule):
    # Widths that grow and shrink from call to call, two callers at once: a
    # call that overlapped another, or a helper left out of a narrow call that
    # worked in it anyway, hung or raced within seconds of this (the review's
    # stress test of the first version of the team).
    script = tmp_path / "stress.py"
    script.write_text(_STRESS)
    out = subprocess.run(
        [sys.executable, str(script), schedule, "4"], capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "bad []"
