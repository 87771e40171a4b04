"""The one CPU-step pipeline (ZeroOptimizer's cpu_offload and GeminiOptimizer
run on it): keys finished in order, the failure rule of [Note: a failed CPU
update] (kept with its call, run once more where it is waited for, raised as
CpuStepError when that fails too), the worker's timers, close from the worker."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from zerostack.shard import CpuStepError, CpuUpdatePipeline

CPU = torch.device("cpu")


class _Updates:
    """Records each run; the keys in ``failing`` raise while it is set."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, str]] = []
        self.failing: set[int] = set()

    def __call__(self, key: int) -> None:
        self.runs.append((key, threading.current_thread().name))
        if key in self.failing:
            raise OSError(f"injected for {key}")


def _pipe(overlap: bool) -> CpuUpdatePipeline:
    return CpuUpdatePipeline("Owner", "unit {}", overlap, CPU, retry_at="forward or step")


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
def test_keys_are_finished_in_order_and_counted(overlap):
    pipe, updates = _pipe(overlap), _Updates()
    for key in (2, 0, 1):
        assert pipe.submit(key, updates, key)
    assert pipe.held == [0, 1, 2] and pipe.pending == [0, 1, 2] and 1 in pipe
    assert [pipe.pop() for _ in range(3)] == [0, 1, 2]
    assert pipe.held == [] and 1 not in pipe
    assert sorted(k for k, _ in updates.runs) == [0, 1, 2]
    on_worker = [name.startswith("zerostack-cpu-step") for _, name in updates.runs]
    assert on_worker == [overlap] * 3
    assert pipe.worker_updates == (3 if overlap else 0) and pipe.update_s > 0
    pipe.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
def test_a_failed_update_runs_once_more_where_it_is_waited_for(overlap, caplog):
    pipe, updates = _pipe(overlap), _Updates()
    updates.failing = {1}
    pipe.submit(0, updates, 0)
    assert pipe.submit(1, updates, 1) is overlap  # inline: failed at once
    pipe.wait(0)
    with pytest.raises(CpuStepError, match=r"Owner: the CPU update of unit 1 failed \(OSError: injected for 1\); .* \(the next forward or step runs it again\)") as raised:  # fmt: skip
        pipe.wait(1)
    assert raised.value.index == 1 and raised.value.chunk_index == 1
    assert isinstance(raised.value.__cause__, OSError) and isinstance(raised.value, RuntimeError)
    assert [k for k, _ in updates.runs] == [0, 1, 1]  # the first run and one more
    assert pipe.failed == [1] and pipe.held == [1] and pipe.pending == []
    with pytest.raises(CpuStepError):  # every later wait runs it again first
        pipe.wait(1)
    updates.failing.clear()
    with caplog.at_level("INFO"):
        pipe.wait(1)
    assert "ran again and succeeded" in caplog.text
    assert pipe.failed == [] and pipe.held == [] and [k for k, _ in updates.runs][-1] == 1
    pipe.close()


def test_a_transient_fault_is_absorbed_by_the_one_retry():
    pipe, updates = _pipe(False), _Updates()
    updates.failing = {0}
    assert not pipe.submit(0, updates, 0)
    updates.failing.clear()
    pipe.wait(0)  # runs once more, succeeds: nothing raised
    assert [k for k, _ in updates.runs] == [0, 0] and pipe.held == []


def test_harvest_keeps_worker_failures_not_waited_for_and_drop_failed_forgets_them():
    pipe, updates = _pipe(True), _Updates()
    updates.failing = {3}
    pipe.submit(3, updates, 3)
    pipe.submit(4, updates, 4)
    pipe.settle()  # both ran; nothing finished
    assert pipe.failed == [] and pipe.held == [3, 4]
    pipe.harvest()
    assert pipe.failed == [3] and pipe.pending == [4]
    assert pipe.drop_failed() == [3]
    assert pipe.held == [4] and pipe.failed == []
    pipe.wait(4)
    assert pipe.held == []
    pipe.close()


def test_the_last_reference_dropped_on_the_worker_closes_without_joining_itself():
    class Owner:
        def __init__(self) -> None:
            self.pipe = _pipe(True)

    owner = Owner()
    pipe = owner.pipe
    done = threading.Event()
    closed_on: list[str] = []

    def last(holder: list) -> None:
        holder.clear()  # the owner's last reference goes on the worker
        gc.collect()
        pipe.close()  # from the worker: must not wait for itself
        closed_on.append(threading.current_thread().name)
        done.set()

    pipe.submit(0, last, [owner])
    del owner
    assert done.wait(10), "close() on the worker hung"
    assert closed_on[0].startswith("zerostack-cpu-step") and not pipe.overlapping


def test_settle_from_another_pipelines_worker_waits():
    # Workers of every pipeline share a thread name; settle() used to skip the
    # wait on any of them, so a step waiter or finalizer running on pipeline
    # A's worker read pipeline B's figures while B's update still ran.
    a, b = _pipe(True), _pipe(True)
    release, settled = threading.Event(), []

    def slow(key: int) -> None:
        assert release.wait(30)

    b.submit(0, slow, 0)
    threading.Timer(0.3, release.set).start()
    a.submit(0, lambda key: (b.settle(), settled.append(release.is_set())), 0)
    a.wait(0)
    assert settled == [True]  # b's running update had ended when settle() returned
    b.wait(0)
    a.close()
    b.close()


def test_cpu_updates_do_not_wait_behind_the_device_lanes():
    """A device-lane update runs on a worker of its own ([Note: the device
    lane's own worker]): CPU Adam's update, queued after it, finishes while
    the lane's is still running; on one worker it waited for it."""
    pipe = _pipe(True)
    release = threading.Event()
    done: list[str] = []
    pipe.submit(0, lambda: (release.wait(timeout=30), done.append("device")), lane="device")
    pipe.submit(1, lambda: done.append("CPU"))
    try:
        pipe.wait(1)
        assert done == ["CPU"], done
    finally:
        release.set()
    pipe.wait(0)
    assert done == ["CPU", "device"]
    assert pipe.device_update_s > 0 and pipe.update_s < pipe.device_update_s
    pipe.close()
