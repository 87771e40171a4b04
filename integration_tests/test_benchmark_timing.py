"""benchmarks/_training.py's timed loop counts the whole of every step.

An offloaded ``step()`` returns with the device lane's copies and kernels
still being queued by the CPU-step worker; the benchmarks once synchronized
before each forward, outside every timed phase, and so left that wait out
of the step ([Note: a step lasts from the end of the one before]). On the
CPU there is no device to wait for: a synchronize that takes time stands in
for it, and the timed steps must account for the loop's wall time."""

from __future__ import annotations

import gc
import gzip
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SYNC_S = 0.05  # each synchronize of the stand-in device


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _training

    stats = {"num_alloc_retries": 0, "num_device_alloc": 0, "num_device_free": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: time.sleep(SYNC_S))
    monkeypatch.setattr(_training, "sync_compute", lambda: time.sleep(SYNC_S))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: dict(stats))
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda *a: dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 0)
    for name in (
        "ZEROSTACK_BENCH_PROFILE",
        "ZEROSTACK_BENCH_HOST_PROFILE",
        "ZEROSTACK_BENCH_TRACE",
    ):
        monkeypatch.delenv(name, raising=False)
    collecting = gc.isenabled()
    gc.disable()  # a collection in the set-up or the summary would be no step's time
    yield _training
    if collecting:
        gc.enable()
    sys.modules.pop("_training", None)


def test_the_timed_steps_hold_the_loop_s_wall_time(training) -> None:
    steps = 6
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    t0 = time.perf_counter()
    out = training.run(
        "stand-in", lambda idx, tgt: torch.zeros(()), lambda loss, backward_only: None,
        batch, steps, 0, False,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    walls = [w for *_, w, _mark in out["steps_s"]]
    assert len(walls) == steps
    # Only the synchronize before the first step (and the set-up and the
    # summary, milliseconds) is no step's: a synchronize left out before each
    # forward would leave `steps` of them out.
    assert sum(walls) >= wall - SYNC_S - 0.1, (walls, wall)
    assert all(w >= 3 * SYNC_S - 1e-3 for w in walls), walls  # the three phases' synchronizes
    assert min(walls) - 1e-3 <= out["step_s"] <= max(walls) + 1e-3  # the median of the walls


def test_only_the_compute_stream_is_waited_for_after_step(training, monkeypatch) -> None:
    # [Note: a step lasts from the end of the one before]: the device
    # after the forward and the backward, the compute stream after step()
    # (the device lane's streams are waited for by the next forward).
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("device"))
    monkeypatch.setattr(training, "sync_compute", lambda: seen.append("compute"))
    steps = []

    def step_fn(loss, backward_only):
        steps.append(backward_only)
        seen.append("backward" if backward_only else "step")

    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    training.run("stand-in", lambda idx, tgt: torch.zeros(()), step_fn, batch, 2, 1, False)
    assert seen == ["device"] + ["device", "backward", "device", "step", "compute"] * 3, seen


def _stand_in_marks(training, steps: int, warmup: int) -> list[str]:
    """The per-step marks of ``run`` over a stand-in model and step."""
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    out = training.run(
        "stand-in", lambda idx, tgt: torch.zeros(()), lambda loss, backward_only: None,
        batch, steps, warmup, False,
    )  # fmt: skip
    return [m for *_, m in out["steps_s"]]


