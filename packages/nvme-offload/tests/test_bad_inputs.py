"""The bad-input matrix of StateSwapper and PrefetchPipeline (issue 17).

One row per bad call: the error type, a regex that names the argument (or
the misused call) and the value got, and whether this table's work added the
check (``fixed``: before it the call gave an unclear error or was accepted).
Every row also checks that the failed call changed nothing (registered keys,
reserved bytes, files, and the values on disk) and that the swapper still
works: a pipeline pass over every key round-trips.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from zerostack.nvme import StateSwapper, tensornvme_backends
from zerostack.testing import BadInput, check_bad_input, check_unique_ids, one_torch_thread

VALUES = {"a": torch.arange(8.0), "b": torch.ones(4)}


@pytest.fixture
def env(tmp_path):
    swapper = StateSwapper(tmp_path / "states", backend="threads", prefetch_depth=1)
    for key, value in VALUES.items():
        swapper.register(key, value.numel())
        swapper.write(key, value.clone())
    swapper.register("c", 2)  # never written
    yield {"s": swapper, "tmp": tmp_path}
    swapper.close()


def _snapshot(env: dict[str, Any]) -> dict[str, Any]:
    s = env["s"]
    return {
        "numel": dict(s._numel),
        "on_disk": set(s._on_disk),
        "reserved": s.reserved_bytes,
        "files": sorted(os.listdir(s.workdir)),
        # Work directories left anywhere under tmp (a failed constructor leaves none).
        "workdirs": sorted(str(p) for p in env["tmp"].rglob("zerostack-nvme-*")),
    }


def _values_kept(s: StateSwapper) -> None:
    for key, value in VALUES.items():
        assert torch.equal(s.read(key, torch.empty_like(value)), value), key


def _swapper(directory, backend="threads", **kwargs):
    return lambda env: StateSwapper(directory, backend=backend, **kwargs)


def _a_file(env):
    path = env["tmp"] / "a-file"
    path.write_text("")
    return StateSwapper(path, backend="threads")


def _pipe(env):
    pipe = env["pipe"] = env["s"].pipeline(list(VALUES))
    pipe.pre_step()
    return pipe


def _closed_then(fn):
    def call(env):
        other = StateSwapper(env["tmp"] / "other", backend="threads")
        other.register("x", 2)
        other.close()
        fn(other)

    return call


_UNAVAILABLE = next((b for b in ("uring", "aio") if b not in tensornvme_backends()), None)

CASES = [
    # -- StateSwapper(...) ---------------------------------------------------------
    BadInput("directory-int", _swapper(3), TypeError, r"nvme: the offload directory must be a path or None \(got 3\)", True),
    BadInput("directory-is-a-file", _a_file, ValueError, r"nvme: cannot create or write the offload directory '.*a-file'"),
    BadInput("backend-unknown", _swapper(None, backend="nvme"), ValueError, r"nvme: unknown backend \(got 'nvme'\); use one of uring, aio, threads"),
    BadInput("backend-int", _swapper(None, backend=3), ValueError, r"nvme: unknown backend \(got 3\)"),
    BadInput("depth-0", _swapper(None, prefetch_depth=0), ValueError, r"nvme: prefetch_depth must be an int >= 1 \(got 0\)"),
    BadInput("depth-str", _swapper(None, prefetch_depth="2"), ValueError, r"nvme: prefetch_depth must be an int >= 1 \(got '2'\)"),
    BadInput("depth-bool", _swapper(None, prefetch_depth=True), ValueError, r"nvme: prefetch_depth must be an int >= 1 \(got True\)"),
    # -- register --------------------------------------------------------------------
    BadInput("register-key-int", lambda env: env["s"].register(3, 4), TypeError, r"nvme: register: key must be a str \(got 3\)", True),
    BadInput("register-numel-0", lambda env: env["s"].register("c", 0), ValueError, r"nvme: register: numel must be an int >= 1 \(got 0\)", True),
    BadInput("register-numel-negative", lambda env: env["s"].register("c", -4), ValueError, r"numel must be an int >= 1 \(got -4\)", True),
    BadInput("register-numel-float", lambda env: env["s"].register("c", 2.5), ValueError, r"numel must be an int >= 1 \(got 2\.5\)", True),
    BadInput("register-other-size", lambda env: env["s"].register("a", 9), ValueError, r"nvme: key 'a' registered again with another size \(got numel 9, registered with 8\)", True),
    # -- write / read ------------------------------------------------------------------
    BadInput("write-unregistered", lambda env: env["s"].write("zz", torch.zeros(2)), RuntimeError, r"nvme: key 'zz' was not registered"),
    BadInput("write-list", lambda env: env["s"].write("b", [1.0] * 4), TypeError, r"nvme: write: the buffer must be a tensor \(got list\)", True),
    BadInput("write-float64", lambda env: env["s"].write("b", torch.zeros(4, dtype=torch.float64)), TypeError, r"nvme: write: the buffer for 'b' must be float32 \(got torch\.float64\)", True),
    BadInput("write-int32", lambda env: env["s"].write("b", torch.zeros(4, dtype=torch.int32)), TypeError, r"must be float32 \(got torch\.int32\)", True),
    BadInput("write-wrong-numel", lambda env: env["s"].write("b", torch.zeros(5)), ValueError, r"nvme: write: the buffer for 'b' must be a contiguous CPU tensor of 4 elements \(got 5 elements on cpu", True),
    BadInput("write-meta", lambda env: env["s"].write("b", torch.zeros(4, device="meta")), ValueError, r"must be a contiguous CPU tensor of 4 elements \(got 4 elements on meta", True),
    BadInput("write-noncontiguous", lambda env: env["s"].write("a", torch.zeros(4, 2).t()), ValueError, r"\(got 8 elements on cpu, contiguous=False\)", True),
    BadInput("read-never-written", lambda env: env["s"].read("c", torch.zeros(2)), RuntimeError, r"nvme: key 'c' was never written"),
    BadInput("read-wrong-numel", lambda env: env["s"].read("a", torch.zeros(3)), ValueError, r"nvme: read: the buffer for 'a' must be .* of 8 elements \(got 3 elements", True),
    BadInput("read-float16", lambda env: env["s"].read("a", torch.zeros(8, dtype=torch.float16)), TypeError, r"nvme: read: the buffer for 'a' must be float32 \(got torch\.float16\)", True),
    # -- pipeline ------------------------------------------------------------------------
    BadInput("pipeline-unregistered", lambda env: env["s"].pipeline(["a", "zz"]), ValueError, r"nvme: pipeline: keys not registered \(got \['zz'\]\)", True),
    BadInput("pipeline-str", lambda env: env["s"].pipeline("ab"), TypeError, r"nvme: pipeline: keys must be a sequence of keys \(got 'ab'\)", True),
    BadInput("pre_update-out-of-range", lambda env: _pipe(env).pre_update(2), ValueError, r"PrefetchPipeline\.pre_update: i must be an int in \[0, 2\) \(got 2\)", True),
    BadInput("pre_update-negative", lambda env: _pipe(env).pre_update(-1), ValueError, r"pre_update: i must be an int in \[0, 2\) \(got -1\)", True),
    BadInput("post_update-before-pre_update", lambda env: _pipe(env).post_update(0), RuntimeError, r"PrefetchPipeline\.post_update\(0\) without pre_update\(0\)", True),
    BadInput("post_update-twice", lambda env: (p := _pipe(env), p.pre_update(0), p.post_update(0), p.post_update(0)), RuntimeError, r"post_update\(0\) without pre_update\(0\)", True),
    # -- a closed swapper ------------------------------------------------------------------
    BadInput("closed-write", _closed_then(lambda s: s.write("x", torch.zeros(2))), RuntimeError, r"nvme: write: the swapper is closed", True),
    BadInput("closed-read", _closed_then(lambda s: s.read("x", torch.zeros(2))), RuntimeError, r"nvme: read: the swapper is closed", True),
    BadInput("closed-register", _closed_then(lambda s: s.register("y", 2)), RuntimeError, r"nvme: register: the swapper is closed", True),
    BadInput("closed-pipeline", _closed_then(lambda s: s.pipeline(["x"])), RuntimeError, r"nvme: pipeline: the swapper is closed", True),
]  # fmt: skip
if _UNAVAILABLE is not None:
    CASES.append(
        BadInput(
            f"backend-{_UNAVAILABLE}-unavailable",
            _swapper(None, backend=_UNAVAILABLE),
            ValueError,
            rf"nvme: backend '{_UNAVAILABLE}' is not available",
        )
    )


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: BadInput, env: dict[str, Any]) -> None:
    check_bad_input(case, env, _snapshot, _still_works, cleanup=_cancel_pipe)


def _cancel_pipe(env: dict[str, Any]) -> None:
    if "pipe" in env:  # a pass that failed half-way is cancelled, as a user would
        env.pop("pipe").cancel()


def _still_works(env: dict[str, Any]) -> None:
    """The values are kept, and a whole pipeline pass adds one to every key."""
    s = env["s"]
    _values_kept(s)
    pipe = _pipe(env)
    for i in range(len(VALUES)):
        pipe.pre_update(i).add_(1)
        pipe.post_update(i)
    pipe.post_step()
    for key, value in VALUES.items():
        assert torch.equal(s.read(key, torch.empty_like(value)), value + 1), key


def test_the_table_names_every_case_once() -> None:
    check_unique_ids(CASES)
