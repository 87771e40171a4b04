"""Hyperparameters set on the optimizer the user built reach every step of
GeminiOptimizer: an lr scheduler built on it (never handed to the wrapper)
and edits of its ``param_groups`` in the middle of a run, in every placement
(nothing offloaded, optimizer states on the CPU with the update started in
backward or by the step, Adam states on disk, auto), at world sizes 1 and 2,
against DDP + torch optimizers with the same scheduler, step by step (see
zerostack.shard's [Note: the user's hyperparameters])."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}
STEPS = 7
EDIT = 3  # weight_decay is changed on the user's optimizer before this step
ZERO = 5  # from this step on the schedule's lr is 0
TOL32 = dict(rtol=1e-5, atol=5e-6)  # as the parity tests'


def _factor(step: int) -> float:
    """Warm-up over three steps, then 0 from step ZERO."""
    return 0.0 if step >= ZERO else min(1.0, (step + 1) / 3)


# (id, optimizer, max_norm, overlap_cpu_step, GeminiDDP arguments); "nvme"
# puts half of HybridAdam's states on disk.
CASES = [
    ("no-offload-adamw", "adamw", 0.0, True, {}),
    ("cpu-states-adam-l2-worker", "adam", 0.0, True, dict(offload_optim_frac=1.0)),
    ("cpu-states-sgd-clip", "sgd", 0.05, True, dict(offload_optim_frac=1.0)),
    ("cpu-states-inline", "adamw", 0.0, False, dict(offload_optim_frac=0.5)),
    ("nvme-adamw", "nvme", 0.0, True, dict(offload_optim_frac=1.0)),
    ("auto-adam-l2", "adam", 0.0, True, dict(placement_policy="auto", steady_cuda_cap_ratio=1.0)),
]

# The NVMe case needs zerostack-nvme (fused-adam's [nvme] extra), which this
# package does not depend on: it runs where it is installed (nox -s
# reliability, the integration session), as test_gemini_host_bytes's does.
if importlib.util.find_spec("zerostack.nvme") is None:
    CASES = [case for case in CASES if case[1] != "nvme"]


def _optimizers(kind, ref_params, params, nvme_dir):
    if kind == "sgd":
        return (
            torch.optim.SGD(ref_params, lr=0.5, momentum=0.9, weight_decay=0.1, foreach=False),
            torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1, foreach=False),
        )
    adamw = kind != "adam"
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    nvme = dict(nvme_offload_fraction=0.5, nvme_offload_dir=nvme_dir) if kind == "nvme" else {}
    return (
        ref_cls(ref_params, lr=1e-3, weight_decay=0.1, foreach=False),
        HybridAdam(params, lr=1e-3, weight_decay=0.1, adamw_mode=adamw, **nvme),
    )


def _capacity(model, world):
    """Every fp32 param shard, three gathered chunks and half the optimizer chunks."""
    n = sum(p.numel() for p in model.parameters())
    return 4 * n // world + 3 * 4 * CHUNKS["chunk_size"] + 12 * n // world // 2


def _run_case(rank, world, case, nvme_dir):
    name, kind, max_norm, overlap, kwargs = case
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    if kwargs.get("placement_policy") == "auto":
        kwargs = dict(kwargs, gpu_capacity_bytes=_capacity(model, world))
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict={world: CHUNKS},
        compute_device="cpu", **kwargs,
    )  # fmt: skip
    ref_opt, user = _optimizers(kind, list(ref.parameters()), list(model.parameters()), nvme_dir)
    opt = GeminiOptimizer(user, ddp, max_norm=max_norm, overlap_cpu_step=overlap)
    # Built on the user's optimizers, never handed to GeminiOptimizer.
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _factor)
    sched = torch.optim.lr_scheduler.LambdaLR(user, _factor)
    before = ddp.state_dict()
    for step in range(STEPS):
        if step == EDIT:  # on the user's objects, mid-run
            for o in (ref_opt, user):
                o.param_groups[0]["weight_decay"] = 0.3
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_sched.step()
        loss = ddp(idx, tgt)
        opt.backward(loss)
        assert opt.step()
        sched.step()
        torch.testing.assert_close(
            loss, ref_loss, **TOL32, msg=lambda m, s=step: f"{name} step {s} loss: {m}"
        )
        after = ddp.state_dict()
        for pname, b in ref.module.named_parameters():
            torch.testing.assert_close(
                after[pname], b.detach(), **TOL32,
                msg=lambda m, p=pname, s=step: f"{name} step {s} {p}: {m}",
            )  # fmt: skip
        # The effect, not only parity: warm-up moves the parameters, lr 0 stops them.
        moved = max((after[k] - before[k]).abs().max().item() for k in after)
        if step >= ZERO:
            assert moved == 0.0, f"{name} step {step}: lr is 0, the parameters moved {moved}"
        else:
            assert moved > 0.0, f"{name} step {step}: the parameters did not move"
        before = after
    assert user.param_groups[0]["lr"] == 0.0 and opt.param_groups is user.param_groups
    if kind == "nvme":
        assert opt.optimizer.nvme_bytes_on_disk() > 0, f"{name}: no Adam state on disk"
    if ddp.auto is not None:
        assert 0 < len(ddp.offloaded_masters) < len(ddp.grad_chunks), name


def _all(rank, world, nvme_root):
    for case in CASES:
        _run_case(rank, world, case, f"{nvme_root}/{case[0]}-{rank}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_scheduler_and_edits_on_the_users_optimizer_reach_every_step(world_size, tmp_path):
    spawn(_all, world_size, args=(str(tmp_path),), backend="gloo", timeout_s=300)


def test_a_scheduler_on_the_wrapper_and_on_the_users_optimizer_see_the_same_groups():
    """The wrapper's param_groups are the user's: one set of values, whoever
    changes them; loading a state writes the loaded values there too."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict={1: CHUNKS}, compute_device="cpu",
        offload_optim_frac=1.0,
    )  # fmt: skip
    user = HybridAdam(list(model.parameters()), lr=1e-2)
    opt = GeminiOptimizer(user, ddp)
    assert opt.param_groups is user.param_groups
    assert opt.optimizer is not user and type(opt.optimizer) is HybridAdam  # the stepping twin
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    opt.backward(ddp(idx, tgt))
    opt.step()
    full = opt.full_state_dict()
    opt.param_groups[0]["lr"] = 0.5
    assert user.param_groups[0]["lr"] == 0.5
    full["param_group"]["lr"] = 2e-3
    opt.load_full_state_dict(full)
    assert user.param_groups[0]["lr"] == 2e-3
    opt.param_groups[0]["lr"] = 4e-3  # a schedule's value, not yet stepped with
    shard = opt.state_dict()  # torch's way: this rank's state_dict and load_state_dict
    assert shard["optimizer"]["param_groups"][0]["lr"] == 4e-3
    shard["optimizer"]["param_groups"][0].update(lr=3e-3, weight_decay=0.25)
    opt.load_state_dict(shard)
    assert user.param_groups[0]["lr"] == 3e-3 and user.param_groups[0]["weight_decay"] == 0.25
    assert opt.optimizer.param_groups[0]["params"] == opt.masters  # the twin steps the masters
    assert all(
        p.requires_grad for p in user.param_groups[0]["params"]
    )  # the user's are the model's
