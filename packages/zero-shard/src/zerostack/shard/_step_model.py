"""The floor of an offloaded training step, from independent measurements
of the machine (``benchmarks/machine.py`` fills a :class:`MachineProfile`).

[Note: step-time floor] The shortest step the hardware allows for a
configuration whose updates of ``host_numel`` parameters (this rank's
piece) have their fp32 masters and Adam states on the host. Terms, each the
time one resource needs at its measured bandwidth:

- ``forward_s``, ``backward_s``: the same model's forward and backward with
  everything on the GPU (the benchmarks take the faster of plain PyTorch's
  row of the same run, fp32 parameters under bf16 autocast, and the same
  system's row all on the GPU, ``gemini_gpu`` or ``zero2``, bf16 parameters
  as the offloaded rows compute: Gemini's is the faster on an H200);
- gradients device to host, ``d2h_bytes_per_param`` per host-updated
  parameter, during backward: backward lasts ``max(backward_s, d2h)``;
- CPU Adam: 28 B of host memory traffic per parameter (read master,
  exp_avg, exp_avg_sq 12 B and the bf16/fp16 gradient 2 B; write the three
  12 B and the copy-out 2 B; see [Note: offloaded step pipeline]);
- parameters host to device, ``h2d_bytes_per_param`` each (the new value
  of a parameter whose copy on the GPU is kept there);
- parameters streamed, ``streamed_bytes``: parameters that live on the
  host between uses (Gemini's host-held shards) cross to the GPU for the
  forward and again for the backward, so each lasts at least as long as
  that copy: ``forward = max(forward_s, streamed / h2d)`` and the backward
  likewise (their updated values stay on the host: no copy at the update);
- disk: the bytes of Adam states read and written per step (NVMe offload),
  one after the other on one device: ``read / read_bw + write / write_bw``.

The update phase runs every resource at once, call by call (buckets or
chunks), so it lasts as long as its slowest resource: ``update = max(cpu,
h2d, disk)`` (a floor: the first call's wait and the last one's copy are not
counted). The
updates start at ``step()``, after the global gradient norm, which
clipping needs before any update (``clip_before_update``; the CPU-step
pipeline never starts earlier, with or without clipping); they then hide
behind the share ``forward_hide_fraction`` of the next forward (a module
waits only for the buckets it uses), and behind backward too when they may
start earlier. So::

    step     = forward + backward + max(0, update - window)
    backward = max(backward_s, d2h, streamed)
    window   = forward_hide_fraction * forward  (+ backward if they may start early)

One link carries the update's copies up and the next forward's streamed
parameters: from the end of backward to the step's end (the next forward
and the update's exposed part) it moves ``streamed + h2d`` bytes, so that
part lasts at least ``link = streamed / h2d_bytes_s + h2d``, ``h2d`` the
update's copies at the rate the update phase takes (and where the updates
may start in backward, the backward's streamed parameters too, over the
whole step). The step is the longer of the two::

    step = backward + max(forward + max(0, update - window), link)

and where the updates may start in backward (``window`` then holds it)::

    step = max(forward + backward + max(0, update - window), link)

The split: a share ``f`` of the host-held updates runs in the GPU's Adam
instead, fed over PCIe: master and both moments, 12 B per parameter, go to
the GPU and come back. Where the parameter's value lives on the GPU, the
gradient is already there and the new value is made there, so neither
crosses. Where it lives on the host (Gemini's host-held shards, the share
``host_value_fraction`` of the host-held updates), the gradient has landed
on the host in backward (the GPU has no room to keep it) and crosses back
up, and the new value crosses down: ``g`` more bytes each way, ``g`` being
``d2h_bytes_per_param`` (the gradient's, which is the value's, dtype).
``ZeroOptimizer(cpu_offload=True, gpu_update_fraction=f)`` and
``GeminiOptimizer`` run it (see [Note: Adam where the bandwidth is]). With
every resource busy at once each runs at its "all at once" bandwidth
(``*_with_*`` fields), so, with ``lane = 12 + host_value_fraction * g``::

    cpu(f) = (1 - f) * N * 28 / cpu_adam_with_copies
    h2d(f) = N * (lane f + h2d_bytes_per_param (1 - f)) / h2d_with_adam
    d2h(f) = N * lane f / d2h_with_adam
    gpu(f) = f * N / gpu_adam_params_s           (on the GPU: added to the phase)

and the backward copies the gradients of the CPU's share and of the host
values' share of the GPU's: ``N * g * (1 - f (1 - host_value_fraction))``.

The best ``f`` makes the step shortest. ``cpu`` falls with ``f`` and
both copies rise, so when the GPU's Adam is faster than the CPU's (by far,
on every GPU) and the disk is not the bound, that is where ``cpu`` meets
the busier copy direction: the smaller of the two ``f`` that equalize
``cpu`` with ``h2d`` and with ``d2h``; where parameters stream (Gemini's
host-held shards), the split's copies up share the link with the next
forward's, and ``f`` stops earlier, where ``cpu + gpu`` meets ``link``. When the disk is
the bound, a larger ``f`` gains nothing and costs GPU time, so ``f`` stops
where ``cpu`` falls to the disk's time. (The step is convex and piecewise
linear in ``f``: its minimum is at 0, 1 or a crossing of two of its lines,
which is how it is found; of equal steps, the smallest ``f``.) The CPU-only floor uses the "alone"
bandwidths; the floor is the lower of the two. The copies' "both ways at
once" figures without CPU Adam (``*_both_*``) are measured and kept for
reading, not used here: during the update phase CPU Adam always runs.

Updates of GPU-resident masters (``gpu_numel``) run in the GPU's Adam
and are added to the backward. Left out: several ranks on one host share
its memory bandwidth and PCIe (give per-rank figures), the all-gather of
updated parameters at world size > 1, the GPU time that streaming steals
from the forward it hides behind, the host memory bandwidth that the
copies' DMA takes from CPU Adam beyond what the "all at once" figures saw,
and the time a gather the forward waits for spends queued behind a larger
copy of the split on the same copy engine (bytes, not order, are counted).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

CPU_ADAM_BYTES_PER_PARAM = 28
"""Host memory traffic of one CPU Adam update with bf16/fp16 gradients and copy-out."""
STATE_BYTES_PER_PARAM = 12
"""fp32 master, exp_avg and exp_avg_sq: what crosses PCIe each way for a GPU update."""

_API = "MachineProfile"
_HOW = "measure the machine with zerostack.shard.measure_machine() or benchmarks/machine.py"


def _check_rate(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_API}: {name} must be a number (got {value!r}); {_HOW}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_API}: {name} must be a finite number > 0 (got {value!r}); {_HOW}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineProfile:
    """What one machine's resources achieve, each alone and some all at
    once (``benchmarks/machine.py`` fills it). Bandwidths in bytes/s; None
    where not measured (no GPU, no disk directory given).

    Raises:
        ValueError: a figure that is not finite and > 0.
        TypeError: a figure that is not a number.
    """

    cpu_adam_bytes_s: float
    """CPU Adam alone over host memory, at 28 B per parameter. Required."""
    h2d_bytes_s: float | None = None
    """Pinned host-to-device copies, one way only. Default None."""
    d2h_bytes_s: float | None = None
    """Pinned device-to-host copies, one way only. Default None."""
    h2d_both_bytes_s: float | None = None
    """Host to device while device to host runs too. Default None."""
    d2h_both_bytes_s: float | None = None
    """Device to host while host to device runs too. Default None."""
    cpu_adam_with_copies_bytes_s: float | None = None
    """CPU Adam while copies run both ways (at 28 B per parameter). Default None."""
    h2d_with_adam_bytes_s: float | None = None
    """Host to device while CPU Adam and device to host run. Default None."""
    d2h_with_adam_bytes_s: float | None = None
    """Device to host while CPU Adam and host to device run. Default None."""
    gpu_adam_params_s: float | None = None
    """The GPU's fused Adam, parameters per second. Default None."""
    disk_read_bytes_s: float | None = None
    """Reads from the NVMe offload directory. Default None."""
    disk_write_bytes_s: float | None = None
    """Writes (fsynced) to the NVMe offload directory. Default None."""
    machine: str = ""
    """Where and when it was measured (free text). Default ""."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "machine":
                _check_rate(f.name, getattr(self, f.name), f.name != "cpu_adam_bytes_s")
        if not isinstance(self.machine, str):
            raise TypeError(f"{_API}: machine must be a str (got {self.machine!r})")

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (what :meth:`save` writes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineProfile:
        """A profile from :meth:`to_dict` output; unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{_API}: unknown fields (got {unknown}); expected some of {sorted(known)}"
            )
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MachineProfile:
        """Read a profile written by :meth:`save` (or ``benchmarks/machine.py --json``)."""
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(
                f"{_API}: {os.fspath(path)} must hold a JSON object (got {type(data).__name__}); "
                f"{_HOW} --json {os.fspath(path)}"
            )
        return cls.from_dict(data)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFloor:
    """One floor and its terms, in seconds (see [Note: step-time floor])."""

    step_s: float
    """The floor: the backward phase + the longer of (forward + the
    update's exposed part) and the link's time; where the updates may start
    in backward, the longer of all of that and the link's time."""
    forward_s: float
    """max(forward, parameters streamed host to device)."""
    backward_s: float
    """max(backward, gradients device to host, parameters streamed host to device)."""
    update_s: float
    """The update phase: its slowest resource + the GPU's Adam."""
    hidden_s: float
    """The part of the update that overlaps forward (and backward)."""
    cpu_s: float
    """CPU Adam over host memory."""
    h2d_s: float
    """Copies host to device during the update phase."""
    d2h_s: float
    """Copies device to host during the update phase (states of the split)."""
    link_s: float
    """The host-to-device link's time from the end of backward to the
    step's end: the next forward's streamed parameters and ``h2d_s`` (the
    whole step's streaming where the updates may start in backward)."""
    disk_s: float
    """Adam states read and written on disk."""
    gpu_adam_s: float
    """The GPU's Adam on its share."""
    gpu_fraction: float
    """The share of the host-held updates done by the GPU's Adam."""
    bound: str
    """The update phase's slowest resource (cpu, h2d, d2h or disk), or
    "link" where the link's time sets the step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FloorEstimate:
    """The floor under CPU-only updates and under the best CPU/GPU split."""

    cpu_only: StepFloor
    """Every host-held update in CPU Adam, each resource at its "alone" bandwidth."""
    split: StepFloor | None
    """The best split; None when the profile lacks the "all at once" figures."""

    @property
    def best(self) -> StepFloor:
        """The lower of the two floors (the CPU-only one on a tie or without a split)."""
        if self.split is not None and self.split.step_s < self.cpu_only.step_s:
            return self.split
        return self.cpu_only

    @property
    def floor_s(self) -> float:
        """The lower of the two floors' step time."""
        return self.best.step_s


