"""spawn(): real process groups, and every way a rank can fail.

The CPU cases pass backend="gloo" so that they test the same thing on a GPU host.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from zerostack.testing import SpawnError, _spawn, spawn


@dataclass(frozen=True)
class _Case:
    """A test-module class passed through args: the child must import this module first."""

    base: float
    backend: str = "gloo"
    wait_policy: str = "PASSIVE"  # OMP_WAIT_POLICY the ranks must see


def _record_group_state_at_exit(path: str, rank: int) -> None:
    # Runs after spawn's worker returns: shows whether it destroyed the group.
    def record() -> None:
        with open(f"{path}.{rank}", "w") as f:
            f.write("initialized" if dist.is_initialized() else "destroyed")

    atexit.register(record)


def _assert_groups_destroyed(path, world_size: int) -> None:
    states = [path.with_name(f"{path.name}.{r}").read_text() for r in range(world_size)]
    assert states == ["destroyed"] * world_size


def _all_reduce_sums(rank: int, world_size: int, case: _Case, path: str = "") -> None:
    if path:
        _record_group_state_at_exit(path, rank)
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise AssertionError(f"rank {rank}: group has rank {dist.get_rank()}")
    if dist.get_backend() != case.backend:
        raise AssertionError(f"rank {rank}: backend {dist.get_backend()}, not {case.backend}")
    t = torch.full((3,), case.base + rank)
    dist.all_reduce(t)
    expected = sum(case.base + r for r in range(world_size))
    if not torch.equal(t, torch.full((3,), expected)):
        raise AssertionError(f"rank {rank}: all_reduce gave {t.tolist()}, expected {expected}")
    if torch.get_num_threads() != max(1, len(os.sched_getaffinity(0)) // world_size):
        raise AssertionError(f"rank {rank}: {torch.get_num_threads()} threads")
    # What libgomp read: the environment the process started with.
    linux = sys.platform == "linux"
    policy = _at_start_up("OMP_WAIT_POLICY") if linux else os.environ.get("OMP_WAIT_POLICY")
    if policy != case.wait_policy:
        raise AssertionError(f"rank {rank}: started with OMP_WAIT_POLICY={policy}")


def test_all_reduce_sums_across_two_ranks(tmp_path, monkeypatch) -> None:
    # Ranks get OpenMP threads that sleep (see [Note: OpenMP threads that
    # sleep]); the parent's environment is left as it was.
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    case = _Case(base=10.0)
    spawn(_all_reduce_sums, 2, args=(case, str(tmp_path / "state")), backend=case.backend)
    _assert_groups_destroyed(tmp_path / "state", 2)
    assert "OMP_WAIT_POLICY" not in os.environ


def test_world_size_one_is_a_real_group_and_partials_work(monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice is kept
    case = _Case(base=3.0, wait_policy="ACTIVE")
    spawn(functools.partial(_all_reduce_sums, case=case), 1, backend="gloo")


def _at_start_up(name: str) -> str | None:
    """``name`` in the environment this process started with (what glibc and
    libgomp read), not ``os.environ``; None where Linux's /proc is missing."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    found = [e[len(prefix) :].decode() for e in entries if e.startswith(prefix)]
    return found[0] if found else None


def _environment_has(
    rank: int, world_size: int, name: str, value: str | None, caller: int, forked: bool
) -> None:
    if os.environ.get(name) != value:
        raise AssertionError(f"rank {rank}: {name}={os.environ.get(name)!r}, expected {value!r}")
    # What the process started with, too, but for the variable spawn ignores.
    if name != "PYTEST_CURRENT_TEST" and _at_start_up(name) != value:
        raise AssertionError(f"rank {rank}: started with {name}={_at_start_up(name)!r}")
    # A rank forked from the fork server is that server's child, not the caller's.
    if (os.getppid() != caller) != forked:
        raise AssertionError(f"rank {rank}: forked from the fork server is not {forked}")


def _print_on_both(rank: int, world_size: int, label: str) -> None:
    print(f"rank {rank} {label} on stdout", flush=True)
    print(f"rank {rank} {label} on stderr", file=sys.stderr, flush=True)


