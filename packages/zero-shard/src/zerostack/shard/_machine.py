"""Measuring the machine (the figures of :class:`MachineProfile`), and
``gpu_update_fraction="auto"``: the CPU/GPU split of the host-held Adam
updates that the step-time model says finishes first.

[Note: gpu_update_fraction="auto"] The best share of the host-held updates
to run in the GPU's Adam depends on the machine alone: CPU Adam's bandwidth
over host memory against PCIe's both ways, each measured while the others
run (see [Note: step-time floor]; every term grows with the parameters
updated, so the best share does not depend on the model's size, only on
the bytes a parameter moves). "auto" takes the profile from the JSON file
that ``ZEROSTACK_MACHINE_PROFILE`` names (``MachineProfile.save``, or
``benchmarks/machine.py --json``), else measures it once per process and
device (CPU Adam over ``AUTO_NUMEL`` parameters, copies of
``AUTO_COPY_BYTES`` each way, each alone and all at once; the GPU's Adam:
1.1-1.2 s in a training process on an H200 host, 7.8 s as a process's first
CUDA work), and uses the share whose update phase ``step_floor`` finds
shortest; 0.0 where the split is not faster. Measured that small the share
moves between processes (on one H200 host 0.52-0.56 in a quiet process,
0.41-0.53 in benchmark processes, against 0.48 from a 256M-parameter
profile; 128M parameters gave 0.494-0.498 but hold 4 GB of GPU memory for
the while, too much under a tight cap); a saved profile gives the same
share every run (docs/benchmarks.md, "Offloaded steps, 2026-12-02 fourth
session"). It chooses 0.0, and says why in the log,
where no split can run: no CUDA compute device, no host-held update, an
optimizer or an Adam-state placement the device lane does not step.

[Note: a placement weighed with its split] Under GeminiDDP's auto placement
the split costs GPU memory: the plan keeps the device lane's staging free,
so fewer optimizer chunks stay on the GPU and more updates are host-held.
There "auto" (GeminiOptimizer's default under auto placement) weighs two
plans at the first step, each by the ``step_floor`` of a step with a
forward and backward of 0 s (both plans run the same passes, and a step
grows with what its updates add, hidden or not): CPU Adam alone with the
optimizer chunks that fit without the staging, and the split with those
that fit beside it, at the share the split will run. It keeps the split
where its floor is the shorter. The comparison leans towards CPU Adam
alone: in training the split's CPU share ran faster than the profile's
"beside the copies" rate and CPU Adam alone slower than its "alone" rate
(on one H100 host, 100 against 90 GB/s and 120 against 142 GB/s). Six
cases on three hosts (docs/benchmarks.md, "Offloaded steps, 2026-12-05
twenty-first session"), the floors split / alone, then the steps: a 4.24B
GPT under 24 GiB, 0.773 / 0.847 s on an H200 (1.130-1.140 s split against
1.238-1.241 s alone), 0.785 / 0.906 s and 0.855 / 0.859 s on two H100s
(1.176 against 1.209-1.227 s; 1.149 against 1.282-1.305 s); LLaMA 1.1B
under 12 GiB, 0.167 / 0.158 s on the H200 (0.335-0.344 against
0.324-0.358 s), 0.169 / 0.169 s (the split's 0.4% longer) on the first H100
(0.337-0.360 against 0.306-0.331 s) and 0.184 / 0.160 s on the second (not
run split there). Where one was clearly faster, the shorter floor named it,
twice by under 0.5%; LLaMA on the H200 was within the spread either way.
The rule as it stands, run on an H100 host ("twenty-second session"): the
4.24B's floors 0.779 / 0.925 s, the split kept, 1.175-1.196 s against
1.305-1.355 s for CPU Adam alone in the same processes; LLaMA's 0.168 /
0.172 s, the split kept, 0.336-0.366 s against 0.330-0.358 s (a tie within
the spread); on a host with slower copies up, LLaMA's 0.203 / 0.178 s, CPU
Adam alone kept. A rank takes the first rank's answer.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerostack.chunk import pinned_empty
from zerostack.shard._config import check_fraction
from zerostack.shard._step_model import CPU_ADAM_BYTES_PER_PARAM, MachineProfile, step_floor

logger = logging.getLogger(__name__)

PROFILE_ENV = "ZEROSTACK_MACHINE_PROFILE"
"""Names a MachineProfile JSON file that "auto" uses instead of measuring."""
AUTO_NUMEL = 32 * 2**20
"""Parameters of the CPU and GPU Adam runs that "auto" measures."""
AUTO_COPY_BYTES = 256 * 2**20
"""Bytes of each pinned copy that "auto" measures."""
_PARTS = 8  # the parameters as a few large tensors, as chunks and buckets are
_HYPER: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
_measured: dict[torch.device, MachineProfile] = {}
_measured_lock = threading.Lock()


def _median_s(run: Callable[[], Any], cuda: bool, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _parts(numel: int, dtype: torch.dtype, device: Any, scale: float) -> list[torch.Tensor]:
    size = -(-numel // _PARTS)
    return [torch.randn(min(size, numel - k), device=device).mul_(scale).to(dtype)
            for k in range(0, numel, size)]  # fmt: skip


def _cpu_adam_step(numel: int) -> Callable[[], Any]:
    """One CPUAdam step over ``numel`` fp32 masters with bf16 gradients and
    the bf16 copy-out (as ZeRO ``cpu_offload`` and Gemini step host-held ones)."""
    from zerostack.fused_adam import CPUAdam

    masters = _parts(numel, torch.float32, "cpu", 0.02)
    for m, g in zip(masters, _parts(numel, torch.bfloat16, "cpu", 1e-3), strict=True):
        if hasattr(m, "grad_dtype"):
            m.grad_dtype = None  # torch >= 2.10 pins a gradient's dtype unless told not to
        m.grad = g
    opt = CPUAdam(masters, adamw_mode=True, **_HYPER)
    for m in masters:
        opt.set_copy_out(m, m.to(torch.bfloat16))
    return opt.step


class _Copies:
    """Pinned host buffers and device buffers for copies each way, on two streams."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.host_up = pinned_empty(nbytes, torch.uint8).fill_(1)
        self.host_down = pinned_empty(nbytes, torch.uint8)
        self.dev_up = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.dev_down = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def _one(self, up: bool) -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.streams[0 if up else 1]):
            start.record()
            if up:
                self.dev_up.copy_(self.host_up, non_blocking=True)
            else:
                self.host_down.copy_(self.dev_down, non_blocking=True)
            end.record()
        return start, end

    def run(
        self, up: bool, down: bool, rounds: int = 0, stop: threading.Event | None = None
    ) -> tuple[float | None, float | None]:
        """Copies in the asked directions, ``rounds`` times or until ``stop``
        (at least once then); bytes/s of each direction from its own events
        (None where not run)."""
        busy = {True: 0.0, False: 0.0}
        done = 0
        while done < rounds if stop is None else (done == 0 or not stop.is_set()):
            pairs = {d: self._one(d) for d, on in ((True, up), (False, down)) if on}
            for d, (start, end) in pairs.items():
                end.synchronize()
                busy[d] += start.elapsed_time(end) / 1e3
            done += 1
        rate = {d: done * self.nbytes / busy[d] if busy[d] > 0 else None for d in busy}
        return (rate[True] if up else None), (rate[False] if down else None)