def _check_amount(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"step_floor: {name} must be a number (got {value!r})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"step_floor: {name} must be finite and >= 0 (got {value!r}); pass what one step does"
        )


def _secs(amount: float, rate: float | None) -> float:
    """Seconds to move ``amount`` at ``rate``; nothing needs no rate."""
    if amount == 0:
        return 0.0
    if rate is None:
        raise AssertionError(f"step_floor: {amount:g} to move at an unmeasured rate")
    return amount / rate


def _slope(amount: float, rate: float | None) -> float:
    """Seconds per unit of ``f`` to move ``amount`` at ``rate``; 0 without a
    rate, which only the CPU-only floor lacks (it is taken at f = 0)."""
    return 0.0 if rate is None else _secs(amount, rate)


class _Rates(NamedTuple):
    """Bytes/s: CPU Adam, copies up, gradients down in backward, states
    down in the update phase (None where the floor moves nothing there)."""

    cpu: float
    up: float | None
    grads_down: float | None
    states_down: float | None


class _Times(NamedTuple):
    """Seconds: the forward and backward (each already at least its
    streamed copies), the disk's reads and writes, the part of the forward
    the updates may hide behind, and the forward's streamed parameters at
    the copy's rate alone."""

    forward: float
    backward: float
    disk: float
    hide: float
    stream: float


