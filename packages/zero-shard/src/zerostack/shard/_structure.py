"""A wrapped model's structure is fixed: a submodule or parameter assigned
into it after a wrapper that packed its parameters (GeminiDDP, AutoOffload's
memory_optimize) raises at the assignment.

[Note: the structure is fixed once wrapped] GeminiDDP packs every parameter
of the module into chunks when it wraps it: the chunks hold the values, the
fp32 masters and the names ``state_dict()`` writes; AutoOffload's traced
graph holds the parameters it was traced with. A submodule assigned
afterwards (``model.unwrap().head = nn.Linear(...)``, a LoRA layer put in
place of a Linear, ``lm_head.weight = wte.weight`` to tie) is in no chunk
and no graph: under Gemini the forward used it and nothing trained it, while
``state_dict()`` and checkpoints kept the old submodule's values, silently
(0.67 off in a test); under AutoOffload the forward went on with the old
one. torch calls its global registration hooks
(``register_module_module_registration_hook``,
``register_module_parameter_registration_hook``) before every such
assignment, so one pair of hooks, installed with the first wrapper, raises
there for modules that a live wrapper holds. Assigning the same object
again, or a module without parameters in place of another without
(``nn.Identity()`` for a ``Dropout``), changes nothing packed and passes.
torch calls no hook for removals (``del model.head``, ``fc.bias = None``,
``Sequential.insert``): those are not caught. An assignment that changes
an attribute's kind (a parameter over a submodule's name) has removed the
old one before the hook refuses it.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

# Every submodule of a wrapped model -> (its name in the model, the
# wrapper, weakly, its API name and why the assignment cannot work).
_HELD: weakref.WeakKeyDictionary[nn.Module, tuple[str, weakref.ref[Any], str, str]] = (
    weakref.WeakKeyDictionary()
)
_installed = False


def fix_structure(wrapper: object, module: nn.Module, api: str, why: str) -> None:
    """Refuse, from now on and while ``wrapper`` lives, assignments into
    ``module``'s tree that change its parameters; ``why`` ends the error
    after "after the model was wrapped (got ...); "."""
    global _installed
    me = weakref.ref(wrapper)
    for name, m in module.named_modules(remove_duplicate=False):
        _HELD[m] = (name, me, api, why)
    if not _installed:
        nn.modules.module.register_module_module_registration_hook(_on_module)
        nn.modules.module.register_module_parameter_registration_hook(_on_parameter)
        _installed = True


def _held(parent: nn.Module) -> tuple[str, weakref.ref[Any], str, str] | None:
    """What a live wrapper noted for ``parent``, else None (checked first:
    the hooks run at every assignment of a module or parameter anywhere)."""
    held = _HELD.get(parent)
    return None if held is None or held[1]() is None else held


def _has_parameters(module: nn.Module | None) -> bool:
    return module is not None and next(module.parameters(), None) is not None


def _on_module(parent: nn.Module, name: str, value: nn.Module | None) -> None:
    held = _held(parent)
    if held is None:
        return
    old = parent._modules.get(name)
    if value is not old and (_has_parameters(old) or _has_parameters(value)):
        _refuse(held, name, "a submodule", value)


def _on_parameter(parent: nn.Module, name: str, value: nn.Parameter) -> None:
    held = _held(parent)
    if held is not None and value is not parent._parameters.get(name):
        _refuse(held, name, "a parameter", value)


def _refuse(held: tuple[str, Any, str, str], name: str, what: str, value: object) -> None:
    path, _, api, why = held
    got = "None" if value is None else f"a new {type(value).__name__}"  # None: a submodule
    raise RuntimeError(
        f"{api}: {path + '.' if path else ''}{name} was assigned {what} after the model was "
        f"wrapped (got {got}); {why}. Build the model whole (heads, adapters, tied weights) "
        "before it is wrapped (or boosted)"
    )
