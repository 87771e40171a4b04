"""ZeroOptimizer allocates its bucket buffers once (see [Note: persistent
bucket buffers]): after the first step no reduce-scatter input, reduced
piece or all-gather buffer is allocated again, and they stay where they are.
At one rank the gradients go straight into the reduced pieces, and each
parameter is written from its master."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

HAVE_FUSED_ADAM = importlib.util.find_spec("zerostack.fused_adam") is not None
CONFIG = GPTConfig(num_layers=2, dim=32, num_heads=2, bias=False)


def _where(zero):
    """Every persistent buffer's address, and the allocation counters."""
    buffers = zero.buffers
    rings = {key: ring.data_ptrs() for key, ring in buffers.rings.items()}
    own = {(i, kind): b.data_ptr() for i, bufs in buffers.own.items() for kind, b in bufs.items()}
    counts = (buffers.allocations, {k: r.allocations for k, r in buffers.rings.items()})
    return rings, own, counts


def _steps(rank, world, kw):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), module=model, reduce_bucket_size=3_000,
        **kw,
    )  # fmt: skip
    assert len(zero.buckets) >= 3
    seen = []
    for step in range(4):
        idx, tgt = make_batch(CONFIG, 2, 16, seed=100 * step + rank)
        zero.backward(model(idx, tgt))
        if kw.get("stage") == 2 and not kw.get("cpu_offload"):
            # The reduced pieces are views of the buckets' own buffers.
            zero.reduction.finish()
            seen.append([s.grad.data_ptr() for s in zero.shards])
            zero.zero_grad()
            zero.backward(model(idx, tgt))
        assert zero.step()
        zero.wait_updates()
        if step == 0:
            first = _where(zero)
        else:
            assert _where(zero) == first, f"{kw}: a bucket buffer was allocated at step {step}"
    rings, _own, (per_bucket, ring_allocations) = first
    assert all(n == 2 for n in ring_allocations.values()), ring_allocations
    # One rank with its masters on the device uses no ring: no collective,
    # and each parameter is written from its master.
    assert bool(rings) == (world > 1 or bool(kw.get("cpu_offload")))
    if kw.get("stage") == 1:  # stage 1 keeps each bucket's all-reduced buffer
        assert per_bucket == len(zero.buckets)
    else:  # stage 2 keeps each bucket's reduced piece; the full inputs share two
        assert per_bucket == len(zero.buckets)
        # One rank packs its gradients into the reduced pieces: no full inputs.
        assert (("send", torch.float32) in zero.buffers.rings) == (world > 1)
    if seen:
        assert all(p == seen[0] for p in seen), "the reduced pieces moved"


CASES = [dict(stage=2), dict(stage=1), dict(stage=2, overlap_communication=False)]
if HAVE_FUSED_ADAM:
    CASES.append(dict(stage=2, cpu_offload=True))


def _all(rank, world):
    for kw in CASES:
        _steps(rank, world, kw)


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_bucket_buffer_is_allocated_after_the_first_step(world_size):
    spawn(_all, world_size, backend="gloo", timeout_s=300)
