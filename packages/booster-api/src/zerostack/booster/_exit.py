"""A finished job exits 0: the process groups are torn down before the
interpreter finalizes.

[Note: exit code under gloo] A gloo process group runs each collective on a
worker thread of its own (``ProcessGroupGloo::runLoop``), which drops its
reference to the collective's work object, and with it the tensors the
work holds, a moment after ``wait()`` returned on the main thread. A tensor
that Python has seen owns a Python object, so that drop takes the GIL. When
the script ends right after its last collective and the worker runs late
(a busy machine), the drop comes during ``Py_FinalizeEx``: CPython ends a
thread that asks for the GIL then with ``pthread_exit``, whose forced unwind
crosses a ``noexcept`` destructor, and the process aborts with "terminate
called without an active exception" (exit code -6; torchrun reports the run
failed, a scheduler retries it). This is torch's
https://github.com/pytorch/pytorch/issues/190489 (the decref guards on
``Py_IsInitialized``, not on finalization); measured here with torch 2.13
on two CPU ranks: a script whose last line is a waited ``all_reduce``
aborted in 7 of 30 launches.

``torch.distributed.destroy_process_group()`` removes the cause only if it
destroys the C++ process group, whose destructor joins the worker threads
while the interpreter is alive; it does not while anything else still holds
the group (torch's DistributedDataParallel does, through its reducer, its
logger and ``process_group``), and gloo's ``shutdown()`` does not join them.
So at exit (an ``atexit`` handler, which runs before finalization, while a
worker can still take the GIL) this module releases the group from the DDP
modules TorchDDPPlugin built and destroys every process group; once the
last reference goes the destructor joins the workers. A group still held
elsewhere after that (a reference in the user's code) cannot be joined: a
warning says so and the teardown waits a moment (0.2 s, the GIL released)
for the workers to drop what they hold, which makes the abort rarer but
does not rule it out. After an uncaught exception it does nothing (a collective of this rank may still be waiting
for a peer, and joining its worker would wait for the group's timeout):
the run fails either way. Only gloo groups are torn down (NCCL's are left
as torch leaves them).
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
import time
import weakref
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

# DistributedDataParallel modules built by TorchDDPPlugin: released at exit.
_DDP_MODULES: weakref.WeakSet = weakref.WeakSet()
_STATE = {"registered": False, "uncaught": False}


def track_ddp(module: Any) -> None:
    """Release ``module``'s (a torch DDP) process group at exit. See [Note:
    exit code under gloo]."""
    _DDP_MODULES.add(module)
    register()


def register() -> None:
    """Tear the process groups down at exit (once per process). See [Note:
    exit code under gloo]."""
    if _STATE["registered"]:
        return
    _STATE["registered"] = True
    previous = sys.excepthook

    def excepthook(kind, value, traceback):  # the run failed: leave the groups alone
        _STATE["uncaught"] = True
        previous(kind, value, traceback)

    sys.excepthook = excepthook
    atexit.register(_teardown)


def _uses_gloo() -> bool:
    return "gloo" in str(dist.get_backend())


def _groups() -> list:
    """The live process groups: the default one and torch's registry of the
    others (private; the default group alone where it moved)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {})
    return groups or [dist.group.WORLD]


def _teardown() -> None:
    if _STATE["uncaught"] or not dist.is_available():
        return
    initialized = dist.is_initialized()
    if initialized and not _uses_gloo():
        return
    for module in list(_DDP_MODULES):
        # The reducer and the logger hold the group in C++; nothing steps the
        # model any more (the interpreter is exiting).
        for name in ("reducer", "logger"):
            module.__dict__.pop(name, None)
        module.__dict__["process_group"] = None
    _DDP_MODULES.clear()
    groups = []
    if initialized:
        groups = [weakref.ref(pg) for pg in _groups()]
        dist.destroy_process_group()
    gc.collect()  # a group held in a reference cycle goes now, not at finalization
    alive = [ref() for ref in groups if ref() is not None]
    if alive:
        logger.warning(
            "zerostack: %d process group(s) are still referenced at exit, so gloo's worker "
            "threads cannot be joined before the interpreter finalizes and the exit may abort "
            "(pytorch/pytorch#190489); drop your references to the group (and to torch DDP "
            "modules not built by TorchDDPPlugin) before the script ends",
            len(alive),
        )
        time.sleep(0.2)
