"""``load_model(strict=False)`` returns what it skipped, as torch's
``load_state_dict`` does (``missing_keys``, ``unexpected_keys``), logs it
once, loads every shared name and leaves the model's other names as they
were; ``strict=True`` refuses the same mismatch. Every plugin, every model
layout: per-rank parallel directory, one file, Hugging Face export."""

from __future__ import annotations

import logging

import pytest
import torch
from test_checkpoint_helpers import same

from zerostack.booster import (
    AutoOffloadPlugin,
    Booster,
    GeminiPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
)
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, spawn

PLUGINS = {
    "ddp": lambda: TorchDDPPlugin(),
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "gemini": lambda: GeminiPlugin(precision="fp32", chunk_config_dict={1: {"chunk_size": 2_000}}),
    "auto-offload": lambda: AutoOffloadPlugin(
        memory_budget=1.0, precision="bf16", device="cpu", profile=_profile(),
        example_inputs={"idx": torch.zeros(2, 8, dtype=torch.long)},
    ),
}  # fmt: skip
LAYOUTS = {  # save_model's arguments
    "parallel": dict(shard=True),
    "file": dict(shard=False),
    "hf": dict(shard=True, use_safetensors=True),
}


def _profile():
    from test_plugins_auto_offload import PROFILE

    from zerostack.auto_offload import HardwareProfile

    return HardwareProfile.from_dict(PROFILE)


def _boosted(plugin: str, layers: int, seed: int):
    config = GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=layers)
    torch.manual_seed(seed)
    model = TinyGPT(config)
    booster = Booster(plugin=PLUGINS[plugin]())
    model, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-3))
    return booster, model


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _cases(rank, world, root, plugin):
    del rank, world
    torch.set_num_threads(1)
    count = _Count()
    logging.getLogger("zerostack.booster._checkpoint").addHandler(count)
    for layout, kwargs in LAYOUTS.items():
        big_booster, big = _boosted(plugin, 2, seed=0)
        small_booster, small = _boosted(plugin, 1, seed=1)
        big_booster.save_model(big, f"{root}/{layout}-big", **kwargs)
        small_booster.save_model(small, f"{root}/{layout}-small", **kwargs)
        big_state, small_state = big.full_state_dict(), small.full_state_dict()
        extra = sorted(set(big_state) - set(small_state))
        assert extra and all(n.startswith("blocks.1.") for n in extra), extra
        where = f"{plugin} {layout}"

        for target_booster, target, path, own, missing, unexpected in (
            (small_booster, small, f"{root}/{layout}-big", small_state, [], extra),
            (big_booster, big, f"{root}/{layout}-small", big_state, extra, []),
        ):
            with pytest.raises(
                ValueError, match=r"does not match the model .* or pass strict=False"
            ):
                target_booster.load_model(target, path)
            same(own, target.full_state_dict(), f"{where}: a refused strict load changed it")
            count.messages.clear()
            result = target_booster.load_model(target, path, strict=False)
            assert (result.missing_keys, result.unexpected_keys) == (missing, unexpected), where
            [message] = count.messages  # logged once
            assert f"{len(missing)} names the checkpoint lacks" in message, message
            assert f"{len(unexpected)} names the model lacks were skipped" in message, message
            source = big_state if target is small else small_state
            got = target.full_state_dict()
            for name, value in got.items():
                want = own[name] if name in missing else source[name]
                assert torch.equal(value, want), f"{where}: {name}"
        # A matching load reports nothing and logs nothing.
        count.messages.clear()
        result = small_booster.load_model(small, f"{root}/{layout}-small", strict=False)
        assert (result.missing_keys, result.unexpected_keys) == ([], []) and not count.messages
        assert small_booster.load_model(small, f"{root}/{layout}-small").missing_keys == []


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_strict_false_returns_and_logs_what_it_skipped(tmp_path, plugin):
    spawn(_cases, 1, args=(str(tmp_path), plugin), timeout_s=300)


@pytest.mark.parametrize("plugin", ["none", "zero2", "gemini"])
def test_a_per_rank_checkpoint_of_other_shapes_is_refused_before_anything_loads(tmp_path, plugin):
    """A weight saved as (32, 16) into a model whose weight is (16, 32):
    the per-rank layout's pieces are flat, so the same number of elements
    once loaded as the values in another order, silently. The saved shapes
    are compared first, as the one-file layout and torch do; nothing of the
    model, optimizer or scheduler changes. And a state saved without a
    dataloader position refuses a dataloader before anything loads too."""

    def boosted(shape):
        torch.manual_seed(0)
        model = torch.nn.Linear(*shape, bias=False)
        booster = Booster(device="cpu") if plugin == "none" else Booster(plugin=PLUGINS[plugin]())
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
        return booster, model, opt, sched

    booster, model, opt, sched = boosted((16, 32))
    booster.backward(model(torch.randn(4, 16)).sum(), opt)
    opt.step()
    booster.save_state(str(tmp_path / "state"), model, opt, sched)
    booster, model, opt, sched = boosted((32, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"holds tensors of other shapes than this model's \(got "
                       r"\[\('weight', \(32, 16\), \(16, 32\)\)\]"):  # fmt: skip
        booster.load_state(str(tmp_path / "state"), model, opt, sched)
    if plugin == "none":
        return
    booster, model, opt, sched = boosted((16, 32))
    loader = booster.plugin.prepare_dataloader(torch.utils.data.TensorDataset(torch.zeros(8)), 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="holds no dataloader position"):
        booster.load_state(str(tmp_path / "state"), model, opt, sched, dataloader=loader)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert sched.last_epoch == 0
