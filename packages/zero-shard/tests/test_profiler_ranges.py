"""ZeroOptimizer names its phases for the profiler (zerostack::reduce, step,
cpu_update, gather), so a trace shows where a step's time goes."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch

HAVE_FUSED_ADAM = importlib.util.find_spec("zerostack.fused_adam") is not None
CONFIG = GPTConfig(num_layers=1, dim=32, num_heads=2, bias=False)


def _ranges(**kw) -> tuple[Counter, ZeroOptimizer]:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), reduce_bucket_size=4096, **kw
    )
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        zero.backward(model(idx, tgt))
        assert zero.step()
    counts = Counter(e.name for e in prof.events() if e.name.startswith("zerostack::"))
    return counts, zero


@pytest.mark.parametrize("overlap", [True, False])
def test_phases_are_named(overlap):
    counts, zero = _ranges(overlap_communication=overlap)
    # One range per bucket launched (during backward with overlap, at step
    # without), and one around the step's wait and gradient statistics.
    assert counts["zerostack::reduce"] == len(zero.buckets) + 1 > 2
    assert counts["zerostack::step"] == 1
    # One write-back (all-gather into the parameters) per bucket.
    assert counts["zerostack::gather"] == len(zero.buckets)
    assert "zerostack::cpu_update" not in counts


@pytest.mark.skipif(not HAVE_FUSED_ADAM, reason="cpu_offload with AdamW needs zerostack-fused-adam")
def test_offloaded_update_is_named_cpu_update():
    # One update per CPU Adam call (here one: the model's pieces are far
    # below cpu_update_numel, see [Note: CPU Adam calls span buckets]) and
    # one write-back per bucket (see [Note: offloaded step pipeline]). On the
    # worker thread (overlap_cpu_step) the updates are outside this thread's
    # profiler; they are counted instead.
    for overlap in (True, False):
        counts, zero = _ranges(cpu_offload=True, overlap_cpu_step=overlap)
        assert len(zero.buckets) > 1
        assert sum(b.piece_total for b in zero.buckets) < zero.cpu_update_numel
        on_worker = zero._pipe.worker_updates
        assert counts["zerostack::cpu_update"] == (0 if overlap else 1)
        assert on_worker == (1 if overlap else 0)
        assert "zerostack::step" not in counts
        assert counts["zerostack::gather"] == len(zero.buckets)