# In a fresh interpreter, so that this script's first spawn starts the fork server.
_FORK_OR_FRESH = """
import os, sys
sys.path.insert(0, sys.argv[1])
from test_spawn import _environment_has
from zerostack.testing import spawn

name = "ZEROSTACK_SPAWN_TEST_VARIABLE"
os.environ.pop(name, None)
spawn(_environment_has, 2, args=(name, None, os.getpid(), True), backend="gloo")
for test in ("a", "b"):  # pytest's, set for every test: ranks still fork, and see it
    os.environ["PYTEST_CURRENT_TEST"] = test
    args = ("PYTEST_CURRENT_TEST", test, os.getpid(), True)
    spawn(_environment_has, 2, args=args, backend="gloo")
for value in ("first", "second"):
    os.environ[name] = value
    spawn(_environment_has, 2, args=(name, value, os.getpid(), False), backend="gloo")
del os.environ[name]
spawn(_environment_has, 2, args=(name, None, os.getpid(), True), backend="gloo")
print("ok")
"""
# The fork server starts while the script's output is a pipe; then it is a file.
_OUTPUT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from test_spawn import _print_on_both
from zerostack.testing import spawn

spawn(_print_on_both, 2, args=("first",), backend="gloo")
with open(sys.argv[2], "w") as f:
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
spawn(_print_on_both, 2, args=("second",), backend="gloo")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ranks fork from the fork server on Linux")
def test_ranks_fork_from_the_server_only_under_its_environment() -> None:
    # What a process reads from its environment at start-up (glibc, libgomp,
    # modules at import) must be the caller's: see [Note: ranks forked from a
    # server that imported torch].
    done = subprocess.run(
        [sys.executable, "-c", _FORK_OR_FRESH, os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_ranks_print_where_the_caller_prints_now(tmp_path) -> None:
    # A rank forked from the fork server writes to the caller's standard
    # output and error of the call, not to the server's (under pytest's
    # capture, another test's).
    done = subprocess.run(
        [sys.executable, "-c", _OUTPUT, os.path.dirname(__file__), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    later = (tmp_path / "out").read_text()
    for rank in range(2):
        for stream in ("stdout", "stderr"):
            assert f"rank {rank} first on {stream}" in getattr(done, stream)
            assert f"rank {rank} second on {stream}" in later, (later, done.stdout, done.stderr)
            assert f"rank {rank} second" not in getattr(done, stream)


def test_default_backend_is_nccl_only_with_a_gpu_per_rank(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _spawn._default_backend(2) == "nccl"
    assert _spawn._default_backend(3) == "gloo"
    with pytest.raises(ValueError, match=r"spawn: backend 'nccl' needs one CUDA device per rank"):
        spawn(_all_reduce_sums, 3, args=(_Case(base=0.0),), backend="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _spawn._default_backend(1) == "gloo"


def _all_reduce_on_cuda(rank: int, world_size: int) -> None:
    if dist.get_backend() != "nccl" or torch.cuda.current_device() != rank:
        raise AssertionError(
            f"rank {rank}: backend {dist.get_backend()}, device {torch.cuda.current_device()}"
        )
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    expected = world_size * (world_size + 1) / 2
    if t.tolist() != [expected] * 4:
        raise AssertionError(f"rank {rank}: all_reduce gave {t.tolist()}, expected {expected}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_backend_on_gpus_is_nccl_with_one_device_per_rank() -> None:
    spawn(_all_reduce_on_cuda, torch.cuda.device_count())


def _raise_on_every_rank(rank: int, world_size: int, path: str) -> None:
    _record_group_state_at_exit(path, rank)
    if rank == 0:
        # Rank 1 fails first: rank 0 raises once the parent has reaped rank 1,
        # which it does in the same poll that reads rank 1's report.
        pid = int(_wait_for_file(f"{path}.pid1"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        raise KeyError("key of rank 0")
    with open(f"{path}.pid1.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.pid1.tmp", f"{path}.pid1")
    raise ValueError("bad value on rank 1")


def _wait_for_file(path: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def test_exceptions_are_reported_with_ranks_and_tracebacks_first_failure_first(
    tmp_path,
) -> None:
    with pytest.raises(SpawnError, match=r"^rank 1 failed") as info:
        spawn(_raise_on_every_rank, 2, args=(str(tmp_path / "state"),), backend="gloo")
    message = str(info.value)
    assert "ValueError: bad value on rank 1" in message
    assert "in _raise_on_every_rank" in message  # the child's traceback, not just the text
    assert message.index("bad value on rank 1") < message.index("rank 0 failed")
    assert message.index("rank 0 failed") < message.index("KeyError: 'key of rank 0'")
    assert info.value.failed_ranks == (1, 0)
    assert info.value.unfinished_ranks == ()
    assert isinstance(info.value, RuntimeError)
    _assert_groups_destroyed(tmp_path / "state", 2)


def _hang_in_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)  # never joins the all_reduce
    dist.all_reduce(torch.ones(1))


def _seconds_since_every_rank_started(caplog) -> float:
    """Seconds from when spawn's parent saw every rank start (timeout_s counts
    from there; start-up, seconds on a loaded machine, does not) until now."""
    [started] = [r for r in caplog.records if "every rank started" in r.getMessage()]
    return time.time() - started.created


def test_hung_collective_fails_within_the_timeout_and_names_the_rank(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="zerostack.testing._spawn")
    with pytest.raises(SpawnError) as info:
        spawn(_hang_in_collective, 2, backend="gloo", timeout_s=2.0)
    elapsed = _seconds_since_every_rank_started(caplog)
    # timeout_s + 1 s slack, a stack dump and termination; rank 1 would sleep an hour.
    assert elapsed < 10.0, elapsed
    # Rank 0 fails in its all_reduce once the gloo timeout fires, unless a slow
    # start-up on a loaded machine lets the parent's deadline come first.
    assert re.search(r"ranks \[(0, )?1\] still running", str(info.value)), info.value
    assert 1 in info.value.unfinished_ranks
    # Rank 1's Python stack, dumped before it was terminated, shows where it hung.
    assert "rank 1 stack when terminated" in str(info.value)
    assert "_hang_in_collective" in str(info.value)


def _record_pid_then_sleep_on_rank_1(rank: int, world_size: int, path: str) -> None:
    with open(f"{path}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)


def test_timeout_names_the_ranks_still_running_and_reaps_them(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="zerostack.testing._spawn")
    with pytest.raises(
        SpawnError, match=r"^timed out after 2s .*; ranks \[1\] still running"
    ) as info:
        spawn(
            _record_pid_then_sleep_on_rank_1,
            2,
            args=(str(tmp_path / "pid"),),
            backend="gloo",
            timeout_s=2.0,
        )
    assert _seconds_since_every_rank_started(caplog) < 10.0
    assert info.value.failed_ranks == ()
    assert info.value.unfinished_ranks == (1,)
    for rank in range(2):
        pid = int((tmp_path / f"pid.{rank}").read_text())
        # A reaped child no longer exists, not even as a zombie.
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _die_in_three_ways(rank: int, world_size: int) -> None:
    dist.barrier()  # every rank finishes connecting before any dies
    if rank == 0:
        ctypes.string_at(0)  # segfault
    if rank == 1:
        os._exit(3)
    atexit.register(os._exit, 5)  # rank 2 returns, then exits badly


def test_ranks_dying_give_their_exit_status() -> None:
    with pytest.raises(SpawnError, match=r"^rank [012] failed") as info:
        spawn(_die_in_three_ways, 3, backend="gloo")
    message = str(info.value)
    assert "rank 0 failed: the process died without reporting (killed by SIGSEGV)" in message
    assert "rank 1 failed: the process died without reporting (exit code 3)" in message
    assert "rank 2 failed: it returned, then exited with exit code 5" in message
    # faulthandler's dump of the crashing rank.
    assert "in _die_in_three_ways" in message
    assert sorted(info.value.failed_ranks) == [0, 1, 2]


def _sleep_then(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class _SlowToLoad:
    """An argument whose unpickling in a rank (part of its start-up) takes
    ``seconds``: the start-up outlasts a short limit however fast the fork
    server forks (a rank forked from it once started inside 0.1 s)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[Callable[[float], float], tuple[float]]:
        return _sleep_then, (self.seconds,)


def _takes(rank: int, world_size: int, x: object) -> None:
    return None


def test_start_up_has_its_own_limit(monkeypatch) -> None:
    monkeypatch.setattr(_spawn, "_STARTUP_TIMEOUT_S", 0.1)
    with pytest.raises(
        SpawnError, match=r"^timed out after 0.1s of start-up; ranks \[0, 1\] still running"
    ):
        spawn(_takes, 2, args=(_SlowToLoad(2.0),), backend="gloo")


def _check_arg(rank: int, world_size: int, expected: str) -> None:
    if expected != "partial":
        raise AssertionError(f"rank {rank}: got {expected!r}")


@dataclass(frozen=True)
class _Scale:
    factor: int

    def __call__(self, rank: int, world_size: int, x: int) -> int:
        return self.factor * x


def _offset(rank: int, world_size: int, x: int, *, offset: int) -> int:
    return x + offset


def test_callables_survive_the_trip_to_the_child() -> None:
    # _pack/_load are what parent and child run; checked in-process to save spawns.
    ref, payload = _spawn._pack(_Scale(3), (2,))
    assert ref is None  # pickled whole
    fn, args = _spawn._load(ref, payload)
    assert fn(0, 1, *args) == 6
    ref, payload = _spawn._pack(functools.partial(_offset, offset=10), [5])
    assert ref is not None and (ref.module, ref.qualname) == (__name__, "_offset")
    assert ref.file == __file__
    fn, args = _spawn._load(ref, payload)
    assert fn(0, 1, *args) == 15


def test_local_function_is_refused_in_the_parent() -> None:
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match=r"spawn: fn must be defined at module top level"):
        spawn(local, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, r"spawn: world_size must be a positive int \(got 0\)"),
        ({"timeout_s": 0}, ValueError, r"spawn: timeout_s must be a positive number"),
        ({"args": 5}, TypeError, r"spawn: args must be a tuple or list \(got int\)"),
        ({"args": (lambda: 0,)}, TypeError, r"spawn: fn and args must be picklable"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, error, match) -> None:
    kwargs = {"world_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        spawn(_check_arg, **kwargs)


def test_child_loads_fn_by_path_when_its_module_name_is_not_importable(
    tmp_path, monkeypatch
) -> None:
    # What a child does under pytest's --import-mode=importlib, where a test module
    # is named after its path ("pkg.tests.test_q") but no sys.path entry leads there.
    # Run in-process, as spawning would cost seconds.
    source = tmp_path / "test_q.py"
    source.write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class Box:\n"
        "    v: int\n"
        "def fn(rank, world_size, box):\n"
        "    return box.v\n"
    )
    name = "zs_missing_pkg.tests.test_q"
    names = [name, "zs_missing_pkg.tests", "zs_missing_pkg"]
    for key in names:  # removed again at teardown
        monkeypatch.delitem(sys.modules, key, raising=False)
    module = _spawn._import_fn_module(_spawn._FnRef(name, "fn", str(source)))
    # Pack a Box as the parent would, then load it as a fresh child does.
    ref, payload = _spawn._pack(module.fn, (module.Box(5),))
    assert ref == _spawn._FnRef(name, "fn", str(source))
    for key in names:
        del sys.modules[key]
    fn, (box,) = _spawn._load(ref, payload)
    assert fn(0, 1, box) == 5
    assert type(box).__module__ == name
    # Without the file there is no fallback, and the import error stands.
    for key in names:
        del sys.modules[key]
    with pytest.raises(ModuleNotFoundError, match="zs_missing_pkg"):
        _spawn._load(dataclasses.replace(ref, file=None), payload)
