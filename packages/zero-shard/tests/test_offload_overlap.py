"""cpu_offload's overlapped step (see [Note: offloaded step pipeline]): the
updates run on the worker thread, ``step()`` returns before they are done,
a forward waits only for the buckets holding its parameters; fp16 overflow
on one rank, lr changes and checkpoints stay right meanwhile."""

from __future__ import annotations

import copy
import importlib.util
import threading
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.shard import CpuStepError, ZeroConfig, ZeroOptimizer, as_kwargs
from zerostack.testing import GPTConfig, TinyGPT, inner_steps, make_batch, spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("zerostack.fused_adam") is None,
    reason="cpu_offload with AdamW needs zerostack-fused-adam",
)
CONFIG = GPTConfig(num_layers=2, dim=32, num_heads=2, bias=False)
FP16_TOL = dict(rtol=0, atol=5e-3)


def _zero(model, overlap=True, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return ZeroOptimizer(
        opt, cpu_offload=True, overlap_cpu_step=overlap, module=model,
        reduce_bucket_size=2_000, **kw,
    )  # fmt: skip


def _train(model, zero, step, rank=0):
    device = next(model.parameters()).device
    idx, tgt = make_batch(CONFIG, 2, 16, seed=100 * step + rank, device=device)
    zero.backward(model(idx, tgt).float())
    return zero.step()


class _Gate:
    """Holds the CPU update of one bucket on the worker until opened (its
    CPU Adam call from now on steps that bucket alone: see [Note: CPU Adam
    calls span buckets])."""

    def __init__(self, zero, bucket):
        self.open = threading.Event()
        self.entered = threading.Event()
        update = zero._cpu_update
        zero.cpu_update_numel = 1

        def gated(buckets, *args):
            if any(b is bucket for b in buckets):
                self.entered.set()
                if not self.open.wait(timeout=30):
                    raise TimeoutError("the gate was never opened")
            update(buckets, *args)

        zero._cpu_update = gated


def _step_returns_before_updates(device, fraction=0.0):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).to(device)
    ref_model = copy.deepcopy(model)
    # Clipping: the updates are queued by step(), after the global norm.
    zero = _zero(model, max_norm=1.0, gpu_update_fraction=fraction)
    # The synchronous step: the reference (the same lanes: on CUDA the
    # device's Adam rounds otherwise than CPU Adam).
    ref = _zero(ref_model, overlap=False, max_norm=1.0, gpu_update_fraction=fraction)
    zero.cpu_update_numel = 1  # one bucket per CPU Adam call (the reference's are gathered)
    assert len(zero.buckets) >= 3
    first, last = zero._order[0], zero._order[-1]
    assert any(s.param is model.tok_emb.weight for s in first.shards)
    assert any(s.param is model.lm_head.weight for s in last.shards)
    for step in range(2):
        assert _train(ref_model, ref, step)
    assert _train(model, zero, 0)
    zero.wait_updates()

    gate = _Gate(zero, last)
    old_head = model.lm_head.weight.detach().clone()
    t0 = time.perf_counter()
    assert _train(model, zero, 1)
    assert time.perf_counter() - t0 < 20, "step() waited for the gated update"
    assert gate.entered.wait(timeout=30)
    # The step returned while the last bucket's update is held on the worker.
    assert zero._pipe.pending and zero._pipe.round_open
    assert torch.equal(model.lm_head.weight, old_head)
    # An lr change now is for the next step, not for the updates in flight.
    zero.param_groups[0]["lr"] = 1e-3
    ref.param_groups[0]["lr"] = 1e-3
    # The embedding's forward waits for its own bucket only.
    model.tok_emb(torch.zeros(1, dtype=torch.long, device=device))
    torch.testing.assert_close(model.tok_emb.weight, ref_model.tok_emb.weight, rtol=0, atol=0)
    assert torch.equal(model.lm_head.weight, old_head), (
        "forward waited for a bucket it does not use"
    )
    gate.open.set()
    # A whole forward waits for every bucket it uses.
    idx, _ = make_batch(CONFIG, 2, 16, seed=7, device=device)
    torch.testing.assert_close(model(idx), ref_model(idx), rtol=0, atol=0)
    assert not zero._pipe.pending
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Every update ran on the worker thread (one per bucket with gradients, per step).
    used = sum(1 for b in zero.buckets if any(s.param.requires_grad for s in b.shards))
    assert zero._pipe.worker_updates == 2 * used
    assert ref._pipe.worker_updates == 0
    # The next step uses the new lr on both.
    for step in (2, 3):
        assert _train(model, zero, step) and _train(ref_model, ref, step)
    zero.wait_updates()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert zero.state_dict()["optimizer"]["param_groups"][0]["lr"] == 1e-3


