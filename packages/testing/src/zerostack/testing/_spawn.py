"""Run a function on every rank of a real ``torch.distributed`` process group."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import gc
import importlib
import importlib.util
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Start-up (a rank importing fn's module, and torch where it starts fresh) is not
# counted in timeout_s, since it takes seconds on a loaded machine; it has its own limit.
_STARTUP_TIMEOUT_S = 60.0
# The parent waits min(this, timeout_s / 2) past timeout_s, so that a rank stuck
# in a collective can hit its own process-group timeout (and report where)
# before it is killed; the cap keeps short test timeouts short.
_DEADLINE_SLACK_S = 3.0
# Once a rank has failed, the others get this long to finish or report their own
# error (gloo peers of a dead rank fail fast; NCCL peers would hang to the timeout).
# Only a peer that hangs waits it out; 2 s cut off the reports of ranks that were
# merely slow on a loaded 2-core machine.
_FAILURE_GRACE_S = 10.0
# Between SIGTERM and SIGKILL.
_TERMINATE_GRACE_S = 2.0
# How long to wait for a stuck rank to write its stack dump after SIGUSR1.
_DUMP_WAIT_S = 1.0
_POLL_S = 0.05
_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
# Worker -> parent messages: (kind, rank, traceback text or None).
_STARTED = "started"  # imports done, about to join the process group
_DONE = "done"  # fn returned (None) or raised (its traceback)
# The environment multiprocessing's fork server started with, once this module
# started it; see [Note: ranks forked from a server that imported torch].
_server_environ: dict[str, str] | None = None
# Set by pytest for every test phase, read by nothing at start-up: left out of
# the comparison with the server's environment.
_IGNORED_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


class SpawnError(RuntimeError):
    """One or more ranks of :func:`spawn` failed, died, or did not finish in time.

    The message starts with ``rank <r> failed`` for the first rank that failed and
    holds every failing rank's traceback, first failure first; a timeout without
    any failure starts with ``timed out after``.

    Attributes:
        failed_ranks: ranks that raised or died, in the order the parent saw them.
        unfinished_ranks: ranks still running when the parent gave up on them;
            they were terminated.
    """

    def __init__(
        self,
        message: str,
        *,
        failed_ranks: tuple[int, ...] = (),
        unfinished_ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.unfinished_ranks = unfinished_ranks


@dataclass(frozen=True)
class _FnRef:
    """A module-level function named by module and qualname, plus the module's file."""

    module: str
    qualname: str
    file: str | None


