"""Crash-safe checkpoints per plugin: a ``save_model`` + ``save_optimizer``
over an existing checkpoint is SIGKILLed before each of its file-system
operations in turn (every ``mkdir``, ``fsync``, ``rename`` / ``replace``,
directory exchange and, in the one-file layout, the file's write, counted
in a dry run), and after every kill the
model and optimizer paths each load exactly (``torch.equal``) either the
previous checkpoint or, once the save had moved it in place, the new one.
A kill before an ``fsync`` of a regular file first truncates that file to
half its size (a torn write, worse than what a SIGKILL leaves).

One process per plugin (a 1-rank gloo group); each kill point is a
``fork`` of it, so a point costs milliseconds instead of a torch import.
CI runs the per-rank parallel layout (``shard=True``) of DDP, LowLevelZero
(ZeRO-2, CPU offload) and Gemini; ``nox -s reliability`` sets
``ZEROSTACK_RELIABILITY_FULL=1`` and adds Gemini with half of HybridAdam's
states on disk, the one-file layout, and filesystems without
``RENAME_EXCHANGE`` (the rename-aside fallback).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time

import pytest
import torch

from zerostack.booster import (
    Booster,
    GeminiPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    _checkpoint_atomic,
    _checkpoint_files,
)
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=1)
FULL = os.environ.get("ZEROSTACK_RELIABILITY_FULL") == "1"
MIN_POINTS = 10  # the count per plugin; every case must reach it
_OPS = ("mkdir", "fsync", "rename", "replace")
_WRITERS = ("write_torch", "write_safetensors", "write_index")
CHILD_TIMEOUT_S = 60.0


def _plugin(name: str, nvme_dir: str):
    """(plugin, HybridAdam keyword arguments) for a case's plugin name."""
    gemini = dict(precision="fp32", chunk_config_dict={1: {"chunk_size": 2_000}})
    table = {
        "ddp": (TorchDDPPlugin(), {}),
        "zero2-offload": (LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True), {}),
        "gemini": (GeminiPlugin(**gemini, offload_optim_frac=0.5), {}),
        "gemini-nvme": (
            GeminiPlugin(**gemini, offload_optim_frac=1.0),
            dict(nvme_offload_fraction=0.5, nvme_offload_dir=nvme_dir),
        ),
    }
    return table[name]


def _boost(name: str, nvme_dir: str):
    torch.manual_seed(0)
    plugin, adam = _plugin(name, nvme_dir)
    model = TinyGPT(CONFIG)
    opt = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1, **adam)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _step(booster, model, opt, seed: int) -> None:
    idx, tgt = make_batch(CONFIG, 4, 8, seed=seed)
    booster.backward(model(idx, tgt), opt)
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    """Deep copies of the full model and optimizer states (exact comparison)."""
    clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return _map(model.full_state_dict(), clone), _map(opt.full_state_dict(), clone)


def _map(obj, fn):
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return fn(obj)


def _equal(a, b, where: str) -> None:
    """Exact equality of nested states; raises naming the first difference."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
            raise AssertionError(f"{where}: tensors differ")
    elif isinstance(a, dict):
        if sorted(map(str, a)) != sorted(map(str, b)):
            raise AssertionError(f"{where}: keys {sorted(a)} != {sorted(b)}")
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{where}: lengths {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    elif a != b:
        raise AssertionError(f"{where}: {a!r} != {b!r}")


class _Recorder:
    """Counts the file-system operations of a save; before the ``kill_at``-th
    (0-based) it tears an fsynced file and SIGKILLs the process. Installed
    only in a forked child (or for the dry run, which kills nothing)."""

    def __init__(self, kill_at: int | None, exchange: bool) -> None:
        self.kill_at, self.events = kill_at, []
        self._saved = {op: getattr(os, op) for op in _OPS}
        self._saved_exchange = _checkpoint_atomic._exchange
        self._saved_writers = {w: getattr(_checkpoint_files, w) for w in _WRITERS}
        for op in _OPS:
            setattr(os, op, self._wrap(op, self._saved[op]))
        for w, real in self._saved_writers.items():  # the one-file layout's writes
            setattr(_checkpoint_files, w, self._wrap(w, real))
        real = self._saved_exchange if exchange else (lambda a, b: False)
        _checkpoint_atomic._exchange = self._wrap("exchange", real)

    def _wrap(self, op, real):
        def hooked(*args, **kwargs):
            if len(self.events) == self.kill_at:
                if op == "fsync":
                    _tear(args[0])
                os.kill(os.getpid(), signal.SIGKILL)
            self.events.append((op, *map(str, args[:2])))
            return real(*args, **kwargs)

        return hooked

    def undo(self) -> None:
        for op, real in self._saved.items():
            setattr(os, op, real)
        _checkpoint_atomic._exchange = self._saved_exchange
        for w, real in self._saved_writers.items():
            setattr(_checkpoint_files, w, real)


def _tear(fd: int) -> None:
    """Cut the regular file open at ``fd`` (maybe read-only) to half its size."""
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode):
        os.truncate(os.readlink(f"/proc/self/fd/{fd}"), info.st_size // 2)


def _save(booster, model, opt, root: str, shard: bool) -> None:
    booster.save_model(model, f"{root}/model", shard=shard)
    booster.save_optimizer(opt, f"{root}/optim", shard=shard)


def _commit_index(events, path: str) -> int:
    """The index of the operation that put the new ``path`` in place: a
    replace onto it, else (a directory over a directory) the exchange."""
    path = os.path.abspath(path)
    for wanted in ("replace", "exchange"):
        for i, (op, *args) in enumerate(events):
            if op == wanted and os.path.abspath(args[-1]) == path:
                return i
    raise AssertionError(f"no operation moved a save onto {path}: {events}")


def _killed_save(booster, model, opt, root, shard, exchange, kill_at) -> None:
    """Fork; the child saves with a kill before operation ``kill_at``. The
    parent waits and checks the child died of SIGKILL."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            # gloo's threads are not in a forked child, so its collectives
            # would hang; at one rank they are identities, and the save
            # skips them when no group is up.
            torch.distributed.is_initialized = lambda: False
            _Recorder(kill_at, exchange)
            _save(booster, model, opt, root, shard)
            code = 4  # the save finished: the point was past the end
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"kill point {kill_at}: the child hung")
        time.sleep(0.005)
    status = done[1]
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise AssertionError(f"kill point {kill_at}: the child ended with status {status}")