@pytest.mark.parametrize("fraction", [0.0, 0.5], ids=["cpu-adam", "device-lane"])
def test_step_returns_before_updates_and_forward_waits_per_bucket(fraction):
    # With the device lane the held (last) bucket is a CPU-lane one, and the
    # embedding's bucket is the device's.
    _step_returns_before_updates("cpu", fraction)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fraction", [0.0, 0.5], ids=["cpu-adam", "device-lane"])
def test_step_returns_before_updates_on_cuda(fraction):
    # The write-back stream, the copied/written events, pinned host buffers;
    # the device lane's up/down streams, its updated/stored events.
    _step_returns_before_updates("cuda", fraction)


def test_no_update_starts_before_step_without_clipping():
    # Updates once started during backward here (no clipping, no loss
    # scale): a batch dropped after an exception could not be taken back,
    # nor could a clip_grad_by_norm after them clip them.
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ref_model = copy.deepcopy(model)
    zero, ref = _zero(model), _zero(ref_model, overlap=False)
    for step in range(3):
        idx, tgt = make_batch(CONFIG, 2, 16, seed=100 * step)
        zero.wait_updates()
        before = zero._pipe.worker_updates
        zero.backward(model(idx, tgt))
        time.sleep(0.1)  # time for the worker, were anything queued
        assert not zero._pipe.pending and zero._pipe.worker_updates == before, step
        assert zero.step() and _train(ref_model, ref, step)
        assert zero._pipe.pending, "step() queued no update"
        idx2, _ = make_batch(CONFIG, 2, 16, seed=7)
        torch.testing.assert_close(model(idx2), ref_model(idx2), rtol=0, atol=0)


def _calls_of(sizes, numel):
    """Positions in write-back order of each CPU Adam call: a call closes
    once it holds ``numel`` elements."""
    calls, call = [], []
    for k in range(len(sizes)):
        call.append(k)
        if sum(sizes[i] for i in call) >= numel:
            calls.append(call)
            call = []
    return calls + ([call] if call else [])


