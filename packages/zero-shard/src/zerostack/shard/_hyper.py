"""The hyperparameters users set, and the ones an offloaded step reads.

[Note: the user's hyperparameters] Users change hyperparameters on the
optimizer they built (``opt.param_groups[0]["lr"] = ...``), through an lr
scheduler built on it (whether or not it was handed to the wrapper), or on
the wrapper's ``param_groups``: all three are the same dicts, the user
optimizer's own groups, and every step reads them. A step whose CPU
updates run on a worker thread must not read those dicts while it runs:
users change them meanwhile (``scheduler.step()`` right after
``optimizer.step()``), and an update would take the next step's values. So
the wrapper steps a *twin* of the user's optimizer (``stepping_twin``): an
object of the same class sharing everything but its ``param_groups``, which
hold the masters and, copied in when no update reads them, the
hyperparameters of the step being run (GeminiOptimizer keeps one snapshot
with each CPU update; ZeroOptimizer copies them in before it queues the
step's updates). A wrapper that replaces the user's optimizer by its own
(ZeroOptimizer's CPUAdam for torch Adam/AdamW) copies in the same way every
key but those only one of the two optimizers' defaults have
(``foreign_keys``). Loading a checkpoint writes the loaded values back into
the user's groups.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

logger = logging.getLogger(__name__)


def stepping_twin(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class that shares its state, defaults,
    hooks and kernel buffers but has groups of its own (copies, to be given
    the masters). See [Note: the user's hyperparameters].

    Args:
        optimizer: the user's optimizer, already checked by the wrapper.

    Returns:
        The twin the wrapper steps.
    """
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    # An lr scheduler built on the user's optimizer wraps its step() in an
    # instance attribute that steps the user's object (their groups): the
    # twin steps through its class, without torch's hook wrapper
    # (``step_with_div_scale(..., hooks=False)``), so the user's step hooks,
    # which it shares, run from the wrapper's step() only.
    twin.__dict__.pop("step", None)
    twin.param_groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
    return twin


def refuse_user_state_dict(optimizer: torch.optim.Optimizer, api: str) -> None:
    """Make ``optimizer``'s ``state_dict`` and ``load_state_dict`` raise:
    the optimizer the user built, once a wrapper steps another object in its
    place (a twin or CPUAdam; see [Note: the user's hyperparameters]).

    [Note: the user's optimizer's state_dict] The states live in what the
    wrapper steps, keyed by its masters. The user's ``state_dict()`` gave
    an empty state (ZeroOptimizer's cpu_offload of Adam, stepped by
    CPUAdam), silently, so ``torch.save(optimizer.state_dict())`` with the
    object passed to ``booster.boost`` saved no Adam moment; or raised a
    bare ``KeyError`` (GeminiOptimizer, whose twin's masters are not in the
    user's groups). Its ``load_state_dict`` rebinds its own ``state``, which
    nothing steps: the loaded moments were never read, silently. Both raise
    now, naming the boosted optimizer's calls. The closures hold no
    reference to the optimizer (see [Note: hooks hold the optimizer weakly]).

    Args:
        optimizer: the user's optimizer, after the wrapper made what it steps.
        api: the wrapper's name, for the errors.
    """
    name = type(optimizer).__name__
    how = (
        f"this optimizer was handed to {api} (through booster.boost or directly), which steps "
        "its states in another object"
    )

    def state_dict() -> dict[str, Any]:
        raise RuntimeError(
            f"{name}.state_dict: {how}, so this one's would hold none of them (got the optimizer "
            "passed to booster.boost); save the optimizer booster.boost returned: "
            "booster.save_optimizer(optimizer, path), or its state_dict()"
        )

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        raise RuntimeError(
            f"{name}.load_state_dict: {how}, so a state loaded here would never be read (got the "
            "optimizer passed to booster.boost); load into the optimizer booster.boost returned: "
            "booster.load_optimizer(optimizer, path), or its load_state_dict()"
        )

    optimizer.state_dict = state_dict  # type: ignore[method-assign]
    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]


def refuse_user_add_param_group(optimizer: torch.optim.Optimizer, api: str, why: str) -> None:
    """Make ``optimizer``'s ``add_param_group`` raise: the optimizer the user
    built, once ``api`` took its groups over (``why``: what it steps in
    their place). A group added to it (the object passed to
    ``booster.boost`` rather than the one returned) was never stepped,
    silently. The closure holds no reference to the optimizer."""
    name = type(optimizer).__name__

    def add_param_group(param_group: Any) -> None:
        params = param_group.get("params") if isinstance(param_group, dict) else None
        count = 1 if isinstance(params, torch.Tensor) else len(list(params or ()))
        raise NotImplementedError(
            f"{name}.add_param_group: this optimizer was handed to {api} (through "
            f"booster.boost or directly), {why}; a group added now would never be stepped (got "
            f"a group of {count} tensors). Build the optimizer with every group before "
            f"booster.boost (or {api})"
        )

    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]