def _copies_alone(c: _Copies, warmup: int, repeats: int) -> dict[str, float | None]:
    c.run(True, True, warmup)
    h2d, _ = c.run(True, False, repeats)
    _, d2h = c.run(False, True, repeats)
    h2d_both, d2h_both = c.run(True, True, repeats)
    return dict(
        h2d_bytes_s=h2d, d2h_bytes_s=d2h, h2d_both_bytes_s=h2d_both, d2h_both_bytes_s=d2h_both
    )


def _adam_with_copies(
    c: _Copies, step: Callable[[], Any], numel: int, warmup: int, repeats: int
) -> dict[str, float | None]:
    """CPU Adam's timed steps while a thread copies both ways until they end."""
    for _ in range(warmup):
        step()
    stop = threading.Event()
    rates: list[tuple[float | None, float | None]] = []
    failed: list[BaseException] = []

    def copy() -> None:
        try:
            rates.append(c.run(True, True, stop=stop))
        except BaseException as exc:  # re-raised below, in the calling thread
            failed.append(exc)

    worker = threading.Thread(target=copy, name="zerostack-machine-copies")
    worker.start()
    try:
        seconds = _median_s(step, False, 0, repeats)
    finally:
        stop.set()
        worker.join()
    if failed:
        raise failed[0]
    return dict(
        cpu_adam_with_copies_bytes_s=numel * CPU_ADAM_BYTES_PER_PARAM / seconds,
        h2d_with_adam_bytes_s=rates[0][0],
        d2h_with_adam_bytes_s=rates[0][1],
    )


