"""Through the Booster, every plugin, world sizes 1 and 2 (gloo): what the
user does to the optimizer they built takes effect, and an exception they
catch in forward or backward costs only its batch.

- An lr scheduler built on the user's optimizer (handed to ``boost`` or not)
  and edits of that optimizer's ``param_groups``: lr 0 stops the parameters
  (see zerostack.shard's [Note: the user's hyperparameters]).
- After an exception in forward or backward, ``optimizer.zero_grad()`` (or
  ``booster.load_state`` of a state saved before the batch) gives, bitwise,
  the steps of a run that never saw the batch (see zerostack.shard's [Note:
  dropping a batch] and [Note: a backward that raised under DDP]).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
CHUNKS = {"chunk_size": 6_000, "keep_gathered": False}
STEPS, AT = 5, 2


def _plugin(name, world):
    chunks = {world: CHUNKS}
    return {
        "ddp": lambda: TorchDDPPlugin(),
        "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
        "zero2-offload": lambda: LowLevelZeroPlugin(
            stage=2, precision="fp32", cpu_offload=True, max_norm=1.0
        ),
        "gemini": lambda: GeminiPlugin(precision="fp32", chunk_config_dict=chunks),
        "gemini-offload": lambda: GeminiPlugin(
            precision="fp32", chunk_config_dict=chunks, offload_optim_frac=1.0, max_norm=1.0
        ),
        "gemini-auto": lambda: GeminiPlugin(
            precision="fp32",
            chunk_config_dict=chunks,
            placement_policy="auto",
            gpu_capacity_bytes=10**6,
            max_norm=1.0,
        ),
    }[name]()


PLUGINS = ["ddp", "zero1", "zero2-offload", "gemini", "gemini-offload", "gemini-auto"]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _boost(name, world, schedule=None, handed=False):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    cls = HybridAdam if name.startswith("gemini") else torch.optim.AdamW
    user = cls(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(user, schedule) if schedule else None
    booster = Booster(plugin=_plugin(name, world))
    model, opt, *_ = booster.boost(model, user, lr_scheduler=sched if handed else None)
    return booster, model, opt, user, sched


def _params(model):
    return {k: v.clone() for k, v in model.full_state_dict(only_rank_0=False).items()}


def _hyper_case(rank, world, name, how):
    """lr 0 from step 2 on, set by a scheduler on the user's optimizer
    (handed to boost or not) or by an edit of its param_groups."""
    schedule = (lambda s: 1.0 if s < 2 else 0.0) if how != "edit" else None
    booster, model, opt, user, sched = _boost(name, world, schedule, handed=how == "handed")
    before = _params(model)
    for step in range(4):
        if how == "edit" and step == 2:
            user.param_groups[0]["lr"] = 0.0
        idx, tgt = make_batch(CONFIG, 2, 16, seed=10 * step + rank)
        booster.backward(lm_loss(model(idx), tgt), opt)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        after = _params(model)
        moved = max((after[k] - before[k]).abs().max().item() for k in after)
        label = f"{name} ({how}) step {step}"
        assert (moved == 0.0) if step >= 2 else (moved > 0.0), f"{label}: moved {moved}"
        before = after


class Injected(Exception):
    """The user's exception."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Injected("backward")


def _train(rank, world, name, where=None, skip=False, recover="zero_grad", root=None):
    """STEPS steps; the batch of step AT is left out (``skip``), or raises in
    ``where`` and is dropped by ``recover``: "zero_grad", or "load_state" of
    a state saved before it."""
    booster, model, opt, _user, _sched = _boost(name, world)
    inner = model.unwrap()
    armed = [False]

    def after_block0(module, args, out):
        return _RaiseInBackward.apply(out) if armed[0] and where == "backward" else None

    def before_block1(module, args):
        if armed[0] and where == "forward":
            raise Injected("forward")

    inner.blocks[0].register_forward_hook(after_block0)
    inner.blocks[1].register_forward_pre_hook(before_block1)
    losses = []
    for step in range(STEPS):
        if skip and step == AT:
            continue
        if recover == "load_state" and step == AT:
            booster.save_state(f"{root}/before", model, opt)
        idx, tgt = make_batch(CONFIG, 2, 16, seed=10 * step + rank)
        armed[0] = step == AT and where is not None
        try:
            loss = lm_loss(model(idx), tgt)
            booster.backward(loss, opt)
        except Injected as error:
            assert str(error) == where
            armed[0] = False
            if recover == "zero_grad":
                opt.zero_grad()
            else:
                booster.load_state(f"{root}/before", model, opt)
            continue
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _params(model)


def _same(label, a, b):
    assert a[0] == b[0], f"{label}: losses {a[0]} != {b[0]}"
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{label}: {k} differs"


def _all(rank, world, root):
    for name in PLUGINS:
        for how in ("edit", "not-handed", "handed"):
            _hyper_case(rank, world, name, how)
        ref = _train(rank, world, name, skip=True)
        for where in ("forward", "backward"):
            _same(f"{name} {where}", _train(rank, world, name, where), ref)
        if name in ("ddp", "zero1", "zero2-offload", "gemini"):  # a load drops the batch too
            got = _train(rank, world, name, "backward", recover="load_state", root=f"{root}/{name}")
            _same(f"{name} load_state", got, ref)


@pytest.mark.parametrize("world_size", [1, 2])
def test_user_actions_take_effect_and_an_exception_costs_only_its_batch(world_size, tmp_path):
    spawn(_all, world_size, args=(str(tmp_path),), backend="gloo", timeout_s=600)


def _ddp_refuses(rank, world):
    booster, model, opt, *_ = _boost("ddp", world)
    inner = model.unwrap()
    inner.blocks[0].register_forward_hook(lambda m, a, out: _RaiseInBackward.apply(out))
    idx, tgt = make_batch(CONFIG, 2, 16, seed=rank)
    with pytest.raises(Injected):
        booster.backward(lm_loss(model(idx), tgt), opt)
    with pytest.raises(
        RuntimeError,
        match=r"last backward raised before it finished .* call "
        r"optimizer.zero_grad\(\) to drop that batch",
    ):
        model(idx)


def test_torch_ddp_after_a_backward_that_raised_says_to_call_zero_grad():
    """torch's own DDP would raise "Expected to have finished reduction in the
    prior iteration" (blaming unused parameters) at every later forward."""
    spawn(_ddp_refuses, 2, backend="gloo", timeout_s=120)