def _sweep(rank, world, name, shard, exchange, root):
    """All kill points of one case; returns nothing, raises on a mismatch."""
    del rank, world
    torch.set_num_threads(1)
    # tensornvme's io_uring / libaio rings do not survive a fork (the child
    # crashed with SIGSEGV); the kill points need one, so the states on disk
    # go through the threads backend here.
    os.environ["ZEROSTACK_NVME_BACKEND"] = "threads"
    nvme = f"{root}/nvme"
    os.makedirs(nvme, exist_ok=True)
    booster, model, opt = _boost(name, nvme)
    _step(booster, model, opt, seed=0)
    pristine = f"{root}/pristine"
    _save(booster, model, opt, pristine, shard)
    old = _snapshot(model, opt)
    _step(booster, model, opt, seed=1)
    new = _snapshot(model, opt)
    ckpt = f"{root}/ckpt"

    def reset():
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(pristine, ckpt)

    reset()  # the dry run: count the operations of one save over the old one
    recorder = _Recorder(None, exchange)
    try:
        _save(booster, model, opt, ckpt, shard)
    finally:
        recorder.undo()
    events = recorder.events
    commits = {k: _commit_index(events, f"{ckpt}/{k}") for k in ("model", "optim")}
    if len(events) < MIN_POINTS:
        raise AssertionError(f"{name}: only {len(events)} kill points: {events}")

    _, target_model, target_opt = _boost(name, f"{nvme}-target")
    for kill_at in range(len(events)):
        reset()
        _killed_save(booster, model, opt, ckpt, shard, exchange, kill_at)
        booster.load_model(target_model, f"{ckpt}/model")
        booster.load_optimizer(target_opt, f"{ckpt}/optim")
        got = _snapshot(target_model, target_opt)
        for i, key in enumerate(("model", "optim")):
            want = new if kill_at > commits[key] else old
            _equal(want[i], got[i], f"{name} kill before {events[kill_at]} ({kill_at}): {key}")
    # The next save after a kill cleans up: one checkpoint per path, nothing beside.
    _save(booster, model, opt, ckpt, shard)
    leftovers = sorted(n for n in os.listdir(ckpt) if n.startswith("."))
    if leftovers:
        raise AssertionError(f"{name}: left beside the checkpoint: {leftovers}")
    with open(f"{root}/count", "w") as f:
        f.write(str(len(events)))


CASES = [
    # (plugin, shard, exchange); the full sweep adds the rest
    ("ddp", True, True),
    ("zero2-offload", True, True),
    ("gemini", True, True),
]
FULL_CASES = [
    ("gemini-nvme", True, True),
    ("ddp", False, True),
    ("zero2-offload", False, True),
    ("gemini", False, True),
    ("ddp", True, False),
    ("zero2-offload", True, False),
    ("gemini", True, False),
    ("gemini-nvme", True, False),
]


def _ids(case):
    name, shard, exchange = case
    return f"{name}-{'dir' if shard else 'file'}-{'exchange' if exchange else 'aside'}"


@pytest.mark.parametrize("case", CASES + (FULL_CASES if FULL else []), ids=_ids)
def test_a_save_killed_at_every_point_leaves_a_loadable_exact_checkpoint(case, tmp_path):
    spawn(_sweep, 1, args=(*case, str(tmp_path)), timeout_s=300)
    count = int((tmp_path / "count").read_text())
    print(f"{_ids(case)}: {count} kill points")
    assert count >= MIN_POINTS


def _flip_middle(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x55]))
