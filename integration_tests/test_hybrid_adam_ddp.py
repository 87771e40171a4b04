"""HybridAdam under DDP against DDP + torch's optimizers, step by step.

Data-driven: each case names the optimizer mode and the parameter dtype.
Two ranks on gloo, rank-dependent batches, the tiny GPT from zerostack-testing.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CASES = [
    # (id, adamw_mode, weight_decay, div_scale): L2 mode with decay and a
    # div_scale make gradient-scale bugs visible, which plain AdamW hides.
    ("adamw", True, 0.1, -1.0),
    ("adam_l2", False, 0.1, -1.0),
    ("adam_l2_div_scale", False, 0.1, 8.0),
]
STEPS = 10


def _run_cases(rank: int, world_size: int) -> None:
    # No biases: the key bias gets a gradient of pure rounding noise (softmax is
    # blind to it), which Adam blows up to lr-sized steps of random sign.
    config = GPTConfig(add_unused_param=True, bias=False)
    for name, adamw_mode, wd, div_scale in CASES:
        torch.manual_seed(0)
        model = TinyGPT(config)
        ref_model = copy.deepcopy(model)
        ours = DDP(model, find_unused_parameters=True)
        ref = DDP(ref_model, find_unused_parameters=True)
        opt = HybridAdam(ours.parameters(), lr=1e-3, weight_decay=wd, adamw_mode=adamw_mode)
        ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        ref_opt = ref_cls(ref.parameters(), lr=1e-3, weight_decay=wd, foreach=False)
        for step in range(STEPS):
            idx, tgt = make_batch(config, 4, 32, seed=100 * step + rank)
            losses = []
            for m, o in ((ours, opt), (ref, ref_opt)):
                o.zero_grad(set_to_none=True)
                loss = m(idx, tgt)
                loss.backward()
                losses.append(loss.detach())
            if div_scale > 0:
                # Our step divides by div_scale; feed it gradients scaled up by it.
                for p in ours.parameters():
                    if p.grad is not None:
                        p.grad.mul_(div_scale)
                opt.step(div_scale=div_scale)
            else:
                opt.step()
            ref_opt.step()
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            # Adam turns last-bit differences of near-zero gradients into
            # visible ones (its first step is about lr * sign(g)); 5e-6 is 0.5%
            # of one step at lr=1e-3, while a gradient-scale bug moves params
            # by ~lr in L2 mode.
            for (pn, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=1e-5,
                    atol=5e-6,
                    msg=lambda m, pn=pn, s=step, c=name: f"{c} step {s} {pn}: {m}",
                )
        # Both ranks hold the same parameters: DDP averaged the gradients.
        flat = torch.cat([p.detach().flatten() for p in ours.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(gathered[0], g) for g in gathered)


@pytest.mark.parametrize("world_size", [1, 2])
def test_hybrid_adam_matches_torch_under_ddp(world_size):
    spawn(_run_cases, world_size)
