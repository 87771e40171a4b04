"""Conversions between what each plugin's optimizer keeps and the name-keyed
[Note: full state format] of zerostack.booster._interface: the parts every
plugin shares (model facts recorded before wrapping, per-parameter entries,
parameter groups, loss scalers, torch's positional layout).

[Note: state conversions copy] Every tensor that goes into or comes out of
a plugin's state is a copy: torch's ``Optimizer.load_state_dict`` keeps the
given tensors when dtype and device already match, so one dict loaded into
two optimizers would otherwise be trained twice (and a saved dict would
change as training goes on).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the user's module looked like before a plugin cast and wrapped it."""

    shapes: dict[str, torch.Size]
    """Parameter name (first name of a tied one) -> shape."""
    param_keys: frozenset[str]
    """Every state-dict key that is a parameter (tied names included)."""
    dtypes: dict[str, torch.dtype]
    """State-dict key -> dtype before wrapping (buffers go back to it)."""

    @classmethod
    def of(cls, module: nn.Module) -> ModelFacts:
        """Record ``module``'s names, shapes and dtypes (works on meta tensors)."""
        shapes = {n: p.shape for n, p in module.named_parameters()}
        keys = frozenset(n for n, _ in module.named_parameters(remove_duplicate=False))
        dtypes = {k: v.dtype for k, v in module.state_dict(keep_vars=True).items()}
        return cls(shapes=shapes, param_keys=keys, dtypes=dtypes)

    def export_model(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` in the full format: floating parameters fp32, buffers in
        their dtype before wrapping, on the CPU, copies."""
        out = {}
        for k, v in state.items():
            v = v.detach()
            if v.is_floating_point():
                dtype = torch.float32 if k in self.param_keys else self.dtypes.get(k, v.dtype)
                v = v.to(dtype)
            out[k] = v.to("cpu", copy=True)
        return out


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``module``."""
    return {id(p): n for n, p in module.named_parameters()}


def _copy(v: Any) -> Any:
    return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)


def export_entry(entry: dict[str, Any], shape: torch.Size) -> dict[str, Any]:
    """One parameter's optimizer state in the full format: tensors of the
    parameter's size shaped like it, in fp32 on the CPU; ``step`` a float32
    scalar; the plugin's fp32 ``master`` left out (the model state carries
    the fp32 weights)."""
    numel = shape.numel()
    out: dict[str, Any] = {}
    for k, v in entry.items():
        if k == "master":
            continue
        if k == "step":
            out[k] = torch.tensor(float(v), dtype=torch.float32)
        elif torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel:
            v = v.detach().reshape(shape)
            out[k] = v.to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
        else:
            out[k] = _copy(v)
    return out


def import_entry(api: str, name: str, entry: dict[str, Any], numel: int) -> dict[str, Any]:
    """One parameter's full-format state, flattened: each tensor of the
    parameter's size becomes 1-D (what the sharded optimizers slice); copies.

    Raises:
        ValueError: a tensor has another number of elements than the parameter.
    """
    out: dict[str, Any] = {}
    for k, v in entry.items():
        if k == "step":
            out[k] = torch.tensor(float(v), dtype=torch.float32)
        elif torch.is_tensor(v) and (v.dim() > 0 or numel == 1):
            if v.numel() != numel:
                raise ValueError(
                    f"{api}: the state's {k} of {name} has {v.numel()} elements, the parameter "
                    f"{numel} (got shape {tuple(v.shape)}); load the state of the same model"
                )
            out[k] = v.detach().reshape(-1).to("cpu", copy=True)
        else:
            out[k] = _copy(v)
    return out


def check_names(api: str, state: dict[str, Any], known: set[str]) -> None:
    """Raises KeyError when the state holds parameters the optimizer lacks."""
    unknown = sorted(set(state) - known)
    if unknown:
        raise KeyError(
            f"{api}: the optimizer state has parameters this optimizer does not (got "
            f"{unknown[:5]}); load a state saved from the same model"
        )


def frozen_names(module: nn.Module) -> frozenset[str]:
    """The first names of ``module``'s parameters that do not train."""
    return frozenset(n for n, p in module.named_parameters() if not p.requires_grad)


def check_group_params(
    api: str, saved: list[dict[str, Any]], current: list[list[str]], frozen: frozenset[str]
) -> None:
    """The saved groups list the current groups' parameters (``current``:
    each group's names), no more and no fewer: a state saved from another
    model is refused before anything loads, as torch's ``load_state_dict``
    refuses groups of other sizes. The groups list every parameter, with a
    state or not (one that never had a gradient has none). Names in
    ``frozen`` (parameters of the model that do not train) may be on one
    side only: GeminiOptimizer lists only trainable parameters, torch's
    optimizers every one they were built on.

    Raises:
        ValueError: naming the parameters one side lacks.
    """
    have = {n for names in current for n in names}
    got = {n for g in saved for n in g["params"]}
    missing, extra = sorted(have - got - frozen), sorted(got - have - frozen)
    if missing or extra:
        raise ValueError(
            f"{api}: the state's parameter groups list other parameters than this optimizer's "
            f"(got {_few(missing)} missing from the state, {_few(extra)} not in this optimizer): "
            "a state saved from another model, which torch's load_state_dict refuses (\"loaded "
            "state dict contains a parameter group that doesn't match the size of optimizer's "
            'group"); load an optimizer state saved from this model'
        )


def _few(names: list[str]) -> str:
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


def hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters (every key but ``params``), copied."""
    return {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}


def saved_group(groups: list[dict[str, Any]], names: list[str]) -> dict[str, Any] | None:
    """The saved group that holds the first of ``names`` (None when none does)."""
    for name in names:
        for g in groups:
            if name in g["params"]:
                return g
    return None


def check_same_groups(api: str, saved: list[dict[str, Any]], current: list[list[str]]) -> None:
    """The saved groups split the parameters both sides have as the current
    groups (``current``: each group's parameter names) do: torch's
    ``load_state_dict`` refuses another layout of groups; taking a group's
    values for parameters now in another (a no-decay group's after a
    checkpoint with one group) would change their training silently.

    Raises:
        ValueError: two parameters in one group on one side and not on the other.
    """
    where = {n: i for i, g in enumerate(saved) for n in g["params"]}
    to_current: dict[int, tuple[int, str]] = {}  # saved group -> (current group, a name)
    to_saved: dict[int, tuple[int, str]] = {}
    for c, names in enumerate(current):
        for name in (n for n in names if n in where):
            s = where[name]
            for seen, key, value in ((to_current, s, c), (to_saved, c, s)):
                other, first = seen.setdefault(key, (value, name))
                if other != value:
                    raise ValueError(
                        f"{api}: the state's parameter groups are laid out otherwise than this "
                        f"optimizer's (got {first!r} and {name!r}, in one group on one side and "
                        "in two on the other); build the optimizer with the groups it was saved "
                        "with, as torch's load_state_dict requires"
                    )


# Put into the groups by torch's LRScheduler, whatever the optimizer's class.
_SCHEDULER_KEYS = ("initial_lr",)


def merge_hyper(current: dict[str, Any], saved: dict[str, Any] | None) -> dict[str, Any]:
    """``current``'s hyperparameters, with the saved values of the keys both
    optimizers know (lr, betas, eps, weight_decay, ...) and of ``initial_lr``,
    which torch's ``load_state_dict`` carries too: an lr scheduler built
    after the load with ``last_epoch=k`` reads it (torch's KeyError without
    it), one built with the default takes it as its base lr. Keys of
    another optimizer class (amsgrad, adamw_mode, ...) are not carried over:
    the optimizer being loaded keeps its own."""
    out = hyper(current)
    if saved is not None:
        out.update(
            {
                k: copy.deepcopy(v)
                for k, v in saved.items()
                if k != "params" and (k in out or k in _SCHEDULER_KEYS)
            }
        )
    return out


def scaler_state(target: dict | None, saved: dict | None) -> dict | None:
    """``saved`` loss-scaler state in the layout of ``target`` (the loading
    scaler's own ``state_dict()``): a DynamicLossScaler's and a
    torch.amp.GradScaler's share the scale and the count of clean steps;
    None when either side has no scaler."""
    if not target or not saved:
        return None
    if set(saved) == set(target):
        return copy.deepcopy(saved)
    out = dict(target)
    out["scale"] = float(saved["scale"])
    if "_growth_tracker" in out and "clean_steps" in saved:
        out["_growth_tracker"] = int(saved["clean_steps"])
    if "clean_steps" in out and "_growth_tracker" in saved:
        out["clean_steps"] = int(saved["_growth_tracker"])
    return out


# -- torch's positional layout (DDP and ZeRO-1/2's inner optimizer) ------------------


def positional_to_full(
    api: str,
    sd: dict[str, Any],
    params: list[torch.Tensor],
    names: dict[int, str],
    shapes: dict[str, torch.Size],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """torch's ``state_dict()`` (``params[i]`` is index ``i``) to the full
    format's ``state`` and ``param_groups``."""
    state = {}
    for idx, entry in sd["state"].items():
        name = param_name(api, names, params[idx])
        state[name] = export_entry(entry, shapes.get(name, params[idx].shape))
    groups = [
        {**hyper(g), "params": [param_name(api, names, params[i]) for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    return state, groups


def full_to_positional(
    api: str,
    full: dict[str, Any],
    current: dict[str, Any],
    params: list[torch.Tensor],
    names: dict[int, str],
    flat: bool,
    frozen: frozenset[str],
) -> dict[str, Any]:
    """The full format to torch's positional ``state_dict()`` for an optimizer
    whose own ``state_dict()`` is ``current`` and whose parameters (or
    shards, index ``i``) belong to ``params[i]``; ``flat`` keeps tensors 1-D
    (ZeRO-1/2 slices them), else they take the parameter's shape; ``frozen``
    as :func:`check_group_params`'s. Checks everything before it converts."""
    by_name = {param_name(api, names, p): i for i, p in enumerate(params)}
    check_names(api, full["state"], set(by_name))
    current_names = [
        [param_name(api, names, params[i]) for i in g["params"]] for g in current["param_groups"]
    ]
    check_group_params(api, full["param_groups"], current_names, frozen)
    check_same_groups(api, full["param_groups"], current_names)
    state = {}
    for name, entry in full["state"].items():
        i = by_name[name]
        mine = import_entry(api, name, entry, params[i].numel())
        if not flat:
            shape = params[i].shape
            mine = {k: v.view(shape) if _is_flat_state(k, v) else v for k, v in mine.items()}
        state[i] = mine
    groups = [
        {**merge_hyper(g, saved_group(full["param_groups"], group_names)), "params": g["params"]}
        for g, group_names in zip(current["param_groups"], current_names, strict=True)
    ]
    return {"state": state, "param_groups": groups}


def _is_flat_state(k: str, v: Any) -> bool:
    return k != "step" and torch.is_tensor(v) and v.dim() == 1


def param_name(api: str, names: dict[int, str], p: torch.Tensor) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise ValueError(
            f"{api}: the optimizer holds a parameter that is not the model's (got shape "
            f"{tuple(p.shape)}); build the optimizer on model.parameters()"
        ) from None