def with_user_step_hooks(step: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A wrapper's ``step()`` that runs the step pre-hooks registered on the
    user's optimizer (``register_step_pre_hook``, ``owner._user``) once a
    step, with the user's optimizer, as torch runs them before its step.

    [Note: the user's step hooks] Where the wrapper steps a twin (see [Note:
    the user's hyperparameters]) once per CPU update or chunk, or an
    optimizer of its own (CPUAdam for torch Adam), torch's step wrapper ran
    the user's hooks once per twin step (twice a step under Gemini's auto
    placement), with the twin as their optimizer: an lr a pre-hook set went
    into the twin's groups and was overwritten from the user's at the next
    step (the lr stayed halved once, where torch halves it every step), or
    the hooks never ran. Now a pre-hook runs once, before the step reads the
    user's hyperparameters: what it sets applies to this step and stays, as
    in torch. A post-hook raises ``NotImplementedError`` there: the updates
    run on a worker, chunk by chunk or call by call, after ``step()``
    returns, and no single point after them is the end of torch's step; call
    the code after ``optimizer.step()`` (after ``optimizer.wait_updates()``,
    on every rank, to read the step's values). torch's global hooks
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` and
    ``..._post_hook``: tools that count steps or track memory, such as
    torch's profiler step counter and MemTracker) run once a step too, with
    the user's optimizer, the post-hooks once the step's updates are done
    (``step()`` waits for them where there is one, only then); the inner
    steps run without torch's hook wrapper (``step_with_div_scale(...,
    hooks=False)``). Where the user's optimizer steps the masters itself
    (ZeRO without ``cpu_offload``), torch runs all these hooks, once, and
    this does nothing. A pre-hook that returns new arguments raises: the
    wrapper's step takes none."""

    @functools.wraps(step)
    def run(owner: Any) -> bool:
        user = owner._user
        if owner.optimizer is user:  # it steps itself: torch runs its hooks
            return step(owner)
        if getattr(user, "_optimizer_step_post_hooks", None):
            raise NotImplementedError(
                f"{type(user).__name__}: a step post-hook (register_step_post_hook) on the "
                "optimizer handed to booster.boost: its updates run on a worker, chunk by chunk "
                "or call by call, after step() returns (cpu_offload, GeminiPlugin), so there is "
                "no end of step to run it at; call that code after optimizer.step() (after "
                "optimizer.wait_updates(), on every rank, to read the step's values)"
            )
        for hook in [
            *_global_optimizer_pre_hooks.values(),
            *getattr(user, "_optimizer_step_pre_hooks", {}).values(),
        ]:
            if hook(user, (), {}) is not None:
                raise RuntimeError(
                    f"{type(user).__name__}: a step pre-hook returned new arguments for step(); "
                    "the optimizer booster.boost returned steps without arguments"
                )
        stepped = step(owner)
        if _global_optimizer_post_hooks:
            # After the updates, which run on a worker and read the
            # optimizer's state: a hook that reads it sees the step done.
            if not getattr(owner, "_said_post_hooks_wait", False):
                owner._said_post_hooks_wait = True
                logger.info(
                    "%s.step: torch's global optimizer post-hooks are registered (%d; torch's "
                    "profiler registers one under KINETO_USE_DAEMON): each step waits for its "
                    "updates before running them, so the CPU step no longer overlaps the next "
                    "forward",
                    type(owner).__name__,
                    len(_global_optimizer_post_hooks),
                )
            wait = getattr(owner, "wait_updates", None) or owner.module.wait_updates
            wait()
            for hook in list(_global_optimizer_post_hooks.values()):
                hook(user, (), {})
        return stepped

    return run


def foreign_keys(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> frozenset[str]:
    """Group keys that one optimizer's defaults have and the other's lack
    (e.g. torch AdamW's ``amsgrad`` and CPUAdam's ``adamw_mode``): never
    copied between their groups. Empty for a twin."""
    return frozenset(set(a.defaults) ^ set(b.defaults))


def hyperparameters(group: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``group``'s hyperparameters: every key but ``params`` and ``skip``."""
    return {k: v for k, v in group.items() if k != "params" and k not in skip}


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """What torch's lr schedulers look for on the optimizer they were built
    on (``_opt_called``, set by their wrapper of its ``step``, which the
    twin does not call): without it a scheduler built on the user's
    optimizer warns that it stepped before the optimizer did."""
    optimizer._opt_called = True  # type: ignore[attr-defined]
