"""Adam states on disk under the wrappers: GeminiOptimizer with every
master chunk on the CPU and ZeroOptimizer(cpu_offload=True), each stepping
HybridAdam(nvme_offload_fraction=...), against DDP + AdamW step by step, with
the bytes on disk checked while training (the no-op this replaced matched the
reference too). gloo, 1 and 2 ranks."""

from __future__ import annotations

import copy
import errno
import os
import re
import time
from concurrent.futures import Future

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

pytest.importorskip("zerostack.nvme")
CONFIG = GPTConfig(bias=False)
STEPS = 5
# (id, wrapper, nvme_offload_fraction)
CASES = [(w, f) for w in ("gemini", "zero") for f in (0.0, 0.5, 1.0)]


def _wrapped(kind, fraction, directory, world, model, backend=None):
    adam = dict(
        lr=1e-3, weight_decay=0.1, nvme_offload_fraction=fraction, nvme_offload_dir=directory,
        nvme_backend=backend,
    )  # fmt: skip
    if kind == "gemini":
        ddp = GeminiDDP(
            model, mixed_precision=torch.float32, compute_device="cpu", offload_optim_frac=1.0,
            chunk_config_dict={world: {"chunk_size": 20_000}},
        )  # fmt: skip
        opt = GeminiOptimizer(HybridAdam(list(model.parameters()), **adam), ddp)
        return ddp, opt, opt.optimizer
    opt = ZeroOptimizer(HybridAdam(list(model.parameters()), **adam), cpu_offload=True)
    return model, opt, opt.optimizer  # ZeroOptimizer reduces the gradients itself


def _masters_numel(kind, opt):
    masters = opt.masters if kind == "gemini" else [s.master for s in opt.shards]
    return sum(m.numel() for m in masters)


def _params(kind, model):
    return model.state_dict() if kind == "gemini" else dict(model.named_parameters())


def _case(rank, world, kind, fraction, directory):
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    wrapped, opt, adam = _wrapped(kind, fraction, directory, world, model)
    for step in range(STEPS):
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = wrapped(idx, tgt)
        opt.backward(loss)
        opt.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        if kind == "gemini":
            wrapped.wait_updates()
        # The effect: the share of this rank's CPU-held states on disk, and
        # those states not in RAM.
        on_disk = adam.nvme_bytes_on_disk()
        numel = _masters_numel(kind, opt)
        if fraction == 0.0:
            assert on_disk == 0
        else:
            assert 8 * fraction * numel * 0.5 <= on_disk <= 8 * fraction * numel, (kind, on_disk)
            in_ram = [p for p in adam._nvme.keys if "exp_avg" in adam.state.get(p, {})]
            assert not in_ram
            assert os.path.getsize(adam._nvme.swapper.path) >= on_disk
    got = _params(kind, wrapped)
    for name, p in ref.module.named_parameters():
        torch.testing.assert_close(got[name].detach(), p.detach(), rtol=1e-5, atol=5e-6)


def _all(rank, world, directory):
    for kind, fraction in CASES:
        _case(rank, world, kind, fraction, os.path.join(directory, f"{kind}-{fraction}-{rank}"))


@pytest.mark.parametrize("world_size", [1, 2])
def test_states_on_disk_under_the_wrappers_match_ddp(world_size, tmp_path):
    spawn(_all, world_size, args=(str(tmp_path),), backend="gloo", timeout_s=300)


def _gemini(fraction, directory, world=1, backend=None):
    torch.manual_seed(0)
    return _wrapped("gemini", fraction, directory, world, TinyGPT(CONFIG), backend)


def _train(wrapped, opt, steps, rank=0, start=0):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        loss = wrapped(idx, tgt)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def _checkpoint(rank, world, directory):
    # Straight: 6 steps; saved after 3 and resumed onto disk at the same world size.
    straight, s_opt, _ = _gemini(1.0, f"{directory}/straight{rank}", world)
    expected = _train(straight, s_opt, 6, rank)
    first, f_opt, _ = _gemini(1.0, f"{directory}/first{rank}", world)
    got = _train(first, f_opt, 3, rank)
    model_sd, opt_sd, full = first.state_dict(), f_opt.state_dict(), f_opt.full_state_dict()
    assert opt_sd["optimizer"]["state"][0]["exp_avg"].numel() > 0  # read back from disk
    resumed, r_opt, adam = _gemini(1.0, f"{directory}/resumed{rank}", world)
    resumed.load_state_dict(model_sd)
    r_opt.load_state_dict(opt_sd)
    assert adam.nvme_bytes_on_disk() > 0  # loaded straight onto disk
    got += _train(resumed, r_opt, 3, rank, start=3)
    assert got == expected
    if rank == 0:
        torch.save(full, f"{directory}/full.pt")


def _load_at_one_rank(rank, world, directory):
    full = torch.load(f"{directory}/full.pt")
    _, opt, adam = _gemini(1.0, f"{directory}/one", world)
    opt.load_full_state_dict(full)
    again = opt.full_state_dict()
    for name, entry in full["params"].items():
        for k, v in entry.items():
            if torch.is_tensor(v):
                assert torch.equal(again["params"][name][k], v), (name, k)
    assert adam.nvme_bytes_on_disk() == 8 * _masters_numel("gemini", opt)


