"""HardwareProfile: what the planner needs to know about the machine, measured on it.

ColossalAI looked FLOP/s up in a table of four GPUs (anything else raised
TypeError). Here every rate is measured at first use on the device itself
and cached per device, so any GPU works; a profile can also be built from a
dict, which is how the solver runs on a CPU-only machine (tests).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_LINKS = ("h2d", "d2h")
_DTYPES = ("float16", "bfloat16", "float32")
_DTYPE_NAMES = frozenset(_DTYPES)


def _check_curve(name: str, curve: dict) -> dict[int, float]:
    if not isinstance(curve, dict) or not curve:
        raise ValueError(
            f"HardwareProfile: {name} must be a non-empty dict of transfer size in bytes -> "
            f"bytes/s (got {curve!r})"
        )
    out: dict[int, float] = {}
    for size, bw in curve.items():
        size_i, bw_f = int(size), float(bw)
        if size_i <= 0 or not bw_f > 0 or not math.isfinite(bw_f):
            raise ValueError(
                f"HardwareProfile: {name} needs positive sizes and finite positive bandwidths "
                f"(got {size!r}: {bw!r})"
            )
        out[size_i] = bw_f
    return dict(sorted(out.items()))


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """Measured rates of one device, as the simulator uses them.

    Build one with :meth:`measure` (on the machine, cached per device) or
    :meth:`from_dict` (tests, CPU-only planning, a profile measured elsewhere).
    """

    device_name: str
    """The device's name (for the cache file and the logs)."""
    device_memory_bytes: int
    """Total device memory; the budget when ``memory_budget <= 0``."""
    h2d_bandwidth: dict[int, float]
    """Pinned host -> device copy rate in bytes/s, keyed by transfer size in bytes."""
    d2h_bandwidth: dict[int, float]
    """Device -> pinned host copy rate in bytes/s, keyed by transfer size in bytes."""
    gemm_flops: dict[str, float]
    """Achieved matmul FLOP/s per dtype name ("float16", "bfloat16", "float32")."""
    memory_bandwidth: float
    """Device-to-device copy rate in bytes/s (bounds element-wise ops)."""
    kernel_launch_s: float = 0.0
    """Host seconds per forward op under autograd (dispatch, graph recording,
    launch): the floor of every forward op's time. Default 0."""
    backward_op_s: float = 0.0
    """Host seconds per op in backward (the autograd engine's node and its
    launches): the floor of every backward op's time. Default 0: twice
    ``kernel_launch_s``."""
    gemm_curve: dict[str, dict[int, float]] = field(default_factory=dict)
    """Achieved matmul FLOP/s per dtype name, keyed by FLOPs per call (small
    matmuls reach a fraction of the peak). Default empty: ``gemm_flops``
    for every size."""
    _sizes: dict[str, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "h2d_bandwidth", _check_curve("h2d_bandwidth", self.h2d_bandwidth))
        object.__setattr__(self, "d2h_bandwidth", _check_curve("d2h_bandwidth", self.d2h_bandwidth))
        if not isinstance(self.device_name, str):
            raise TypeError(
                f"HardwareProfile: device_name must be a str (got {self.device_name!r})"
            )
        for name in ("device_memory_bytes", "memory_bandwidth", "kernel_launch_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"HardwareProfile: {name} must be a number (got {value!r})")
        if not isinstance(self.gemm_flops, dict) or not set(self.gemm_flops) <= _DTYPE_NAMES:
            raise ValueError(
                "HardwareProfile: gemm_flops must map dtype names "
                f"({', '.join(sorted(_DTYPE_NAMES))}) to positive FLOP/s (got {self.gemm_flops!r})"
            )
        if not self.device_memory_bytes > 0:
            raise ValueError(
                f"HardwareProfile: device_memory_bytes must be > 0 (got {self.device_memory_bytes!r})"
            )
        if not self.gemm_flops or any(not v > 0 for v in self.gemm_flops.values()):
            raise ValueError(
                "HardwareProfile: gemm_flops must map dtype names to positive FLOP/s "
                f"(got {self.gemm_flops!r})"
            )
        if not self.memory_bandwidth > 0:
            raise ValueError(
                f"HardwareProfile: memory_bandwidth must be > 0 bytes/s (got {self.memory_bandwidth!r})"
            )
        for name in ("kernel_launch_s", "backward_op_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(
                    f"HardwareProfile: {name} must be >= 0 (got {getattr(self, name)!r})"
                )
        curves = {
            name: _check_curve(f"gemm_curve[{name!r}]", c) for name, c in self.gemm_curve.items()
        }
        object.__setattr__(self, "gemm_curve", curves)
        sizes = {k: list(getattr(self, f"{k}_bandwidth")) for k in _LINKS}
        sizes.update({f"gemm:{name}": list(c) for name, c in curves.items()})
        object.__setattr__(self, "_sizes", sizes)

    # -- rates ---------------------------------------------------------------

    def bandwidth(self, link: str, nbytes: float) -> float:
        """Bytes/s of a ``link`` ("h2d" or "d2h") copy of ``nbytes``: linear in
        log(size) between measured sizes, the end values outside them."""
        if link not in _LINKS:
            raise ValueError(
                f"HardwareProfile.bandwidth: link must be 'h2d' or 'd2h' (got {link!r})"
            )
        return _interpolate(getattr(self, f"{link}_bandwidth"), self._sizes[link], nbytes)

    def gemm_rate(self, dtype: torch.dtype, flops: float) -> float:
        """Achieved FLOP/s of a matmul of ``flops`` in ``dtype``: the measured
        curve where there is one, else the peak (the largest peak for a dtype
        not measured)."""
        name = str(dtype).removeprefix("torch.")
        if name in self.gemm_curve:
            return _interpolate(self.gemm_curve[name], self._sizes[f"gemm:{name}"], flops)
        return self.gemm_flops.get(name) or max(self.gemm_flops.values())

    def transfer_time(self, link: str, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` over ``link`` (0 for nothing)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.bandwidth(link, nbytes)

    def compute_time(
        self,
        flops: float,
        bytes_moved: float,
        dtype: torch.dtype,
        kernels: int = 1,
        backward: bool = False,
    ) -> float:
        """Roofline estimate of one op: the larger of its matmul time and its
        memory time, never below the host's cost of its ``kernels`` ops
        (``backward_op_s`` each in backward, ``kernel_launch_s`` in forward)."""
        matmul = flops / self.gemm_rate(dtype, flops) if flops > 0 else 0.0
        per_op = self.kernel_launch_s
        if backward:
            per_op = self.backward_op_s or 2 * self.kernel_launch_s
        return max(matmul, bytes_moved / self.memory_bandwidth, kernels * per_op)

    # -- (de)serialisation ---------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-able dict that :meth:`from_dict` reads back."""
        d = asdict(self)
        d.pop("_sizes", None)
        for link in _LINKS:
            d[f"{link}_bandwidth"] = {str(k): v for k, v in d[f"{link}_bandwidth"].items()}
        d["gemm_curve"] = {n: {str(k): v for k, v in c.items()} for n, c in d["gemm_curve"].items()}
        return d

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        """Build a profile from a dict with the field names (sizes may be strings).

        Raises:
            TypeError: ``data`` is not a dict, or a field has the wrong type.
            ValueError: a missing or unknown field, or a bad value.
        """
        if not isinstance(data, dict):
            raise TypeError(
                f"HardwareProfile.from_dict: data must be a dict of the fields (got "
                f"{type(data).__name__}); pass e.g. json.load of a saved profile"
            )
        fields = {"device_name", "device_memory_bytes", "h2d_bandwidth", "d2h_bandwidth",
                  "gemm_flops", "memory_bandwidth", "kernel_launch_s", "backward_op_s",
                  "gemm_curve"}  # fmt: skip
        missing = fields - {"kernel_launch_s", "backward_op_s", "gemm_curve"} - set(data)
        unknown = set(data) - fields
        if missing or unknown:
            raise ValueError(
                f"HardwareProfile.from_dict: missing fields {sorted(missing)}, unknown fields "
                f"{sorted(unknown)}; the fields are {sorted(fields)}"
            )
        return cls(**{k: data[k] for k in fields if k in data})

    # -- measuring -----------------------------------------------------------

    @classmethod
    def measure(
        cls,
        device: torch.device | str | int | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
        refresh: bool = False,
    ) -> HardwareProfile:
        """Measure ``device`` (default: the current CUDA device), or read the
        cached measurement of that very device.

        Args:
            device: a CUDA device. Default: ``torch.cuda.current_device()``.
            cache_dir: where the per-device JSON lives. Default:
                ``$ZEROSTACK_CACHE_DIR/auto_offload`` or ``~/.cache/zerostack/auto_offload``.
            refresh: measure again even when a cached file exists. Default False.

        Raises:
            RuntimeError: no CUDA device (pass a profile instead, e.g.
                ``HardwareProfile.from_dict``).
        """
        if not torch.cuda.is_available():
            raise RuntimeError(
                "HardwareProfile.measure: no CUDA device; build the profile with "
                "HardwareProfile.from_dict(...) (e.g. one measured on the GPU machine) to plan on "
                "a CPU-only machine"
            )
        index = None if device is None else torch.device(device).index
        device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        name, uuid, total = _device_facts(device)
        path = _cache_path(cache_dir, name, uuid, device)
        if path.exists() and not refresh:
            try:
                return cls.from_dict(json.loads(path.read_text()))
            except (ValueError, json.JSONDecodeError) as err:
                logger.warning("auto_offload: ignoring unreadable profile %s (%s)", path, err)
        logger.info("auto_offload: measuring %s (cached in %s)", name, path)
        profile = cls(device_name=name, device_memory_bytes=total, **_measure_rates(device))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_dict(), indent=1))
        tmp.replace(path)
        return profile


def _interpolate(curve: dict[int, float], sizes: list[int], x: float) -> float:
    """Linear in log(x) between measured points; the end values outside them."""
    if x <= sizes[0]:
        return curve[sizes[0]]
    if x >= sizes[-1]:
        return curve[sizes[-1]]
    i = bisect.bisect_left(sizes, x)
    lo, hi = sizes[i - 1], sizes[i]
    w = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return curve[lo] + w * (curve[hi] - curve[lo])


def _device_facts(device: torch.device) -> tuple[str, str, int]:
    """Name, a stable id and total memory; NVML when installed, torch otherwise."""
    props = torch.cuda.get_device_properties(device)
    name, uuid, total = props.name, str(getattr(props, "uuid", "")), int(props.total_memory)
    try:
        import pynvml
    except ImportError:
        return name, uuid, total
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        nv_name = pynvml.nvmlDeviceGetName(handle)
        name = nv_name.decode() if isinstance(nv_name, bytes) else nv_name
        nv_uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = nv_uuid.decode() if isinstance(nv_uuid, bytes) else nv_uuid
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except pynvml.NVMLError as err:  # e.g. inside a container without NVML access
        logger.info("auto_offload: NVML unavailable (%s); using torch's device facts", err)
    return name, uuid, total


def _cache_path(cache_dir, name: str, uuid: str, device: torch.device) -> Path:
    root = Path(cache_dir) if cache_dir is not None else (
        Path(os.environ["ZEROSTACK_CACHE_DIR"]) / "auto_offload" if "ZEROSTACK_CACHE_DIR" in os.environ
        else Path.home() / ".cache" / "zerostack" / "auto_offload"
    )  # fmt: skip
    key = re.sub(
        r"[^A-Za-z0-9_.-]+", "_", f"{name}-{uuid or device.index}-torch{torch.__version__}-v2"
    )
    return root / f"{key}.json"


def _time_cuda(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def _measure_rates(device: torch.device) -> dict:
    """Copy curves from 4 KiB to 256 MiB, matmul FLOP/s by size, HBM copy rate, launch cost."""
    with torch.cuda.device(device):
        curves: dict[str, dict[int, float]] = {"h2d": {}, "d2h": {}}
        host = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(1 << 28, dtype=torch.uint8, device=device)
        for exp in range(12, 29, 2):
            n = 1 << exp
            repeat = max(3, min(50, (1 << 26) // n))
            h2d = _time_cuda(lambda n=n: dev[:n].copy_(host[:n], non_blocking=True), repeat)
            d2h = _time_cuda(lambda n=n: host[:n].copy_(dev[:n], non_blocking=True), repeat)
            curves["h2d"][n], curves["d2h"][n] = n / h2d, n / d2h
        other = torch.empty_like(dev)
        hbm = 2 * dev.numel() / _time_cuda(lambda: other.copy_(dev), 10)
        host = dev = other = None  # free them before the matmuls
        gemm, gemm_curve = {}, {}
        for name in _DTYPES:
            dt = getattr(torch, name)
            b = torch.randn(4096, 4096, device=device, dtype=dt)
            curve = {}
            for rows in (64, 256, 1024, 4096, 16384):  # (rows x 4096) @ (4096 x 4096)
                a = torch.randn(rows, 4096, device=device, dtype=dt)
                flops = 2 * rows * 4096 * 4096
                repeat = max(20, 2**37 // flops)
                curve[flops] = flops / _time_cuda(lambda a=a, b=b: a @ b, repeat)
            gemm_curve[name], gemm[name] = curve, max(curve.values())
            a = b = None
        launch, backward = _host_op_costs(device)
        torch.cuda.empty_cache()
    return dict(
        h2d_bandwidth=curves["h2d"], d2h_bandwidth=curves["d2h"], gemm_flops=gemm,
        gemm_curve=gemm_curve, memory_bandwidth=hbm, kernel_launch_s=launch,
        backward_op_s=backward,
    )  # fmt: skip


def _host_op_costs(device: torch.device, ops: int = 200) -> tuple[float, float]:
    """Host seconds per op of a chain of tiny ops under autograd: forward
    (dispatch, graph recording, launch) and backward (the engine's node and
    its launches). Small ops are bound by these, not by the GPU."""
    x = torch.zeros(16, device=device, requires_grad=True)

    def forward():
        y = x
        for _ in range(ops):
            y = y * 1.5
        return y

    def forward_backward():
        forward().sum().backward()

    fwd = _time_cuda(forward, 20, warmup=5)
    both = _time_cuda(forward_backward, 20, warmup=5)
    return fwd / ops, max(both - fwd, 0.0) / ops
