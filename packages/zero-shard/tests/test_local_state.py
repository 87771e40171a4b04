"""ZeroOptimizer.local_state_dict / load_local_state_dict: this rank's pieces
of the masters and states, as views, loadable into another optimizer (on 2
ranks: each rank's ranges, the padding left out)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerostack.shard import ZeroOptimizer
from zerostack.testing import spawn


def _zero(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 1))  # 3 + 1 elements: padding at 2 ranks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return model, ZeroOptimizer(opt, stage=2, module=model)


def _step(model, zero, seed):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
    zero.backward(model(x).pow(2).mean())
    zero.step()


def _check(rank, world):
    torch.set_num_threads(1)
    model, zero = _zero(0)
    for i in range(2):
        _step(model, zero, i)
    local = zero.local_state_dict()
    ranges = zero.local_ranges()
    for entry, s, (start, end) in zip(local["params"], zero.shards, ranges, strict=True):
        assert entry["master"].numel() == end - start == entry["exp_avg"].numel()
        if end > start:  # a view, not a copy
            assert entry["master"].data_ptr() == s.master.data_ptr()
    copy = {
        **local,
        "params": [{k: v.clone() if torch.is_tensor(v) else v for k, v in e.items()} for e in local["params"]],
    }  # fmt: skip
    other_model, other = _zero(1)
    other.load_local_state_dict(copy)
    for a, b in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(a, b)  # masters loaded, then the parameters all-gathered
    _step(model, zero, 5)
    _step(other_model, other, 5)
    for a, b in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(a, b)  # the Adam states and step came along
    wrong = {
        **copy,
        "params": [dict(copy["params"][0], exp_avg=torch.zeros(99)), *copy["params"][1:]],
    }
    with pytest.raises(ValueError, match=r"exp_avg of parameter 0 has 99 elements"):
        other.load_local_state_dict(wrong)
    with pytest.raises(ValueError, match=r"1 parameters given, this optimizer has 4"):
        other.load_local_state_dict({**copy, "params": copy["params"][:1]})


def test_local_state_round_trip_one_process():
    _check(0, 1)


def test_local_state_round_trip_two_ranks():
    spawn(_check, 2, backend="gloo", timeout_s=120)
