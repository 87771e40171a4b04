"""StateSwapper and PrefetchPipeline: round trips, depth, cleanup, bad input, faults."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zerostack.nvme import NVMeWriteError, StateSwapper, _backends
from zerostack.testing import drop_page_cache


def _run_steps(swapper, sizes, steps):
    keys = [f"k{i}" for i in range(len(sizes))]
    for k, n in zip(keys, sizes, strict=True):
        swapper.register(k, n)
    truth = {k: torch.zeros(n) for k, n in zip(keys, sizes, strict=True)}
    for step in range(steps):
        pipe = swapper.pipeline(keys)
        pipe.pre_step()
        for i, k in enumerate(keys):
            buf = pipe.pre_update(i)
            assert torch.equal(buf, truth[k]), f"step {step} key {k}"
            buf.add_(torch.randn(buf.shape))
            truth[k].copy_(buf)
            pipe.post_update(i)
        pipe.post_step()
    return truth


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_pipeline_round_trips_every_key(backend, depth, tmp_path):
    swapper = StateSwapper(tmp_path, backend=backend, prefetch_depth=depth)
    truth = _run_steps(swapper, [1000, 1, 4099, 17, 65536, 3, 333], steps=4)
    for k, t in truth.items():
        out = torch.empty_like(t)
        assert torch.equal(swapper.read(k, out), t)
        assert swapper.is_on_disk(k)
    swapper.close()


def test_states_are_on_disk_not_in_memory(backend, tmp_path):
    swapper = StateSwapper(tmp_path, backend=backend, prefetch_depth=1)
    _run_steps(swapper, [2**20] * 6, steps=1)
    # 6 keys of 4 MiB live in the file; RAM holds only depth + 2 slots.
    assert os.path.getsize(swapper.path) >= 6 * 4 * 2**20
    assert len(swapper._slots) == 3
    assert swapper.reserved_bytes == 6 * 4 * 2**20


def test_a_released_key_gives_back_its_reservation_and_its_value(backend, tmp_path):
    swapper = StateSwapper(tmp_path, backend=backend, prefetch_depth=1)
    truth = _run_steps(swapper, [1000, 500], steps=2)
    swapper.register("never written", 300)
    assert swapper.reserved_bytes == 4 * 1800
    swapper.release("k0")
    swapper.release("never written")
    swapper.release("never registered")  # ignored
    assert swapper.reserved_bytes == 4 * 500
    assert not swapper.holds("k0") and swapper.holds("k1")
    with pytest.raises(RuntimeError, match="'k0' was not registered"):
        swapper.read("k0", torch.empty(1000))
    assert torch.equal(swapper.read("k1", torch.empty(500)), truth["k1"])
    swapper.register("k0", 1000)  # within the file's size: a new value
    swapper.write("k0", torch.ones(1000))
    assert torch.equal(swapper.read("k0", torch.empty(1000)), torch.ones(1000))
    assert torch.equal(swapper.read("k1", torch.empty(500)), truth["k1"])
    swapper.close()


@pytest.mark.parametrize("depth", [1, 3])
def test_host_buffers_are_the_slots_whatever_the_number_of_keys(backend, depth, tmp_path):
    for num_keys in (2, 12):
        swapper = StateSwapper(tmp_path, backend=backend, prefetch_depth=depth)
        assert swapper.host_buffers() == []
        _run_steps(swapper, [4096] * num_keys, steps=2)
        held = swapper.host_buffers()
        assert len(held) == min(depth + 2, num_keys) and {b.numel() for b in held} == {4096}
        swapper.close()


def test_write_then_read_whole_buffers(backend, tmp_path):
    swapper = StateSwapper(tmp_path, backend=backend)
    swapper.register("a", 10)
    swapper.write("a", torch.arange(10.0))
    swapper.write("a", torch.arange(10.0) * 2)  # a rewrite replaces
    assert torch.equal(swapper.read("a", torch.empty(10)), torch.arange(10.0) * 2)
    assert torch.equal(swapper.read("a", torch.empty(10)), torch.arange(10.0) * 2)


def test_temporary_directory_removed_on_delete_and_close(backend):
    fds_before = len(os.listdir("/proc/self/fd"))
    swapper = StateSwapper(None, backend=backend)
    workdir = swapper.workdir
    _run_steps(swapper, [100, 200], steps=1)
    assert os.path.isdir(workdir)
    del swapper
    gc.collect()
    assert not os.path.exists(workdir)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no file descriptor leaks either
    other = StateSwapper(None, backend=backend)
    other.close()
    assert not os.path.exists(other.workdir)


def test_temporary_directory_removed_after_an_exception(backend):
    seen = {}

    def failing_step():
        swapper = StateSwapper(None, backend=backend)
        seen["dir"] = swapper.workdir
        _run_steps(swapper, [10], steps=1)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        failing_step()
    gc.collect()
    assert not os.path.exists(seen["dir"])


def test_given_directory_is_kept_but_our_files_go(tmp_path):
    (tmp_path / "user-file").write_text("keep me")
    swapper = StateSwapper(tmp_path, backend="threads")
    _run_steps(swapper, [10], steps=1)
    swapper.close()
    assert sorted(os.listdir(tmp_path)) == ["user-file"]


def test_directory_removed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(f"""
        from zerostack.nvme import StateSwapper
        s = StateSwapper({str(tmp_path)!r}, backend="threads")
        s.register("a", 10)
        print(s.workdir)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not os.path.exists(out.stdout.strip())


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_bad_prefetch_depth(depth):
    with pytest.raises(ValueError, match=r"prefetch_depth must be an int >= 1"):
        StateSwapper(backend="threads", prefetch_depth=depth)


