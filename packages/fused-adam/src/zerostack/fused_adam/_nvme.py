"""Adam states on disk: the bridge from the optimizers to zerostack-nvme.

Imported only when ``nvme_offload_fraction > 0``; zerostack-nvme is the
optional extra ``zerostack-fused-adam[nvme]``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _import_nvme() -> Any:
    try:
        import zerostack.nvme as nvme
    except ImportError:
        raise ImportError(
            "nvme_offload_fraction > 0 needs zerostack-nvme: "
            "pip install 'zerostack-fused-adam[nvme]' (or pip install zerostack-nvme)"
        ) from None
    return nvme


# Largest piece of a parameter swapped as one unit. Pieces bound the RAM of
# the pipeline's slots ((prefetch_depth + 2) x 8 bytes x this) whatever the
# largest parameter, e.g. 128 MiB at depth 2 next to a 38M-element embedding.
PIECE_NUMEL = 1 << 22


class NVMeStates:
    """Which parameters keep ``exp_avg``/``exp_avg_sq`` on disk, and their I/O.

    [Note: NVMe binding] The parameters whose states go to disk are chosen
    when the optimizer first steps (``bind``), not when it is built: the
    wrappers (GeminiOptimizer, ZeroOptimizer with cpu_offload) replace the
    optimizer's parameters by master shards after building it, and only the
    tensors that are really stepped can own disk space. ``fraction`` is a
    share of the host-held parameters' elements (states of parameters on
    a GPU stay there), taken whole parameter by parameter in parameter
    order. Host-held means on the CPU and, where a wrapper said which of its
    tensors its placement keeps on the host (``set_host``), one of those: a
    GeminiOptimizer names its offloaded master chunks, so that on a CPU
    compute device the same chunks go to disk as on a GPU. Keys are
    positional (group.index:start), so a rebinding to other tensors of the
    same sizes keeps what is on disk. A parameter no longer host-held at a
    rebinding (moved to a GPU; auto placement's plan keeping its chunk on
    the device after a resume loaded its states to disk) gets its states
    back from disk, and its disk reservation is given back.

    A parameter is cut into pieces of at most PIECE_NUMEL elements; each piece
    is one key holding ``[exp_avg piece, exp_avg_sq piece]`` as one fp32
    buffer, so a piece costs one read and one write per step.
    """

    def __init__(
        self, api: str, fraction: float, directory: str | None, backend: str | None,
        prefetch_depth: int,
    ) -> None:  # fmt: skip
        nvme = _import_nvme()
        self.api = api
        self.fraction = fraction
        self.swapper = nvme.StateSwapper(directory, backend=backend, prefetch_depth=prefetch_depth)
        self.keys: dict[torch.Tensor, list[tuple[str, int, int]]] = {}
        self._bound: list[torch.Tensor] | None = None
        self._open: list | None = None  # [pipeline, pieces, next piece] of a planned order
        self.wait_s = 0.0  # time the optimizer waited for disk reads and writes
        # A wrapper's worker thread steps while a figure may be read on the
        # main thread: one holder at a time of the keys and the pipelines.
        self.lock = threading.RLock()
        self._host: set[int] | None = None  # ids of the tensors a wrapper keeps on the host
        self._host_hint = ""
        self._bound_host: set[int] | None = None
        # Returns the wrapper's wait for its worker's steps (or None): see
        # the optimizers' set_step_waiter.
        self.step_waiter: Callable[[], Callable[[], Any] | None] | None = None

    def wait_steps(self) -> None:
        """Wait for the steps a wrapper's worker runs (see set_step_waiter)."""
        wait = self.step_waiter() if self.step_waiter is not None else None
        if wait is not None:
            wait()

    def set_host(self, params: list[torch.Tensor] | None, hint: str) -> None:
        """Restrict the states that may go to disk to those of ``params``
        (None: every CPU parameter); ``hint`` says how to put more on the
        host, for the warning when none is. Takes effect at the next bind."""
        with self.lock:
            self._host = None if params is None else {id(p) for p in params}
            self._host_hint = hint

    def bound_to(self, params: list[torch.Tensor]) -> bool:
        return (
            self._bound is not None
            and self._bound_host == self._host
            and len(params) == len(self._bound)
            and all(a is b for a, b in zip(params, self._bound, strict=True))
        )

    def bind(
        self, param_groups: list[dict]
    ) -> tuple[list[torch.Tensor], dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
        """Choose the parameters whose states live on disk (see [Note: NVMe
        binding]). Returns the parameters newly put on disk, and the states
        read back from disk of those no longer host-held (a parameter moved
        to a GPU, or auto placement's plan keeping its chunk on the device),
        keyed by the parameter now in that place, on its device.

        Raises:
            NotImplementedError: a parameter whose states are on disk changed
                size or is gone.
        """
        with self.lock:
            return self._bind(param_groups)

    def _bind(
        self, param_groups: list[dict]
    ) -> tuple[list[torch.Tensor], dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
        self._finish_open()
        params = [p for g in param_groups for p in g["params"]]
        cpu = [
            p for p in params
            if p.device.type == "cpu" and (self._host is None or id(p) in self._host)
        ]  # fmt: skip
        host = {id(p) for p in cpu}
        target = self.fraction * sum(p.numel() for p in cpu)
        old = {key[0]: p for p, key in ((p, ks[0]) for p, ks in self.keys.items())}
        keys: dict[torch.Tensor, list[tuple[str, int, int]]] = {}
        offloaded = 0
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in host or offloaded + p.numel() > target:
                    continue
                pieces = []
                for start in range(0, p.numel(), PIECE_NUMEL):
                    end = min(p.numel(), start + PIECE_NUMEL)
                    key = f"{gi}.{pi}:{start}"
                    self.swapper.register(key, 2 * (end - start))
                    pieces.append((key, start, end))
                keys[p] = pieces
                offloaded += p.numel()
        kept = {ks[0][0] for ks in keys.values()}
        back = self._read_back({k: p for k, p in old.items() if k not in kept}, param_groups)
        fresh = [p for p, ks in keys.items() if ks[0][0] not in old]
        self.keys, self._bound, self._bound_host = keys, params, self._host
        self._warn_no_effect(params, cpu)
        self._warn_short(offloaded, target)
        logger.info(
            "nvme: Adam states of %d of %d parameters (%d elements, %.1f MB, %.0f%% of the "
            "CPU-held ones) on disk in %s",
            len(keys), len(params), offloaded, 8 * offloaded / 2**20,
            100 * offloaded / max(1, sum(p.numel() for p in cpu)), self.swapper.workdir,
        )  # fmt: skip
        return fresh, back

    def _read_back(
        self, gone: dict[str, torch.Tensor], param_groups: list[dict]
    ) -> dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Parameters whose states no longer go to disk (``gone``, by first
        key): their disk space is given back, and their states, where any
        were written, are returned for the parameter now in each one's place
        (same group and index), on its device. Checked for all before any is
        read, so a refusal leaves everything on disk as it was."""
        now: dict[str, torch.Tensor] = {}
        for first, was in gone.items():
            if not any(self.swapper.holds(key) for key, _, _ in self.keys[was]):
                continue
            gi, pi = (int(i) for i in first.split(":")[0].split("."))
            group = param_groups[gi]["params"] if gi < len(param_groups) else []
            there = group[pi] if pi < len(group) else None
            if there is None or there.numel() != was.numel():
                raise NotImplementedError(
                    f"{self.api}: a parameter whose Adam states are on disk is gone or changed "
                    f"size (had {was.numel()} elements, now "
                    f"{'none' if there is None else there.numel()}); build the optimizer on "
                    "the tensors it will step"
                )
            now[first] = there
        states = {}
        for first, was in gone.items():
            if first in now:
                p = now[first]
                m, v = self._snapshot(was)  # file-backed: copied to the parameter's device
                states[p] = (
                    m.reshape(p.shape).to(p.device, copy=True),
                    v.reshape(p.shape).to(p.device, copy=True),
                )
            for key, _, _ in self.keys[was]:
                self.swapper.release(key)
        return states

    def _warn_no_effect(self, params: list[torch.Tensor], host: list[torch.Tensor]) -> None:
        """Warn once when the fraction puts nothing on disk: no state is held
        on the host, or every host-held parameter is larger than the share."""
        if not params:
            return
        if not host:
            hint = self._host_hint or (
                "Adam states live where their parameters are and only host-held ones go to "
                "disk: step parameters on the CPU"
            )
            devices = sorted({str(p.device) for p in params})
            _warn_once(
                f"{self.api}: nvme_offload_fraction={self.fraction} has no effect: no optimizer "
                f"state it keeps is held in host memory (got {len(params)} parameters on "
                f"{', '.join(devices)}, none of them host-held); {hint}"
            )
        elif not self.keys:
            total = sum(p.numel() for p in host)
            smallest = min(p.numel() for p in host)
            _warn_once(
                f"{self.api}: nvme_offload_fraction={self.fraction} puts no Adam state on disk: "
                "it is a share of the host-held elements, taken whole parameter by parameter "
                "(a wrapper such as GeminiOptimizer steps one parameter per chunk), and every "
                f"host-held parameter is larger than that share (got {total} host-held "
                f"elements, the smallest parameter {smallest}); raise nvme_offload_fraction to "
                f"at least {smallest / total:.3g}, or hold more optimizer states on the host"
            )

    def _warn_short(self, offloaded: int, target: float) -> None:
        """Warn once when the states on disk fall well short of the share:
        parameters are taken whole, and one that no longer fits is skipped,
        so a share below a large parameter's size leaves mostly small ones."""
        if 0 < offloaded < 0.5 * target:
            _warn_once(
                f"{self.api}: nvme_offload_fraction={self.fraction} put {offloaded / target:.0%} "
                f"of its share on disk (got {offloaded} of {target:.0f} elements): the share is "
                "taken whole parameter by parameter, never above it, and the parameters that "
                "did not fit stay in host memory; raise nvme_offload_fraction to take them"
            )

    def plan(self, params: list[torch.Tensor]) -> None:
        """The next ``step`` calls will step ``params`` one at a time, in this
        order: read ahead across them, so the first pieces of the next
        parameter are in flight while the current one updates."""
        with self.lock:
            self._plan(params)

    def _plan(self, params: list[torch.Tensor]) -> None:
        self._finish_open()
        pieces = [(p, *piece) for p in params for piece in self.keys.get(p, ())]
        if pieces:
            pipe = self.swapper.pipeline([key for _, key, _, _ in pieces])
            pipe.pre_step()
            self._open = [pipe, pieces, 0]

    def _finish_open(self) -> None:
        if self._open is None:
            return
        pipe, pieces, nxt = self._open
        self._open = None
        t0 = time.perf_counter()
        try:
            pipe.cancel() if nxt < len(pieces) else pipe.post_step()
        finally:
            self.wait_s += time.perf_counter() - t0

    def step(self, params: list[torch.Tensor], update: Callable) -> None:
        """Run ``update(param, start, end, exp_avg, exp_avg_sq)`` piece by piece
        through the prefetch pipeline (the planned one when ``params`` is next
        in the plan)."""
        with self.lock:
            self._step(params, update)

    def _step(self, params: list[torch.Tensor], update: Callable) -> None:
        if self._open is not None:
            pipe, pieces, nxt = self._open
            mine = [i for i in range(nxt, len(pieces)) if pieces[i][0] is params[0]]
            if len(params) == 1 and mine and mine[0] == nxt:
                self._run(pipe, pieces, mine, update)
                self._open[2] = mine[-1] + 1
                if self._open[2] == len(pieces):
                    self._finish_open()
                return
        self._finish_open()
        pieces = [(p, *piece) for p in params for piece in self.keys[p]]
        pipe = self.swapper.pipeline([key for _, key, _, _ in pieces])
        pipe.pre_step()
        self._run(pipe, pieces, range(len(pieces)), update)
        t0 = time.perf_counter()
        try:
            pipe.post_step()
        finally:
            self.wait_s += time.perf_counter() - t0

    def _run(self, pipe, pieces, indices, update: Callable) -> None:
        try:
            for i in indices:
                p, _, start, end = pieces[i]
                t0 = time.perf_counter()
                buf = pipe.pre_update(i)
                self.wait_s += time.perf_counter() - t0
                n = end - start
                update(p, start, end, buf[:n], buf[n:])
                pipe.post_update(i)
        except BaseException:
            # A failed update (a kernel call, a disk read): the pass stops and
            # the states it read go back to disk as they were, for the step
            # the caller runs again (the optimizers put its count back).
            if self._open is not None and self._open[0] is pipe:
                self._open = None
            try:
                pipe.cancel()
            except OSError as error:  # a write that failed: that state stays in RAM
                logger.error("%s: %s", self.api, error)
            raise

    def host_buffers(self) -> list[torch.Tensor]:
        """The swapper's pipeline slots and states kept in RAM (failed writes)."""
        with self.lock:
            return self.swapper.host_buffers()

    def on_disk_bytes(self) -> int:
        """Bytes of optimizer state on disk: waits for a piece being updated
        and for the writes in flight, so a piece counts once its bytes have
        landed (never while it is in RAM for its update)."""
        with self.lock:
            if self._open is not None:
                self._open[0].drain_writes()
            return sum(
                8 * (end - start)
                for pieces in self.keys.values()
                for key, start, end in pieces
                if self.swapper.is_on_disk(key)
            )

    def snapshot(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This parameter's states, read into a file-backed mapping.

        The mapping's file is unlinked at once: the pages are page cache the
        kernel can write back and drop, so a state_dict of states on disk
        never needs them all in RAM at once.
        """
        with self.lock:
            return self._snapshot(p)

    def _snapshot(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._finish_open()
        path = os.path.join(self.swapper.workdir, f"snapshot-{uuid.uuid4().hex}")
        out = torch.from_file(path, shared=True, size=2 * p.numel(), dtype=torch.float32)
        os.unlink(path)
        n = p.numel()
        m, v = out[:n], out[n:]
        scratch = torch.empty(2 * min(n, PIECE_NUMEL), dtype=torch.float32)
        for key, start, end in self.keys[p]:
            piece = self.swapper.read(key, scratch[: 2 * (end - start)])
            m[start:end].copy_(piece[: end - start])
            v[start:end].copy_(piece[end - start :])
        return m.view_as(p), v.view_as(p)

    def load(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Write loaded states of one parameter to disk, a piece at a time."""
        with self.lock:
            self._finish_open()
            m, v = exp_avg.reshape(-1), exp_avg_sq.reshape(-1)
            for key, start, end in self.keys[p]:
                piece = torch.cat([m[start:end].float(), v[start:end].float()]).cpu()
                self.swapper.write(key, piece)

    def close(self) -> None:
        with self.lock:
            self._finish_open()
            self.swapper.close()


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel of the first caller outside zerostack (a warning
    raised in a wrapper's step points at the user's line)."""
    level, frame = 2, sys._getframe(2)  # _warn_once's caller
    inside = f"{os.sep}zerostack{os.sep}"
    while frame.f_back is not None and inside in frame.f_code.co_filename:
        frame, level = frame.f_back, level + 1
    return level
