"""An exception in forward or backward that the user catches: after
``zero_grad()`` the steps that follow equal, bitwise, those of a run that
never saw the batch, at stage 1 and 2, with and without cpu_offload, at world
sizes 1 and 2, with buckets in the device's Adam too (gpu_update_fraction).
No update starts before step(), so there is none to take back (see [Note:
dropping a batch])."""

from __future__ import annotations

import pytest
import torch

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
STEPS, AT = 5, 2


class Injected(Exception):
    """The user's exception."""


class _RaiseInBackward(torch.autograd.Function):
    before_raising = staticmethod(lambda: None)

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _RaiseInBackward.before_raising()
        raise Injected("backward")


def _build(case):
    _name, stage, offload, overlap, max_norm, kind, *fraction = case
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    params = list(model.parameters())
    if kind == "sgd":
        inner = torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1)
    else:
        inner = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False)
    zero = ZeroOptimizer(
        inner, stage=stage, cpu_offload=offload, overlap_cpu_step=overlap, max_norm=max_norm,
        module=model, reduce_bucket_size=20_000, gpu_update_fraction=fraction[0] if fraction else 0.0,
    )  # fmt: skip
    return model, zero


def _arm(model, where, armed):
    """blocks[1]'s forward raises (blocks[0] ran), or the backward of
    blocks[0]'s output (blocks[1] and the head have their gradients)."""

    def after_block0(module, args, out):
        if armed[0] and where == "backward":
            return _RaiseInBackward.apply(out)
        return None

    def before_block1(module, args):
        if armed[0] and where == "forward":
            raise Injected("forward")

    model.blocks[0].register_forward_hook(after_block0)
    model.blocks[1].register_forward_pre_hook(before_block1)


def _train(model, zero, rank, where=None, skip=False):
    armed = [False]
    if where:
        _arm(model, where, armed)
    losses = []
    for step in range(STEPS):
        if skip and step == AT:
            continue
        idx, tgt = make_batch(CONFIG, 2, 16, seed=100 * step + rank)
        armed[0] = step == AT
        try:
            loss = model(idx, tgt)
            zero.backward(loss)
        except Injected as error:
            assert step == AT and str(error) == where
            armed[0] = False
            if where == "backward":
                assert any(b.launched for b in zero.buckets), "no bucket was reduced"
            zero.zero_grad()
            continue
        assert zero.step()
        losses.append(loss.item())
    zero.wait_updates()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _same(name, a, b):
    assert a[0] == b[0], f"{name}: losses {a[0]} != {b[0]}"
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{name}: {k} differs"


# (id, stage, cpu_offload, overlap_cpu_step, max_norm, optimizer[, gpu_update_fraction]).
CASES = [
    ("s1", 1, False, True, 0.0, "adamw"),
    # The worker, no clipping: updates once started during backward here.
    ("s2-offload-worker", 2, True, True, 0.0, "adamw"),
    ("s2-sgd", 2, False, True, 0.0, "sgd"),
    ("s1-offload-clip", 1, True, True, 0.5, "adamw"),
    ("s2-offload-inline", 2, True, False, 0.0, "adamw"),
    ("s2-offload-sgd-clip", 2, True, True, 0.5, "sgd"),
    # Half the buckets in the device's Adam, and all of them, updated inline.
    ("s2-offload-device-lane", 2, True, True, 0.5, "adamw", 0.5),
    ("s1-offload-device-lane-inline", 1, True, False, 0.0, "adamw", 1.0),
]


def _all(rank, world):
    for case in CASES:
        ref = _train(*_build(case), rank, skip=True)
        for where in ("forward", "backward"):
            _same(f"{case[0]} ({where})", _train(*_build(case), rank, where), ref)


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero_grad_after_an_exception_drops_the_batch_bitwise(world_size):
    spawn(_all, world_size, backend="gloo", timeout_s=300)


@pytest.mark.parametrize(
    "drop", ["module", "module-set-to-zero", "one-param", "then-step", "set-to-zero-then-step"]
)
@pytest.mark.parametrize(
    ("stage", "offload"), [(1, False), (2, False), (2, True)], ids=["s1", "s2", "s2-offload"]
)
def test_the_modules_zero_grad_drops_gradients_as_torch_does(stage, offload, drop):
    """The habit of torch loops (PyTorch's DCGAN example among them): the
    model's own ``zero_grad()`` (or ``p.grad = None``) between a backward
    and the next. Its gradients were already reduced into the shards; they
    are forgotten as torch forgets a dropped ``.grad``, parameter by
    parameter: one left with none does not step, one zeroed steps with
    zeros (SGD with momentum and weight decay moves it)."""

    def run(zero_shard: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = TinyGPT(CONFIG)
        inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
        opt = inner
        if zero_shard:
            opt = ZeroOptimizer(
                inner, stage=stage, cpu_offload=offload, module=model, reduce_bucket_size=20_000
            )
        for step in range(2):
            opt.zero_grad()
            model(*make_batch(CONFIG, 2, 16, seed=step)).backward()  # dropped below
            if drop == "module":
                model.zero_grad()
            elif drop in ("module-set-to-zero", "set-to-zero-then-step"):
                model.zero_grad(set_to_none=False)
            else:
                for p in (model.lm_head.weight,) if drop == "one-param" else model.parameters():
                    p.grad = None
            if not drop.endswith("then-step"):
                model(*make_batch(CONFIG, 2, 16, seed=10 + step)).backward()
            opt.step()
        if zero_shard:
            opt.wait_updates()
        return {k: v.clone() for k, v in model.state_dict().items()}

    ours, torchs = run(True), run(False)
    for k in torchs:
        torch.testing.assert_close(ours[k], torchs[k], rtol=0, atol=0, msg=k)