def test_checkpoints_with_states_on_disk_resume_and_move_world_size(tmp_path):
    spawn(_checkpoint, 2, args=(str(tmp_path),), backend="gloo", timeout_s=300)
    spawn(_load_at_one_rank, 1, args=(str(tmp_path),), backend="gloo", timeout_s=300)


def test_a_full_disk_fails_when_the_wrapper_binds_the_masters(tmp_path, monkeypatch):
    from zerostack.nvme import NVMeSpaceError, _swapper

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_swapper.os, "posix_fallocate", full)
    for kind in ("gemini", "zero"):
        torch.manual_seed(0)
        with pytest.raises(NVMeSpaceError, match=r"not enough space in .* for optimizer states"):
            _wrapped(kind, 1.0, str(tmp_path / kind), 1, TinyGPT(CONFIG))


def test_a_failed_write_keeps_the_state_and_training_goes_on(tmp_path, monkeypatch, caplog):
    ref, ref_opt, _ = _gemini(1.0, str(tmp_path / "ref"))
    expected = _train(ref, ref_opt, 4)
    ddp, opt, adam = _gemini(1.0, str(tmp_path / "x"), backend="threads")
    got = _train(ddp, opt, 1)
    io = adam._nvme.swapper._io
    real_write, failures = io.write, []

    def flaky(key, tensor):
        if not failures:  # the first write of step 2 fails, as a real I/O error would
            failures.append(key)
            failed = Future()
            failed.set_exception(OSError(errno.EIO, "Input/output error"))
            return failed
        return real_write(key, tensor)

    monkeypatch.setattr(io, "write", flaky)
    got += _train(ddp, opt, 3, start=1)
    assert failures and "state write(s)" in caplog.text
    assert got == expected  # the failed write's state stayed in RAM, nothing lost