def _gpu_adam(numel: int, device: torch.device, warmup: int, repeats: int) -> float:
    """fused-adam's FusedAdam over ``numel`` fp32 parameters, parameters/s."""
    from zerostack.fused_adam import FusedAdam

    params = _parts(numel, torch.float32, device, 0.02)
    for p, g in zip(params, _parts(numel, torch.float32, device, 1e-3), strict=True):
        p.grad = g
    opt = FusedAdam(params, adamw_mode=True, **_HYPER)
    return numel / _median_s(opt.step, True, warmup, repeats)


def measure_machine(
    device: torch.device | str | None = None,
    *,
    numel: int = AUTO_NUMEL,
    copy_bytes: int = AUTO_COPY_BYTES,
    warmup: int = 1,
    repeats: int = 5,
) -> MachineProfile:
    """Measure CPU Adam (zerostack-fused-adam's CPUAdam, bf16 gradients and
    copy-out), and on a CUDA ``device`` pinned copies each way alone and both
    at once, all three at once, and the GPU's Adam (FusedAdam). No disk
    figures (``benchmarks/machine.py --disk-dir`` measures those). CPU work
    is timed with ``time.perf_counter``, GPU work with CUDA events; each
    figure is the median of ``repeats`` runs after ``warmup``.

    Args:
        device: the GPU to measure the copies and the GPU's Adam on; None or
            a CPU device: CPU Adam only. Default None.
        numel: parameters of the Adam runs. Default ``AUTO_NUMEL``.
        copy_bytes: bytes of each copy. Default ``AUTO_COPY_BYTES``.
        warmup: untimed runs first. Default 1.
        repeats: timed runs. Default 5.

    Raises:
        ImportError: zerostack-fused-adam is not installed.
        ValueError: ``numel`` or ``copy_bytes`` < 1, ``warmup`` < 0, ``repeats`` < 1.
    """
    if importlib.util.find_spec("zerostack.fused_adam") is None:
        raise ImportError(
            "measure_machine: CPU Adam is zerostack-fused-adam's, which is not installed; "
            "`pip install zerostack-fused-adam`"
        )
    if numel < 1 or copy_bytes < 1 or warmup < 0 or repeats < 1:
        raise ValueError(
            "measure_machine: numel and copy_bytes must be >= 1, warmup >= 0 and repeats >= 1 "
            f"(got {numel}, {copy_bytes}, {warmup}, {repeats})"
        )
    device = torch.device(device) if device is not None else torch.device("cpu")
    step = _cpu_adam_step(numel)
    seconds = _median_s(step, False, warmup, repeats)
    figures: dict[str, Any] = {"cpu_adam_bytes_s": numel * CPU_ADAM_BYTES_PER_PARAM / seconds}
    where = "CPU only"
    if device.type == "cuda":
        with torch.cuda.device(device):
            copies = _Copies(copy_bytes, device)
            figures |= _copies_alone(copies, warmup, repeats)
            figures |= _adam_with_copies(copies, step, numel, warmup, repeats)
            del copies
            figures["gpu_adam_params_s"] = _gpu_adam(numel, device, warmup, repeats)
            torch.cuda.empty_cache()  # its buffers are freed: give their memory back
        where = torch.cuda.get_device_name(device)
    from zerostack.fused_adam import backend_info

    return MachineProfile(
        **figures,
        machine=f"measure_machine: {where}, {os.cpu_count()} cores, {torch.get_num_threads()} "
        f"torch threads, CPU Adam's {backend_info().get('cpu_schedule', 'static')} schedule, "
        f"Adam over {numel} parameters, copies of {copy_bytes} B",
    )


