"""Which ``state_dict`` names a module has, and which of them are one tensor.

[Note: tied weights in checkpoints] Names that are one tensor in the model
(Hugging Face GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are
written once, as ``save_pretrained`` does (safetensors cannot hold one
storage twice): under the first name in ``state_dict`` order, except that
names a transformers model declares as tie targets (``all_tied_weights_keys``
/ ``_tied_weights_keys``) are the ones left out, since ``from_pretrained``
re-ties them from their source. A load gives the left-out names the same
tensor, so strict loads still see every name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def state_names(module: nn.Module) -> list[str]:
    """The keys ``module.state_dict()`` has, without calling it (and its hooks)."""
    names: list[str] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        names += [dot + n for n, p in sub._parameters.items() if p is not None]
        names += [
            dot + n
            for n, b in sub._buffers.items()
            if b is not None and n not in sub._non_persistent_buffers_set
        ]
        if type(sub).get_extra_state is not nn.Module.get_extra_state:
            names.append(dot + "_extra_state")
    return list(dict.fromkeys(names))


def alias_groups(module: nn.Module, state: dict[str, Any] | None = None) -> list[list[str]]:
    """Names that are one tensor: the same Parameter/buffer object in ``module``,
    or the same memory in ``state``. See [Note: tied weights in checkpoints]."""
    order = {name: i for i, name in enumerate(state_names(module))}
    by_id: dict[int, list[str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for n, t in list(sub._parameters.items()) + list(sub._buffers.items()):
            if t is not None and dot + n in order:
                by_id.setdefault(id(t), []).append(dot + n)
    groups = [list(dict.fromkeys(g)) for g in by_id.values()]
    if state is not None:
        by_memory: dict[tuple, list[str]] = {}
        for name, t in state.items():
            if isinstance(t, torch.Tensor) and t.numel() and not t.is_meta:
                key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                by_memory.setdefault(key, []).append(name)
        groups += list(by_memory.values())
    # Merge groups that share a name.
    merged: list[set[str]] = []
    for g in groups:
        if len(g) < 2:
            continue
        hits = [m for m in merged if m.intersection(g)]
        union = set(g).union(*hits)
        merged = [m for m in merged if m not in hits] + [union]
    rank_of = {**{n: i for i, n in enumerate(state or {})}, **order}
    targets = _hf_tie_targets(module)
    return [
        sorted(m, key=lambda n: (n in targets, rank_of.get(n, len(rank_of)), n)) for m in merged
    ]


def _hf_tie_targets(module: nn.Module) -> set[str]:
    """Names a transformers model re-ties on load (``lm_head.weight``): they must
    be the ones left out, or ``from_pretrained`` ties them to an uninitialized
    source. transformers 5 declares ``{target: source}``, 4 a list of targets."""
    declared = getattr(module, "all_tied_weights_keys", None) or getattr(
        module, "_tied_weights_keys", None
    )
    if isinstance(declared, dict):
        return set(declared)
    if isinstance(declared, list | tuple | set):
        return {str(n) for n in declared}
    return set()


def drop_aliases(state: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    drop = set()
    for group in groups:
        present = [n for n in group if n in state]
        drop.update(present[1:])
    return {k: v for k, v in state.items() if k not in drop}


def alias_fill(names: set[str], groups: list[list[str]]) -> dict[str, str]:
    """``{missing name: name in the checkpoint}`` for tied names the checkpoint lacks."""
    fill = {}
    for group in groups:
        source = next((n for n in group if n in names), None)
        if source is not None:
            fill.update({n: source for n in group if n not in names})
    return fill
