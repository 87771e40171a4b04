"""``GeminiOptimizer.clip_grad_by_norm`` against DDP + torch's
``clip_grad_norm_`` step by step (gloo, 2 ranks; SGD, which moves with the
gradient's scale) in every placement, its composition with ``max_norm``;
torch's own clip on GeminiDDP's parameters raising; the step's norm in fp32
for bf16 chunks. See zerostack.shard's [Note: gradient clipping] and
[Note: sharded param.grad]."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.chunk import all_gather_into
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.gemini._optimizer import _grad_share, _grad_target
from zerostack.shard import ShardedGradient
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
CHUNKS = {"chunk_size": 6_000, "keep_gathered": False}
TOL32 = dict(rtol=1e-5, atol=5e-6)
NORM_RTOL = 1e-5  # fp32 rounding; bf16's spacing is 3.9e-3
CASES = [
    # (name, GeminiDDP arguments, explicit max_norm, norm_type, GeminiOptimizer max_norm)
    ("device", {}, 0.3, 2.0, 0.0),
    ("kept-gathered-inf", dict(shard_param_frac=0.0), 0.03, math.inf, 0.0),
    ("cpu-step-and-max-norm", dict(offload_optim_frac=1.0), 0.3, 2.0, 0.2),
    ("params-on-cpu-l1", dict(offload_optim_frac=1.0, offload_param_frac=1.0), 40.0, 1.0, 0.0),
]


def _clip_parity(rank, world):
    torch.set_num_threads(1)
    for name, kwargs, max_norm, p, plugin_max in CASES:
        torch.manual_seed(0)
        ref_model = TinyGPT(CONFIG)
        model = copy.deepcopy(ref_model)
        ref = DDP(ref_model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
        ddp = GeminiDDP(
            model, mixed_precision=torch.float32, chunk_config_dict={world: CHUNKS},
            compute_device="cpu", **kwargs,
        )  # fmt: skip
        inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
        opt = GeminiOptimizer(inner, ddp, max_norm=plugin_max)
        for step in range(3):
            where = f"{name} step {step}"
            idx, tgt = make_batch(CONFIG, 4, 16, seed=100 * step + rank)
            ref(idx, tgt).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, p)
            assert ref_norm > max_norm, f"{where}: nothing to clip"
            if plugin_max:
                assert torch.nn.utils.clip_grad_norm_(ref.parameters(), plugin_max) > plugin_max
            ref_opt.step()
            ref_opt.zero_grad()
            opt.backward(ddp(idx, tgt))
            if step == 0:
                assert all(isinstance(q.grad, ShardedGradient) for q in model.parameters())
                with pytest.raises(RuntimeError, match=r"booster\.clip_grad_norm_.*max_norm"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            norm = opt.clip_grad_by_norm(max_norm, p)
            torch.testing.assert_close(norm, ref_norm, rtol=NORM_RTOL, atol=0, msg=where)
            assert opt.step(), where
            assert all(q.grad is None for q in model.parameters())  # the step clears the guards
            full = ddp.state_dict()
            for n, b in ref.module.named_parameters():
                torch.testing.assert_close(
                    full[n], b.detach(), **TOL32, msg=lambda m, n=n, w=where: f"{w} {n}: {m}"
                )
        opt.close()


def test_clip_grad_by_norm_matches_ddp_and_torch_clip():
    spawn(_clip_parity, 2, backend="gloo", timeout_s=300)


def _whole(share: torch.Tensor, chunk) -> torch.Tensor:
    share = share.detach().float()
    out = torch.empty(chunk.world_size * share.numel())
    all_gather_into(out, share, chunk.process_group)
    return out


def _bf16_norms(rank, world):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = GeminiDDP(
        TinyGPT(CONFIG), mixed_precision=torch.bfloat16, chunk_config_dict={world: CHUNKS},
        compute_device="cpu", offload_optim_frac=0.5,
    )  # fmt: skip
    # Synchronous CPU step: an update on the worker would write over the
    # gradient this test reads (the step's own norm takes it before).
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp, overlap_cpu_step=False)
    with _norm_reads() as read:
        for step in range(3):
            idx, tgt = make_batch(CONFIG, 4, 16, seed=100 * step + rank)
            opt.backward(ddp(idx, tgt).float())
            # The chunks' reduced bf16 gradients, whole, in fp32: a DDP reference's.
            grads = [_whole(_grad_share(chunk), chunk) for chunk, _ in opt.pairs]
            expected = torch.nn.utils.get_total_norm(grads, 2.0).item()
            read.clear()
            assert opt.step()
            assert opt.last_grad_norm == pytest.approx(expected, rel=NORM_RTOL), step
            assert float(torch.tensor(opt.last_grad_norm).bfloat16()) != opt.last_grad_norm
            # Every share's norm came from its reduction: the step read none (here
            # every share is in host memory). See zero-chunk's [Note: the reduced
            # share's norm]. The updates wrote over the shares: no norm is left.
            assert read == [0], (step, read)
            assert all(_grad_target(c).reduced_norm() is None for c, _ in opt.pairs), step
    opt.close()


@contextlib.contextmanager
def _norm_reads():
    """How many gradient shares each of the optimizer's norms reads itself."""
    import zerostack.gemini._optimizer as optimizer_module

    counts: list[int] = []
    inner = optimizer_module.norm_part

    def counted(tensors, norm_type, device):
        counts.append(len(tensors))
        return inner(tensors, norm_type, device)

    optimizer_module.norm_part = counted
    try:
        yield counts
    finally:
        optimizer_module.norm_part = inner


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_step_norm_of_bf16_chunks_is_accumulated_in_fp32(world_size):
    spawn(_bf16_norms, world_size, backend="gloo", timeout_s=300)
