"""An exception in forward or backward that the user catches: after
``optimizer.zero_grad()`` the steps that follow equal, bitwise, those of a run
that never saw the batch, in every placement, at world sizes 1 and 2; no CPU
update starts before step(), so there is none to take back (see
zerostack.shard's [Note: dropping a batch])."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer, TrainingState
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}
STEPS, AT = 5, 2  # the batch of step AT raises (the warm-up's under "auto")


class Injected(Exception):
    """The user's exception."""


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: later modules' gradients are reduced by then."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Fault.before_raising(_Fault.ddp)
        raise Injected("backward")


class _Fault:
    """Where the armed batch raises: in the forward of blocks[1] (blocks[0]'s
    chunks are gathered), or in the backward of blocks[0]'s output (blocks[1],
    the final norm and the head have their gradients, some chunks reduced)."""

    ddp = None
    before_raising = staticmethod(lambda ddp: None)

    def __init__(self, model, ddp, where):
        self.armed, self.where, self.seen = False, where, []
        _Fault.ddp = ddp
        model.blocks[0].register_forward_hook(self._after_block0)
        model.blocks[1].register_forward_pre_hook(self._before_block1)

    def _after_block0(self, module, args, out):
        if self.armed and self.where == "backward":
            return _RaiseInBackward.apply(out)
        return None

    def _before_block1(self, module, args):
        if self.armed and self.where == "forward":
            self.seen.append(sum(c.is_gathered for c in _Fault.ddp.param_chunks))
            raise Injected("forward")


# (id, GeminiDDP arguments, optimizer, mixed precision, max_norm, overlap_cpu_step,
# micro-batches).
CASES = [
    ("no-offload", {}, "adamw", torch.float32, 0.0, True, 1),
    # The worker, no clipping: updates once started during backward here.
    ("cpu-states-worker", dict(offload_optim_frac=1.0), "adamw", torch.float32, 0.0, True, 1),
    ("kept-gathered-sgd", dict(shard_param_frac=0.0), "sgd", torch.float32, 0.0, True, 1),
    ("cpu-states-worker-clip", dict(offload_optim_frac=1.0), "adam", torch.float32, 0.5, True, 1),
    ("cpu-states-inline", dict(offload_optim_frac=1.0), "adamw", torch.float32, 0.0, False, 1),
    ("cpu-params-bf16", dict(offload_param_frac=0.5, offload_optim_frac=0.5), "adamw",
     torch.bfloat16, 0.5, True, 1),
    ("nvme", dict(offload_optim_frac=1.0), "nvme", torch.float32, 0.5, True, 1),
    ("accumulate", dict(enable_gradient_accumulation=True), "adam", torch.float32, 0.0, True, 2),
    ("auto", dict(placement_policy="auto", steady_cuda_cap_ratio=1.0), "adam", torch.float32,
     0.5, True, 1),
]  # fmt: skip

# The NVMe case needs zerostack-nvme (fused-adam's [nvme] extra), which this
# package does not depend on: it runs where it is installed (nox -s
# reliability, the integration session), as test_gemini_host_bytes's does.
if importlib.util.find_spec("zerostack.nvme") is None:
    CASES = [case for case in CASES if case[2] != "nvme"]


def _build(world, case, nvme_dir):
    _name, kwargs, kind, dtype, max_norm, overlap, _micro = case
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    if kwargs.get("placement_policy") == "auto":
        n = sum(p.numel() for p in model.parameters())
        capacity = 4 * n // world + 3 * 4 * CHUNKS["chunk_size"] + 12 * n // world // 2
        kwargs = dict(kwargs, gpu_capacity_bytes=capacity)
    ddp = GeminiDDP(
        model, mixed_precision=dtype, chunk_config_dict={world: CHUNKS}, compute_device="cpu",
        **kwargs,
    )  # fmt: skip
    params = list(model.parameters())
    if kind == "sgd":
        inner = torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1, foreach=False)
    else:
        nvme = dict(nvme_offload_fraction=0.5, nvme_offload_dir=nvme_dir) if kind == "nvme" else {}
        inner = HybridAdam(params, lr=1e-3, weight_decay=0.1, adamw_mode=kind != "adam", **nvme)
    return model, ddp, GeminiOptimizer(inner, ddp, max_norm=max_norm, overlap_cpu_step=overlap)


def _batches(step, micro, rank):
    return [make_batch(CONFIG, 2, 16, seed=1000 * step + 10 * m + rank) for m in range(micro)]


def _train(model, ddp, opt, micro, rank, where=None, skip=False, at=AT):
    """STEPS steps; the batch of step ``at`` is left out (``skip``) or raises
    in its last micro-batch (``where``) and is dropped by zero_grad()."""
    fault = _Fault(model, ddp, where) if where else None
    losses = []
    for step in range(STEPS):
        if skip and step == at:
            continue
        batches = _batches(step, micro, rank)
        try:
            for m, (idx, tgt) in enumerate(batches):
                if fault is not None:
                    fault.armed = step == at and m == micro - 1
                if m < micro - 1:
                    with ddp.no_sync():
                        opt.backward(ddp(idx, tgt).float() / micro)
                    continue
                loss = ddp(idx, tgt)
                opt.backward(loss.float() / micro)
        except Injected as error:
            assert step == at and str(error) == where
            fault.armed = False
            if where == "backward":
                assert ddp.training_state is TrainingState.BACKWARD
                assert ddp._next_reduce > 0, "no chunk was reduced before the fault"
            opt.zero_grad()
            assert ddp.training_state is TrainingState.IDLE
            continue
        assert opt.step()
        losses.append(loss.item())
    if fault is not None and where == "forward":
        assert fault.seen and fault.seen[0] > 0, "no chunk was gathered before the fault"
    ddp.wait_updates()
    return losses, ddp.state_dict()


