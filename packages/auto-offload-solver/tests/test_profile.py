"""HardwareProfile: built from a dict, interpolated, validated; the CPU's measured
once per process (a GPU's in test_gpu.py)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from offload_helpers import fake_profile

from zerostack.auto_offload import HardwareProfile


def test_round_trip_and_interpolation():
    p = fake_profile(h2d_bandwidth={"1024": 1e9, "1048576": 4e9})
    q = HardwareProfile.from_dict(p.to_dict())
    assert q == p
    assert p.bandwidth("h2d", 100) == 1e9  # below the curve: its first value
    assert p.bandwidth("h2d", 1 << 30) == 4e9  # above: its last
    # halfway in log(size) between 1 KiB and 1 MiB is 32 KiB
    assert math.isclose(p.bandwidth("h2d", 32768), 2.5e9)
    assert math.isclose(p.transfer_time("h2d", 1 << 20), (1 << 20) / 4e9)
    assert p.transfer_time("d2h", 0) == 0.0


def test_compute_time_is_a_roofline():
    p = fake_profile(kernel_launch_s=1e-5)
    assert math.isclose(p.compute_time(2e12, 0, torch.float16), 2.0)  # matmul bound
    assert math.isclose(p.compute_time(0, 3e12, torch.float16), 3.0)  # memory bound
    assert p.compute_time(0, 0, torch.float16, kernels=3) == pytest.approx(3e-5)
    assert math.isclose(p.compute_time(2.5e11, 0, torch.float32), 1.0)
    # backward: twice the forward's host cost per op unless measured
    assert p.compute_time(0, 0, torch.float16, kernels=3, backward=True) == pytest.approx(6e-5)
    q = fake_profile(kernel_launch_s=1e-5, backward_op_s=4e-5)
    assert q.compute_time(0, 0, torch.float16, kernels=3, backward=True) == pytest.approx(1.2e-4)
    assert HardwareProfile.from_dict(q.to_dict()) == q


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("h2d_bandwidth", {}, "h2d_bandwidth must be a non-empty dict"),
        ("d2h_bandwidth", {4096: -1.0}, "positive sizes and finite positive"),
        ("device_memory_bytes", 0, "device_memory_bytes must be > 0"),
        ("gemm_flops", {"float16": 0.0}, "gemm_flops must map"),
        ("memory_bandwidth", 0.0, "memory_bandwidth must be > 0"),
        ("kernel_launch_s", -1.0, "kernel_launch_s must be >= 0"),
    ],
)
def test_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        fake_profile(**{field: value})


def test_from_dict_names_missing_and_unknown_fields():
    data = fake_profile().to_dict()
    del data["gemm_flops"]
    data["flops"] = 1
    with pytest.raises(
        ValueError, match=r"missing fields \['gemm_flops'\], unknown fields \['flops'\]"
    ):
        HardwareProfile.from_dict(data)
    with pytest.raises(ValueError, match="link must be 'h2d' or 'd2h'"):
        fake_profile().bandwidth("d2d", 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_measure_without_cuda_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"pass device='cpu' to measure the CPU, or .*from_dict"):
        HardwareProfile.measure()


def _rates(p: HardwareProfile) -> list[float]:
    curves = [*p.h2d_bandwidth.values(), *p.gemm_flops.values()]
    curves += [v for c in p.gemm_curve.values() for v in c.values()]
    return [*curves, p.memory_bandwidth, p.kernel_launch_s, p.backward_op_s]


def test_the_cpu_is_measured_once_per_process_and_thread_count():
    p = HardwareProfile.measure("cpu")
    assert HardwareProfile.measure(torch.device("cpu")) is p  # the process's cache
    assert p.device_name.startswith("cpu: ")
    assert p.device_memory_bytes == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert set(p.gemm_flops) == {"float16", "bfloat16", "float32"} == set(p.gemm_curve)
    assert list(p.h2d_bandwidth) == [1 << 12, 1 << 16, 1 << 20, 1 << 24]
    assert all(v > 0 and math.isfinite(v) for v in _rates(p))
    # a host copy is the CPU's transfer, both ways; its memory bandwidth counts read and write
    assert p.d2h_bandwidth == p.h2d_bandwidth
    assert p.memory_bandwidth == 2 * p.h2d_bandwidth[1 << 24]
    # measured, not looked up: a second measurement's timings differ
    q = HardwareProfile.measure("cpu", refresh=True)
    assert q is not p and HardwareProfile.measure("cpu") is q
    assert _rates(q) != _rates(p)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # rates follow the thread count
        assert HardwareProfile.measure("cpu") is not q
    finally:
        torch.set_num_threads(threads)
    assert HardwareProfile.measure("cpu") is q
    with pytest.warns(UserWarning, match="cache_dir has no effect for the CPU"):
        assert HardwareProfile.measure("cpu", cache_dir="/nonexistent") is q


def test_gemm_curve_for_small_matmuls():
    p = fake_profile(gemm_curve={"bfloat16": {"1000": 1e9, "1000000": 1e12}})
    assert HardwareProfile.from_dict(p.to_dict()) == p
    assert p.gemm_rate(torch.bfloat16, 10) == 1e9  # below the curve
    assert math.isclose(p.gemm_rate(torch.bfloat16, 31622.776601683792), 5.005e11)  # log-midpoint
    assert p.gemm_rate(torch.float16, 10) == 1e12  # no curve: the peak
    # a small matmul runs at the curve's rate, not the peak
    assert math.isclose(p.compute_time(1000, 0, torch.bfloat16, kernels=0), 1e-6)
    with pytest.raises(ValueError, match=r"gemm_curve\['bfloat16'\] needs positive sizes"):
        fake_profile(gemm_curve={"bfloat16": {"0": 1.0}})
