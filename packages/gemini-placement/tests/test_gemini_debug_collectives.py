"""The collective debug mode ([Note: collective debug mode] in zero-chunk's
_comm.py): ranks that disagree on the next collective raise, on every rank,
an error naming what each rank was about to do, instead of hanging (gloo,
2 ranks)."""

from __future__ import annotations

import re

import pytest
import torch

from zerostack.chunk import CollectiveMismatchError, all_reduce_sum, set_collective_label
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
# Small chunks: each block's parameters in chunks of their own.
CHUNKS = {2: {"chunk_size": 4_000, "keep_gathered": False}}


def _trainer(debug):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS, compute_device="cpu",
        debug_collectives=debug,
    )  # fmt: skip
    return model, ddp, GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3), ddp)


def _skipped_block(rank, world):
    model, ddp, opt = _trainer(debug=True)
    assert len(model.blocks) == 2  # rank 1 goes on with the final norm
    if rank == 1:  # a data-dependent branch: this rank skips block 1
        model.blocks[1].forward = lambda x: x
    idx, tgt = make_batch(CONFIG, 2, 16, seed=rank)
    with pytest.raises(CollectiveMismatchError) as caught:
        opt.backward(ddp(idx, tgt))
    message = str(caught.value)
    assert "ranks disagree on the next collective" in message, message
    assert re.search(r"rank 0: all_gather .*forward of module blocks\.1\.", message)
    assert re.search(r"rank 1: all_gather .*forward of module ln_f\)", message)


def test_a_block_skipped_on_one_rank_raises_on_every_rank_naming_the_modules():
    spawn(_skipped_block, 2, timeout_s=120)


def _same_run(rank, world):
    losses = {}
    for debug in (False, True):
        _, ddp, opt = _trainer(debug)
        losses[debug] = []
        for step in range(2):
            idx, tgt = make_batch(CONFIG, 2, 16, seed=10 * step + rank)
            loss = ddp(idx, tgt)
            opt.backward(loss)
            opt.step()
            losses[debug].append(loss.item())
    assert losses[True] == losses[False]  # the checks change nothing
    # Ranks that disagree only in their labels, or in size, are told apart.
    set_collective_label(f"label of rank {rank}")
    with pytest.raises(
        CollectiveMismatchError,
        match=r"rank 0: all_reduce\(sum\) of 3 x torch.float32 \(label of rank 0\); "
        r"rank 1: all_reduce\(sum\) of 3 x torch.float32 \(label of rank 1\)",
    ):
        all_reduce_sum(torch.ones(3))
    set_collective_label("same label")
    with pytest.raises(CollectiveMismatchError, match=r"rank 1: all_reduce\(sum\) of 4 x"):
        all_reduce_sum(torch.ones(3 + rank))


def test_agreeing_ranks_train_as_without_the_checks_and_labels_and_sizes_are_compared():
    spawn(_same_run, 2, timeout_s=120)


def _from_the_environment(rank, world):
    from zerostack.chunk import debug_collectives

    assert debug_collectives()
    set_collective_label(f"rank {rank}")
    with pytest.raises(CollectiveMismatchError):
        all_reduce_sum(torch.ones(1))


def test_the_environment_variable_switches_it_on(monkeypatch):
    monkeypatch.setenv("ZEROSTACK_DEBUG_COLLECTIVES", "1")
    spawn(_from_the_environment, 2, timeout_s=120)


def test_a_bad_setting_is_refused():
    from zerostack.chunk import debug_collectives

    with pytest.raises(TypeError, match=r"enabled must be a bool or None \(got 'yes'\)"):
        debug_collectives("yes")
    assert debug_collectives() is False


class _Experts(torch.nn.Module):
    """Two experts of one size, each its own chunk; ``route`` picks one."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(5, 5) for _ in range(2))
        self.route = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[self.route](x).pow(2).mean()


def _routed_by_rank(rank, world):
    torch.manual_seed(0)
    model = _Experts()
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, compute_device="cpu",
        chunk_config_dict={2: {"chunk_size": 30, "keep_gathered": False}},
    )  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(list(model.parameters()), lr=1.0), ddp)
    before = ddp.state_dict()
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))
    model.route = rank  # each gather pairs with the other expert's on the other rank
    opt.backward(ddp(x))
    with pytest.raises(CollectiveMismatchError, match=r"the ranks gathered different chunks since the last step: different modules ran on different ranks .*this step's gradients are dropped"):  # fmt: skip
        opt.step()
    after = ddp.state_dict()  # nothing was stepped
    assert all(torch.equal(before[k], after[k]) for k in before)
    model.route = 0  # the same modules on every rank: trains as torch would
    opt.backward(ddp(x))
    assert opt.step()
    assert not torch.equal(ddp.state_dict()["experts.0.weight"], before["experts.0.weight"])


def test_ranks_that_gathered_different_chunks_of_one_size_raise_at_the_step():
    """Different modules on different ranks with chunks of one size: no hang,
    each rank computes with the other's chunk. Without the debug mode the
    step's check of the ranks' gather traces raises on every rank (before, the
    step trained on the wrong gradients: an expert's weight 0.22 off torch
    DDP's after one SGD step)."""
    spawn(_routed_by_rank, 2, backend="gloo")
