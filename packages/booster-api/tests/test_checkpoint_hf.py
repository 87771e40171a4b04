"""A sharded save of a transformers model is a Hugging Face directory:
``AutoModelForCausalLM.from_pretrained`` loads it with equal weights and the
LM head tied, and ``load_model`` reads ``save_pretrained``'s own output."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_checkpoint_helpers import PlainModel, same

from zerostack.booster._checkpoint import CheckpointIO

transformers = pytest.importorskip("transformers")


def _gpt2(seed: int):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


def _assert_same_model(a, b):
    same(a.state_dict(), b.state_dict())
    idx = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(a(idx).logits, b(idx).logits, rtol=0, atol=0)


@pytest.mark.parametrize("use_safetensors", [True, False], ids=["safetensors", "torch"])
def test_from_pretrained_loads_sharded_save(tmp_path, use_safetensors):
    model = _gpt2(0)
    path = tmp_path / "gpt2"
    # 1 MB shards of a 0.13 MB model: one shard; the split is covered elsewhere,
    # and HF reads any number of shards through the index.
    CheckpointIO().save_model(PlainModel(model), path, shard=True, use_safetensors=use_safetensors)
    names = sorted(os.listdir(path))
    index_name = (
        "model.safetensors.index.json" if use_safetensors else "pytorch_model.bin.index.json"
    )
    assert index_name in names and "config.json" in names and "generation_config.json" in names
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_embd"] == 32
    weight_map = json.loads((path / index_name).read_text())["weight_map"]
    assert "transformer.wte.weight" in weight_map and "lm_head.weight" not in weight_map

    loaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    _assert_same_model(model, loaded)


def test_from_pretrained_loads_many_shards(tmp_path):
    """A wider GPT-2 (about 3.5 MB) in 1 MB shards: several files through the index."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=256, n_head=2, vocab_size=128, n_positions=64
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path / "gpt2"
    CheckpointIO().save_model(
        PlainModel(model), path, shard=True, use_safetensors=True, size_per_shard=1
    )
    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(shards) >= 3
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    _assert_same_model(model, loaded)


def test_load_model_reads_save_pretrained(tmp_path):
    """A directory save_pretrained wrote (tied head omitted, several shards)."""
    model = _gpt2(0)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert len([n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]) > 1
    target = _gpt2(1)
    wrapper = PlainModel(target)
    CheckpointIO().load_model(wrapper, tmp_path / "hf")  # strict
    _assert_same_model(model, target)
    assert len(wrapper.loads) > 1  # one call per shard


def test_round_trip_through_checkpoint_io(tmp_path):
    model = _gpt2(0)
    CheckpointIO().save_model(PlainModel(model), tmp_path / "c", shard=True, use_safetensors=True)
    target = _gpt2(1)
    CheckpointIO().load_model(PlainModel(target), tmp_path / "c")
    _assert_same_model(model, target)
    assert target.lm_head.weight is target.transformer.wte.weight
