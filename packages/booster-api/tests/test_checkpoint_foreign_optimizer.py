"""An optimizer checkpoint of another model is refused before anything
loads, as torch's ``optimizer.load_state_dict`` refuses it ("loaded state
dict contains a parameter group that doesn't match the size of optimizer's
group"). Model A has l1 and l2, model B adds l3: A's state once loaded into
B's optimizer silently (l1 and l2 took A's moments; l3's Adam state was
erased, or kept with zero moments under GeminiPlugin). Every plugin, both
gathered layouts and the per-rank one (``shard=True``)."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_helpers import same
from torch import nn

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin
from zerostack.testing import spawn

PLUGINS = {  # name -> (plugin or None, world size)
    "none": (lambda: None, 1),
    "zero2": (lambda: LowLevelZeroPlugin(stage=2, precision="fp32"), 2),
    "gemini": (lambda: GeminiPlugin(precision="fp32"), 2),
}


class _Net(nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)
        if extra:
            self.l3 = nn.Linear(4, 4)

    def forward(self, x):
        y = self.l2(torch.tanh(self.l1(x)))
        return self.l3(y) if hasattr(self, "l3") else y


def _boosted(plugin: str, extra: bool, seed: int, steps: int = 2):
    torch.manual_seed(seed)
    net = _Net(extra)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    made = PLUGINS[plugin][0]()
    booster = Booster(device="cpu") if made is None else Booster(plugin=made)
    model, opt, *_ = booster.boost(net, opt)
    for _ in range(steps):
        booster.backward(model(torch.randn(4, 8)).pow(2).mean(), opt)
        opt.step()
        opt.zero_grad()
    return booster, model, opt


def _cases(rank, world, root, plugin):
    del rank, world
    torch.set_num_threads(1)
    for shard in (False, True):
        where = f"{plugin} shard={shard}"
        path = f"{root}/A-optim{'' if shard else '.pt'}"
        booster, _, opt = _boosted(plugin, extra=False, seed=0)
        booster.save_optimizer(opt, path, shard=shard)
        booster, model, opt = _boosted(plugin, extra=True, seed=1)
        before, weights = opt.full_state_dict(), model.full_state_dict(only_rank_0=False)
        assert set(before["state"]) == {f"l{i}.{k}" for i in (1, 2, 3) for k in ("weight", "bias")}
        with pytest.raises(
            ValueError,
            match=r"parameter groups list other parameters than this optimizer's \(got "
            r"\['l3.bias', 'l3.weight'\] missing from the state, \[\] not in this optimizer\)"
            r".*torch's load_state_dict refuses .*doesn't match the size of optimizer's group",
        ):
            booster.load_optimizer(opt, path)
        same(before, opt.full_state_dict(), f"{where}: a refused load changed the optimizer")
        same(weights, model.full_state_dict(only_rank_0=False), f"{where}: it changed the model")

        # A parameter without a state (no gradient yet) is still listed in
        # the groups: a state saved before the first step loads.
        fresh_path = f"{root}/B-fresh{'' if shard else '.pt'}"
        booster, _, fresh = _boosted(plugin, extra=True, seed=2, steps=0)
        booster.save_optimizer(fresh, fresh_path, shard=shard)
        booster.load_optimizer(opt, fresh_path)
        assert opt.full_state_dict()["state"] == {}, where


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_an_optimizer_state_of_another_model_is_refused_before_anything_loads(tmp_path, plugin):
    spawn(_cases, PLUGINS[plugin][1], args=(str(tmp_path), plugin), backend="gloo", timeout_s=240)


def _boosted_frozen(plugin: str, *, seed: int, trainable_only: bool):
    torch.manual_seed(seed)
    net = _Net(extra=False)
    net.l1.weight.requires_grad_(False)
    params = [p for p in net.parameters() if p.requires_grad or not trainable_only]
    made = PLUGINS[plugin][0]()
    booster = Booster(device="cpu") if made is None else Booster(plugin=made)
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(params, lr=1e-2))
    booster.backward(model(torch.randn(4, 8)).pow(2).mean(), opt)
    opt.step()
    return booster, opt


def _frozen_cases(rank, world, root):
    del rank, world
    torch.set_num_threads(1)
    # (plugin, optimizer on the trainable parameters only) saved -> loaded.
    for source, target in (
        (("none", False), ("none", True)),  # the state lists l1.weight, the optimizer not
        (("gemini", False), ("none", False)),  # GeminiOptimizer lists trainable ones only
        (("none", False), ("gemini", False)),
    ):
        booster, opt = _boosted_frozen(source[0], seed=0, trainable_only=source[1])
        booster.save_optimizer(opt, f"{root}/frozen.pt")
        saved = opt.full_state_dict()["state"]
        booster, opt = _boosted_frozen(target[0], seed=1, trainable_only=target[1])
        booster.load_optimizer(opt, f"{root}/frozen.pt")
        same(saved, opt.full_state_dict()["state"], f"{source} -> {target}")


def test_frozen_parameters_may_be_listed_on_one_side_only(tmp_path):
    """A frozen parameter is in a torch optimizer built on
    model.parameters(), not in one built on the trainable ones, nor in
    GeminiOptimizer's group: states still load across these."""
    spawn(_frozen_cases, 1, args=(str(tmp_path),), backend="gloo", timeout_s=240)


def _linear_boosted(plugin: str, out_features: int):
    torch.manual_seed(out_features)
    net = nn.Linear(8, out_features, bias=False)
    made = PLUGINS[plugin][0]()
    booster = Booster(device="cpu") if made is None else Booster(plugin=made)
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    booster.backward(model(torch.randn(4, 8)).pow(2).mean(), opt)
    opt.step()
    opt.zero_grad()
    return booster, opt


def _save_other_size(rank, world, root):
    del rank, world
    booster, opt = _linear_boosted("none", out_features=8)  # weight: 64 elements
    booster.save_optimizer(opt, f"{root}/optim", shard=True)


def _load_other_size(rank, world, root):
    del world
    torch.set_num_threads(1)
    booster, opt = _linear_boosted("zero2", out_features=16)  # 128 elements, 64 a rank
    assert opt.local_ranges()["weight"] == (64 * rank, 64 * (rank + 1), 128)
    before = opt.full_state_dict()
    with pytest.raises(
        ValueError,
        match=r"CheckpointIO\.load_optimizer: .*/optim holds optimizer states of other sizes "
        r"than this optimizer's parameters \(got \[\('weight', 'exp_avg', 64, 128\), "
        r"\('weight', 'exp_avg_sq', 64, 128\)\] .*load the state of the same model",
    ):
        booster.load_optimizer(opt, f"{root}/optim")
    same(before, opt.full_state_dict(), f"rank {rank}: a refused load changed the optimizer")


def test_a_per_rank_state_of_other_sizes_is_refused_where_it_fits_a_rank_s_range(tmp_path):
    """A per-rank (``shard=True``) optimizer state of a parameter of 64
    elements, loaded at ZeRO-2 over 2 ranks into one of 128 (64 a rank).
    Before, each rank read the saved tensor whole and, its size being the
    rank's range, took it as its piece: both halves of exp_avg held the
    same 64 values, without an error."""
    spawn(_save_other_size, 1, args=(str(tmp_path),), backend="gloo", timeout_s=120)
    spawn(_load_other_size, 2, args=(str(tmp_path),), backend="gloo", timeout_s=120)