def test_a_step_on_a_host_busy_elsewhere_is_marked(training, monkeypatch) -> None:
    # A slow step whose host lost CPU time to the hypervisor or to other
    # processes says so in its per-step line (docs/benchmarks.md, "twenty-second
    # session": LLaMA's slow stretches, on rows with and without the split).
    cores = training.os.cpu_count() or 1
    readings = iter([
        (0.0, 0.0, 0.0),  # before the first step
        (0.0, 0.0, 0.0),  # step 1: nothing elsewhere
        (10.0 * cores, 0.0, 0.0),  # step 2: the hypervisor took the cores
        (10.0 * cores, 10.0 * cores, 0.0),  # step 3: another process did
        (10.0 * cores, 10.0 * cores + 5.0, 5.0),  # step 4: only this process worked
    ])  # fmt: skip
    monkeypatch.setattr(training, "host_cpu", lambda: next(readings))
    marks = _stand_in_marks(training, 4, 0)
    assert marks[0] == "" and marks[3] == "", marks
    assert "[steal " in marks[1] and "[others" not in marks[1], marks
    assert "[others " in marks[2] and "[steal" not in marks[2], marks
    # One clock tick on a short step is the counters' resolution, not a busy host.
    tick = 1 / training.os.sysconf("SC_CLK_TCK")
    assert training.host_marks((0.0, 0.0, 0.0), (tick, tick, 0.0), 0.01) == ""


def test_a_step_whose_allocator_calls_the_driver_is_marked(training, monkeypatch) -> None:
    # A step in which the caching allocator called cudaMalloc or cudaFree (a
    # cudaFree synchronizes the device) says how many in its per-step line, so
    # a slow backward can be set beside the allocator's calls of the same step.
    stats = {"num_alloc_retries": 0, "num_device_alloc": 0, "num_device_free": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda *a: dict(stats))

    def forward(idx, tgt):
        if forward.calls == 1:  # the second step frees three blocks and maps one
            stats["num_device_free"] += 3
            stats["num_device_alloc"] += 1
        forward.calls += 1
        return torch.zeros(())

    forward.calls = 0
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    out = training.run("stand-in", forward, lambda loss, backward_only: None, batch, 3, 0, False)
    marks = [m for *_, m in out["steps_s"]]
    assert "[cudaMalloc" not in marks[0] and "[cudaFree" not in marks[0], marks
    assert "[cudaMalloc 1][cudaFree 3]" in marks[1], marks
    assert "[cudaMalloc" not in marks[2] and "[cudaFree" not in marks[2], marks


def test_a_step_whose_training_thread_waited_for_a_core_is_marked(training, monkeypatch) -> None:
    # The training thread's runqueue wait over the forward and backward: a
    # slow backward beside a thread kept from a core (by CPU Adam's team) says
    # so; a step with less than 1 ms says nothing.
    waits = iter([0.0, 0.0, 0.0, 0.0005, 0.0005, 0.0125])  # two readings a step
    monkeypatch.setattr(training, "queued_s", lambda: next(waits))
    marks = _stand_in_marks(training, 3, 0)
    assert "[queued" not in marks[0] + marks[1], marks
    assert "[queued 12 ms]" in marks[2], marks


def test_a_backward_beside_cpu_adam_says_for_how_long(training, monkeypatch) -> None:
    # [adam in bwd N ms]: how far into the backward CPU Adam's kernel still
    # ran (the last step's CPU step, late), beside the backward's time.
    class FakeKernel:
        def adam_step(self, *args, **kwargs) -> None:
            time.sleep(0.03)

    clock = training.KERNEL_CLOCK
    monkeypatch.setitem(clock.__dict__, "_module", FakeKernel())
    monkeypatch.setattr(clock, "last_end", 0.0)

    def step_fn(loss, backward_only):
        if backward_only and step_fn.calls == 1:  # the second step's backward
            clock.adam_step(numels=[1])
        step_fn.calls += backward_only

    step_fn.calls = 0
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    out = training.run("stand-in", lambda idx, tgt: torch.zeros(()), step_fn, batch, 3, 0, False)
    marks = [m for *_, m in out["steps_s"]]
    assert "[adam in bwd" not in marks[0] + marks[2], marks
    ms = int(re.search(r"\[adam in bwd (\d+) ms\]", marks[1]).group(1))
    assert 30 <= ms < 30 + 1e3 * SYNC_S + 20, marks  # the call, then at most the synchronize
    assert clock.running == 0


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="Linux's schedstat")
def test_queued_s_counts_the_time_a_thread_waited_for_its_core(training) -> None:
    # Pinned to one core beside two processes spinning on it, this thread runs
    # about a third of the time and waits, runnable, the rest: queued_s must
    # count the wait (more than the thread's own CPU time), not the run.
    core = min(os.sched_getaffinity(0))
    before_affinity = os.sched_getaffinity(0)
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    try:
        time.sleep(0.3)  # the children are pinned and spinning
        os.sched_setaffinity(0, {core})
        q0, ran0, t0 = training.queued_s(), time.thread_time(), time.perf_counter()
        while time.perf_counter() - t0 < 0.6:
            pass
        waited, ran = training.queued_s() - q0, time.thread_time() - ran0
    finally:
        os.sched_setaffinity(0, before_affinity)
        for spin in spinners:
            spin.kill()
            spin.wait()
    assert waited >= 0.2 and waited > ran, (waited, ran)


