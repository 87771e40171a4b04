"""A parameter used on some ranks only (a branch taken by the data, MoE
routing): torch DDP (``find_unused_parameters=True``) hands every rank its
reduced gradient, so every piece of it is stepped; ZeroOptimizer must too.
(Before, the ranks without a local gradient dropped their pieces: half of a
bias stayed at its initial value at 2 ranks, with SGD and AdamW, stages 1
and 2; with cpu_offload and SGD the CPU update raised an AttributeError.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.shard import ZeroOptimizer
from zerostack.testing import spawn


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(6, 5)  # used where ``use_b``
        self.use_a = self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) if self.use_a else x[:, :5] * 1.0
        if self.use_b:
            h = h + self.b(x)
        return h.square().mean()


def _optimizer(kind: str, params):
    if kind == "sgd":  # Adam is nearly blind to a gradient's scale: SGD shows a missing piece
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _pair(kind: str, zero_kwargs: dict):
    """The model and ZeroOptimizer, and torch DDP's copy with its optimizer."""
    torch.manual_seed(0)
    model = _Branchy()
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, find_unused_parameters=True)
    zero = ZeroOptimizer(_optimizer(kind, model.parameters()), module=model, **zero_kwargs)
    return model, zero, ref, _optimizer(kind, ref.parameters())


def _compared_step(
    model, zero, ref, ref_opt, x: torch.Tensor, use_b: bool, step: int, case: str = ""
) -> None:
    """One step of each on ``x``, the branch used where ``use_b``; the
    parameters then equal torch's (fp32: the same sums in a few roundings
    per element and step)."""
    for m in (model, ref.module):
        m.use_b = use_b
    ref(x).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    zero.backward(model(x))
    zero.step()
    zero.zero_grad()
    zero.wait_updates()
    for (name, p), q in zip(model.named_parameters(), ref.module.parameters(), strict=True):
        torch.testing.assert_close(
            p, q, rtol=1e-5, atol=1e-6, msg=f"{case} step {step} {name}".lstrip()
        )


def _case(rank: int, world: int, kind: str, zero_kwargs: dict) -> None:
    model, zero, ref, ref_opt = _pair(kind, zero_kwargs)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        use_b = rank == world - 1 if step != 1 else rank == 0
        _compared_step(model, zero, ref, ref_opt, x, use_b, step, f"{kind} {zero_kwargs}")


# Every optimizer and layout, in one spawn per world size (spawning costs seconds).
CASES = [
    (kind, zero_kwargs)
    for kind in ("sgd", "adamw")
    for zero_kwargs in ({"stage": 1}, {"stage": 2}, {"stage": 2, "cpu_offload": True})
]


def _cases(rank: int, world: int) -> None:
    for kind, zero_kwargs in CASES:
        _case(rank, world, kind, zero_kwargs)


@pytest.mark.parametrize("world", [2, 3])
def test_a_parameter_used_on_some_ranks_is_stepped_whole(world):
    spawn(_cases, world, backend="gloo")


def _after_a_failed_backward(rank: int, world: int) -> None:
    """A backward that raised (its end-of-backward callback never ran),
    dropped with zero_grad(): the steps after it still step every piece."""
    model, zero, ref, ref_opt = _pair("sgd", {"stage": 2})
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    # After ZeroOptimizer's own hook on that parameter (registered first).
    handle = model.a.bias.register_post_accumulate_grad_hook(
        lambda p: (_ for _ in ()).throw(ValueError("a hook failed"))
    )
    with pytest.raises(ValueError, match="a hook failed"):
        zero.backward(model(x))
    handle.remove()
    zero.zero_grad()
    for step in range(2):
        _compared_step(model, zero, ref, ref_opt, x, rank == world - 1, step)


def test_a_failed_backward_dropped_with_zero_grad_leaves_partial_use_stepped_whole():
    spawn(_after_a_failed_backward, 2, backend="gloo")


def _a_rank_reaching_no_parameter(rank: int, world: int) -> None:
    """Against one process stepping the mean of every rank's loss (torch DDP
    aborts when a rank's loss reaches no parameter)."""
    model, zero, ref, _ = _pair("sgd", {"stage": 2})
    plain = copy.deepcopy(ref.module)
    plain_opt = _optimizer("sgd", plain.parameters())
    for step in range(2):

        def batch(r: int, step: int = step) -> torch.Tensor:
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r))
            return x.requires_grad_()  # a loss that reaches no parameter still has a backward

        for r in range(world):
            plain.use_a = plain.use_b = not (step == 0 and r == world - 1)
            (plain(batch(r)) / world).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model.use_a = model.use_b = not (step == 0 and rank == world - 1)
        zero.backward(model(batch(rank)))
        assert zero.step()
        zero.zero_grad()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


def test_a_rank_whose_loss_reaches_no_parameter_steps_with_the_others():
    """Its step() takes part in every collective (for a while it returned
    alone: the others hung in the reduction)."""
    spawn(_a_rank_reaching_no_parameter, 2, backend="gloo", timeout_s=60)
