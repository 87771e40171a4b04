"""A checkpoint cannot lose its checks (see [Note: checkpoint record]):
every directory a save writes is valid only with its record, written last;
a load refuses a directory without it, a damaged file, and files of
different saves, naming the file, before it reads anything. ``verify=False``
loads a checkpoint from before the records, with a warning once. Per plugin
(DDP, ZeRO-2 with CPU offload, Gemini) for the per-rank parallel layout, at
world sizes 1 and 2, and for ``save_state`` and the Hugging Face export."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import warnings

import pytest
import torch
from test_checkpoint_helpers import PlainModel, PlainOptimizer, mlp, same, train
from test_checkpoint_kill_points import _boost, _flip_middle, _save, _snapshot, _step

from zerostack.booster import Booster, CheckpointCorruptError, LowLevelZeroPlugin
from zerostack.booster import _checkpoint_record as record
from zerostack.booster._checkpoint import CheckpointIO
from zerostack.testing import GPTConfig, TinyGPT, spawn

RECORD = "zerostack-checkpoint.json"


def _distcp(path: str, rank: int = 0) -> str:
    [name] = glob.glob(f"{path}/__{rank}_*_0.distcp")
    return name


def _later_file_renamed(path: str, later: str) -> None:
    """A later save's rank-0 file under this save's name (same size)."""
    shutil.copyfile(_distcp(later), _distcp(path))


def _later_metadata_and_files(path: str, later: str) -> None:
    """A later save's ``.metadata`` and files copied over this one (its record stays)."""
    for name in os.listdir(later):
        if name != RECORD:
            shutil.copyfile(f"{later}/{name}", f"{path}/{name}")


def _later_record(path: str, later: str) -> None:
    shutil.copyfile(f"{later}/{RECORD}", f"{path}/{RECORD}")


# name: (damage(path, later save's path), the message's words); every one must be refused.
DAMAGES = {
    "truncated": (
        lambda p, _: os.truncate(_distcp(p), os.path.getsize(_distcp(p)) * 6 // 10),
        r"__0_[0-9a-f]{16}_0\.distcp is truncated",
    ),
    "flipped": (lambda p, _: _flip_middle(_distcp(p)), r"__0_[0-9a-f]{16}_0\.distcp is corrupt"),
    "missing": (lambda p, _: os.unlink(_distcp(p)), r"__0_[0-9a-f]{16}_0\.distcp is missing"),
    "record-deleted": (
        lambda p, _: os.unlink(f"{p}/{RECORD}"),
        rf"^CheckpointIO\.load_\w+: checkpoint record .*{RECORD} is missing",
    ),
    "record-deleted-and-flipped": (
        lambda p, _: (os.unlink(f"{p}/{RECORD}"), _flip_middle(_distcp(p))),
        rf"checkpoint record .*{RECORD} is missing",
    ),
    "later-file-renamed": (
        _later_file_renamed,
        r"__0_[0-9a-f]{16}_0\.distcp is corrupt .* or it is a file of another save",
    ),
    "later-metadata-and-files": (_later_metadata_and_files, r"\.metadata is corrupt"),
    "later-record": (_later_record, r"__0_[0-9a-f]{16}_0\.distcp is missing"),
}
# With verify=False (sizes and save ids only) these are still refused:
UNVERIFIED_DAMAGES = {
    "truncated": DAMAGES["truncated"],
    "missing": DAMAGES["missing"],
    "later-metadata-and-files": (_later_metadata_and_files, r"\.metadata belongs to another save"),
    "later-record": DAMAGES["later-record"],
}


def _damaged_parallel(rank, world, root):
    """Each plugin's parallel model and optimizer checkpoints, damaged one
    way at a time: every load is refused naming the file and changes
    nothing; the undamaged one loads exactly, also with verify=False and no
    record."""
    del rank, world
    torch.set_num_threads(1)
    for name in ("ddp", "zero2-offload", "gemini"):
        booster, model, opt = _boost(name, f"{root}/nvme")
        _step(booster, model, opt, seed=0)
        _save(booster, model, opt, f"{root}/{name}-a", shard=True)
        old = _snapshot(model, opt)
        _step(booster, model, opt, seed=1)
        _save(booster, model, opt, f"{root}/{name}-b", shard=True)  # a later save
        new = _snapshot(model, opt)
        for i, (kind, target, load) in enumerate(
            (("model", model, booster.load_model), ("optim", opt, booster.load_optimizer))
        ):
            saved, later = f"{root}/{name}-a/{kind}", f"{root}/{name}-b/{kind}"
            for verify, damages in ((True, DAMAGES), (False, UNVERIFIED_DAMAGES)):
                for damage, (how, words) in damages.items():
                    path = f"{root}/{name}-{kind}-{damage}-{verify}"
                    shutil.copytree(saved, path)
                    how(path, later)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # verify=False's warning
                        with pytest.raises(CheckpointCorruptError, match=words):
                            load(target, path, verify=verify)
            same(new[i], _snapshot(model, opt)[i], f"{name} {kind}: a refused load changed it")
        # The controls: the whole one loads exactly, and without its record with verify=False.
        booster.load_model(model, f"{root}/{name}-a/model")
        booster.load_optimizer(opt, f"{root}/{name}-a/optim")
        same(old, _snapshot(model, opt), name)
        os.unlink(f"{root}/{name}-b/model/{RECORD}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            booster.load_model(model, f"{root}/{name}-b/model", verify=False)
        same(new[0], _snapshot(model, opt)[0], name)


def test_a_damaged_or_mixed_parallel_checkpoint_is_refused_naming_the_file(tmp_path):
    spawn(_damaged_parallel, 1, args=(str(tmp_path),), timeout_s=300)


def _mixed_at_two(rank, world, root):
    """ZeRO-2 at 2 ranks: rank 1's file of a later save, or the later save's
    ``.metadata``, or no record: every rank raises the same error."""
    torch.set_num_threads(1)
    booster, model, opt = _boost("zero2-offload", f"{root}/nvme-{rank}")
    _step(booster, model, opt, seed=rank)
    booster.save_model(model, f"{root}/a", shard=True)
    old = _snapshot(model, opt)[0]
    _step(booster, model, opt, seed=2 + rank)
    booster.save_model(model, f"{root}/b", shard=True)
    new = _snapshot(model, opt)[0]
    cases = [
        ("rank-1-file", lambda p: shutil.copyfile(_distcp(f"{root}/b", 1), _distcp(p, 1)),
         r"__1_[0-9a-f]{16}_0\.distcp is corrupt", True),
        ("metadata", lambda p: _later_metadata_and_files(p, f"{root}/b"),
         r"\.metadata belongs to another save", False),
        ("record", lambda p: os.unlink(f"{p}/{RECORD}"), r"checkpoint record .* is missing", True),
    ]  # fmt: skip
    for case, how, words, verify in cases:
        path = f"{root}/{case}"
        if rank == 0:
            shutil.copytree(f"{root}/a", path)
            how(path)
        torch.distributed.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointCorruptError, match=words):
                booster.load_model(model, path, verify=verify)
    same(new, _snapshot(model, opt)[0], "a refused load changed the model")
    booster.load_model(model, f"{root}/a")
    same(old, _snapshot(model, opt)[0])


def test_parts_of_two_saves_at_world_size_2_are_refused_on_every_rank(tmp_path):
    spawn(_mixed_at_two, 2, args=(str(tmp_path),), timeout_s=300)


CONFIG = GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=1)