class _WithSideHead(torch.nn.Module):
    """TinyGPT plus a head that only some steps use: its parameter then has no
    gradient, and its Adam moments (on disk) must stay as they were."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT(CONFIG)
        self.side = torch.nn.Linear(16, 16, bias=False)

    def forward(self, idx, tgt, use_side):
        loss = self.gpt(idx, tgt)
        if use_side:
            loss = loss + 1e-2 * self.side(torch.ones(16)).pow(2).sum()
        return loss


def _unused(rank, world, directory):
    torch.manual_seed(0)
    ref_model = _WithSideHead()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, compute_device="cpu", offload_optim_frac=1.0,
        chunk_config_dict={world: {"chunk_size": 20_000}},
    )  # fmt: skip
    adam = HybridAdam(
        list(model.parameters()), lr=1e-3, weight_decay=0.1, nvme_offload_fraction=1.0,
        nvme_offload_dir=directory,
    )  # fmt: skip
    opt = GeminiOptimizer(adam, ddp)
    for step in range(4):
        use_side = step == 0  # moments built at step 0, then left alone
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        ref_loss = ref(idx, tgt, use_side)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(ddp(idx, tgt, use_side))
        opt.step()
        ddp.wait_updates()
    assert adam.nvme_bytes_on_disk() == 8 * _masters_numel("gemini", opt)
    got = ddp.state_dict()
    for name, p in ref.module.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=5e-6, msg=name)
    # The side head's moments on disk are those of step 0, AdamW's, up to the
    # kernel's other rounding order (a few ulp); three more decays would be
    # off by 0.999**3 (v) and 0.9**3 (m).
    ref_state = ref_opt.state[ref.module.side.weight]
    got_state = opt.full_state_dict()["params"]["side.weight"]
    rtol = 4 * torch.finfo(torch.float32).eps
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            got_state[key].view_as(ref_state[key]), ref_state[key], rtol=rtol, atol=0
        )


def test_a_parameter_without_gradient_keeps_its_moments_on_disk(tmp_path):
    spawn(_unused, 1, args=(str(tmp_path),), backend="gloo", timeout_s=300)


def _expected_on_disk(kind, opt, fraction):
    """Bytes the fraction puts on disk: whole host-held masters in order while
    their elements stay within the share (8 bytes of Adam moments each)."""
    masters = opt.masters if kind == "gemini" else [s.master for s in opt.shards]
    target, taken = fraction * sum(m.numel() for m in masters), 0
    for m in masters:
        if taken + m.numel() <= target:
            taken += m.numel()
    return 8 * taken


@pytest.mark.parametrize("kind", ["gemini", "zero"])
def test_bytes_on_disk_read_right_after_step_are_exact(kind, tmp_path, monkeypatch):
    # The CPU updates run on the wrapper's worker after step() returns: the
    # figure waits for them (and their writes), every step, the first included.
    # Each CPU kernel call takes 5 ms more, as on a larger model, so the
    # worker is still busy when step() returns.
    from zerostack.fused_adam import _kernels

    real = _kernels.launch

    def slow(params, *args, **kwargs):
        if params[0].device.type == "cpu":
            time.sleep(0.005)
        return real(params, *args, **kwargs)

    monkeypatch.setattr(_kernels, "launch", slow)
    torch.manual_seed(0)
    if kind == "gemini":
        wrapped, opt, adam = _wrapped(kind, 0.5, str(tmp_path), 1, TinyGPT(CONFIG), "threads")
    else:  # with the module, step() returns once the updates are queued
        wrapped = TinyGPT(CONFIG)
        adam = HybridAdam(
            list(wrapped.parameters()), lr=1e-3, nvme_offload_fraction=0.5,
            nvme_offload_dir=str(tmp_path), nvme_backend="threads",
        )  # fmt: skip
        opt = ZeroOptimizer(adam, cpu_offload=True, module=wrapped)
    assert opt.pipeline.overlapping if kind == "gemini" else opt._pipe.overlapping
    expected = _expected_on_disk(kind, opt, 0.5)
    assert expected > 0
    seen = []
    for step in range(20):
        idx, tgt = make_batch(CONFIG, 4, 32, seed=step)
        opt.backward(wrapped(idx, tgt))
        opt.step()
        seen.append(adam.nvme_bytes_on_disk())
    assert seen == [expected] * 20
    if kind == "gemini":
        from zerostack.gemini import tier_bytes

        opt.backward(wrapped(*make_batch(CONFIG, 4, 32, seed=99)))
        opt.step()
        assert tier_bytes(wrapped, opt)["disk"] == expected


# See [Note: NVMe on the host tier]: only the states the placement holds on
# the host go to disk, on a CPU compute device as on a GPU, and a fraction
# that puts nothing there says so once, naming what to set.
# (id, wrapper, its placement arguments, nvme_offload_fraction, warning or None)
HOST_CASES = [
    ("gemini-static-0", "gemini", dict(offload_optim_frac=0.0), 1.0,
     r"no optimizer state it keeps is held in host memory .* offloads no optimizer chunk "
     r"\(got offload_optim_frac=0.0\); set placement_policy='static' with offload_optim_frac=1.0"),
    ("gemini-static-half", "gemini", dict(offload_optim_frac=0.5), 1.0, None),
    ("gemini-static-all", "gemini", dict(offload_optim_frac=1.0), 0.5, None),
    ("gemini-auto-all-on-device", "gemini", dict(placement_policy="auto", gpu_capacity_bytes=1 << 40),
     1.0, r"placement_policy='auto' planned every optimizer chunk on the compute device; set "
     r"placement_policy='static' with offload_optim_frac=1.0"),
    ("gemini-share-below-one-chunk", "gemini", dict(offload_optim_frac=1.0), 0.01,
     r"nvme_offload_fraction=0.01 puts no Adam state on disk: .* raise nvme_offload_fraction to "
     r"at least 0.\d+"),
    ("zero-no-cpu-offload", "zero", dict(cpu_offload=False), 1.0,
     r"keeps the fp32 masters and their states on the compute device \(got cpu_offload=False\); "
     r"set cpu_offload=True"),
    ("zero-cpu-offload", "zero", dict(cpu_offload=True), 0.5, None),
]  # fmt: skip


@pytest.mark.parametrize("case", HOST_CASES, ids=[c[0] for c in HOST_CASES])
def test_only_host_held_states_go_to_disk(case, tmp_path, monkeypatch, recwarn):
    from zerostack.fused_adam import _nvme

    monkeypatch.setattr(_nvme, "_warned", set())  # once per process: fresh for each case
    _, kind, placement, fraction, warning = case
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    adam = HybridAdam(
        list(model.parameters()), lr=1e-3, nvme_offload_fraction=fraction,
        nvme_offload_dir=str(tmp_path),
    )  # fmt: skip
    if kind == "gemini":
        wrapped = GeminiDDP(
            model, mixed_precision=torch.float32, compute_device="cpu",
            chunk_config_dict={1: {"chunk_size": 20_000}}, **placement,
        )  # fmt: skip
        opt = GeminiOptimizer(adam, wrapped)
    else:
        wrapped, opt = model, ZeroOptimizer(adam, **placement)
    for step in range(3):
        opt.backward(wrapped(*make_batch(CONFIG, 4, 32, seed=step)))
        opt.step()
    if kind == "gemini":
        host = [opt.masters[i] for i in opt._host]
        masters = opt.masters
    else:
        masters = [s.master for s in opt.shards]
        host = masters if opt.cpu_offload else []
    target, expected = fraction * sum(m.numel() for m in host), 0
    for m in host:  # whole host-held masters, in order, within the share
        if expected + m.numel() <= target:
            expected += m.numel()
    assert adam.nvme_bytes_on_disk() == 8 * expected
    assert {id(p) for p in adam._nvme.keys} <= {id(m) for m in host}
    ours = [w for w in recwarn.list if "nvme_offload_fraction" in str(w.message)]
    if warning is None:
        assert expected > 0 and ours == []
        if placement.get("offload_optim_frac") == 0.5:  # a share of the masters, not all
            assert 0 < len(host) < len(masters)
    else:
        assert expected == 0
        assert len(ours) == 1, [str(w.message) for w in ours]  # once, not every step
        assert re.search(warning, str(ours[0].message)), str(ours[0].message)
