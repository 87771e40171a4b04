"""Parameters the user writes between steps (GeminiDDP's [Note: parameters
written between steps]): the next step starts from them, as with torch's
optimizers, or the write raises where it did nothing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import spawn


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _halve(module: nn.Module) -> None:
    with torch.no_grad():
        module[0].weight.mul_(0.5)


def _load_new(module: nn.Module) -> None:
    state = {k: v.clone() for k, v in module.state_dict().items()}
    state["2.weight"] = torch.full_like(state["2.weight"], 0.05)
    module.load_state_dict(state)


WRITES = {"mul_": _halve, "load_state_dict": _load_new}


def _train_and_write(rank, world, write, offload):
    net = _net()
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    config = {world: {"chunk_size": 256, "keep_gathered": True}}
    # offload_optim_frac: the masters' updates run on the CPU-step worker after step()
    ddp = GeminiDDP(net, chunk_config_dict=config, compute_device="cpu",
                    mixed_precision=torch.float32, offload_optim_frac=offload)  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), ddp)
    for step in range(3):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(ddp(x.chunk(world)[rank]).square().mean())
        opt.step()
        if step == 0:
            ddp.wait_updates()  # offloaded updates: the parameters hold the step's values
            WRITES[write](ref)
            WRITES[write](net)
    got = ddp.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(
            got[name], value, rtol=1e-6, atol=1e-6, msg=f"{write}, offload {offload}: {name}"
        )


def _every_write(rank, world):
    # The step on the device and on the CPU worker, in one spawn (a spawn costs seconds).
    for offload in (0.0, 1.0):
        for write in WRITES:
            _train_and_write(rank, world, write, offload)


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_written_between_steps_is_where_the_next_step_starts(world):
    """The step updated the fp32 master and wrote the old value plus the
    update back: 0.53 off torch after one SGD step, silently."""
    spawn(_every_write, world)


def _write_released(rank, world):
    net = _net()
    ddp = GeminiDDP(net, chunk_config_dict={world: {"chunk_size": 256, "keep_gathered": False}},
                    compute_device="cpu", mixed_precision=torch.float32)  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    opt.backward(ddp(torch.ones(2, 8)).square().mean())
    opt.step()
    assert net[0].weight.numel() == 0  # released: p.mul_ does nothing
    _halve(net)
    with pytest.raises(RuntimeError, match=r"\['0.weight'\] was written between steps while its"):
        ddp(torch.ones(2, 8))
    ddp(torch.ones(2, 8))  # said once; training goes on
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2])
def test_a_write_to_a_released_parameter_raises_once(world):
    spawn(_write_released, world)


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_write_before_the_offloaded_update_is_written_back_raises(accumulate):
    """One rank, kept-gathered chunks, the update on the CPU-step worker.
    Right after step() the parameters have no elements until the write-back
    (with enable_gradient_accumulation: they hold the values of before the
    step). A write then did nothing (or was made to the old values), and the
    next forward's write-back put the step's values in its place: the write
    was lost, silently (0.50 off torch after one more SGD step). The next
    forward raises once, naming optimizer.wait_updates()."""
    torch.manual_seed(0)
    net = _net()
    ddp = GeminiDDP(net, chunk_config_dict={1: {"chunk_size": 256, "keep_gathered": True}},
                    compute_device="cpu", mixed_precision=torch.float32,
                    offload_optim_frac=1.0, enable_gradient_accumulation=accumulate)  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    opt.backward(ddp(torch.ones(2, 8)).square().mean())
    opt.step()
    assert net[0].weight.numel() == (8 * 16 if accumulate else 0)  # not written back yet
    _halve(net)
    said = r"written after optimizer\.step\(\) while its offloaded update was still running"
    with pytest.raises(RuntimeError, match=(
        rf"\['0.weight'\] was ({said if accumulate else 'written between steps while its'})"
    )):  # fmt: skip
        ddp(torch.ones(2, 8))
    ddp(torch.ones(2, 8))  # said once; training goes on


class _RenormedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8, max_norm=0.5)  # renorms its rows in place in forward
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.emb(x))


def test_a_write_inside_forward_is_not_taken_for_a_users_write():
    """An embedding's max_norm writes its weight in forward: that moved the
    version counter, and the next forward raised as for a user's write to a
    released parameter."""
    torch.manual_seed(0)
    ddp = GeminiDDP(_RenormedEmbedding(), chunk_config_dict={1: {"chunk_size": 256,
                    "keep_gathered": False}}, compute_device="cpu",
                    mixed_precision=torch.float32)  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    for _ in range(3):
        opt.backward(ddp(torch.arange(4).view(2, 2)).square().mean())
        assert opt.step()


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("offload", [0.0, 1.0])
def test_bf16_training_without_a_users_write_adopts_nothing(monkeypatch, gathered, offload):
    """A parameter adopted by ``adopt_writes`` has its bf16 slot copied into
    its fp32 master, which rounds the master: a counter moved by anything
    but a user's write (the package's own writes, the forward, clipping,
    ``state_dict()``, an evaluation under ``no_grad``) would do that
    silently, every step. Tied embeddings, clipping, offloaded updates."""
    from zerostack.gemini import _ddp
    from zerostack.testing import GPTConfig, TinyGPT, make_batch

    adopted = []
    write_slot = _ddp._write_slot
    monkeypatch.setattr(
        _ddp, "_write_slot", lambda m, o, v: (adopted.append(o), write_slot(m, o, v))[1]
    )
    config = GPTConfig(tie_embeddings=True)
    torch.manual_seed(0)
    net = TinyGPT(config)
    ddp = GeminiDDP(net, chunk_config_dict={1: {"chunk_size": 20_000, "keep_gathered": gathered}},
                    compute_device="cpu", mixed_precision=torch.bfloat16,
                    offload_optim_frac=offload)  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), ddp,
                          max_norm=0.5)  # fmt: skip
    for step in range(3):
        x, y = make_batch(config, 2, 16, seed=step)
        opt.backward(ddp(x, y))
        opt.step()
        opt.zero_grad()
        ddp.state_dict()
        with torch.no_grad():
            ddp(x, y)
    assert adopted == []
    if gathered:  # the spy sees a user's write
        ddp.wait_updates()
        with torch.no_grad():
            net.lm_head.weight.mul_(0.5)
        ddp(x, y)
        assert len(adopted) == 1