def test_unknown_backend():
    with pytest.raises(
        ValueError, match=r"unknown backend \(got 'spdk'\); use one of uring, aio, threads"
    ):
        StateSwapper(backend="spdk")


def test_unavailable_tensornvme_backend(monkeypatch):
    monkeypatch.setattr(_backends, "tensornvme_backends", lambda: set())
    with pytest.raises(ValueError, match=r"backend 'uring' is not available; install tensornvme"):
        StateSwapper(backend="uring")


def test_environment_variable_picks_the_backend(monkeypatch):
    monkeypatch.setenv("ZEROSTACK_NVME_BACKEND", "threads")
    swapper = StateSwapper()
    assert swapper.backend == "threads"
    swapper.close()


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        ValueError, match=r"cannot create or write the offload directory .*a-file/states"
    ):
        StateSwapper(blocker / "states", backend="threads")


def test_full_disk_fails_before_anything_leaves_memory(tmp_path):
    # A 1 MiB file size limit, set up by the test in a child process.
    code = textwrap.dedent(f"""
        import resource, signal, torch
        from zerostack.nvme import NVMeSpaceError, StateSwapper
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
        s = StateSwapper({str(tmp_path)!r}, backend="threads")
        s.register("small", 1000)
        try:
            s.register("big", 2**20)
        except NVMeSpaceError as exc:
            print("ERROR", exc)
        s.write("small", torch.arange(1000.0))
        assert torch.equal(s.read("small", torch.empty(1000)), torch.arange(1000.0))
        print("still usable")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "not enough space in" in out.stdout
    assert str(tmp_path) in out.stdout
    assert "4198304 bytes needed" in out.stdout  # 4000 reserved + 4 MiB asked
    assert "still usable" in out.stdout


def test_failed_write_keeps_the_state_in_memory(tmp_path, monkeypatch):
    swapper = StateSwapper(tmp_path, backend="threads", prefetch_depth=1)
    truth = _run_steps(swapper, [100, 200, 300], steps=1)
    real = _backends.ThreadBackend._pwrite
    calls = {"n": 0}

    def flaky(self, view, offset):
        calls["n"] += 1
        if calls["n"] == 2:  # the second key's write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, view, offset)

    monkeypatch.setattr(_backends.ThreadBackend, "_pwrite", flaky)
    keys = ["k0", "k1", "k2"]
    pipe = swapper.pipeline(keys)
    pipe.pre_step()
    for i, k in enumerate(keys):
        buf = pipe.pre_update(i)
        buf.add_(1.0)
        truth[k].add_(1.0)
        pipe.post_update(i)
    with pytest.raises(
        NVMeWriteError,
        match=r"1 state write\(s\) to .* failed; the step completed.*k1 \(800 bytes\)",
    ):
        pipe.post_step()
    monkeypatch.setattr(_backends.ThreadBackend, "_pwrite", real)
    for k in keys:  # nothing lost: the next step sees every updated state
        assert torch.equal(swapper.read(k, torch.empty_like(truth[k])), truth[k])
    truth2 = {k: v.clone() for k, v in truth.items()}
    pipe = swapper.pipeline(keys)
    pipe.pre_step()
    for i, k in enumerate(keys):
        assert torch.equal(pipe.pre_update(i), truth2[k])
        pipe.post_update(i)
    pipe.post_step()
    assert swapper.is_on_disk("k1")


def test_a_cancelled_pass_leaves_every_key_on_disk_with_its_value(backend, tmp_path):
    # A pass stopped after its first key (fused-adam cancels a planned pass
    # when a parameter of it has no gradient, or when an update fails): the
    # reads already in flight took the later keys off disk on tensornvme,
    # which frees a key's disk copy when it is read back. They must be back,
    # unchanged, as on threads; so must a key whose update failed.
    swapper = StateSwapper(tmp_path, backend=backend, prefetch_depth=2)
    truth = _run_steps(swapper, [100, 200, 300, 400], steps=1)
    keys = list(truth)
    pipe = swapper.pipeline(keys)
    pipe.pre_step()
    buf = pipe.pre_update(0)
    buf.add_(1.0)
    truth["k0"].add_(1.0)
    pipe.post_update(0)
    assert torch.equal(pipe.pre_update(1), truth["k1"])  # its update fails: no post_update
    assert not swapper.is_on_disk("k1")
    pipe.cancel()  # reads of k2 and k3 are in flight
    assert all(swapper.is_on_disk(k) for k in keys)
    assert os.path.getsize(swapper.path) >= 4 * 1000
    for step in range(2):  # the next passes read every key, the cancelled ones included
        pipe = swapper.pipeline(keys)
        pipe.pre_step()
        for i, k in enumerate(keys):
            assert torch.equal(pipe.pre_update(i), truth[k]), f"pass {step} key {k}"
            pipe.post_update(i)
        pipe.post_step()
    for k in keys:
        assert torch.equal(swapper.read(k, torch.empty_like(truth[k])), truth[k])
    swapper.close()


def test_every_backend_reads_a_key_once_per_write(backend, tmp_path):
    # See [Note: one write, one read]: tensornvme forgets a key once it is
    # read back; the thread backend does the same, so that a caller reading a
    # key twice fails on every machine, not only on those with tensornvme.
    io = _backends.open_backend(backend, str(tmp_path / "states.bin"))
    data, out = torch.arange(64.0), torch.empty(64)
    io.wait(io.write("a", data))
    io.wait(io.read("a", out))
    assert torch.equal(out, data)
    for key in ("a", "never-written"):
        with pytest.raises(AssertionError, match=rf"read of key '{key}', which is not on disk"):
            io.read(key, out)
    doubled = data * 2  # alive until the wait, as the backends require
    io.wait(io.write("a", doubled))  # written again: readable again
    io.wait(io.read("a", out))
    assert torch.equal(out, doubled)
    io.close()


def test_the_default_backend_is_threads_even_with_tensornvme(monkeypatch):
    # See [Note: tensornvme 0.1.0's waits]: tensornvme is used only by name.
    monkeypatch.delenv("ZEROSTACK_NVME_BACKEND", raising=False)
    monkeypatch.setattr(_backends, "tensornvme_backends", lambda: {"uring", "aio"})
    assert _backends.resolve_backend(None) == "threads"
    assert _backends.resolve_backend("uring") == "uring"


class _Offloader:
    """tensornvme 0.1.0's Offloader as its Python binding behaves: requests
    finish later, on a thread, and ``sync_read_events`` is the write wait."""

    def __init__(self):
        import threading

        self._threading = threading
        self._pending = {"w": [], "r": []}
        self._data = {}

    def _later(self, kind, fn):
        thread = self._threading.Timer(0.2, fn)
        self._pending[kind].append(thread)
        thread.start()

    def async_write(self, tensor, key, callback):
        self._later("w", lambda: self._data.__setitem__(key, tensor.clone()))

    def async_read(self, tensor, key, callback):
        self._later("r", lambda: tensor.copy_(self._data.pop(key)))

    def _join(self, kind):
        for thread in self._pending[kind]:
            thread.join()
        self._pending[kind].clear()

    def sync_write_events(self):
        self._join("w")

    sync_read_events = sync_write_events  # as tensornvme 0.1.0 binds it

    def synchronize(self):
        self._join("w")
        self._join("r")


def test_a_tensornvme_read_is_waited_for_with_no_write_in_flight():
    io = _backends.TensorNVMeBackend.__new__(_backends.TensorNVMeBackend)
    _backends.Backend.__init__(io)
    io.name, io._off, io._alive = "uring", _Offloader(), {"w": [], "r": []}
    data, out = torch.arange(1024.0), torch.zeros(1024)
    io.wait(io.write("a", data))
    io.wait(io.read("a", out))
    assert torch.equal(out, data)


@pytest.mark.parametrize("name", sorted(_backends.tensornvme_backends()))
def test_a_tensornvme_read_from_the_disk_is_complete_after_its_wait(name, tmp_path):
    # With the page cache dropped the read goes to the disk and finishes
    # long after it is submitted; tensornvme's own read wait returned at once
    # (benchmarks/nvme.py: 13 us, 4064 of 4096 sampled elements unread).
    io = _backends.open_backend(name, str(tmp_path / "states.bin"))
    try:
        data = torch.arange(64 * 2**20, dtype=torch.float32)
        io.wait(io.write("a", data))
        if not drop_page_cache():
            pytest.skip("the page cache cannot be dropped here (needs root)")
        out = torch.zeros_like(data)
        io.wait(io.read("a", out))
        assert torch.equal(out, data)
    finally:
        io.close()