def _same(name, a, b):
    assert a[0] == b[0], f"{name}: losses {a[0]} != {b[0]}"
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{name}: {k} differs"


def _all(rank, world, root):
    for case in CASES:
        name, micro = case[0], case[6]
        ref = _train(*_build(world, case, f"{root}/{name}-ref-{rank}"), micro, rank, skip=True)
        for where in ("forward", "backward"):
            model, ddp, opt = _build(world, case, f"{root}/{name}-{where}-{rank}")
            _same(f"{name} ({where})", _train(model, ddp, opt, micro, rank, where), ref)
            if case[2] == "nvme":
                assert opt.optimizer.nvme_bytes_on_disk() > 0
        if "auto" in name:  # the warm-up iteration raises: the next one records again
            ref = _train(*_build(world, case, None), micro, rank, skip=True, at=0)
            model, ddp, opt = _build(world, case, None)
            _same(f"{name} (warm-up)", _train(model, ddp, opt, micro, rank, "backward", at=0), ref)
            assert 0 < len(ddp.offloaded_masters) < len(ddp.grad_chunks)


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero_grad_after_an_exception_drops_the_batch_bitwise(world_size, tmp_path):
    spawn(_all, world_size, args=(str(tmp_path),), backend="gloo", timeout_s=600)


def test_no_cpu_update_starts_during_backward():
    # With the worker idle and no clipping, a backward that raises late
    # (after most chunks were reduced and given time) has queued nothing.
    case = ("worker", dict(offload_optim_frac=1.0), "adamw", torch.float32, 0.0, True, 1)
    model, ddp, opt = _build(1, case, None)
    fault = _Fault(model, ddp, "backward")
    queued = []

    def look(ddp):
        time.sleep(0.2)
        queued.extend(ddp.step_pipeline.pending())

    _Fault.before_raising = staticmethod(look)
    try:
        for step in range(AT + 1):
            idx, tgt = _batches(step, 1, 0)[0]
            fault.armed = step == AT
            loss = ddp(idx, tgt)
            if step < AT:
                opt.backward(loss)
                assert opt.step()
                ddp.wait_updates()
                continue
            with pytest.raises(Injected):
                opt.backward(loss)
    finally:
        _Fault.before_raising = staticmethod(lambda ddp: None)
    assert queued == []
    opt.zero_grad()
    assert ddp.training_state is TrainingState.IDLE


def test_forward_and_step_after_a_backward_that_raised_say_to_call_zero_grad():
    model, ddp, opt = _build(1, CASES[0], None)
    fault = _Fault(model, ddp, "backward")
    idx, tgt = _batches(0, 1, 0)[0]
    fault.armed = True
    with pytest.raises(Injected):
        opt.backward(ddp(idx, tgt))
    fault.armed = False
    with pytest.raises(
        RuntimeError,
        match=r"last backward did not finish .* call "
        r"optimizer.zero_grad\(\) to drop that batch",
    ):
        ddp(idx, tgt)
    with pytest.raises(RuntimeError, match=r"last backward did not finish"):
        opt.step()
    opt.zero_grad()
    opt.backward(ddp(idx, tgt))
    assert opt.step()
    with pytest.warns(UserWarning, match=r"no backward since the last step"):
        assert opt.step() is False  # zero_grad() between steps changes nothing
    opt.zero_grad()
    assert ddp.training_state is TrainingState.IDLE


def _accumulating():
    case = ("accumulate", dict(enable_gradient_accumulation=True), "adam", torch.float32, 0.0,
            True, 1)  # fmt: skip
    return _build(1, case, None)


@pytest.mark.parametrize("when", ["accumulated", "before-backward", "reduced"])
def test_zero_grad_drops_what_the_batch_left_at_any_point(when):
    """zero_grad() after a no_sync backward (ACCUMULATED), between the next
    forward and its backward (AWAIT_BACKWARD: the accumulated gradients go,
    the forward stays), or after a backward that was not stepped (REDUCED):
    the run equals one without what was dropped."""
    (idx0, tgt0), (idx1, tgt1), (idx2, tgt2) = (_batches(s, 1, 0)[0] for s in range(3))
    _model, ref, ref_opt = _accumulating()
    for idx, tgt in ((idx0, tgt0), (idx2, tgt2)):
        ref_opt.backward(ref(idx, tgt) / 2)
        assert ref_opt.step()
    _model, ddp, opt = _accumulating()
    opt.backward(ddp(idx0, tgt0) / 2)
    assert opt.step()
    if when == "reduced":
        opt.backward(ddp(idx1, tgt1) / 2)
        assert ddp.training_state is TrainingState.REDUCED
        opt.zero_grad()
        loss = ddp(idx2, tgt2)
    else:
        with ddp.no_sync():
            opt.backward(ddp(idx1, tgt1) / 2)
        if when == "accumulated":
            assert ddp.training_state is TrainingState.ACCUMULATED
            opt.zero_grad()
            assert ddp.training_state is TrainingState.IDLE
        loss = ddp(idx2, tgt2)
        if when == "before-backward":
            opt.zero_grad()
            assert ddp.training_state is TrainingState.AWAIT_BACKWARD
    opt.backward(loss / 2)
    assert opt.step()
    ddp.wait_updates()
    ref.wait_updates()
    _same(when, ([], ddp.state_dict()), ([], ref.state_dict()))