def machine_profile(device: torch.device) -> tuple[MachineProfile, str]:
    """The profile "auto" uses, and where it came from: the file that
    ``ZEROSTACK_MACHINE_PROFILE`` names, else this process's measurement of
    ``device`` (made at the first call).

    Raises:
        OSError, ValueError: the named file cannot be read or holds no profile.
    """
    path = os.environ.get(PROFILE_ENV)
    if path:
        return MachineProfile.load(path), f"{PROFILE_ENV}={path}"
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one GPU
        device = torch.device("cuda", torch.cuda.current_device())
    with _measured_lock:
        profile = _measured.get(device)
        if profile is None:
            t0 = time.perf_counter()
            profile = _measured[device] = measure_machine(device)
            logger.info("measured this machine in %.2f s: %s", time.perf_counter() - t0,
                        _figures(profile))  # fmt: skip
    return profile, f"measured on {device} (set {PROFILE_ENV} to a saved profile to skip this)"


def _figures(p: MachineProfile) -> str:
    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value / 1e9:.1f}"

    return (
        f"CPU Adam {rate(p.cpu_adam_bytes_s)} GB/s alone, {rate(p.cpu_adam_with_copies_bytes_s)} "
        f"beside copies; copies {rate(p.h2d_bytes_s)}/{rate(p.d2h_bytes_s)} GB/s each way alone, "
        f"{rate(p.h2d_with_adam_bytes_s)}/{rate(p.d2h_with_adam_bytes_s)} beside CPU Adam; GPU "
        f"Adam {rate(p.gpu_adam_params_s)} G params/s"
    )


def best_gpu_update_fraction(
    profile: MachineProfile, *, h2d_bytes_per_param: float = 2, d2h_bytes_per_param: float = 2,
    host_value_fraction: float = 0.0, streamed_bytes_per_param: float = 0.0,
) -> float:  # fmt: skip
    """The share of the host-held updates that makes the step shortest on
    ``profile``'s machine, with nothing to hide behind (a forward and
    backward of 0 s, but for the streamed parameters): the update phase,
    the gradients' copies to the host (which the GPU's share saves) and the
    link the next forward's streamed parameters share. ``step_floor``'s
    best split, or 0.0 where the profile lacks the "all at once" figures or
    the split is not faster. See [Note: gpu_update_fraction="auto"].

    Args:
        profile: the machine's figures.
        h2d_bytes_per_param: parameter bytes copied to the GPU per CPU
            update (2 for bf16/fp16 parameters; 0 where they live on the host).
        d2h_bytes_per_param: gradient bytes copied to the host per CPU update.
        host_value_fraction: the share of the host-held updates whose
            parameter values live on the host too (``step_floor``'s).
        streamed_bytes_per_param: parameter bytes that live on the host and
            cross for each forward, per host-held update the share applies
            to (``step_floor``'s ``streamed_bytes`` over ``host_numel``).
            Default 0.0.
    """
    needed = (
        profile.h2d_bytes_s, profile.d2h_bytes_s, profile.cpu_adam_with_copies_bytes_s,
        profile.h2d_with_adam_bytes_s, profile.d2h_with_adam_bytes_s, profile.gpu_adam_params_s,
    )  # fmt: skip
    if any(figure is None for figure in needed):  # no GPU measured: no split to weigh
        return 0.0
    estimate = step_floor(
        profile, forward_s=0.0, backward_s=0.0, host_numel=2**30,
        h2d_bytes_per_param=h2d_bytes_per_param, d2h_bytes_per_param=d2h_bytes_per_param,
        host_value_fraction=host_value_fraction, streamed_bytes=2**30 * streamed_bytes_per_param,
    )  # fmt: skip
    return estimate.best.gpu_fraction


