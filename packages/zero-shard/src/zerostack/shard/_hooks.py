"""The hooks a ZeroOptimizer puts on the model: a post-accumulate-grad hook
per parameter (its gradient is ready for its bucket's reduction) and, with
deferred CPU updates, forward pre-hooks that wait for the buckets a module
uses and a state-dict pre-hook that waits for them all.

[Note: hooks hold the optimizer weakly] Tensor hooks live in autograd's C++
graph, out of the garbage collector's sight: a strong reference would keep
the optimizer (masters, states, buckets) alive as long as the model. Nor may
a hook hold a shard: shard -> param -> hook -> shard is a cycle the collector
cannot see, which kept every parameter and its fp32 master alive after the
model and optimizer were dropped. So each hook holds a weak reference to the
optimizer and an index, and is built once (a hook or a closure over the
optimizer made per step would be garbage per step); a dropped optimizer
leaves inert hooks on the model.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from zerostack.shard._optimizer import ZeroOptimizer


def _grad_hook(me: weakref.ref[ZeroOptimizer], index: int) -> None:
    zero = me()
    if zero is not None:  # See [Note: hooks hold the optimizer weakly]
        zero._on_grad(zero.shards[index])


def _forward_hook(
    me: weakref.ref[ZeroOptimizer], positions: tuple[int, ...], shards: frozenset[int]
) -> None:
    zero = me()
    if zero is None:
        return
    zero._hooked |= shards  # See [Note: parameters read outside their module]
    if zero._pipe is not None and zero._pipe.round_open:
        zero._await_positions(positions)


def _root_hook(me: weakref.ref[ZeroOptimizer]) -> None:
    zero = me()
    if zero is None:
        return
    zero._hooked = set()
    if zero._await_all and zero._pipe is not None and zero._pipe.round_open:
        zero._await_positions(tuple(range(len(zero._order))))


def _state_dict_hook(me: weakref.ref[ZeroOptimizer]) -> None:
    zero = me()
    if zero is not None:
        zero.wait_updates()


def register_grad_hooks(zero: ZeroOptimizer) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on every trainable parameter."""
    me = weakref.ref(zero)
    return [
        s.param.register_post_accumulate_grad_hook(lambda p, i=i, me=me: _grad_hook(me, i))
        for i, s in enumerate(zero.shards)
        if s.param.requires_grad
    ]


def register_forward_hooks(zero: ZeroOptimizer, module: torch.nn.Module) -> list[RemovableHandle]:
    """Each module with parameters of its own waits, before its forward,
    for the buckets that hold them (positions in write-back order), and
    the root module first notes a new forward (see [Note: parameters read
    outside their module]); the state_dict() of the module or of any
    submodule waits for all."""
    me = weakref.ref(zero)
    where = {id(s.param): (k, s.index) for k, b in enumerate(zero._order) for s in b.shards}
    handles = [module.register_forward_pre_hook(lambda _m, _a, me=me: _root_hook(me))]
    for m in module.modules():
        found = [where[id(p)] for p in m.parameters(recurse=False) if id(p) in where]
        if found:
            positions = tuple(sorted({k for k, _ in found}))
            shards = frozenset(i for _, i in found)
            handles.append(
                m.register_forward_pre_hook(
                    lambda _m, _a, pos=positions, sh=shards, me=me: _forward_hook(me, pos, sh)
                )
            )
    # Every module's, not the root's alone: a submodule's state_dict() (a
    # backbone saved apart) read the parameters one step stale.
    handles += [
        m.register_state_dict_pre_hook(lambda *_a, me=me: _state_dict_hook(me))
        for m in module.modules()
    ]
    return handles
