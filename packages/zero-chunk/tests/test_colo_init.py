"""ColoInitContext: ColossalAI's legacy eager construction, parameters on its
device in its dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerostack.chunk import ColoInitContext


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.register_buffer("pos", torch.arange(6, device="cpu"))
        self.steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)


def test_parameters_are_cast_after_an_fp32_init():
    torch.manual_seed(0)
    with ColoInitContext(device="cpu", dtype=torch.bfloat16) as ctx:
        model = Model()
    assert ctx.device == torch.device("cpu")
    torch.manual_seed(0)
    ref = Model()
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        want = torch.bfloat16 if b.is_floating_point() else b.dtype  # integers are kept
        assert a.dtype == want and torch.equal(a, b.to(want)), n
    assert model.pos.dtype == torch.int64 and torch.equal(model.pos, ref.pos)
    assert model.lin.weight.requires_grad and not model.steps.requires_grad


def test_the_default_is_eager_fp32_on_the_cpu():
    torch.manual_seed(0)
    with ColoInitContext():
        model = Model()
    torch.manual_seed(0)
    ref = Model()
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert a.device.type == "cpu" and a.dtype == b.dtype and torch.equal(a, b), n
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_built_on_the_gpu():
    torch.manual_seed(0)
    with ColoInitContext(device=torch.device("cuda")):
        model = Model()
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = Model()
    # pos is made with device="cpu": moved at the end of the block
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert a.device.type == "cuda" and torch.equal(a, b.cuda()), n
