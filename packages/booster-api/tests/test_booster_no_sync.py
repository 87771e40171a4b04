"""booster.no_sync: gradient accumulation with every plugin (gloo, 2 ranks),
against DDP accumulating the same micro-batches, and the effect (nothing
reduced inside the context)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.gemini import TrainingState
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
STEPS, MICRO = 3, 3
TOL = dict(rtol=1e-5, atol=5e-6)


def _plugin(name, world):
    if name == "ddp":
        return TorchDDPPlugin()
    if name == "gemini":
        return GeminiPlugin(
            precision="fp32", enable_gradient_accumulation=True,
            chunk_config_dict={world: {"chunk_size": 6_000}},
        )  # fmt: skip
    return LowLevelZeroPlugin(stage=int(name[-1]), precision="fp32", reduce_bucket_size_in_m=0.01)


def _differs_across_ranks(t):
    both = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(both, t.contiguous())
    return not torch.equal(both[0], both[1])


def _accumulate(rank, world, name):
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    booster = Booster(plugin=_plugin(name, world))
    assert booster.plugin.support_no_sync()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    for step in range(STEPS):
        for m in range(MICRO):
            idx, tgt = make_batch(CONFIG, 2, 16, seed=100 * step + 10 * m + rank)
            last = m == MICRO - 1
            with contextlib.nullcontext() if last else ref.no_sync():
                (ref(idx, tgt) / MICRO).backward()
            with contextlib.nullcontext() if last else booster.no_sync(model, opt):
                booster.backward(model(idx, tgt) / MICRO, opt)
                if not last:  # the effect: nothing was reduced
                    if name == "ddp":
                        assert _differs_across_ranks(model.unwrap().lm_head.weight.grad)
                    elif name == "gemini":
                        assert model.module.training_state is TrainingState.ACCUMULATED
                    else:
                        assert all(s.grad is None for s in opt.optim.shards), name
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.step() is not False
        opt.zero_grad()
        full = model.full_state_dict(only_rank_0=False)
        for pname, value in ref.module.state_dict().items():
            torch.testing.assert_close(
                full[pname], value, **TOL,
                msg=lambda msg, p=pname, s=step: f"{name} step {s} {p}: {msg}",
            )  # fmt: skip


def _all(rank, world):
    torch.set_num_threads(1)
    for name in ("ddp", "zero1", "zero2", "gemini"):
        _accumulate(rank, world, name)


def test_no_sync_accumulates_like_ddp_with_every_plugin():
    spawn(_all, 2, backend="gloo", timeout_s=180)