class _Moved(NamedTuple):
    """Per host-held update: bytes of its new value up, of its gradient
    down, and the share whose value lives on the host."""

    up: float
    down: float
    host_values: float

    @property
    def lane(self) -> float:
        """What one GPU update of the split moves each way: the master and
        moments, and for a value that lives on the host its gradient up and
        its new value down."""
        return STATE_BYTES_PER_PARAM + self.host_values * self.down


_Line = tuple[float, float]  # (seconds at f = 0, seconds per unit of f)
_UPDATE = ("cpu", "h2d", "d2h", "disk")  # the update phase's resources


def _lines(
    numel: float, rates: _Rates, times: _Times, moved: _Moved, gpu_rate: float | None
) -> dict[str, _Line]:
    """Each term of the step as a line in ``f``: the update phase's
    resources, the GPU's Adam, the link's time after backward (the
    forward's stream and the update's copies up) and the gradients' copies
    in backward."""
    cpu = numel * CPU_ADAM_BYTES_PER_PARAM / rates.cpu
    h2d = (_secs(numel * moved.up, rates.up), _slope(numel * (moved.lane - moved.up), rates.up))
    landed = _secs(numel * moved.down, rates.grads_down)
    return {
        "cpu": (cpu, -cpu),
        "h2d": h2d,
        "d2h": (0.0, _slope(numel * moved.lane, rates.states_down)),
        "disk": (times.disk, 0.0),
        "gpu": (0.0, _slope(numel, gpu_rate)),
        "link": (times.stream + h2d[0], h2d[1]),
        "landed": (landed, -landed * (1 - moved.host_values)),
    }


