"""A failed save raises ``CheckpointSaveError`` (an ``Exception``) on every
rank, the root cause in its first line, and leaves the previous checkpoint
loadable (see [Note: checkpoint save errors]); two saves to one path at once
get a clear error from the save lock, not a race (see [Note: checkpoint save
lock]). A full disk is injected into torch.distributed.checkpoint's writer
(``_write_item`` raises ``OSError(ENOSPC)``), at world sizes 1 and 2."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from test_checkpoint_helpers import same
from test_checkpoint_kill_points import _boost, _snapshot, _step

from zerostack.booster import Booster, CheckpointSaveError, LowLevelZeroPlugin, _checkpoint_files
from zerostack.booster._checkpoint_lock import save_lock
from zerostack.testing import GPTConfig, TinyGPT, spawn

FULL = r"no space left on device: [0-9.]+ [kMG]?B needed, [0-9.]+ [kMG]?B free at "


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _beside(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def _full_disk_cases(rank, world, root):
    """The writer of one rank fails; every rank raises the same error, the
    previous checkpoint stays, and the next save works."""
    torch.set_num_threads(1)
    booster, model, opt = _boost("zero2-offload", f"{root}/nvme-{rank}")
    _step(booster, model, opt, seed=rank)
    booster.save_model(model, f"{root}/model", shard=True)
    booster.save_optimizer(opt, f"{root}/optim", shard=True)
    old = _snapshot(model, opt)
    _step(booster, model, opt, seed=2 + rank)
    failing = world - 1  # the last rank's disk is full
    where = re.escape(root)
    for save, path, api in (
        (booster.save_model, f"{root}/model", "save_model"),
        (booster.save_optimizer, f"{root}/optim", "save_optimizer"),
    ):
        real = dcp_filesystem._write_item
        if rank == failing:
            dcp_filesystem._write_item = _full_disk
        try:
            save(model if api == "save_model" else opt, path, shard=True)
        except Exception as exc:  # the point: CheckpointSaveError is an Exception
            caught = exc
        else:
            raise AssertionError(f"rank {rank}: the save did not fail")
        finally:
            dcp_filesystem._write_item = real
        assert isinstance(caught, CheckpointSaveError) and caught.errno == errno.ENOSPC, caught
        first = str(caught).splitlines()[0]
        assert re.match(
            rf"CheckpointIO\.{api}: {FULL}{where} \(got on rank {failing}: OSError: \[Errno 28\]",
            first,
        ), first
        firsts = [None] * world
        torch.distributed.all_gather_object(firsts, first)
        assert len(set(firsts)) == 1, firsts  # the same first line on every rank
    assert _beside(root) == [], _beside(root)
    booster.load_model(model, f"{root}/model")
    booster.load_optimizer(opt, f"{root}/optim")
    same(old, _snapshot(model, opt))
    # save_state: a full disk while its per-rank file is written.
    booster.save_state(f"{root}/state", model, opt)
    for where in ("rank file", "optimizer"):  # the per-rank file; a nested save
        real = _checkpoint_files.write_torch, dcp_filesystem._write_item
        if rank == failing and where == "rank file":
            _checkpoint_files.write_torch = _full_disk
        elif rank == failing:
            dcp_filesystem._write_item = _full_disk
        try:
            with pytest.raises(
                CheckpointSaveError,
                match=rf"^Booster\.save_state: {FULL}{re.escape(root)} \(got on rank {failing}: "
                rf"OSError: \[Errno 28\] .* the previous checkpoint at {re.escape(root)}/state is",
            ):
                booster.save_state(f"{root}/state", model, opt)
        finally:
            _checkpoint_files.write_torch, dcp_filesystem._write_item = real
    booster.load_state(f"{root}/state", model, opt)
    same(old, _snapshot(model, opt))


@pytest.mark.parametrize("world", [1, 2])
def test_a_full_disk_fails_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path, world):
    spawn(_full_disk_cases, world, args=(str(tmp_path),), timeout_s=300)


def test_a_lock_held_elsewhere_refuses_the_save_naming_the_holder(tmp_path):
    torch.manual_seed(0)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))
    model, *_ = booster.boost(TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=16)))
    path = tmp_path / "ckpt"
    booster.save_model(model, path, shard=True)
    with save_lock(str(path), "another job"):
        for use_safetensors in (False, True):  # per-rank files; the gathered export
            with pytest.raises(
                CheckpointSaveError,
                match=rf"^CheckpointIO\.save_model: another save to {re.escape(str(path))} is "
                rf"running \(got the lock .*/\.ckpt\.lock held by pid {os.getpid()} on host "
                rf"{re.escape(socket.gethostname())} \(another job, since ",
            ):
                booster.save_model(model, path, shard=True, use_safetensors=use_safetensors)
        with pytest.raises(CheckpointSaveError, match=r"save_state: another save .* is running"):
            booster.save_state(path, model)
    assert _beside(str(tmp_path)) == []  # released
    booster.save_model(model, path, shard=True)  # and taken again


def test_a_refused_save_waits_for_the_holder_to_write_its_name(tmp_path):
    # The holder writes its name just after taking the lock; a save refused
    # in between still names it (CI once got "a process that has not written
    # its name yet" from two saves started at once).
    import fcntl
    import threading

    path = str(tmp_path / "ckpt")
    fd = os.open(tmp_path / ".ckpt.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {"pid": 4242, "host": "elsewhere", "api": "save_model", "time": 0}
    late = threading.Timer(0.3, os.pwrite, (fd, json.dumps(holder).encode(), 0))
    late.start()
    try:
        refused = pytest.raises(CheckpointSaveError, match=r"held by pid 4242 on host elsewhere ")
        with refused, save_lock(path, "save_model"):
            pass
    finally:
        late.join()
        os.close(fd)


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / ".ckpt.lock"
    holder = {"pid": dead.pid, "host": socket.gethostname(), "api": "save_model", "time": 0}
    lock.write_text(json.dumps(holder))
    booster = Booster(device="cpu")
    model, *_ = booster.boost(TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=16)))
    with caplog.at_level(logging.WARNING, logger="zerostack.booster._checkpoint_lock"):
        booster.save_model(model, tmp_path / "ckpt", shard=True)
    [message] = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert f"pid {dead.pid} on host" in message and "no longer running" in message
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# Each child saves its own model (seeded by its argument) to PATH once GO
# exists, having created READY; its write waits for RELEASE, so that the
# first save holds the lock until the parent has seen the other one end.
CHILD = r"""
import os, sys, time, torch
path, ready, go, release, seed = sys.argv[1:]
from zerostack.booster import Booster, CheckpointSaveError, _checkpoint_dcp
from zerostack.testing import GPTConfig, TinyGPT

