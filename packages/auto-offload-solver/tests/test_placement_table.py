"""BaseOffloadModule.placement_table: where each region lives over a step."""

from __future__ import annotations

import torch
from offload_helpers import fake_profile, halfway_budget, ref_batch, tiny_ref_gpt

from zerostack.auto_offload import memory_optimize


def test_the_table_names_every_region_with_parameters_and_the_plan():
    budget = halfway_budget(tiny_ref_gpt, "asyn", ref_batch)
    torch.manual_seed(0)
    om = memory_optimize(tiny_ref_gpt(), ref_batch(), budget, "asyn", precision="bf16",
                         profile=fake_profile(), device="cpu")  # fmt: skip
    table = om.placement_table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    owning = [r for r in om.regions if r.params]
    assert len(rows) == len(owning)
    offloaded = [r for r in owning if r.need_offload]
    assert offloaded, "the halfway budget offloads nothing"
    assert sum("| host |" in row for row in rows) == len(offloaded)
    for r, row in zip(owning, rows, strict=True):
        assert row.startswith(f"| {r.r_id} | {len(r.params)} | {r.param_bytes / 2**20:.2f} |")
    assert table.splitlines()[-1] == om.region_manager.solver.describe()