def spawn(
    fn: Callable[..., object],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] | list[Any] = (),
    backend: str | None = None,
    timeout_s: float = 120.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes.

    Each process (forked from multiprocessing's fork server, which imported
    torch once, while the environment is the one it started with; else a
    fresh interpreter, start method "spawn") joins a process group
    through a file rendezvous in a fresh temporary directory, runs ``fn``, and
    destroys the group in a ``finally``. Each rank gets
    ``max(1, num_cpus // world_size)`` intra-op threads, so that ranks do not
    oversubscribe the machine, and OpenMP threads that sleep when idle
    (``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it; see [Note:
    OpenMP threads that sleep]).

    ``fn`` must be a module-level function, or a ``functools.partial`` of one:
    the child imports it by module name and, when that name is not importable
    (pytest's ``--import-mode=importlib``), loads it from the module's file.
    ``args`` (and a partial's bound arguments) are pickled by the parent and
    unpickled in the child after ``fn``'s module is imported, so they may be
    instances of classes defined in the test module. Any other callable is
    pickled whole, and its module must be importable by name in the child.

    Args:
        fn: called as ``fn(rank, world_size, *args)`` in each rank.
        world_size: number of ranks; 1 gives a real 1-rank group. Default 2.
        args: extra positional arguments, picklable. Default ``()``.
        backend: process-group backend. Default None: ``"nccl"`` when there is
            a CUDA device per rank (each rank then calls
            ``torch.cuda.set_device(rank)``), else ``"gloo"``.
        timeout_s: process-group timeout in each rank, and the parent's total
            wait for all ranks, plus ``min(3, timeout_s / 2)`` seconds of slack,
            counted from when the last rank has started (imported torch and
            ``fn``'s module; start-up has its own 60 s limit). Default 120.0.

    Raises:
        SpawnError: a rank raised (its traceback is in the message), died without
            reporting (its exit code is), or was still running at the deadline
            (its Python stack is, where the platform has SIGUSR1). Every rank is
            terminated and reaped before this is raised.
        TypeError: ``fn`` is not module-level, or ``fn``/``args`` do not pickle.
        ValueError: ``world_size``, ``timeout_s`` or ``backend`` is invalid.
    """
    backend = _check_args(world_size, args, backend, timeout_s)
    fn_ref, payload = _pack(fn, tuple(args))
    num_threads = max(1, _num_cpus() // world_size)

    tmpdir = tempfile.mkdtemp(prefix="zerostack-spawn-")
    init_method = Path(tmpdir, "rendezvous").as_uri()
    procs: list[multiprocessing.process.BaseProcess] = []
    queue = None
    logger.debug("spawn: %d ranks, backend %s, rendezvous %s", world_size, backend, init_method)
    try:
        with _child_environment(OMP_WAIT_POLICY="PASSIVE"):
            ctx = _context()
            queue = ctx.SimpleQueue()
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_worker,
                    args=(rank, world_size, backend, init_method, timeout_s, num_threads, tmpdir)
                    + (fn_ref, payload, queue, dict(os.environ), _CallerStdio()),
                    name=f"zerostack-spawn-rank{rank}",
                )
                proc.start()
                procs.append(proc)
        error = _supervise(procs, queue, timeout_s, tmpdir)
    finally:
        _reap(procs)
        if queue is not None:
            queue.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if error is not None:
        raise error


def _context() -> Any:  # a SpawnContext or a ForkServerContext
    """The multiprocessing context this spawn's ranks start from.

    [Note: ranks forked from a server that imported torch] A rank started as
    a fresh interpreter (start method "spawn") imports torch itself: about
    1.5 s of one core per rank, more than many tests' own work. On Linux,
    ranks fork from multiprocessing's fork server instead, which imports
    torch, torch.distributed and torch._dynamo once (torch's
    DistributedDataParallel imports the last: 1.1 s of a core on the 2-core
    CI machine in every rank that built the tests' reference model; nothing
    else: zerostack's modules, some of which read the environment at import,
    are imported by each rank). What a process reads from its environment when it starts
    (glibc's ``MALLOC_*``, libgomp's ``OMP_*``, the modules above) it reads
    in the server, which keeps the environment it started with: so ranks
    fork from it only while ``os.environ`` is what it was when spawn started
    the server (ignoring pytest's ``PYTEST_CURRENT_TEST``, which changes
    with every test and which nothing reads at start-up), and a spawn under
    any other environment (a test's ``monkeypatch.setenv``) starts fresh
    interpreters, as before; so does every spawn of a process whose fork
    server something else started (its environment is not known), and, for
    the process's life, of one whose first spawn ran under a changed
    environment. A forked rank installs the caller's ``os.environ`` before
    it loads ``fn``, and writes to the caller's standard output and error
    (passed to it as file descriptors), not the server's: under pytest's
    capture, what a rank prints shows in its own test's report. Nothing in
    the server initializes CUDA; importing torch leaves one native thread
    idle in it (a library's), as in every process that forks after
    importing torch (DataLoader workers on Linux, say). Not on macOS, where
    system frameworks that torch loads are not safe to fork. Unit sessions on a 2-core machine:
    gemini-placement 248 -> 146-155 s, booster-api 252 -> 152 s, zero-shard
    211 -> 124 s.
    """
    global _server_environ
    fresh = multiprocessing.get_context("spawn")
    if sys.platform != "linux":
        return fresh
    environ = {k: v for k, v in os.environ.items() if k not in _IGNORED_VARIABLES}
    if _server_environ is None:
        server = getattr(multiprocessing.forkserver, "_forkserver", None)
        if server is None or getattr(server, "_forkserver_pid", 0) is not None:
            return fresh  # already started by someone else (or an unknown Python)
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
        multiprocessing.forkserver.ensure_running()
        _server_environ = environ
        logger.debug("spawn: ranks fork from a server that imports torch")
    if environ != _server_environ:
        return fresh
    return multiprocessing.get_context("forkserver")


class _CallerStdio:
    """The caller's standard output and error, handed to a rank as file
    descriptors and put in place of its own as the rank unpickles its
    arguments, before ``fn``'s module loads: a rank forked from the fork
    server would otherwise write to the server's (see [Note: ranks forked
    from a server that imported torch])."""

    def __reduce__(self) -> tuple:
        fds: list[Any] = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed in the caller: the rank keeps its own
                fds.append(None)
            else:  # only while a process starts (the popen duplicates it for the child)
                fds.append(multiprocessing.reduction.DupFd(fd))
        return (_install_stdio, tuple(fds))


def _install_stdio(*wrapped: Any) -> None:
    for target, fd in zip((1, 2), wrapped, strict=True):
        if fd is not None:
            received = fd.detach()
            if received != target:
                os.dup2(received, target)
                os.close(received)


@contextlib.contextmanager
def _child_environment(**defaults: str) -> Iterator[None]:
    """Set the variables the environment lacks while the children start
    (they copy it then), and remove them again.

    [Note: OpenMP threads that sleep] torch's OpenMP threads spin while idle
    by default. A rank whose threads spin takes the cores its own main thread
    and the other ranks need once the machine has more runnable threads than
    cores: beside two busy loops on 2 cores, 40 steps of TinyGPT with 2
    threads took 16-29 s spinning and 0.4-0.6 s with ``OMP_WAIT_POLICY=PASSIVE``
    (1 thread: 0.4-1.4 s). libgomp reads the variable once, when torch loads
    it, so it must be in the environment the child starts with (or the fork
    server's: see [Note: ranks forked from a server that imported torch]).
    """
    added = [name for name in defaults if name not in os.environ]
    for name in added:
        os.environ[name] = defaults[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _check_args(world_size: int, args: object, backend: str | None, timeout_s: float) -> str:
    """spawn's arguments checked; returns the backend to use."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"spawn: world_size must be a positive int (got {world_size!r}); pass 1 or more"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ValueError(
            f"spawn: timeout_s must be a positive number of seconds (got {timeout_s!r}); "
            "pass e.g. 120.0"
        )
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"spawn: args must be a tuple or list (got {type(args).__name__}); "
            "write args=(x,) for a single argument"
        )
    if backend is None:
        return _default_backend(world_size)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"spawn: backend 'nccl' needs one CUDA device per rank (got world_size={world_size} "
            f"with {torch.cuda.device_count()} devices); use backend='gloo' or fewer ranks"
        )
    return backend


def _default_backend(world_size: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _num_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _pack(fn: Callable[..., object], args: tuple[Any, ...]) -> tuple[_FnRef | None, bytes]:
    """Name a plain function (or a partial's) by reference; pickle other callables whole."""
    fn_ref: _FnRef | None = None
    target, bound_args, bound_kwargs = fn, (), {}
    if isinstance(fn, functools.partial):
        target, bound_args, bound_kwargs = fn.func, fn.args, fn.keywords
    if isinstance(target, types.FunctionType):
        name = f"{target.__module__}.{target.__qualname__}"
        if "<" in target.__qualname__:
            raise TypeError(
                f"spawn: fn must be defined at module top level so that the child process "
                f"can import it (got {name}); move it out of the enclosing function"
            )
        module = sys.modules.get(target.__module__)
        if _lookup(module, target.__qualname__) is not target:
            raise TypeError(
                f"spawn: fn is not reachable as {name} (got a function shadowed or "
                "replaced under its own name); give it a unique module-level name"
            )
        # Never re-execute a __main__ script by path: multiprocessing already
        # re-imports it in the child as __mp_main__.
        file = None if target.__module__ == "__main__" else getattr(module, "__file__", None)
        fn_ref = _FnRef(target.__module__, target.__qualname__, file)
        obj: object = (bound_args, bound_kwargs, args)
    elif callable(fn):
        obj = (fn, args)
    else:
        raise TypeError(f"spawn: fn must be callable (got {type(fn).__name__}); pass a function")
    try:
        payload = pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(
            f"spawn: fn and args must be picklable (got {type(exc).__name__}: {exc}); "
            "pass module-level functions and plain data"
        ) from exc
    return fn_ref, payload


def _lookup(module: object, qualname: str) -> object:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _import_fn_module(ref: _FnRef) -> types.ModuleType:
    try:
        return importlib.import_module(ref.module)
    except ModuleNotFoundError as exc:
        # Only fall back when the module itself is missing, not one it imports.
        missing = exc.name or ""
        if ref.file is None or not (ref.module == missing or ref.module.startswith(missing + ".")):
            raise
    spec = importlib.util.spec_from_file_location(ref.module, ref.file)
    if spec is None or spec.loader is None:
        raise ImportError(f"spawn: cannot load {ref.module} from {ref.file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[ref.module] = module
    _insert_missing_parents(ref.module, module)
    spec.loader.exec_module(module)
    return module


def _insert_missing_parents(name: str, module: types.ModuleType) -> None:
    """Give a module loaded by path importable parents, as pytest's importlib mode does.

    Unpickling ``args`` whose classes live in ``pkg.tests.test_x`` runs
    ``__import__("pkg.tests.test_x")``, which needs ``pkg`` and ``pkg.tests``.
    """
    child_name, child = name, module
    while "." in child_name:
        parent_name, _, attr = child_name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is None:
            try:
                parent = importlib.import_module(parent_name)
            except ImportError:
                parent = types.ModuleType(parent_name)
                parent.__path__ = []
                sys.modules[parent_name] = parent
        setattr(parent, attr, child)
        child_name, child = parent_name, parent


def _load(fn_ref: _FnRef | None, payload: bytes) -> tuple[Callable[..., object], tuple[Any, ...]]:
    """Undo :func:`_pack` in the child: import ``fn``'s module, then unpickle."""
    if fn_ref is None:
        return pickle.loads(payload)
    module = _import_fn_module(fn_ref)
    fn = _lookup(module, fn_ref.qualname)
    if not callable(fn):
        raise AttributeError(f"spawn: {fn_ref.module}.{fn_ref.qualname} not found in the child")
    bound_args, bound_kwargs, args = pickle.loads(payload)
    if bound_args or bound_kwargs:
        fn = functools.partial(fn, *bound_args, **bound_kwargs)
    return fn, args


def _stack_file(tmpdir: str, rank: int) -> Path:
    return Path(tmpdir, f"stack-rank{rank}.txt")


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    num_threads: int,
    tmpdir: str,
    fn_ref: _FnRef | None,
    payload: bytes,
    queue: Any,
    environ: dict[str, str],
    stdio: None,  # _CallerStdio: installed as it was unpickled
) -> None:
    # A forked rank's environment is the fork server's, which differs from the
    # caller's in PYTEST_CURRENT_TEST at most: see [Note: ranks forked from a
    # server that imported torch].
    os.environ.clear()
    os.environ.update(environ)
    # Kept open for the life of the process: faulthandler writes a crash's stack
    # here, and every thread's stack on SIGUSR1, which the parent sends to a
    # rank that is stuck before terminating it.
    stack_file = open(_stack_file(tmpdir, rank), "w")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, file=stack_file, all_threads=True)
    error: str | None = None
    try:
        torch.set_num_threads(num_threads)
        fn, args = _load(fn_ref, payload)
        # Everything alive now (torch's and the test module's objects) out of
        # the cyclic collector's way: a full collection (the optimizers run one
        # at their first step) walked it all, 0.1-0.3 s apiece on the 2-core CI
        # machine. What fn makes is collected as before.
        gc.freeze()
        queue.put((_STARTED, rank, None))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            if backend == "gloo":
                # gloo connects every pair inside init_process_group, and a rank
                # can return from it while a peer still reads its side of the
                # handshake; a rank whose fn communicates nothing then exits and
                # its peer fails with "Connection closed by peer". A rank leaves
                # the barrier only once every rank has entered it, that is, has
                # returned from init_process_group. (NCCL connects at its first
                # collective: nothing to wait for.)
                dist.barrier()
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
    # A SimpleQueue writes synchronously, so the report is in the pipe before the
    # process exits; the parent relies on that to tell "died" from "reported".
    queue.put((_DONE, rank, error))
    # Run the atexit handlers, then leave without interpreter and C++ teardown:
    # the report is sent, and backend destructors at exit have aborted ranks
    # that had finished cleanly (SIGABRT, seen with gloo on 2-core machines).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    stack_file.flush()
    os._exit(0)


def _supervise(
    procs: list[multiprocessing.process.BaseProcess],
    queue: Any,
    timeout_s: float,
    tmpdir: str,
) -> SpawnError | None:
    """Wait for every rank; return the error to raise, or None when all succeeded."""
    started: set[int] = set()
    reported: set[int] = set()
    succeeded: set[int] = set()
    done: set[int] = set()
    failures: list[tuple[int, str]] = []
    first_failure_at: float | None = None
    unfinished: list[int] = []
    reason = ""
    slack_s = min(_DEADLINE_SLACK_S, timeout_s / 2)
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    running = False  # every rank has started; deadline now counts timeout_s
    while True:
        # Snapshot exits before draining: a rank that exited has written its report.
        exited = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
        new_reports = []
        while not queue.empty():
            kind, rank, error = queue.get()
            started.add(rank)
            if kind == _DONE:
                new_reports.append((rank, error))
        reported.update(rank for rank, _ in new_reports)
        # Deaths go first: a rank that died unannounced usually caused the errors
        # its peers reported within the same poll.
        for rank in exited:
            done.add(rank)
            if rank not in reported:
                failures.append((rank, _died_message(rank, procs[rank].exitcode, tmpdir)))
        for rank, error in new_reports:
            if error is None:
                succeeded.add(rank)
            else:
                failures.append((rank, f"rank {rank} failed:\n{error.rstrip()}"))
        for rank in exited:
            code = procs[rank].exitcode
            if rank in succeeded and code != 0:
                failures.append(
                    (
                        rank,
                        f"rank {rank} failed: it returned, then exited with {_describe_exit(code)}",
                    )
                )
        now = time.monotonic()
        if failures and first_failure_at is None:
            first_failure_at = now
        if not running and len(started) == len(procs):
            running = True
            deadline = now + timeout_s + slack_s
            logger.debug("spawn: every rank started; timeout_s counts from here")
        alive = [r for r in range(len(procs)) if r not in done]
        if not alive:
            break
        if now >= deadline:
            unfinished = alive
            if running:
                reason = f"timed out after {timeout_s:g}s (+{slack_s:g}s slack)"
            else:
                reason = f"timed out after {_STARTUP_TIMEOUT_S:g}s of start-up"
            break
        if first_failure_at is not None and now >= first_failure_at + _FAILURE_GRACE_S:
            unfinished = alive
            reason = f"{_FAILURE_GRACE_S:g}s after rank {failures[0][0]} failed"
            break
        multiprocessing.connection.wait([procs[r].sentinel for r in alive], timeout=_POLL_S)

    return _spawn_error(
        procs, failures, unfinished, reason, first_failure_at is None, running, tmpdir
    )


def _spawn_error(
    procs: list[multiprocessing.process.BaseProcess],
    failures: list[tuple[int, str]],
    unfinished: list[int],
    reason: str,
    no_failure: bool,
    running: bool,
    tmpdir: str,
) -> SpawnError | None:
    """The error for how supervision ended (None: every rank succeeded),
    with the stacks of the ranks still running."""
    if not failures and not unfinished:
        return None
    parts = [text for _, text in failures]
    if unfinished:
        stacks = _dump_stacks(procs, unfinished, tmpdir)
        summary = f"ranks {unfinished} still running; terminated them"
        if no_failure:
            parts.insert(0, f"{reason}; {summary}")
            if running:
                parts[0] += (
                    "\n(a rank stuck in a collective usually means the ranks disagree on "
                    "the order or number of collectives)"
                )
        else:
            parts.append(f"{reason}: {summary}")
        parts.extend(stacks)
    return SpawnError(
        "\n\n".join(parts),
        failed_ranks=tuple(r for r, _ in failures),
        unfinished_ranks=tuple(unfinished),
    )


def _dump_stacks(
    procs: list[multiprocessing.process.BaseProcess], ranks: list[int], tmpdir: str
) -> list[str]:
    """Ask stuck ranks for their Python stacks (SIGUSR1 -> faulthandler) and read them."""
    if _DUMP_SIGNAL is None:
        return []
    for rank in ranks:
        # A rank still importing has no handler yet and dies of the signal: it is
        # being terminated anyway.
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, _DUMP_SIGNAL)  # type: ignore[arg-type]
    end = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < end:
        if all(_has_stack(tmpdir, r) for r in ranks):
            break
        time.sleep(_POLL_S)
    time.sleep(_POLL_S)  # let a dump in progress finish
    return [
        text.lstrip()
        for r in ranks
        if (text := _read_stack(tmpdir, r, f"rank {r} stack when terminated"))
    ]


def _has_stack(tmpdir: str, rank: int) -> bool:
    try:
        return _stack_file(tmpdir, rank).stat().st_size > 0
    except OSError:
        return False


def _read_stack(tmpdir: str, rank: int, title: str) -> str:
    try:
        text = _stack_file(tmpdir, rank).read_text(errors="replace").strip()
    except OSError:
        return ""
    return f"\n{title}:\n{text}" if text else ""


def _died_message(rank: int, code: int | None, tmpdir: str) -> str:
    return (
        f"rank {rank} failed: the process died without reporting ({_describe_exit(code)}); "
        "os._exit, a crash in native code or the OOM killer end a process this way"
        + _read_stack(tmpdir, rank, "stack at the crash")
    )


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _reap(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate, then kill, whatever is still running, and join every process."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
