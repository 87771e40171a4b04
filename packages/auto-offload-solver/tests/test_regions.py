"""Region cuts: every parameter in exactly one region (tied ones included),
boundaries where one gradient-carrying value crosses, least-waste block size."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import batch, fake_profile, tiny_gpt2, tiny_llama

from zerostack.auto_offload import Region, RegionManager, propagate, trace_model


class ManyTied(torch.nn.Module):
    """Three parameters each read by two far-apart layers, and one never read."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))
        self.layers[5].weight = self.layers[0].weight
        self.layers[4].weight = self.layers[1].weight
        self.layers[3].bias = self.layers[2].bias
        self.unused = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _manager(model, inputs) -> RegionManager:
    gm = trace_model(model, inputs)
    rm = RegionManager(gm, propagate(gm, inputs), fake_profile(), solver_name="syn")
    rm.build_regions()
    return rm


def _check_cover(model, rm):
    owned = [id(p) for r in rm.region_list for p in r.params]
    assert sorted(owned) == sorted({id(p) for p in model.parameters()})  # each exactly once
    nodes = [n.index for r in rm.region_list for n in r.nodes]
    assert nodes == list(range(len(rm.nodes)))  # every node, in order, once
    for p in model.parameters():
        assert sum(q is p for q in rm.get_region(p).params) == 1


@pytest.mark.parametrize(
    "build",
    [tiny_gpt2, tiny_llama, lambda: tiny_llama(tie=True)],
    ids=["gpt2-tied", "llama", "llama-tied"],
)
def test_transformers_cover_every_parameter_once(build):
    model = build().to(torch.bfloat16)
    rm = _manager(model, batch())
    _check_cover(model, rm)
    assert len(rm.region_list) >= 2
    # before merging: the embedding, attention and MLP of each layer, the head
    assert len(rm._linearize_graph()) >= 5
    emb = rm.get_region(model.model.get_input_embeddings().weight)
    tied = model.model.get_output_embeddings().weight is model.model.get_input_embeddings().weight
    assert emb.shared == tied and emb.offloadable == (not tied)


def test_any_number_of_shared_parameters():
    model = ManyTied()
    rm = _manager(model, (torch.randn(4, 16),))
    _check_cover(model, rm)
    shared = {id(p) for r in rm.region_list if r.shared for p in r.params}
    for p in (model.layers[0].weight, model.layers[1].weight, model.layers[2].bias):
        assert id(p) in shared
    assert rm.get_region(model.unused) is not None
    assert not any(model.unused is q for r in rm.region_list for q in r.grad_params)


def test_each_boundary_has_one_gradient_carrying_value():
    rm = _manager(tiny_gpt2(2).half(), batch())
    index = {n.node: n.index for n in rm.nodes}
    for r in rm.region_list[1:]:
        start = r.nodes[0].index
        crossing = [
            n for n in rm.nodes[:start]
            if n.requires_grad and any(index.get(u, len(index)) >= start for u in n.node.users)
        ]  # fmt: skip
        assert [n.node for n in crossing] == [r.cut_node]


def test_block_size_wastes_least():
    sizes = [30, 30, 40, 20, 40]
    regions = []
    for s in sizes:
        r = Region(len(regions))
        r.params = [torch.nn.Parameter(torch.zeros(s // 2, dtype=torch.float16))]
        r.grad_params = list(r.params)
        regions.append(r)
    rm = RegionManager.__new__(RegionManager)
    rm.search_interval_bytes, rm.search_range_bytes = 1, 1000
    # blocks of 60: [30,30] [40,20] [40] wastes 20; 70: [30,30] [40,20] [40] wastes 30;
    # 80: [30,30,-] [40,20,-] ... ; 60 is the least over [40, 80]
    assert RegionManager._wasted(sizes, 60) == 20
    assert rm._search_block_size(regions) == 60
    rm.mem_block_size = 60
    merged = rm._merge_small_regions(regions)
    assert [r.param_bytes for r in merged] == [60, 60, 40]


def test_split():
    r = Region(3)
    r.nodes = ["a", "b", "c"]
    r.params = [torch.nn.Parameter(torch.zeros(n)) for n in (2, 3, 4)]
    r.grad_params = list(r.params)
    latter = r.split(2, 1)
    assert latter.r_id == 4 and latter.nodes == ["c"] and r.nodes == ["a", "b"]
    assert [p.numel() for p in latter.params] == [3, 4] and latter.param_numel == 7
    assert r.param_bytes == 8 and len(r.grad_params) == 1
    with pytest.raises(ValueError, match="cut_node_idx must be in"):
        r.split(0, 0)