def _zero2():
    torch.manual_seed(0)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))
    model = TinyGPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def test_save_state_parts_of_two_saves_are_refused(tmp_path):
    booster, model, opt, sched = _zero2()
    _step(booster, model, opt, seed=0)
    booster.save_state(tmp_path / "a", model, opt, sched)
    old = _snapshot(model, opt)
    _step(booster, model, opt, seed=1)
    sched.step()
    booster.save_state(tmp_path / "b", model, opt, sched)
    ids = {json.loads((tmp_path / p / RECORD).read_text())["save_id"] for p in ("a", "a/model")}
    assert len(ids) == 1  # one save id for the whole state

    def model_of_b(p):
        shutil.rmtree(p / "model")
        shutil.copytree(tmp_path / "b" / "model", p / "model")

    def rank_file_of_b(p):
        shutil.copyfile(tmp_path / "b" / "rank-00000-of-00001.pt", p / "rank-00000-of-00001.pt")

    cases = [
        (lambda p: (p / RECORD).unlink(), True, rf"checkpoint record .*{RECORD} is missing"),
        (model_of_b, True, rf"model/{RECORD} belongs to another save"),
        (model_of_b, False, rf"model/{RECORD} belongs to another save"),
        (rank_file_of_b, True, r"rank-00000-of-00001\.pt is (corrupt|truncated|longer)"),
        (rank_file_of_b, False, r"rank-00000-of-00001\.pt (belongs to another save|is trunc|is long)"),
        (lambda p: _flip_middle(_distcp(str(p / "optimizer"))), True, r"distcp is corrupt"),
    ]  # fmt: skip
    for i, (how, verify, words) in enumerate(cases):
        path = tmp_path / f"case-{i}"
        shutil.copytree(tmp_path / "a", path)
        how(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointCorruptError, match=words):
                booster.load_state(path, model, opt, sched, verify=verify)
    booster.load_state(tmp_path / "a", model, opt, sched)
    same(old, _snapshot(model, opt))
    assert sched.last_epoch == 0