def test_the_probe_and_cpu_adam_s_rate_mark_each_timed_step(training, monkeypatch) -> None:
    # [Note: which side slowed]: with ZEROSTACK_BENCH_PROBE=1 each timed
    # step's line says how long the same small work took on the host thread
    # and on the GPU after its forward, and every step says at what rate CPU
    # Adam's kernel ran in it, so a slow backward can be laid to the host,
    # the GPU or neither.
    probed: list[int] = []

    class FakeProbe:
        def mark(self) -> str:
            probed.append(1)
            return f"[probe host {len(probed)}.00 gpu 0.50 ms]"

    monkeypatch.setattr(training, "Probe", FakeProbe)
    monkeypatch.setenv(training.PROBE_ENV, "1")
    # CPU Adam's counters (seconds, calls, elements, event seconds): 1e9
    # elements in 0.28 s in the second timed step only.
    clock = iter([(0.0, 0, 0, 0.0)] * 3 + [(0.28, 1, 10**9, 0.0)] * 3)
    monkeypatch.setattr(training.KERNEL_CLOCK, "read", lambda: next(clock))
    marks = _stand_in_marks(training, 3, 1)
    assert len(probed) == 3, probed  # the timed steps only, not the warm-up
    assert [m.count("[probe host") for m in marks] == [1, 1, 1], marks
    assert "[probe host 3.00 gpu 0.50 ms]" in marks[2], marks
    assert "[adam 100 GB/s]" in marks[1] and "[adam" not in marks[0] + marks[2], marks


def test_the_probe_is_off_unless_asked_for(training, monkeypatch) -> None:
    monkeypatch.setattr(training, "Probe", lambda: pytest.fail("a probe made unasked"))
    monkeypatch.delenv(training.PROBE_ENV, raising=False)
    assert all("[probe" not in m for m in _stand_in_marks(training, 2, 0))


