"""ZeRO-2 keeps 1/N of the gradients per rank; ZeRO-1 keeps them whole.

Parity cannot show this (both stages give the same parameters), so these
tests count the bytes: every tensor storage reachable from the optimizer
(the model's ``.grad`` included), less the parameters, the masters, the
optimizer states and the two-slot communication rings (fixed-size, reused
by every bucket), is gradient memory this rank holds. The gradient buffers
are persistent (allocated once), so they are counted whether or not they
existed before this backward.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

from zerostack.shard import ShardedGradient, ZeroOptimizer, local_grad, shard_numel
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)  # every parameter gets a gradient every step
BUCKET = 8192  # elements; the largest parameters (16384) get a bucket each
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _storages(root: object) -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage reachable from ``root``
    through Python references, and of those tensors' ``.grad``."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, ShardedGradient):  # no storage: what it accumulated, if anything
            todo.append(obj.local)
            continue
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
            if obj.is_leaf and obj.grad is not None:
                todo.append(obj.grad)
            continue
        todo.extend(gc.get_referents(obj))
    return found


def _grad_bytes(zero: ZeroOptimizer, baseline: dict[int, int]) -> int:
    return sum(n for ptr, n in _storages(zero).items() if ptr not in baseline)


def _not_gradients(model: torch.nn.Module, zero: ZeroOptimizer) -> dict[int, int]:
    """Storages of the parameters, masters, optimizer states and rings (not
    their ``.grad``: detached views share the storage, not the gradient)."""
    params = [p.detach() for p in model.parameters()]
    masters = [p.detach() for g in zero.optimizer.param_groups for p in g["params"]]
    states = [t.detach() for s in zero.optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor)]  # fmt: skip
    return _storages([params, masters, states, zero.buffers.rings])


def _held_gradients(rank, world):
    for stage in (1, 2):
        torch.manual_seed(0)
        model = TinyGPT(CONFIG)
        zero = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, reduce_bucket_size=BUCKET
        )
        pieces = sum(shard_numel(p.numel(), world) for p in model.parameters()) * 4  # fp32
        whole = world * pieces  # every rank's pieces: the padded full gradient
        largest_bucket = world * max(b.piece_total for b in zero.buckets) * 4
        at_step: list[int] = []
        for step in range(2):  # the first step creates the optimizer states
            idx, tgt = make_batch(CONFIG, 2, 32, seed=10 * step + rank)
            loss = model(idx, tgt)
            zero.backward(loss)
            baseline = _not_gradients(model, zero)
            after_backward = _grad_bytes(zero, baseline)
            # The model's grads went into the buckets as they arrived; param.grad
            # holds no values (see [Note: sharded param.grad]).
            assert all(local_grad(p) is None for p in model.parameters())
            assert all(isinstance(p.grad, ShardedGradient) for p in model.parameters())
            hook = zero.optimizer.register_step_pre_hook(
                lambda *_, z=zero, b=baseline, out=at_step: out.append(_grad_bytes(z, b))
            )
            assert zero.step()
            hook.remove()
        if stage == 1:  # the all-reduced buffers, whole
            assert after_backward == whole, (stage, after_backward, whole)
            assert at_step[-1] == whole, (stage, at_step, whole)
        else:
            # Only this rank's reduced pieces, plus the input of the one
            # reduce-scatter that may still be in flight when backward ends.
            assert pieces <= after_backward <= pieces + largest_bucket, (
                stage,
                after_backward,
                pieces,
                largest_bucket,
            )
            assert after_backward < whole / world + whole / 4
            assert at_step[-1] == pieces, (stage, at_step, pieces)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage2_holds_a_1_over_n_share_of_the_gradients(world_size):
    spawn(_held_gradients, world_size, backend="gloo")
