"""Simulators against a hand-computed three-node chain.

Each node: 100 bytes of output (and of gradient), saves its input; the last
is the graph output. Each owns a 1000-byte parameter in its own region.
Transfers take 1 ms (1e6 B/s), a forward 1 ms, a backward 2 ms.
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import fake_profile

from zerostack.auto_offload import (
    ActivationProfile,
    AsynTrainingSimulator,
    NodeInfo,
    Region,
    SynTrainingSimulator,
    region_costs,
)

PROFILE = fake_profile(
    h2d_bandwidth={1: 1e6}, d2h_bandwidth={1: 1e6}, gemm_flops={"bfloat16": 1e9},
    memory_bandwidth=1e30, kernel_launch_s=0.0,
)  # fmt: skip


def chain():
    nodes = [
        NodeInfo(index=i, node=None, inputs=(i - 1,) if i else (), out_bytes=100, grad_bytes=100,
                 saves=(i - 1,) if i else (), fwd_flops=1e6, bwd_flops=2e6, kernels=1,
                 requires_grad=True, dtype=torch.bfloat16, param_grad_bytes=1000, is_output=i == 2)
        for i in range(3)
    ]  # fmt: skip
    regions = []
    for i, n in enumerate(nodes):
        r = Region(i)
        r.nodes = [n]
        r.params = [torch.nn.Parameter(torch.zeros(500, dtype=torch.bfloat16))]
        r.grad_params = list(r.params)
        regions.append(r)
    act = ActivationProfile(nodes)
    return regions, act, region_costs(regions, act, PROFILE)


def test_activation_replay():
    _, act, _ = chain()
    assert act.fwd == [100, 200, 300]
    # backward: the output's grad (100) on top of 300; each node adds its
    # input's grad and a transient 1000-byte parameter gradient
    assert act.bwd == [1100, 1300, 1500]


def test_syn_without_offload():
    regions, _, costs = chain()
    ts = SynTrainingSimulator(regions, costs, PROFILE).execute()
    assert ts.peak_mem == 4500  # all three parameters + the last node's backward
    assert ts.step_time == pytest.approx(15e-3)  # 3 uploads + 3 fwd + 3 bwd(2) + 3 downloads
    assert ts.total_mem == 1100 + 2200 + 3300 + 4500 + 3300 + 2100


def test_syn_offloading_the_first_region():
    regions, act, costs = chain()
    regions[0].need_offload = regions[0].is_syn = True
    ts = SynTrainingSimulator(regions, costs, PROFILE).execute()
    assert ts.peak_mem == 3500
    assert ts.step_time == pytest.approx(16e-3)  # one more upload
    fwd, bwd = ts.node_memory(act)
    assert fwd == {0: 1100, 1: 1200, 2: 2300} and bwd == {2: 3500, 1: 2300, 0: 2100}


def test_asyn_without_offload_overlaps_transfers():
    regions, _, costs = chain()
    ts = AsynTrainingSimulator(regions, costs, PROFILE).execute()
    # forward: upload 0 (0-1), prefetch 1 (1-2) and 2 (2-3) behind compute 1-2, 2-3, 3-4;
    # backward 4-6, 6-8, 8-10; the last download 10-11
    assert ts.step_time == pytest.approx(11e-3)
    assert ts.peak_mem == 4500


def test_asyn_prefetch_versus_sync_upload():
    regions, _, costs = chain()
    regions[0].need_offload = True
    regions[1].bwd_prefetch_region = regions[0]  # prefetched when region 1's backward starts
    pre = AsynTrainingSimulator(regions, costs, PROFILE).execute()
    assert pre.step_time == pytest.approx(11e-3)  # hidden behind region 1's backward
    assert pre.peak_mem == 4300  # region 2's gradient is still downloading then
    regions[1].bwd_prefetch_region = None
    regions[0].is_syn = True
    syn = AsynTrainingSimulator(regions, costs, PROFILE).execute()
    assert syn.step_time == pytest.approx(12e-3)  # the upload waits for compute
    assert syn.peak_mem == 3500