class FakeEvent:
    """A CUDA event's stand-in: ``record`` reads the host's clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at - self.at) * 1e3


def test_phase_spans_say_which_phase_a_step_lost_its_time_in(training, monkeypatch) -> None:
    # [Note: phases on the device's timeline]: the spans between the events
    # recorded at the step's start and after each phase.
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    spans = training.PhaseSpans()
    assert spans.line() == ""  # nothing marked yet
    spans.begin()
    time.sleep(0.02)
    spans.after()
    time.sleep(0.06)
    spans.after()
    assert spans.line() == ""  # a phase not marked: no line rather than a wrong one
    spans.after()
    fwd, bwd, opt = (float(x) for x in re.findall(r"\d+\.\d+", spans.line()))
    assert spans.line().startswith(" [fwd ") and spans.line().endswith(" s]")
    assert 0.015 <= fwd < bwd and bwd >= 0.055 and opt < 0.015, spans.line()
    spans.begin()  # a new step starts a new set
    assert spans.line() == ""


def test_every_step_s_loss_is_kept_warm_up_too(training) -> None:
    # The per-step lines print every step's loss, so a row that trains wrong
    # shows beside the rows of the same run (docs/benchmarks.md, "Offloaded
    # steps, 2026-12-04: Gemini's device lane refused under auto placement").
    seen = iter(range(100))
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    out = training.run(
        "stand-in", lambda idx, tgt: torch.tensor(float(next(seen))),
        lambda loss, backward_only: None, batch, 3, 2, False,
    )  # fmt: skip
    assert out["losses"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out["loss"] == 4.0


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_trace_records_the_cpu_step_worker(training, tmp_path, monkeypatch) -> None:
    # ZEROSTACK_BENCH_TRACE: the CPU-step worker's zerostack:: phases and the
    # main thread's phases in one Chrome trace; zerostack.chunk.phase, which
    # asks whether a profiler runs on its own thread, is told yes only while
    # the profiled steps run.
    from zerostack.chunk import phase

    monkeypatch.setenv("ZEROSTACK_BENCH_TRACE", str(tmp_path / "trace"))
    worker = ThreadPoolExecutor(1, thread_name_prefix="zerostack-cpu-step")
    layer = torch.nn.Linear(4, 4)

    def update() -> None:
        with phase("zerostack::cpu_update"):
            torch.ones(8).sum()

    def step_fn(loss, backward_only) -> None:
        if backward_only:
            loss.backward()
        else:
            worker.submit(update).result()

    enabled = torch._C._autograd._profiler_enabled
    try:
        training._profile(
            "row (a)", lambda idx, tgt: layer(idx).sum(), step_fn, torch.ones(2, 4), None, False, 2
        )
    finally:
        worker.shutdown()
    assert torch._C._autograd._profiler_enabled is enabled
    with gzip.open(tmp_path / "trace.row_a_.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    names = [e.get("name") for e in events]
    assert names.count("bench::forward") == 2 and names.count("zerostack::cpu_update") == 2
    main = {e["tid"] for e in events if e.get("name") == "bench::forward"}
    assert {e["tid"] for e in events if e.get("name") == "zerostack::cpu_update"}.isdisjoint(main)


@pytest.fixture
def scale(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import scale

    yield scale
    sys.modules.pop("scale", None)


def test_scale_waits_for_the_compute_stream_only_after_step(scale, monkeypatch) -> None:
    # benchmarks/scale.py's timed loop keeps the same boundary as _training.run
    # ([Note: a step lasts from the end of the one before]): after a timed
    # step() only the compute stream is waited for, so the device lane's
    # work lands in the next step, not between the two.
    seen: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("device"))
    monkeypatch.setattr(scale, "sync_compute", lambda: seen.append("compute"))
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    monkeypatch.setattr(scale, "batch_of", lambda a, config, device: batch)

    class Ddp:
        update_wait_s = 0.0

        def __call__(self, idx, tgt):
            seen.append("forward")
            return torch.zeros(())

        def wait_updates(self) -> None:
            seen.append("wait_updates")

    class Opt:
        cpu_step_s = nvme_wait_s = 0.0

        def backward(self, loss) -> None:
            seen.append("backward")

        def step(self) -> None:
            seen.append("step")

        def host_bytes(self):
            return type("Table", (), {"table": lambda self: ""})()

    class Args:
        warmup, steps, profile, batch_size, seq_len = 1, 3, False, 1, 8

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    lines: list[str] = []
    monkeypatch.setattr(scale, "log", lines.append)
    out = scale.train(Args(), None, Ddp(), Opt(), torch.device("cuda"))
    assert out["spread"] >= 1.0 and out["step_s"] > 0
    # Each step's line carries its phases' spans (the warm-up's too); the
    # untimed step, synchronized whole, has none to give.
    looped = [x for x in lines if x.startswith("step ")]
    assert len(looped) == 4 and all(" [fwd " in x for x in looped), lines
    assert not any(" [fwd " in x for x in lines if x.startswith("untimed")), lines
    one = ["forward", "backward", "step"]
    assert seen == (
        ["device", *one, "compute"]  # the warm-up
        # the untimed step: begun on an idle device, ended as a timed step
        # (its device lane's work lands in the first timed step)
        + ["wait_updates", "device", *one, "compute"]
        + [*one, "compute"] * 3  # the timed steps
        + ["wait_updates"]
    ), seen
