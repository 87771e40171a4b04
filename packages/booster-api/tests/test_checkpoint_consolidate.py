"""``python -m zerostack.booster.consolidate``: any model checkpoint
CheckpointIO saves becomes a Hugging Face safetensors directory, on a CPU
without torch.distributed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_helpers import PlainModel, mlp, same

from zerostack.booster._checkpoint import CheckpointIO
from zerostack.booster._checkpoint_files import CheckpointCorruptError
from zerostack.booster.consolidate import consolidate, main

MB = 1024 * 1024


def _read_hf(directory):
    """The tensors of an HF safetensors directory, checking its index."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    assert set(index["weight_map"].values()) == set(shards)
    state = {}
    for name in shards:
        part = load_file(str(directory / name))
        assert all(index["weight_map"][k] == name for k in part)
        state.update(part)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    return state, shards


@pytest.mark.parametrize(
    "layout",
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["file-torch", "file-safetensors", "shard-torch", "shard-safetensors"],
)
def test_consolidate_every_layout(tmp_path, layout):
    shard, use_safetensors = layout
    model = mlp(0)
    CheckpointIO().save_model(
        PlainModel(model),
        tmp_path / "ckpt",
        shard=shard,
        use_safetensors=use_safetensors,
        size_per_shard=2,
    )
    written = consolidate(tmp_path / "ckpt", tmp_path / "hf", size_per_shard=1)
    state, shards = _read_hf(tmp_path / "hf")
    same(model.state_dict(), state)
    assert sorted(written) == sorted(os.listdir(tmp_path / "hf"))
    # 1 MB weights alone, biases beside the next weight would pass 1 MB: 6 files.
    assert shards == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    assert all(os.path.getsize(tmp_path / "hf" / n) <= MB + 4096 for n in shards)
    # What consolidate wrote loads back through CheckpointIO too.
    target = PlainModel(mlp(1))
    CheckpointIO().load_model(target, tmp_path / "hf")
    same(model.state_dict(), target.module.state_dict())


def test_consolidate_to_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    CheckpointIO().save_model(PlainModel(model), tmp_path / "ckpt", shard=True)  # torch shards
    consolidate(tmp_path / "ckpt", tmp_path / "hf")
    assert {"config.json", "generation_config.json"} <= set(os.listdir(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").read_bytes() == (
        tmp_path / "ckpt" / "config.json"
    ).read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    same(model.state_dict(), loaded.state_dict())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_consolidate_command_line(tmp_path):
    """The module runs as a script in a fresh interpreter (no process group)."""
    model = mlp(0, depth=2)
    CheckpointIO().save_model(PlainModel(model), tmp_path / "m.pt")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerostack.booster.consolidate",
            str(tmp_path / "m.pt"),
            str(tmp_path / "hf"),
            "--size-per-shard",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote 6 files" in result.stderr  # 4 shards, the index, the record
    state, shards = _read_hf(tmp_path / "hf")
    assert len(shards) == 4
    same(model.state_dict(), state)


def test_consolidate_errors(tmp_path, caplog):
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "no checkpoint at" in caplog.text and "missing" in caplog.text
    CheckpointIO().save_model(
        PlainModel(mlp(0, depth=1)), tmp_path / "c", shard=True, size_per_shard=1
    )
    with pytest.raises(ValueError, match=r"consolidate: out is the checkpoint itself"):
        consolidate(tmp_path / "c", tmp_path / "c")
    with pytest.raises(ValueError, match=r"size_per_shard must be a positive int"):
        consolidate(tmp_path / "c", tmp_path / "o", size_per_shard=0)
    shard = tmp_path / "c" / "pytorch_model-00001-of-00002.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(
        CheckpointCorruptError, match=r"pytorch_model-00001-of-00002.bin is truncated"
    ):
        consolidate(tmp_path / "c", tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