def _pieces(lines: dict[str, _Line], times: _Times, clip: bool) -> list[tuple[str, _Line]]:
    """The step as the largest of these lines in ``f``, each named by the
    term after backward it holds (see [Note: step-time floor]). With
    ``clip``: the backward (or its gradients' copies) plus the forward, an
    update resource plus the GPU's Adam less the hidden part, or the link.
    Without: the forward plus the backward (or its copies), an update
    resource plus the GPU's Adam plus the forward's unhidden part, or the
    link with the backward's stream. The step is convex and piecewise
    linear in ``f``: its minimum is at 0, 1 or a crossing of two pieces."""
    gpu = lines["gpu"][1]
    lead = times.forward - times.hide
    updates = [(k, (lines[k][0] + lead, lines[k][1] + gpu)) for k in _UPDATE]
    backward = [(times.backward, 0.0), lines["landed"]]
    link = lines["link"]
    if clip:
        after = [("forward", (times.forward, 0.0)), *updates, ("link", link)]
        return [(name, (a0 + b0, a1 + b1)) for name, (a0, a1) in after for b0, b1 in backward]
    passes = [("forward", (times.forward + b0, b1)) for b0, b1 in backward]
    return [*passes, *updates, ("link", (link[0] + times.stream, link[1]))]


def _at(line: _Line, f: float) -> float:
    return line[0] + line[1] * f


def _floor(
    numel: float, f: float, rates: _Rates, times: _Times, moved: _Moved,
    gpu_rate: float | None, clip: bool,
) -> StepFloor:  # fmt: skip
    """One floor at GPU share ``f``; ``clip``: the updates wait for
    backward's end."""
    lines = _lines(numel, rates, times, moved, gpu_rate)
    terms = {k: _at(lines[k], f) for k in _UPDATE}
    bound = max(terms, key=terms.__getitem__)
    gpu_adam_s = _at(lines["gpu"], f)
    update = terms[bound] + gpu_adam_s
    backward = max(times.backward, _at(lines["landed"], f))
    pieces = _pieces(lines, times, clip)
    step = max(_at(line, f) for _, line in pieces)
    if any(name == "link" and _at(line, f) == step for name, line in pieces):
        bound = "link"
    link = _at(lines["link"], f) + (0.0 if clip else times.stream)
    return StepFloor(
        step_s=step, forward_s=times.forward, backward_s=backward, update_s=update,
        hidden_s=min(update, times.hide + (0.0 if clip else backward)), cpu_s=terms["cpu"],
        h2d_s=terms["h2d"], d2h_s=terms["d2h"], link_s=link, disk_s=terms["disk"],
        gpu_adam_s=gpu_adam_s, gpu_fraction=f, bound=bound,
    )  # fmt: skip


