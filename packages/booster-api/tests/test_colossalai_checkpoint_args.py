"""The Booster's checkpoint methods take the arguments ColossalAI's take
(colossalai/booster/booster.py): ``use_async`` of ``save_model`` and
``save_optimizer``, ``low_cpu_mem_mode`` and ``num_threads`` of
``load_model`` and ``load_optimizer`` (in its positional order). They only
change how ColossalAI reads or writes: the checkpoint is the same, and
another value than the default warns once. They were a ``TypeError``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from zerostack.booster import Booster, LowLevelZeroPlugin, _booster

# (method, extra arguments, the argument named in the warning)
CASES = [
    ("save_model", {"use_async": True}, "use_async"),
    ("save_optimizer", {"use_async": True}, "use_async"),
    ("load_model", {"low_cpu_mem_mode": False}, "low_cpu_mem_mode"),
    ("load_model", {"num_threads": 4}, "num_threads"),
    ("load_optimizer", {"low_cpu_mem_mode": False}, "low_cpu_mem_mode"),
    ("load_optimizer", {"num_threads": 4}, "num_threads"),
]


def _trained(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    opt.backward(model(torch.randn(4, 8)).pow(2).mean())
    opt.step()
    return booster, model, opt


@pytest.mark.parametrize(("method", "extra", "named"), CASES)
def test_colossalai_checkpoint_arguments_save_and_load_the_same(tmp_path, method, extra, named):
    _booster._WARNED.clear()
    booster, model, opt = _trained(0)
    target = model if method.endswith("model") else opt
    kind = "model" if method.endswith("model") else "optimizer"
    path = str(tmp_path / f"{kind}.pt")
    if method.startswith("save"):
        with pytest.warns(UserWarning, match=rf"{method}: {named}=True has no effect"):
            getattr(booster, method)(target, path, **extra)
    else:
        getattr(booster, f"save_{kind}")(target, path)
    _, fresh_model, fresh_opt = _trained(1)
    fresh = fresh_model if kind == "model" else fresh_opt
    if method.startswith("load"):
        with pytest.warns(UserWarning, match=rf"{method}: {named}=.* has no effect"):
            getattr(booster, method)(fresh, path, **extra)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: a second call says nothing
            getattr(booster, method)(fresh, path, **extra)
    else:
        getattr(booster, f"load_{kind}")(fresh, path)
    if kind == "model":
        saved, loaded = model.full_state_dict(), fresh_model.full_state_dict()
    else:
        saved, loaded = opt.full_state_dict()["state"], fresh_opt.full_state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for key in saved:
        torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0)


def test_load_arguments_in_colossalais_positional_order(tmp_path):
    _booster._WARNED.clear()
    booster, model, _ = _trained(0)
    booster.save_model(model, str(tmp_path / "model.pt"))
    _, fresh, _ = _trained(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults say nothing
        booster.load_model(fresh, str(tmp_path / "model.pt"), True, True, 1)
    for key, value in model.full_state_dict().items():
        assert torch.equal(fresh.full_state_dict()[key], value)
