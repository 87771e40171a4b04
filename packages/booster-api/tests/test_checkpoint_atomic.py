"""Saves are atomic: a save killed (SIGKILL) at any point leaves the previous
checkpoint at its path, whole and exact; the next save cleans up after it.
See [Note: atomic checkpoint save]."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_checkpoint_helpers import PlainModel, mlp, same

from zerostack.booster import CheckpointSaveError, _checkpoint_atomic
from zerostack.booster._checkpoint import CheckpointIO

# Run in a child: save mlp(1) over the checkpoint at PATH, stopping for good at
# POINT (after writing MARKER) so that the parent can SIGKILL it there.
CHILD = r"""
import os, sys, time
path, shard, use_safetensors, point, marker = sys.argv[1:]
shard, use_safetensors = shard == "1", use_safetensors == "1"
from test_checkpoint_helpers import PlainModel, mlp
from zerostack.booster import _checkpoint_atomic, _checkpoint_files
from zerostack.booster import CheckpointSaveError
from zerostack.booster._checkpoint import CheckpointIO

def stop():
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

if point == "mid-write":  # the first file half written
    name = "write_safetensors" if use_safetensors else "write_torch"
    original = getattr(_checkpoint_files, name)
    def half(file, *args, **kwargs):
        original(file, *args, **kwargs)
        os.truncate(file, os.path.getsize(file) // 2)
        stop()
    setattr(_checkpoint_files, name, half)
elif point == "before-index":  # every shard written, the index not
    _checkpoint_files.write_index = lambda *a, **k: stop()
elif point in ("before-rename", "after-aside"):
    if point == "after-aside":  # a filesystem without RENAME_EXCHANGE
        _checkpoint_atomic._exchange = lambda a, b: False
    else:
        _checkpoint_atomic._exchange = lambda a, b: stop()
    original_replace = os.replace
    def replace(src, dst):
        if os.path.abspath(dst) == os.path.abspath(path):
            stop()
        return original_replace(src, dst)
    _checkpoint_atomic.os.replace = replace
CheckpointIO().save_model(
    PlainModel(mlp(1)), path, shard=shard, use_safetensors=use_safetensors, size_per_shard=1
)
raise SystemExit("the save was not stopped")
"""

CASES = [
    # (shard, use_safetensors, point)
    (False, False, "mid-write"),
    (False, True, "before-rename"),
    (True, True, "mid-write"),
    (True, False, "before-index"),
    (True, True, "before-rename"),
    (True, False, "after-aside"),
]


def _start(tmp_path, case):
    shard, use_safetensors, point = case
    name = f"{'dir' if shard else 'file'}-{'st' if use_safetensors else 'pt'}-{point}"
    path = tmp_path / name
    CheckpointIO().save_model(
        PlainModel(mlp(0)), path, shard=shard, use_safetensors=use_safetensors, size_per_shard=1
    )
    marker = tmp_path / f"{name}.marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    argv = [str(path), str(int(shard)), str(int(use_safetensors)), point, str(marker)]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv], env=env, stderr=subprocess.PIPE, text=True
    )
    return path, marker, proc


def _siblings(path, tag):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}{tag}"))


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    # The children run side by side (each pays for importing torch: six at
    # once took 22 s of a loaded 2-core machine).
    started = [(case, *_start(tmp_path, case)) for case in CASES]
    deadline = time.monotonic() + 300
    for case, _path, marker, proc in started:
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"{case}: the child exited first:\n{proc.stderr.read()}")
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{case}: the child never reached its stop point")
            time.sleep(0.05)
        time.sleep(0.05)  # let the marker's writer reach its sleep
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        proc.stderr.close()

    previous = mlp(0).state_dict()
    for case, path, _, _ in started:
        shard, _, point = case
        # The killed save left its temporary (or, between the fallback's two
        # renames, the previous checkpoint set aside).
        if point == "after-aside":
            assert not path.exists() and len(_siblings(path, ".old-")) == 1, case
            with pytest.warns(UserWarning, match=r"save there was interrupted; loading"):
                target = PlainModel(mlp(5))
                CheckpointIO().load_model(target, path)
        else:
            assert len(_siblings(path, ".tmp-")) == 1, case
            target = PlainModel(mlp(5))
            CheckpointIO().load_model(target, path)
        same(previous, target.module.state_dict(), str(case))

        # The next save puts things in order: one checkpoint, nothing beside it.
        CheckpointIO().save_model(PlainModel(mlp(2)), path, shard=shard, size_per_shard=1)
        assert _siblings(path, ".") == [], case
        target = PlainModel(mlp(5))
        CheckpointIO().load_model(target, path)
        same(mlp(2).state_dict(), target.module.state_dict(), str(case))


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    """An exception mid-save removes the temporary; the previous checkpoint stays."""
    path = tmp_path / "m"
    CheckpointIO().save_model(PlainModel(mlp(0)), path, shard=True, size_per_shard=1)
    calls = []

    def failing(file, state):
        calls.append(file)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        torch.save(state, file)

    monkeypatch.setattr("zerostack.booster._checkpoint_files.write_torch", failing)
    with pytest.raises(
        CheckpointSaveError,
        match=r"^CheckpointIO.save_model: no space left on device: 3\.0 MB needed, [0-9.]+ [kMG]?B free at ",
    ):
        CheckpointIO().save_model(PlainModel(mlp(1)), path, shard=True, size_per_shard=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    target = PlainModel(mlp(5))
    CheckpointIO().load_model(target, path)
    same(mlp(0).state_dict(), target.module.state_dict())


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_directory_replace(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(_checkpoint_atomic, "_exchange", lambda a, b: False)
    final = tmp_path / "d"
    for content in ("old", "new"):
        with _checkpoint_atomic.atomic_path(str(final), is_dir=True) as tmp:
            (tmp_path / tmp / "f").write_text(content)
    assert (final / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_exchange_swaps_directories(tmp_path):
    """RENAME_EXCHANGE works here, so the atomic path is the one taken (Linux)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux only")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("b")
    if not _checkpoint_atomic._exchange(str(tmp_path / "a"), str(tmp_path / "b")):
        pytest.skip("this filesystem cannot exchange; the rename-aside fallback is used")
    assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"


def test_prepare_restores_a_checkpoint_set_aside(tmp_path):
    final = tmp_path / "ckpt"
    aside = tmp_path / ".ckpt.old-123-abc"
    aside.mkdir()
    (aside / "f").write_text("previous")
    (tmp_path / ".ckpt.tmp-123-abc").mkdir()
    _checkpoint_atomic.prepare(str(final))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (final / "f").read_text() == "previous"