def _candidates(pieces: list[tuple[str, _Line]]) -> list[float]:
    """0, 1 and every crossing inside (0, 1) of two of ``pieces``: where
    the step can change slope in ``f``."""
    found = {0.0, 1.0}
    for i, (_, (a0, a1)) in enumerate(pieces):
        for _, (b0, b1) in pieces[i + 1 :]:
            if a1 != b1 and 0.0 < (b0 - a0) / (a1 - b1) < 1.0:
                found.add((b0 - a0) / (a1 - b1))
    return sorted(found)


def _check_inputs(
    profile: MachineProfile, amounts: dict[str, Any], clip: Any, share: float | None = None
) -> None:
    if share is not None and not 0 <= share <= 1:
        raise ValueError(f"step_floor: gpu_fraction must be in [0, 1] or None (got {share!r})")
    if not isinstance(profile, MachineProfile):
        raise TypeError(f"step_floor: profile must be a MachineProfile (got {profile!r}); {_HOW}")
    for name, value in amounts.items():
        _check_amount(name, value)
    hide = amounts["forward_hide_fraction"]
    if hide > 1:
        raise ValueError(
            f"step_floor: forward_hide_fraction must be in [0, 1] (got {hide!r}); it is the "
            "share of forward that can run beside the updates"
        )
    values = amounts["host_value_fraction"]
    if values > 1:
        raise ValueError(
            f"step_floor: host_value_fraction must be in [0, 1] (got {values!r}); it is the "
            "share of the host-held updates whose parameter values live on the host too"
        )
    if not isinstance(clip, bool):
        raise TypeError(f"step_floor: clip_before_update must be a bool (got {clip!r})")
    if amounts["streamed_bytes"] > 0 and profile.h2d_bytes_s is None:
        raise ValueError(
            f"step_floor: streamed_bytes is {amounts['streamed_bytes']:g} but the profile has no "
            f"h2d_bytes_s (got None); {_HOW} on a CUDA machine"
        )
    for way in ("h2d", "d2h"):
        rate = getattr(profile, f"{way}_bytes_s")
        if amounts["host_numel"] > 0 and amounts[f"{way}_bytes_per_param"] > 0 and rate is None:
            raise ValueError(
                f"step_floor: host-held updates copy {amounts[f'{way}_bytes_per_param']:g} B "
                f"per parameter {way.upper()} but the profile has no {way}_bytes_s (got None); "
                f"{_HOW} on a CUDA machine"
            )
    if amounts["gpu_numel"] > 0 and profile.gpu_adam_params_s is None:
        raise ValueError(
            f"step_floor: gpu_numel is {amounts['gpu_numel']:g} but the profile has no "
            f"gpu_adam_params_s (got None); {_HOW} on a CUDA machine"
        )
    for kind in ("read", "write"):
        amount = amounts[f"disk_{kind}_bytes"]
        if amount > 0 and getattr(profile, f"disk_{kind}_bytes_s") is None:
            raise ValueError(
                f"step_floor: disk_{kind}_bytes is {amount:g} but the profile has no "
                f"disk_{kind}_bytes_s (got None); {_HOW} --disk-dir on the offload disk"
            )