def _grouped_calls(rank, world):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ref_model = copy.deepcopy(model)
    zero, ref = _zero(model, max_norm=1.0), _zero(ref_model, max_norm=1.0)
    numel = 4000 // world
    zero.cpu_update_numel, ref.cpu_update_numel = numel, 1
    per_step = _calls_of([b.piece_total for b in zero._order], numel)
    assert len(per_step) >= 3 and any(len(c) > 1 for c in per_step), per_step
    calls = []
    update = zero._cpu_update

    def counted(buckets, *args):
        calls.append([zero._order.index(b) for b in buckets])
        update(buckets, *args)

    zero._cpu_update = counted
    for step in range(3):
        assert _train(model, zero, step, rank) and _train(ref_model, ref, step, rank)
    zero.wait_updates()
    ref.wait_updates()
    assert calls == per_step * 3
    assert zero._pipe.worker_updates == 3 * len(per_step)
    assert ref._pipe.worker_updates == 3 * len(zero.buckets)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(zero.state_dict()["masters"], ref.state_dict()["masters"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [1, 2])
def test_cpu_adam_calls_gather_buckets_up_to_cpu_update_numel(world_size):
    """See [Note: CPU Adam calls span buckets]: consecutive buckets in
    write-back order share a call until it holds ``cpu_update_numel``
    elements, and the run equals one call per bucket bit for bit (at two
    ranks too, where each write-back is an all-gather)."""
    if world_size == 1:
        _grouped_calls(0, 1)
    else:
        spawn(_grouped_calls, world_size, backend="gloo")


def _built_with(numel, via):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    if via == "keyword":
        return model, _zero(model, cpu_update_numel=numel)
    config = ZeroConfig(cpu_offload=True, reduce_bucket_size=2_000, cpu_update_numel=numel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, ZeroOptimizer(opt, module=model, **as_kwargs(config))


def _cpu_adam_calls_per_step(model, zero, steps=2):
    """The calls of the CPU Adam in each training step."""
    per_step = []
    with inner_steps(zero.optimizer) as calls:
        for step in range(steps):
            before = len(calls)
            assert _train(model, zero, step)
            zero.wait_updates()
            per_step.append(len(calls) - before)
    return per_step


@pytest.mark.parametrize("via", ["keyword", "config"])
def test_cpu_update_numel_given_at_construction_sets_the_cpu_adam_calls(via):
    """``ZeroOptimizer(cpu_update_numel=n)``, or a ZeroConfig's field passed
    on: 1 steps each bucket in a CPU Adam call of its own, a value above the
    model's size all of them in one call."""
    model, zero = _built_with(1, via)
    assert zero.cpu_update_numel == 1 and len(zero.buckets) >= 3
    assert _cpu_adam_calls_per_step(model, zero) == [len(zero.buckets)] * 2
    model, zero = _built_with(10**9, via)
    assert zero.cpu_update_numel == 10**9
    assert _cpu_adam_calls_per_step(model, zero) == [1, 1]


def test_cpu_update_numel_without_cpu_offload_warns():
    model = TinyGPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.warns(UserWarning, match=r"cpu_update_numel has no effect without cpu_offload"):
        ZeroOptimizer(opt, cpu_update_numel=1)


def test_a_failed_call_of_several_buckets_names_them_and_zero_grad_drops_them(caplog):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = _zero(model, overlap=False, max_norm=1.0)
    zero.cpu_update_numel = 4000
    with pytest.raises(ValueError, match="cpu_update_numel must be >= 1"):
        zero.cpu_update_numel = 0
    _train(model, zero, 0)
    calls = _calls_of([b.piece_total for b in zero._order], 4000)
    failed = next(c for c in calls[1:] if len(c) > 1)  # a call of several, not the first
    target, update = zero._order[failed[0]], zero._cpu_update

    def failing(buckets, *args):
        if any(b is target for b in buckets):
            raise OSError("injected")
        update(buckets, *args)

    zero._cpu_update = failing
    in_failed = {id(s.param) for k in failed for s in zero._order[k].shards}
    before = {id(p): p.detach().clone() for p in model.parameters()}
    idx, tgt = make_batch(CONFIG, 2, 16, seed=1)
    zero.backward(model(idx, tgt).float())
    named = f"{failed[0]}-{failed[-1]}"  # consecutive positions, as a run
    assert failed == list(range(failed[0], failed[-1] + 1))
    message = rf"the CPU update of buckets {named} \(in write-back order, one CPU Adam call\) failed \(OSError: injected\)"
    with pytest.raises(CpuStepError, match=message) as raised:
        zero.step()
    assert raised.value.index == failed[0]
    with caplog.at_level("WARNING"):
        zero.zero_grad()
    assert f"the failed CPU updates of buckets {named} (in write-back order) are dropped" in (
        caplog.text
    )
    for p in model.parameters():  # the dropped call's keep their values, the others stepped
        assert torch.equal(p, before[id(p)]) == (id(p) in in_failed), p.shape
    zero._cpu_update = update
    assert _train(model, zero, 2)


def _overlapped_and_synchronous():
    """One model stepped with the CPU step overlapped, a copy stepped inside ``step()``."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ref_model = copy.deepcopy(model)
    zero, ref = _zero(model, max_norm=1.0), _zero(ref_model, overlap=False, max_norm=1.0)
    return model, zero, ref_model, ref


def test_checkpoint_while_updates_are_in_flight():
    model, zero, ref_model, ref = _overlapped_and_synchronous()
    for step in range(2):
        assert _train(model, zero, step) and _train(ref_model, ref, step)
    gate = _Gate(zero, zero._order[-1])
    assert _train(model, zero, 2) and _train(ref_model, ref, 2)
    assert gate.entered.wait(timeout=30)
    threading.Timer(0.2, gate.open.set).start()
    # Both wait for the update held on the worker, then read its result.
    weights = model.state_dict()
    state = zero.state_dict()
    ref_state = ref.state_dict()
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=0, atol=0)
    for a, b in zip(state["masters"], ref_state["masters"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Loading into a fresh optimizer writes the saved masters into the model.
    torch.manual_seed(1)
    other = TinyGPT(CONFIG)
    other_zero = _zero(other, max_norm=1.0)
    other_zero.load_state_dict(state)
    for a, b in zip(other.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert _train(other, other_zero, 3) and _train(ref_model, ref, 3)
    other_zero.wait_updates()
    for a, b in zip(other.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_submodules_state_dict_waits_for_the_step():
    """A block saved apart (``model.blocks[-1].state_dict()``) right after
    ``step()`` holds the step's values, as the root's ``state_dict()``
    does; it read them one step stale."""
    model, zero, ref_model, ref = _overlapped_and_synchronous()
    for step in range(3):
        assert _train(model, zero, step) and _train(ref_model, ref, step)
        got = {k: v.clone() for k, v in model.blocks[-1].state_dict().items()}
        for k, v in ref_model.blocks[-1].state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"step {step}: {k}")


class _KernelFault:
    """While ``active``, every CPU Adam kernel call raises before it runs (a
    failed NVMe read, say): nothing of the update happens."""

    def __init__(self, monkeypatch) -> None:
        from zerostack.fused_adam import _kernels

        self.active = False
        real = _kernels.launch

        def launch(params, *args, **kwargs):
            if self.active and params[0].device.type == "cpu":
                raise OSError("nvme read failed: injected")
            return real(params, *args, **kwargs)

        monkeypatch.setattr(_kernels, "launch", launch)


def _train_through_a_fault(overlap, max_norm, fraction, fault=None, steps=5, at=2):
    """``steps`` steps; with ``fault`` it is on from step ``at`` until its
    error is caught (where the failed update surfaces), then removed."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = _zero(model, overlap=overlap, max_norm=max_norm, gpu_update_fraction=fraction)
    losses, caught = [], []

    def surfaced(error):
        assert "failed (OSError: nvme read failed: injected)" in str(error), error
        caught.append(error)
        fault.active = False

    for step in range(steps):
        if step == at:
            # The last step's updates done first (in both runs): a fault
            # switched on under a running update could fail it between two
            # kernel launches, which a retry does not undo.
            zero.wait_updates()
            if fault is not None:
                fault.active = True
        idx, tgt = make_batch(CONFIG, 2, 16, seed=step)
        try:
            loss = model(idx, tgt).float()
        except CpuStepError as error:  # a worker's failure, met by this forward
            surfaced(error)
            loss = model(idx, tgt).float()  # again: the failed update runs first
        zero.backward(loss)
        try:
            zero.step()
        except CpuStepError as error:  # a synchronous step: it stays unfinished
            with pytest.raises(RuntimeError, match=r"call step\(\) again first"):
                zero.backward(model(idx, tgt).float())
            surfaced(error)
            assert zero.step()  # finishes the failed step
        losses.append(loss.item())
    zero.wait_updates()
    return losses, [p.detach().clone() for p in model.parameters()], caught


@pytest.mark.parametrize(
    ("overlap", "max_norm", "fraction"),
    [(False, 1.0, 0.0), (True, 1.0, 0.0), (True, 0.0, 0.0), (True, 1.0, 0.5), (False, 0.0, 1.0)],
    ids=["synchronous", "worker", "started-in-backward", "worker-device-lane",
         "synchronous-device-lane"],
)  # fmt: skip
def test_a_failed_update_runs_again_once_the_cause_is_removed(
    overlap, max_norm, fraction, monkeypatch
):
    """See [Note: a failed CPU update]: the losses and parameters of
    a run through the fault equal those of a run without it, bitwise. The
    device lane's updates (buckets spread through write-back order, see
    [Note: Adam where the bandwidth is]) fail and run again under the same
    rule."""
    ref_losses, ref_params, _ = _train_through_a_fault(overlap, max_norm, fraction)
    fault = _KernelFault(monkeypatch)
    losses, params, caught = _train_through_a_fault(overlap, max_norm, fraction, fault)
    assert len(caught) == 1 and not fault.active
    assert losses == ref_losses
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fraction", "lane"), [(0.0, "CPU"), (1.0, "device")], ids=["cpu-adam", "device-lane"]
)
def test_a_failed_update_that_stays_changes_nothing_and_zero_grad_drops_it(
    fraction, lane, monkeypatch, caplog
):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = _zero(model, overlap=False, max_norm=1.0, gpu_update_fraction=fraction)
    _train(model, zero, 0)
    fault = _KernelFault(monkeypatch)
    before = copy.deepcopy(zero.state_dict())  # the states are live tensors (the homes)
    params = [p.detach().clone() for p in model.parameters()]
    idx, tgt = make_batch(CONFIG, 2, 16, seed=1)
    zero.backward(model(idx, tgt).float())
    fault.active = True
    for _ in range(2):  # the cause stays: each step() raises, nothing changes
        with pytest.raises(CpuStepError, match=rf"the {lane} update of buckets? 0\b.* failed \(OSError") as raised:  # fmt: skip
            zero.step()
        assert raised.value.index == 0 and zero._pipe.failed[0] == 0
    fault.active = False
    with caplog.at_level("WARNING"):
        zero.zero_grad()  # drops the failed updates
    assert "are dropped" in caplog.text
    after = zero.state_dict()
    for a, b in zip(before["masters"], after["masters"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    old, new = before["optimizer"]["state"], after["optimizer"]["state"]
    assert old.keys() == new.keys()
    for i in old:  # moments and step counts as before
        for k in old[i]:
            torch.testing.assert_close(old[i][k], new[i][k], rtol=0, atol=0)
    for a, b in zip(params, model.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    assert _train(model, zero, 2)  # and training goes on


def _fp16_overflow_parity(rank, world, device="cpu"):
    """fp16 with clipping, an overflow on rank 0 at step 2: every rank skips
    it; the other steps match DDP + AdamW with clipping, step by step
    (integration_tests/multi_gpu.py runs it on GPUs)."""
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG).to(device)
    model = copy.deepcopy(ref_model).half()
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), cpu_offload=True,
        module=model, max_norm=0.5, reduce_bucket_size=2_000, initial_scale=1024.0,
        hysteresis=1,
    )  # fmt: skip
    for step in range(6):
        idx, tgt = make_batch(CONFIG, 2, 16, seed=100 * step + rank, device=device)
        poison = step == 2 and rank == 0
        handle = model.lm_head.weight.register_hook(
            lambda g, poison=poison: torch.full_like(g, float("inf")) if poison else g
        )
        loss = model(idx, tgt).float()
        ref_loss = ref(idx, tgt)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=2e-2)
        zero.backward(loss)
        handle.remove()
        ref_loss.backward()
        stepped = zero.step()
        assert stepped == (step != 2), f"rank {rank} step {step}: stepped={stepped}"
        if stepped:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
        ref_opt.zero_grad()
        zero.wait_updates()
        for (name, a), b in zip(model.named_parameters(), ref.module.parameters(), strict=True):
            torch.testing.assert_close(
                a.float(), b, **FP16_TOL, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}"
            )
    assert zero.scaler.scale == 512.0


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp16_overflow_on_one_rank_with_offload(world_size):
    spawn(_fp16_overflow_parity, world_size, backend="gloo", timeout_s=300)