def resolve_gpu_update_fraction(
    api: str, fraction: float | str, device: torch.device, why_not: str | None,
    param_bytes: int = 2, host_value_fraction: float = 0.0, group: Any = None,
    required: bool = True, streamed_bytes_per_param: float = 0.0,
) -> float:  # fmt: skip
    """``gpu_update_fraction`` as a number: itself, or for ``"auto"`` the
    machine's best (see [Note: gpu_update_fraction="auto"]), or 0.0 where
    ``why_not`` says no split can run (logged here).

    Args:
        api: the caller's name, for messages.
        fraction: the argument, a number in [0, 1] or "auto".
        device: the compute device.
        why_not: why no split can run, or None.
        param_bytes: bytes of a parameter (and its gradient). Default 2.
        host_value_fraction: the share of the host-held updates whose
            parameter values live on the host (``step_floor``'s). Default 0.0.
        group: the data-parallel group. With several ranks "auto" is a
            collective (every rank calls this): every rank takes the first
            rank's share, or 0.0 where any rank cannot split. Default: the
            default group.
        required: False where "auto" is a default, not the user's ask
            (GeminiOptimizer's auto placement, ZeroOptimizer's cpu_offload):
            a profile a rank could not take then gives 0.0 on every rank,
            with a warning, instead of raising. Default True.
        streamed_bytes_per_param: parameter bytes on the host that cross
            for each forward, per host-held update (``best_gpu_update_fraction``'s).
            Default 0.0.

    Raises:
        RuntimeError: ``required`` and a rank could not take the
            machine's profile (on that rank, its own error is the cause).
    """
    check_fraction(api, fraction)
    if fraction != "auto":
        return float(fraction)
    if device.type != "cuda":  # every rank's: no collective
        why = (
            why_not
            or f"the compute device is {device}: there is no GPU Adam to share the updates with"
        )
        logger.info("%s: gpu_update_fraction='auto' chose 0.0: %s", api, why)
        return 0.0
    mine, figures, failed = _CANNOT, "", None
    if why_not is None:
        mine, figures, failed = _this_ranks_share(
            device, h2d_bytes_per_param=param_bytes * (1 - host_value_fraction),
            d2h_bytes_per_param=param_bytes, host_value_fraction=host_value_fraction,
            streamed_bytes_per_param=streamed_bytes_per_param,
        )  # fmt: skip
    shares = _gather_shares(mine, device, group)
    broken = [r for r, share in enumerate(shares) if math.isnan(share)]
    if broken:
        refused = RuntimeError(
            f"{api}: gpu_update_fraction='auto' could not take the machine's profile on rank(s) "
            f"{broken} of the group{f': {failed}' if failed else ' (their errors say why)'}; "
            f"set {PROFILE_ENV} to a profile file every rank can read, or pass a number"
        )
        if required:
            raise refused from failed
        warnings.warn(
            f"{refused} (gpu_update_fraction was left at its default: every host-held update "
            "steps in CPU Adam)",
            UserWarning,
            stacklevel=4,
        )
        return 0.0
    if _CANNOT in shares:
        why = why_not or f"rank(s) {[r for r, x in enumerate(shares) if x == _CANNOT]} cannot split"
        logger.info("%s: gpu_update_fraction='auto' chose 0.0: %s", api, why)
        return 0.0
    best = shares[0]
    logger.info(
        "%s: gpu_update_fraction='auto' chose %.3f of the host-held updates for the GPU's Adam "
        "(the step-time model's fastest split%s; %s)",
        api, best, "" if best == mine else f", the first rank's; this rank's was {mine:.3f}",
        figures,
    )  # fmt: skip
    return best


