"""torch idioms applied to a boosted model or optimizer: what the wrappers
share so that each idiom takes effect or raises naming what to do instead
(docs/reliability.md, "User actions take effect").

[Note: boosted model methods] A plugin that keeps fp32 masters apart from the
parameters (LowLevelZeroPlugin, GeminiPlugin, AutoOffloadPlugin) cannot let
torch's own ``nn.Module`` methods reach the parameters: ``load_state_dict``
would write parameters that the next step overwrites from the masters, and
``to()`` / ``half()`` / ``cuda()`` would replace tensors the plugin holds
(chunk views under Gemini). Their wrappers therefore route
``state_dict`` / ``load_state_dict`` through the plugin (the masters are
read and written) and refuse a move or cast (``_apply``) that would change a
tensor; one that changes nothing (``model.to(the device it is on)``) is let
through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys

# The key prefix of the user's module in a wrapper's state_dict (ModelWrapper.module).
PREFIX = "module."


def refuse_moves(
    api: str, plugin: str, fn: Callable[[torch.Tensor], torch.Tensor], tensors: Iterable
) -> None:
    """Raise unless ``fn`` (what ``nn.Module._apply`` applies: a ``to()``,
    ``half()``, ``cuda()``, ...) leaves the dtype and device of every tensor
    as they are. See [Note: boosted model methods].

    Raises:
        NotImplementedError: ``fn`` would move or cast a tensor.
    """
    seen = set()
    for t in tensors:
        if (t.dtype, t.device) in seen:
            continue
        seen.add((t.dtype, t.device))
        # An empty probe of each kind: a parameter's storage may be released
        # (a sharded chunk, an offloaded region), and no copy is made.
        out = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        if out.dtype != t.dtype or out.device != t.device:
            raise NotImplementedError(
                f"{api}: moving or casting the boosted model (to(), half(), float(), cuda(), "
                f"...) is not supported (got a {t.dtype} tensor on {t.device} turned into "
                f"{out.dtype} on {out.device}); {plugin} places the parameters and keeps them "
                f"in step with its fp32 masters: choose the dtype with {plugin}(precision=...) "
                "and the device before boost (torch.cuda.set_device)"
            )


def run_closure(api: str, closure: Callable[[], Any] | None) -> Any:
    """torch's ``step(closure)``: the closure (forward and backward) runs
    first, with gradients enabled; its loss is returned by the step."""
    if closure is None:
        return None
    if not callable(closure):
        raise TypeError(
            f"{api}.step: closure must be callable or None (got {type(closure).__name__})"
        )
    with torch.enable_grad():
        return closure()


def with_prefix(
    state: Mapping[str, torch.Tensor], prefix: str, destination: dict | None
) -> dict[str, torch.Tensor]:
    """``state`` keyed as ``nn.Module.state_dict`` keys the user's module
    inside a wrapper (``prefix`` + ``"module."`` + name), into ``destination``."""
    out = {} if destination is None else destination
    for k, v in state.items():
        out[prefix + PREFIX + k] = v
    return out


def without_prefix(
    api: str, state_dict: Mapping[str, Any], strict: bool, assign: bool
) -> tuple[dict[str, Any], list[str]]:
    """The entries of a wrapper's ``state_dict`` keyed by the user's module's
    names, and the keys without the wrapper's ``"module."`` prefix
    (unexpected ones).

    Raises:
        TypeError: ``state_dict`` is not a dict.
        NotImplementedError: ``assign=True``.
        KeyError: with ``strict``, a key without the prefix.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{api}.load_state_dict: state_dict must be a dict of tensors (got "
            f"{type(state_dict).__name__})"
        )
    if assign:
        raise NotImplementedError(
            f"{api}.load_state_dict: assign=True would replace the parameters the plugin holds "
            "(got assign=True); load with assign=False: the values are copied in"
        )
    stray = sorted(k for k in state_dict if not k.startswith(PREFIX))
    if stray and strict:
        raise KeyError(
            f"{api}.load_state_dict: keys without the boosted model's '{PREFIX}' prefix (got "
            f"{stray[:5]}); pass model.state_dict()'s keys, or load a plain model's state dict "
            "with booster.load_model or strict=False"
        )
    own = {k[len(PREFIX) :]: v for k, v in state_dict.items() if k.startswith(PREFIX)}
    return own, stray


def incompatible(
    expected: Iterable[str], given: Iterable[str], stray: Iterable[str] = ()
) -> _IncompatibleKeys:
    """torch's ``load_state_dict`` result, in the wrapper's keys."""
    expected, given = set(expected), set(given)
    missing = sorted(PREFIX + k for k in expected - given)
    unexpected = sorted([PREFIX + k for k in given - expected] + list(stray))
    return _IncompatibleKeys(missing, unexpected)