def wait_for(name):
    deadline = time.monotonic() + 120
    while not os.path.exists(name) and time.monotonic() < deadline:
        time.sleep(0.01)

real = _checkpoint_dcp.save
def held(*args, **kwargs):
    wait_for(release)
    return real(*args, **kwargs)
_checkpoint_dcp.save = held
torch.manual_seed(int(seed))
booster = Booster(device="cpu")
model, *_ = booster.boost(TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=16)))
open(ready, "w").close()
wait_for(go)
try:
    booster.save_model(model, path, shard=True)
except CheckpointSaveError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
print(os.getpid())
"""


def _wait_until(done, procs, what: str, timeout_s: float = 120.0) -> None:
    """Poll ``done()``; fail when a child exits first or the time is up."""
    deadline = time.monotonic() + timeout_s
    while not done():
        exited = [p.returncode for p in procs if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            outs = [p.communicate() for p in procs]
            pytest.fail(f"{what} (exit codes {exited}): {outs}")
        time.sleep(0.01)


def test_two_processes_saving_to_one_path_at_once(tmp_path):
    path, ctl = tmp_path / "ckpt", tmp_path / "ctl"
    ctl.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path)]
            + [str(ctl / name) for name in (f"ready{seed}", "go", "release")]
            + [str(seed)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    # Both start saving only once both have imported torch and built their model.
    _wait_until(lambda: all((ctl / f"ready{s}").exists() for s in (1, 2)), procs, "not ready")
    (ctl / "go").touch()
    # The first save holds the lock (its write waits) until the other ended;
    # without a lock both would wait in their writes, then both succeed.
    deadline = time.monotonic() + 60
    while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    (ctl / "release").touch()
    outs = [p.communicate(timeout=180) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 3], (codes, outs)
    winner = codes.index(0)
    loser_err = outs[1 - winner][1]
    assert re.search(
        rf"CheckpointIO\.save_model: another save to {re.escape(str(path))} is running \(got "
        rf"the lock .*\.ckpt\.lock held by pid {outs[winner][0].strip()} on host ",
        loser_err,
    ), loser_err
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ctl"]
    torch.manual_seed(1 + winner)
    expected = TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=16)).state_dict()
    torch.manual_seed(9)
    booster = Booster(device="cpu")
    model, *_ = booster.boost(TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=16)))
    booster.load_model(model, path)
    for name, value in model.unwrap().state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_save_that_never_had_a_checkpoint_does_not_speak_of_one(tmp_path):
    """A failed save to a path that held nothing (its parent is a file)
    says nothing is left there, not that a previous checkpoint is unchanged."""
    booster, model, _ = _boost("zero2-offload", str(tmp_path / "nvme"))
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointSaveError) as caught:
        booster.save_model(model, str(tmp_path / "file" / "model.pt"))
    assert "nothing is left at" in str(caught.value)
    assert "previous checkpoint" not in str(caught.value)
