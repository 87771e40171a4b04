"""Loads detect truncated, altered and missing checkpoint files and name the
file, for every layout (see [Note: checkpoint integrity])."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from test_checkpoint_helpers import PlainModel, PlainOptimizer, mlp, same, train

from zerostack.booster._checkpoint import CheckpointIO
from zerostack.booster._checkpoint_files import CheckpointCorruptError


def _flip(path, offset_from_end=100):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset_from_end is None else -offset_from_end] ^= 0x55
    path.write_bytes(bytes(data))


def _truncate(path, keep=0.6):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _save(tmp_path, shard, use_safetensors):
    path = tmp_path / "m"
    CheckpointIO().save_model(
        PlainModel(mlp(0)), path, shard=shard, use_safetensors=use_safetensors, size_per_shard=1
    )
    if not shard:
        return path, path
    ext = ".safetensors" if use_safetensors else ".bin"
    victim = sorted(p for p in path.iterdir() if p.name.endswith(ext))[2]  # a 1 MB weight
    return path, victim


LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]
IDS = ["file-torch", "file-safetensors", "shard-torch", "shard-safetensors"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("damage", ["truncated", "flipped-middle", "flipped-end"])
def test_damage_is_detected_naming_the_file(tmp_path, layout, damage):
    path, victim = _save(tmp_path, *layout)
    if damage == "truncated":
        _truncate(victim)
    else:
        # The middle is tensor bytes; near the end, tensor bytes (safetensors)
        # or the zip's records (torch).
        _flip(victim, None if damage == "flipped-middle" else 100)
    target = PlainModel(mlp(1))
    with pytest.raises(CheckpointCorruptError, match=re.escape(victim.name)) as info:
        CheckpointIO().load_model(target, path)
    if layout[0]:  # a sharded directory is checked file by file against its record
        what = "truncated" if damage == "truncated" else "corrupt"
        assert f"is {what}" in str(info.value)
        # Every file is checked before any is read: nothing was loaded.
        assert target.loads == []


def test_missing_shard_and_broken_index(tmp_path):
    path, victim = _save(tmp_path, True, True)
    victim.rename(tmp_path / "elsewhere")
    with pytest.raises(CheckpointCorruptError, match=rf"{victim.name} is missing"):
        CheckpointIO().load_model(PlainModel(mlp(1)), path)
    (tmp_path / "elsewhere").rename(victim)
    index = path / "model.safetensors.index.json"
    _truncate(index, 0.5)
    with pytest.raises(CheckpointCorruptError, match=r"index\.json is truncated"):
        CheckpointIO().load_model(PlainModel(mlp(1)), path)
    # Without the record (a checkpoint from before it), the index's own parse error.
    (path / "zerostack-checkpoint.json").unlink()
    with (
        pytest.raises(
            CheckpointCorruptError, match=r"index .*model.safetensors.index.json cannot be read"
        ),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # verify=False's warning (tested elsewhere)
        CheckpointIO(verify=False).load_model(PlainModel(mlp(1)), path)


def test_longer_file_is_detected(tmp_path):
    path, victim = _save(tmp_path, True, False)
    with open(victim, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CheckpointCorruptError, match=rf"{victim.name} is longer than saved"):
        CheckpointIO().load_model(PlainModel(mlp(1)), path)


def test_verify_false_checks_sizes_only(tmp_path):
    """verify=False skips the hash: a same-size change loads (wrongly), a cut does not."""
    path, victim = _save(tmp_path, True, True)
    _flip(victim, None)
    target = PlainModel(mlp(1))
    CheckpointIO(verify=False).load_model(target, path)
    assert not torch.equal(target.module[1].weight, mlp(0)[1].weight)
    _truncate(victim)
    with pytest.raises(CheckpointCorruptError, match=rf"{victim.name} is truncated"):
        CheckpointIO(verify=False).load_model(PlainModel(mlp(1)), path)


@pytest.mark.parametrize("shard", [False, True], ids=["file", "shard"])
def test_optimizer_damage_is_detected(tmp_path, shard):
    model = mlp(0)
    opt = PlainOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    train(model, opt, 1)
    path = tmp_path / "o"
    CheckpointIO().save_optimizer(opt, path, shard=shard, size_per_shard=1)
    victims = sorted(path.iterdir()) if shard else [path]
    victims = [v for v in victims if not v.name.endswith(".json")]
    for victim in victims:  # every shard and the groups file
        original = victim.read_bytes()
        _flip(victim, None)
        with pytest.raises(CheckpointCorruptError, match=re.escape(victim.name)):
            CheckpointIO().load_optimizer(opt, path)
        victim.write_bytes(original)
    opt2 = PlainOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    CheckpointIO().load_optimizer(opt2, path)
    same(opt.full_state_dict(), opt2.full_state_dict())


def test_lr_scheduler_damage_is_detected(tmp_path):
    opt = torch.optim.SGD(mlp(0, depth=1).parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    CheckpointIO().save_lr_scheduler(sched, tmp_path / "s.pt")
    _truncate(tmp_path / "s.pt")
    with pytest.raises(CheckpointCorruptError, match=r"s\.pt is truncated or corrupt"):
        CheckpointIO().load_lr_scheduler(sched, tmp_path / "s.pt")


def test_index_records_every_file(tmp_path):
    path, _ = _save(tmp_path, True, True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    records = index["metadata"]["zerostack"]["files"]
    assert set(records) == set(index["weight_map"].values())
    assert all(r["size_bytes"] == os.path.getsize(path / n) for n, r in records.items())
    assert all(re.fullmatch(r"[0-9a-f]{64}", r["sha256"]) for r in records.values())