@pytest.mark.parametrize("layout", ["hf-safetensors", "hf-torch", "optimizer-shards"])
def test_a_gathered_directory_without_its_record_is_refused(tmp_path, layout):
    model = mlp(0, depth=2)
    opt = PlainOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    train(model, opt, 1)
    io, path = CheckpointIO(), tmp_path / "ckpt"
    if layout == "optimizer-shards":
        io.save_optimizer(opt, path, shard=True, size_per_shard=1, parallel=False)
        load = lambda **kw: io.load_optimizer(opt, path, **kw)  # noqa: E731
    else:
        st = layout == "hf-safetensors"
        io.save_model(PlainModel(model), path, shard=True, use_safetensors=st, parallel=False)
        load = lambda **kw: io.load_model(PlainModel(mlp(1, depth=2)), path, **kw)  # noqa: E731
    load()
    (path / RECORD).unlink()
    with pytest.raises(CheckpointCorruptError, match=rf"checkpoint record .*{RECORD} is missing"):
        load()
    with pytest.warns(UserWarning, match=r"verify=False loads checkpoints without their record"):
        kind = "optimizer" if layout == "optimizer-shards" else "model"
        record._warned_unverified.discard(f"CheckpointIO.load_{kind}")
        load(verify=False)


def test_verify_false_warns_once(tmp_path):
    io = CheckpointIO()
    io.save_model(PlainModel(mlp(0, depth=1)), tmp_path / "m", shard=True, size_per_shard=1)
    record._warned_unverified.discard("CheckpointIO.load_model")
    with pytest.warns(UserWarning, match=r"^CheckpointIO\.load_model: verify=False"):
        io.load_model(PlainModel(mlp(1, depth=1)), tmp_path / "m", verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        io.load_model(PlainModel(mlp(1, depth=1)), tmp_path / "m", verify=False)
    with pytest.raises(TypeError, match=r"load_model: verify must be a bool \(got 'no'\)"):
        io.load_model(PlainModel(mlp(1, depth=1)), tmp_path / "m", verify="no")


def test_every_file_is_in_the_record_and_the_record_is_last(tmp_path):
    booster, model, opt, sched = _zero2()
    booster.save_state(tmp_path / "s", model, opt, sched)
    top = json.loads((tmp_path / "s" / RECORD).read_text())
    sid = top["save_id"]
    expected = {
        "s": {
            "lr_scheduler.pt",
            "rank-00000-of-00001.pt",
            f"model/{RECORD}",
            f"optimizer/{RECORD}",
        },
        "s/model": {".metadata", f"__0_{sid}_0.distcp"},
        "s/optimizer": {".metadata", f"__0_{sid}_0.distcp"},
    }
    for where, names in expected.items():
        path = tmp_path / where
        rec = json.loads((path / RECORD).read_text())
        assert rec["save_id"] == sid and set(rec["files"]) == names, (where, rec)
        assert {p.name for p in path.iterdir() if p.is_file()} == {
            n for n in names if "/" not in n
        } | {RECORD}
        for name, entry in rec["files"].items():
            assert entry["size_bytes"] == (path / name).stat().st_size
            assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
        latest = max((path / n).stat().st_mtime_ns for n in rec["files"])
        assert (path / RECORD).stat().st_mtime_ns >= latest, where


def test_a_checkpoint_from_before_the_records_loads_with_verify_false(tmp_path, monkeypatch):
    """The layout before the records: ``__0_0.distcp`` and the per-rank
    ``zerostack-files-0.json``, no record. Refused by default; loads exactly
    with verify=False, whose per-rank sizes are still checked."""
    from torch.distributed.checkpoint import FileSystemWriter

    from zerostack.booster import _checkpoint_dcp
    from zerostack.booster._checkpoint_files import file_record

    booster = Booster(device="cpu")
    torch.manual_seed(0)
    model, *_ = booster.boost(TinyGPT(CONFIG))
    with monkeypatch.context() as m:  # DCP's own file names, as before
        m.setattr(
            _checkpoint_dcp._Writer, "prepare_global_plan", FileSystemWriter.prepare_global_plan
        )
        booster.save_model(model, tmp_path / "old", shard=True)
    old = tmp_path / "old"
    (old / RECORD).unlink()
    legacy = {n: file_record(str(old / n)) for n in ("__0_0.distcp", ".metadata")}
    (old / "zerostack-files-0.json").write_text(json.dumps(legacy))
    torch.manual_seed(1)
    target, *_ = booster.boost(TinyGPT(CONFIG))
    with pytest.raises(CheckpointCorruptError, match=rf"checkpoint record .*{RECORD} is missing"):
        booster.load_model(target, old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        booster.load_model(target, old, verify=False)
        same(model.unwrap().state_dict(), target.unwrap().state_dict())
        legacy["__0_0.distcp"]["size_bytes"] += 1
        (old / "zerostack-files-0.json").write_text(json.dumps(legacy))
        with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp is truncated"):
            booster.load_model(target, old, verify=False)
