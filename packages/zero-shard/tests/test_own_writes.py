"""The parameters' writes after a step are the optimizer's own and are not
taken for a user's (see [Note: parameters written in place]): a user's write
becomes its master's value at the next step, the optimizer's do not (else
every step would round the fp32 masters to the parameters' bf16). At one
rank with the masters on the device, the write-back copies each master
straight into its parameter; with ``cpu_offload``, through the pinned copy."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch

CONFIG = GPTConfig(num_layers=2, dim=32, num_heads=2, bias=False)
OFFLOAD = [False] + ([True] if importlib.util.find_spec("zerostack.fused_adam") else [])


def _step(model, zero, seed):
    idx, tgt = make_batch(CONFIG, 2, 16, seed=seed)
    zero.backward(model(idx, tgt).float())
    assert zero.step()
    zero.wait_updates()
    zero.zero_grad()


@pytest.mark.parametrize("cpu_offload", OFFLOAD)
def test_one_rank_keeps_its_own_writes_apart_from_the_users(cpu_offload):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = ZeroOptimizer(opt, module=model, cpu_offload=cpu_offload, gpu_update_fraction=0.0)
    _step(model, zero, 0)  # the masters now hold fp32 values their bf16 copies round
    masters = [s.master.clone() for s in zero.shards]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)
    for group in zero.param_groups:
        group["lr"] = 0.0  # AdamW at lr 0 changes nothing: the masters must stay as they are
    with torch.no_grad():
        model.tok_emb.weight.mul_(0.5)  # the user's write
    _step(model, zero, 1)
    for s, before in zip(zero.shards, masters, strict=True):
        n = s.param.numel()
        if s.param is model.tok_emb.weight:  # taken into its master
            torch.testing.assert_close(
                s.master[:n], s.param.detach().float().view(-1), rtol=0, atol=0
            )
        else:  # the optimizer's own write-back is not taken for one
            torch.testing.assert_close(s.master, before, rtol=0, atol=0)
