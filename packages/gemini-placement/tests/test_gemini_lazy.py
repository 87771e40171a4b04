"""A model built under LazyInitContext goes straight into Gemini's chunks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerostack.chunk import LazyInitContext
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import spawn

CHUNKS = {"chunk_size": 5000, "keep_gathered": False}


class _Scaled(nn.Module):
    """Values computed in __init__ and no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(64) * 0.1 + 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def _model():
    return nn.Sequential(
        nn.Embedding(50, 32), nn.LayerNorm(32), nn.Linear(32, 64), _Scaled(), nn.GELU(),
        nn.Linear(64, 50),
    )  # fmt: skip


def _lazy_equals_eager(rank, world):
    torch.manual_seed(0)
    eager = _model()
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = _model()
    assert all(p.is_meta for p in lazy.parameters())
    ddp = GeminiDDP(
        lazy, mixed_precision=torch.float32, chunk_config_dict={world: CHUNKS}, compute_device="cpu"
    )
    full = ddp.state_dict()
    for name, p in eager.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    # And it trains like the eager model wrapped the same way.
    ref = GeminiDDP(
        eager,
        mixed_precision=torch.float32,
        chunk_config_dict={world: CHUNKS},
        compute_device="cpu",
    )
    x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(rank))
    for model in (ddp, ref):
        opt = GeminiOptimizer(HybridAdam(list(model.module.parameters()), lr=1e-2), model)
        for _ in range(2):
            opt.backward(model(x).float().pow(2).mean())
            opt.step()
    a, b = ddp.state_dict(), ref.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world_size", [1, 2])
def test_lazy_model_goes_into_chunks_with_eager_values(world_size):
    spawn(_lazy_equals_eager, world_size, backend="gloo")