def _gpu_overflow(rank, world):
    torch.cuda.set_device(rank)
    _fp16_overflow_parity(rank, world, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_overflow_on_one_rank_with_offload_on_cuda():
    spawn(_gpu_overflow, min(2, torch.cuda.device_count()), backend="nccl", timeout_s=300)


def test_a_write_back_that_raises_mid_call_is_finished_by_the_next():
    """A write-back that raises partway through a CPU Adam call of several
    buckets (a collective's error) leaves that bucket and the rest of the
    call to the next write-back: after it, the run equals one without the
    fault, bit for bit, and goes on so."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ref_model = copy.deepcopy(model)
    zero, ref = _zero(model, max_norm=1.0), _zero(ref_model, max_norm=1.0)
    zero.cpu_update_numel = ref.cpu_update_numel = 4000
    calls = _calls_of([b.piece_total for b in zero._order], 4000)
    call = next(c for c in calls if len(c) > 2)  # its second bucket fails, a third follows
    target, write = zero._order[call[1]], zero._write_back
    failures = []

    def failing(bucket, *args, **kwargs):
        if bucket is target and not failures:
            failures.append(bucket)
            raise RuntimeError("injected collective error")
        write(bucket, *args, **kwargs)

    zero._write_back = failing
    for step in range(2):
        assert _train(model, zero, step) and _train(ref_model, ref, step)
        ref.wait_updates()
        if step == 0:
            with pytest.raises(RuntimeError, match="injected collective error"):
                zero.wait_updates()
            assert zero._unwritten == call[1:]  # the failed bucket and the rest of its call
            stale = [s.param for k in call[1:] for s in zero._order[k].shards]
            assert not all(
                torch.equal(p, r)
                for p, r in zip(model.parameters(), ref_model.parameters(), strict=True)
                if any(p is q for q in stale)
            )
        zero.wait_updates()
        assert not zero._unwritten
        for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert failures == [target]


class _ReadsAChildsParameter(torch.nn.Module):
    """A parent that reads a child's parameter instead of calling it: the
    bias added (not saved for backward: a stale read is silent), or the
    weight in ``F.linear`` (saved: autograd saw the write-back)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.trunk = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if self.read == "bias":
            return h[:, :4] + self.head.bias
        return torch.nn.functional.linear(h, self.head.weight, self.head.bias)


@pytest.mark.parametrize("read", ["bias", "weight"])
def test_a_parameter_read_outside_its_module_is_waited_for(read):
    """See [Note: parameters read outside their module]: the head's update
    is held back on the worker, so a forward that does not wait for it
    reads the values before it; the run equals torch's, step by step, and
    says once that every update is now waited for at the forward's start."""
    import warnings

    def run(zero_shard: bool) -> list[float]:
        torch.manual_seed(0)
        model = _ReadsAChildsParameter(read)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if zero_shard:
            opt = ZeroOptimizer(
                opt, cpu_offload=True, module=model, reduce_bucket_size=1, cpu_update_numel=1
            )
            update = opt._cpu_update

            def held(buckets, *args):  # the head's update ends after the next forward began
                if any(s.param is model.head.bias for b in buckets for s in b.shards):
                    time.sleep(0.2)
                update(buckets, *args)

            opt._cpu_update = held
        losses = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.backward(loss) if zero_shard else loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(True)
    said = [str(w.message) for w in caught if "outside its module's forward" in str(w.message)]
    assert len(said) == 1 and "head." in said[0], said
    assert ours == run(False)


def test_a_model_that_calls_its_modules_waits_per_bucket_and_says_nothing():
    import warnings

    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = _zero(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for step in range(3):
            _train(model, zero, step)
    assert not zero._await_all
    zero.wait_updates()