def split_beats_cpu_only(
    api: str, device: torch.device, fraction: float, cpu_only: dict[str, Any],
    split: dict[str, Any], group: Any = None,
) -> bool:  # fmt: skip
    """Whether a placement whose host-held updates share the GPU's Adam at
    ``fraction`` steps faster than one that keeps them all in CPU Adam, by
    the step-time model on the profile "auto" took (see [Note: a placement
    weighed with its split]).

    Args:
        api: the caller's name, for messages.
        device: the compute device (whose profile "auto" took).
        fraction: the split's share of the host-held updates.
        cpu_only: ``step_floor``'s amounts (``host_numel`` and the rest)
            under the placement without the split.
        split: its amounts under the placement with the split's staging.
        group: the data-parallel group. A collective (every rank calls it):
            every rank takes the first rank's answer. Default: the default group.
    """
    mine, shared, weighed = 0.0, None, False
    try:
        profile, _ = machine_profile(device)
        alone = step_floor(profile, forward_s=0.0, backward_s=0.0, **cpu_only).cpu_only
        shared = step_floor(
            profile, forward_s=0.0, backward_s=0.0, gpu_fraction=fraction, **split
        ).split
        mine = 1.0 if shared is not None and shared.step_s < alone.step_s else 0.0
        weighed = True
    except (OSError, ValueError) as error:  # the profile file went away since "auto" read it
        logger.warning("%s: the split was not weighed (%s)", api, error)
    chosen = _gather_shares(mine, device, group)[0] == 1.0
    choice = "the split" if chosen else "CPU Adam alone"
    if shared is None:
        why = "no host-held update to split" if weighed else "not weighed here"
        logger.info("%s: gpu_update_fraction='auto': %s: %s", api, why, choice)
    else:
        logger.info(
            "%s: gpu_update_fraction='auto' weighed the placement with the split (%.3f of "
            "%s host-held updates in the GPU's Adam: %.3f s a step with nothing to hide "
            "behind) against CPU Adam alone (%s: %.3f s): %s",
            api, shared.gpu_fraction, f"{int(split['host_numel']):,}", shared.step_s,
            f"{int(cpu_only['host_numel']):,}", alone.step_s, choice,
        )  # fmt: skip
    return chosen


_CANNOT = -1.0  # a rank's share where it cannot split


def _this_ranks_share(
    device: torch.device, **amounts: float
) -> tuple[float, str, Exception | None]:
    """This rank's best share from its machine's profile (``amounts`` as
    ``best_gpu_update_fraction`` takes them), the profile's figures for the
    log, and the error that kept it from a profile (its share then NaN,
    for ``_gather_shares`` to tell every rank)."""
    try:
        profile, source = machine_profile(device)
        mine = best_gpu_update_fraction(profile, **amounts)
    except Exception as error:  # said on every rank by the caller, not only this one
        return math.nan, "", error
    return mine, f"{_figures(profile)}; profile {source}", None


def _gather_shares(share: float, device: torch.device, group: Any) -> list[float]:
    """Every rank's ``share``, by group rank (``[share]`` without several
    ranks). Ranks of one host measure the machine at the same time, each
    beside the others' measurements, so their shares differ a little; the
    caller takes one for all. A collective: every rank of ``group`` calls it."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return [share]
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([share], dtype=torch.float64, device=on)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [float(t.item()) for t in every]
