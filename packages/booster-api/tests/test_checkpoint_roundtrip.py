"""CheckpointIO round trips on one process: model, optimizer and lr scheduler,
single files and sharded directories, torch and safetensors; the layout on
disk; shard-by-shard loading; tied weights; strictness; argument errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_checkpoint_helpers import PlainModel, PlainOptimizer, mlp, same, train
from torch import nn

from zerostack.booster._checkpoint import CheckpointIO
from zerostack.testing import GPTConfig, TinyGPT

MB = 1024 * 1024
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


def _ids(layout):
    shard, st = layout
    return f"{'shard' if shard else 'file'}-{'safetensors' if st else 'torch'}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_model_round_trip(tmp_path, layout):
    shard, use_safetensors = layout
    source = mlp(0)
    path = tmp_path / "model"
    CheckpointIO().save_model(
        PlainModel(source), path, shard=shard, use_safetensors=use_safetensors, size_per_shard=1
    )
    target = PlainModel(mlp(1))
    CheckpointIO().load_model(target, path)
    same(source.state_dict(), target.module.state_dict())
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "temporary left behind"
    if not shard:
        assert path.is_file()
        assert target.loads == [(sorted(source.state_dict()), True)]
        return
    # Hugging Face layout: shards of at most 1 MB (a 1 MB weight fills one alone).
    ext, index_name, stem = (
        ("safetensors", "model.safetensors.index.json", "model")
        if use_safetensors
        else ("bin", "pytorch_model.bin.index.json", "pytorch_model")
    )
    index = json.loads((path / index_name).read_text())
    shards = sorted(n for n in os.listdir(path) if n.endswith(ext))
    assert shards == [f"{stem}-{i:05d}-of-00006.{ext}" for i in range(1, 7)]
    assert set(index["weight_map"]) == set(source.state_dict())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 4 for t in source.state_dict().values()
    )
    for name in shards:
        assert os.path.getsize(path / name) <= MB + 4096  # 1 MB of tensors plus the header
        record = index["metadata"]["zerostack"]["files"][name]
        assert record["size_bytes"] == os.path.getsize(path / name)
    # Loaded one shard at a time, each non-strict after the names were checked.
    assert [names for names, _ in target.loads] == [
        sorted(n for n, f in index["weight_map"].items() if f == s) for s in shards
    ]
    assert not any(strict for _, strict in target.loads)


def test_model_saves_replace_previous(tmp_path):
    """A second save to the same path replaces the first whole (file and directory)."""
    io = CheckpointIO()
    for shard in (False, True):
        path = tmp_path / f"m{shard}"
        io.save_model(PlainModel(mlp(0, depth=3)), path, shard=shard, size_per_shard=1)
        second = mlp(1, depth=1)
        io.save_model(PlainModel(second), path, shard=shard, size_per_shard=1)
        target = PlainModel(mlp(2, depth=1))
        io.load_model(target, path)
        same(second.state_dict(), target.module.state_dict())
        if shard:  # the old shards are gone
            assert len([n for n in os.listdir(path) if n.endswith(".bin")]) == 2
    assert sorted(os.listdir(tmp_path)) == ["mFalse", "mTrue"]


@pytest.mark.parametrize("share_memory", [False, True], ids=["copies", "shared"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_tied_weights_written_once(tmp_path, layout, share_memory):
    shard, use_safetensors = layout
    config = GPTConfig(tie_embeddings=True)
    torch.manual_seed(0)
    source = TinyGPT(config)
    assert source.lm_head.weight is source.tok_emb.weight
    path = tmp_path / "gpt"
    CheckpointIO().save_model(
        PlainModel(source, share_memory=share_memory),
        path,
        shard=shard,
        use_safetensors=use_safetensors,
    )
    if shard:
        index = next(p for p in path.iterdir() if p.name.endswith("index.json"))
        names = set(json.loads(index.read_text())["weight_map"])
    elif use_safetensors:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
    else:
        names = set(torch.load(path, weights_only=True))
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    torch.manual_seed(1)
    target = TinyGPT(config)
    CheckpointIO().load_model(PlainModel(target), path)  # strict: the tie fills lm_head
    same(source.state_dict(), target.state_dict())
    assert target.lm_head.weight is target.tok_emb.weight


def test_strict_names(tmp_path):
    io = CheckpointIO()
    path = tmp_path / "ckpt"
    io.save_model(PlainModel(mlp(0, depth=2)), path, shard=True, size_per_shard=1)
    bigger = PlainModel(mlp(1, depth=3))
    before = {k: v.clone() for k, v in bigger.module.state_dict().items()}
    with pytest.raises(ValueError, match=r"load_model: .*missing names \['2.bias', '2.weight'\]"):
        io.load_model(bigger, path)
    assert bigger.loads == []  # checked against the index before any shard was read
    io.load_model(bigger, path, strict=False)
    same(
        mlp(0, depth=2).state_dict(),
        {k: v for k, v in bigger.module.state_dict().items() if k[0] != "2"},
    )
    assert torch.equal(bigger.module[2].weight, before["2.weight"])
    smaller = PlainModel(mlp(1, depth=1))
    with pytest.raises(ValueError, match=r"unexpected names \['1.bias', '1.weight'\]"):
        io.load_model(smaller, path)
    io.load_model(smaller, path, strict=False)
    same(mlp(0, depth=1).state_dict(), smaller.module.state_dict())


@pytest.mark.parametrize("shard", [False, True], ids=["file", "shard"])
def test_optimizer_round_trip(tmp_path, shard):
    model = mlp(0)
    opt = PlainOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9)), model)
    train(model, opt, 2)
    path = tmp_path / "optim"
    CheckpointIO().save_optimizer(opt, path, shard=shard, size_per_shard=1)
    saved = opt.full_state_dict()

    model2 = mlp(1)
    opt2 = PlainOptimizer(torch.optim.AdamW(model2.parameters(), lr=0.5), model2)
    opt2.loss_scaler = None
    CheckpointIO().load_optimizer(opt2, path)
    same(saved, opt2.full_state_dict())
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9)
    if shard:
        index = json.loads((path / "pytorch_optim.bin.index.json").read_text())
        shards = sorted(n for n in os.listdir(path) if n.startswith("pytorch_optim-"))
        # Each parameter's state whole in one file, in parameter order: a
        # weight's exp_avg + exp_avg_sq (2 MB) over the 1 MB limit fills a file
        # alone, so weights and biases alternate.
        assert len(shards) == 6 and set(index["weight_map"].values()) == set(shards)
        assert [index["weight_map"][n] for n in saved["state"]] == shards
        assert set(index["weight_map"]) == set(saved["state"])
        assert index["metadata"]["param_groups"] == "pytorch_optim_group.bin"
    # Training continues identically from the loaded state.
    model.load_state_dict(model2.state_dict())
    train(model, opt, 2)
    train(model2, opt2, 2)
    same(model.state_dict(), model2.state_dict())


def test_optimizer_before_first_step(tmp_path):
    """No per-parameter state yet: the directory holds the groups file, the index and the record."""
    model = mlp(0, depth=1)
    opt = PlainOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    CheckpointIO().save_optimizer(opt, tmp_path / "o", shard=True)
    assert sorted(os.listdir(tmp_path / "o")) == [
        "pytorch_optim.bin.index.json",
        "pytorch_optim_group.bin",
        "zerostack-checkpoint.json",
    ]
    opt2 = PlainOptimizer(torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.1), model)
    CheckpointIO().load_optimizer(opt2, tmp_path / "o")
    same(opt.full_state_dict(), opt2.full_state_dict())


def test_lr_scheduler_round_trip(tmp_path):
    model = mlp(0, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=20)
    for _ in range(7):
        opt.step()
        sched.step()
    CheckpointIO().save_lr_scheduler(sched, tmp_path / "sched.pt")
    opt2 = torch.optim.SGD(model.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=1.0, total_steps=20)
    CheckpointIO().load_lr_scheduler(sched2, tmp_path / "sched.pt")
    assert sched2.last_epoch == 7
    for _ in range(5):
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()


def test_prefix_names_files(tmp_path):
    io = CheckpointIO()
    model = mlp(0, depth=1)
    io.save_model(PlainModel(model), tmp_path / "m", shard=True, prefix="ema", use_safetensors=True)
    assert sorted(os.listdir(tmp_path / "m")) == [
        "model.ema-00001-of-00001.safetensors",
        "model.safetensors.index.ema.json",
        "zerostack-checkpoint.json",
    ]
    target = PlainModel(mlp(1, depth=1))
    io.load_model(target, tmp_path / "m")
    same(model.state_dict(), target.module.state_dict())
    opt = PlainOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    io.save_optimizer(opt, tmp_path / "o", shard=True, prefix="ema")
    assert "pytorch_optim.bin.index.ema.json" in os.listdir(tmp_path / "o")
    io.load_optimizer(opt, tmp_path / "o", prefix="ema")
    with pytest.raises(ValueError, match=r"holds no optimizer index"):
        io.load_optimizer(opt, tmp_path / "o", prefix="other")


def test_argument_errors(tmp_path):
    io = CheckpointIO()
    model = PlainModel(mlp(0, depth=1))
    with pytest.raises(ValueError, match=r"size_per_shard must be a positive int .*got 0"):
        io.save_model(model, tmp_path / "m", shard=True, size_per_shard=0)
    # A wrapper without a per-rank state: parallel=True is refused, shard=True gathers.
    with pytest.raises(NotImplementedError, match=r"PlainModel.sharded_state_dict: no per-rank"):
        io.save_model(model, tmp_path / "m", parallel=True)
    with pytest.raises(TypeError, match=r"model must be a ModelWrapper \(got Sequential\)"):
        io.save_model(model.module, tmp_path / "m")
    with pytest.raises(TypeError, match=r"checkpoint must be a path \(got None\)"):
        io.save_model(model, None)
    with pytest.raises(ValueError, match=r"prefix must be None or a file-name part"):
        io.save_model(model, tmp_path / "m", prefix="a/b")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"shard=True writes a directory but .*file is a file"):
        io.save_model(model, tmp_path / "file", shard=True)
    assert (tmp_path / "file").read_bytes() == b"x"
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match=r"shard=False writes one file but .*dir is a directory"):
        io.save_model(model, tmp_path / "dir")
    with pytest.raises(FileNotFoundError, match=r"load_model: no checkpoint at .*nothing"):
        io.load_model(model, tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"load_model: .*dir holds no model checkpoint"):
        io.load_model(model, tmp_path / "dir")
    with pytest.raises(TypeError, match=r"verify must be a bool"):
        CheckpointIO(verify="yes")
    io.save_model(model, tmp_path / "m.pt")
    with pytest.raises(ValueError, match=r"load_optimizer: .*does not hold an optimizer state"):
        io.load_optimizer(
            PlainOptimizer(torch.optim.SGD(model.parameters(), lr=1), model.module),
            tmp_path / "m.pt",
        )


def test_gather_dtensor_false_warns_once(tmp_path, caplog):
    from zerostack.booster import _checkpoint

    _checkpoint._warned.discard("gather_dtensor")
    io = CheckpointIO()
    model = PlainModel(mlp(0, depth=1))
    for _ in range(2):
        io.save_model(model, tmp_path / "m.pt", gather_dtensor=False)
    warnings = [r for r in caplog.records if "gather_dtensor=False has no effect" in r.message]
    assert len(warnings) == 1


def test_loads_hugging_face_style_single_file_directory(tmp_path):
    """A directory holding one model.safetensors and no index (small HF saves)."""
    from safetensors.torch import save_file

    model = nn.Linear(4, 3)
    (tmp_path / "hf").mkdir()
    save_file(model.state_dict(), str(tmp_path / "hf" / "model.safetensors"), {"format": "pt"})
    target = PlainModel(nn.Linear(4, 3))
    CheckpointIO().load_model(target, tmp_path / "hf")
    same(model.state_dict(), target.module.state_dict())


class _HeadFirst(nn.Module):
    """A tie whose target (the head) comes first in state_dict order, declared
    the way transformers 5 declares ties."""

    all_tied_weights_keys = {"head.weight": "emb.weight"}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 10, bias=False)
        self.emb = nn.Embedding(10, 4)
        self.head.weight = self.emb.weight


def test_declared_tie_target_is_the_name_left_out(tmp_path):
    torch.manual_seed(0)
    model = _HeadFirst()
    assert list(model.state_dict()) == ["head.weight", "emb.weight"]
    CheckpointIO().save_model(PlainModel(model), tmp_path / "m.pt")
    assert list(torch.load(tmp_path / "m.pt", weights_only=True)) == ["emb.weight"]
    target = _HeadFirst()
    CheckpointIO().load_model(PlainModel(target), tmp_path / "m.pt")
    same(model.state_dict(), target.state_dict())