def step_floor(
    profile: MachineProfile,
    *,
    forward_s: float,
    backward_s: float,
    host_numel: int,
    gpu_numel: int = 0,
    h2d_bytes_per_param: float = 2,
    d2h_bytes_per_param: float = 2,
    disk_read_bytes: float = 0,
    disk_write_bytes: float = 0,
    streamed_bytes: float = 0,
    host_value_fraction: float = 0.0,
    clip_before_update: bool = True,
    forward_hide_fraction: float = 1.0,
    gpu_fraction: float | None = None,
) -> FloorEstimate:
    """The floor of an offloaded step (see [Note: step-time floor]).

    Args:
        profile: the machine's measured figures.
        forward_s: the model's forward, all on the GPU, seconds.
        backward_s: its backward, all on the GPU, seconds.
        host_numel: parameters (this rank's) whose masters and states live on the host.
        gpu_numel: parameters (this rank's) whose masters and states live on
            the GPU: their updates run in the GPU's Adam at
            ``gpu_adam_params_s`` and are added to the backward. Default 0.
        h2d_bytes_per_param: parameter bytes copied to the GPU per update. Default 2 (bf16).
        d2h_bytes_per_param: gradient bytes copied to the host per update. Default 2 (bf16).
        disk_read_bytes: Adam-state bytes read from disk per step. Default 0.
        disk_write_bytes: Adam-state bytes written to disk per step. Default 0.
        streamed_bytes: parameter bytes (this rank's) that live on the host
            and are copied to the GPU for the forward, and again for the
            backward. Default 0.
        host_value_fraction: the share of ``host_numel`` whose parameter
            values live on the host too (Gemini's host-held shards), in
            [0, 1]: under the split their gradients cross back to the GPU
            and their new values down. Default 0.0.
        clip_before_update: updates wait for the global gradient norm, so
            none overlaps backward. Default True (what the CPU-step pipeline
            does, with or without clipping).
        forward_hide_fraction: the share of the next forward that can run
            beside the updates, in [0, 1]. Default 1.0.
        gpu_fraction: the split's share of the host-held updates in the
            GPU's Adam, in [0, 1], for the floor of a split that runs at
            that share. Default None: the best share.

    Returns:
        A :class:`FloorEstimate`: the CPU-only floor, the split one (None
        without the figures it needs) and ``floor_s``, the lower.

    Raises:
        ValueError: a negative or non-finite amount, a fraction outside
            [0, 1], or PCIe or disk traffic the profile has no bandwidth for.
        TypeError: an amount that is not a number, a profile that is not a
            MachineProfile.
    """
    amounts = dict(
        forward_s=forward_s, backward_s=backward_s, host_numel=host_numel, gpu_numel=gpu_numel,
        h2d_bytes_per_param=h2d_bytes_per_param, d2h_bytes_per_param=d2h_bytes_per_param,
        disk_read_bytes=disk_read_bytes, disk_write_bytes=disk_write_bytes,
        streamed_bytes=streamed_bytes, host_value_fraction=host_value_fraction,
        forward_hide_fraction=forward_hide_fraction,
    )  # fmt: skip
    _check_inputs(profile, amounts, clip_before_update, gpu_fraction)
    stream = _secs(streamed_bytes, profile.h2d_bytes_s)
    forward_s = max(forward_s, stream)
    backward_s = max(backward_s + _secs(gpu_numel, profile.gpu_adam_params_s), stream)
    disk_s = _secs(disk_read_bytes, profile.disk_read_bytes_s) + _secs(
        disk_write_bytes, profile.disk_write_bytes_s
    )
    times = _Times(forward_s, backward_s, disk_s, forward_hide_fraction * forward_s, stream)
    moved = _Moved(h2d_bytes_per_param, d2h_bytes_per_param, host_value_fraction)
    alone = _Rates(profile.cpu_adam_bytes_s, profile.h2d_bytes_s, profile.d2h_bytes_s, None)
    cpu_only = _floor(host_numel, 0.0, alone, times, moved, None, clip_before_update)
    split = _split(profile, host_numel, times, moved, clip_before_update, gpu_fraction)
    return FloorEstimate(cpu_only=cpu_only, split=split)


def _split(
    profile: MachineProfile, numel: float, times: _Times, moved: _Moved, clip: bool,
    fraction: float | None = None,
) -> StepFloor | None:  # fmt: skip
    """The floor under the best CPU/GPU split (the smallest ``f`` of the
    shortest steps, to rounding), or at the share ``fraction``; None
    without the figures."""
    cpu_rate, up, down = (
        profile.cpu_adam_with_copies_bytes_s, profile.h2d_with_adam_bytes_s,
        profile.d2h_with_adam_bytes_s,
    )  # fmt: skip
    gpu_rate = profile.gpu_adam_params_s
    if numel == 0 or gpu_rate is None or not (cpu_rate and up and down):
        return None
    rates = _Rates(cpu_rate, up, profile.d2h_bytes_s, down)
    pieces = _pieces(_lines(numel, rates, times, moved, gpu_rate), times, clip)
    shares = _candidates(pieces) if fraction is None else [fraction]
    floors = [_floor(numel, f, rates, times, moved, gpu_rate, clip) for f in shares]
    shortest = min(floor.step_s for floor in floors)
    return next(floor for floor in floors if floor.step_s <= shortest * (1 + 1e-12))
