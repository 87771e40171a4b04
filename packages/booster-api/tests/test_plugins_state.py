"""The [Note: full state format] is one format for every plugin: a state saved
from one plugin loads into another (and at another world size), and
training goes on with the losses an uninterrupted run gives. This is the
contract the checkpoint code relies on.

Every step trains on the same 8 samples split over the ranks, so the mean
loss does not depend on the world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
LR = 1e-2
TOL = dict(rtol=1e-5, atol=1e-5)


def _gemini(world, **kwargs):
    chunk = kwargs.pop("chunk_size", 6_000)
    return GeminiPlugin(
        precision="fp32", chunk_config_dict={world: {"chunk_size": chunk}}, **kwargs
    )


def _boost(plugin, seed, optimizer="hybrid", mixed_precision=None):
    """A fresh model (weights from ``seed``: loading must replace them) and
    its optimizer, boosted."""
    torch.manual_seed(seed)
    model = TinyGPT(CONFIG)
    if optimizer == "hybrid":
        opt = HybridAdam(model.parameters(), lr=LR, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    booster = Booster(plugin=plugin, mixed_precision=mixed_precision)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _train(booster, model, opt, start, steps, rank, world):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(CONFIG, 8, 16, seed=step)
        per = 8 // world
        part = slice(rank * per, (rank + 1) * per)
        loss = model(idx[part], tgt[part])
        booster.backward(loss, opt)
        assert opt.step() is not False, f"step {step} skipped"
        opt.zero_grad()
        mean = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _save(model, opt):
    return {"model": model.full_state_dict(only_rank_0=False), "optim": opt.full_state_dict()}


def _load(model, opt, state, optimizer_first=False):
    """Either order: loading the optimizer keeps the fp32 weights as they are."""
    if optimizer_first:
        opt.load_full_state_dict(state["optim"])
    model.load_full_state_dict(state["model"])
    if not optimizer_first:
        opt.load_full_state_dict(state["optim"])


def _check_format(state, names, steps):
    """What every plugin must give: see [Note: full state format]."""
    reference = TinyGPT(CONFIG)
    assert list(state["model"]) == list(reference.state_dict())
    for k, v in state["model"].items():
        assert v.dtype == torch.float32 and v.device.type == "cpu", k
        assert v.shape == reference.state_dict()[k].shape, k
    optim = state["optim"]
    assert set(optim) == {"state", "param_groups", "loss_scaler"}
    assert set(optim["state"]) == set(names)
    shapes = dict(reference.named_parameters())
    for name, entry in optim["state"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}, (name, sorted(entry))
        assert entry["step"].dtype == torch.float32 and entry["step"].item() == steps, name
        for k in ("exp_avg", "exp_avg_sq"):
            assert entry[k].shape == shapes[name].shape, (name, k)
            assert entry[k].dtype == torch.float32 and entry[k].device.type == "cpu"
    [group] = optim["param_groups"]
    assert group["params"] == names and group["lr"] == LR and group["weight_decay"] == 0.1


def _close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _chain(rank, world, path):
    torch.set_num_threads(1)
    names = [n for n, _ in TinyGPT(CONFIG).named_parameters()]
    # G: Gemini, saved after 3 steps, then on without interruption.
    booster, g, g_opt = _boost(_gemini(world), seed=0)
    _train(booster, g, g_opt, 0, 3, rank, world)
    g3 = _save(g, g_opt)
    _check_format(g3, names, steps=3)
    assert "master" not in g3["optim"]["state"][names[0]]
    uninterrupted = _train(booster, g, g_opt, 3, 5, rank, world)
    g8 = g.full_state_dict(only_rank_0=False)

    # G -> ZeRO-2 (HybridAdam) and G -> DDP (torch AdamW): the same losses.
    booster, z, z_opt = _boost(LowLevelZeroPlugin(stage=2, precision="fp32"), seed=1)
    _load(z, z_opt, g3, optimizer_first=True)
    _close(z.full_state_dict(only_rank_0=False), g3["model"], "zero after load")
    _close(_train(booster, z, z_opt, 3, 3, rank, world), uninterrupted[:3], "gemini -> zero")
    z6 = _save(z, z_opt)
    _check_format(z6, names, steps=6)

    booster, d, d_opt = _boost(TorchDDPPlugin(), seed=2, optimizer="adamw")
    _load(d, d_opt, g3)
    _close(_train(booster, d, d_opt, 3, 3, rank, world), uninterrupted[:3], "gemini -> ddp")
    d6 = _save(d, d_opt)
    _check_format(d6, names, steps=6)
    _close(z6["optim"]["state"], d6["optim"]["state"], "zero and ddp states at step 6")

    # DDP -> Gemini with other chunks, half the optimizer on the CPU;
    # ZeRO -> DDP: the last two steps of the uninterrupted run.
    plugin = _gemini(world, chunk_size=4_000, offload_optim_frac=0.5)
    booster, g2, g2_opt = _boost(plugin, seed=3)
    _load(g2, g2_opt, d6, optimizer_first=True)
    _close(_train(booster, g2, g2_opt, 6, 2, rank, world), uninterrupted[3:], "ddp -> gemini")
    _close(g2.full_state_dict(only_rank_0=False), g8, "ddp -> gemini: the weights at step 8")
    booster, d2, d2_opt = _boost(TorchDDPPlugin(), seed=4)
    _load(d2, d2_opt, z6)
    _close(_train(booster, d2, d2_opt, 6, 2, rank, world), uninterrupted[3:], "zero -> ddp")

    # The state is a copy: training after saving left g3 as it was.
    _check_format(g3, names, steps=3)
    # only_rank_0: rank 0 gets the model, the others {} (all take part).
    for model in (g, z, d):
        state = model.full_state_dict(only_rank_0=True)
        assert (state != {}) == (rank == 0), type(model).__name__
    if rank == 0:
        torch.save({"g3": g3, "losses": uninterrupted}, path)


def _resume_elsewhere(rank, world, path):
    """The world-2 state, loaded at this world size into every plugin."""
    torch.set_num_threads(1)
    saved = torch.load(path, weights_only=False)
    g3, uninterrupted = saved["g3"], saved["losses"]
    for name, plugin, optimizer in (
        ("gemini", _gemini(world), "hybrid"),
        ("zero1", LowLevelZeroPlugin(stage=1, precision="fp32"), "adamw"),
        ("ddp", TorchDDPPlugin(), "adamw"),
    ):
        booster, m, opt = _boost(plugin, seed=5, optimizer=optimizer)
        _load(m, opt, g3)
        losses = _train(booster, m, opt, 3, 3, rank, world)
        _close(losses, uninterrupted[:3], f"world 2 -> {name} at world {world}")


def _scalers(rank, world):
    """fp16: the loss scale travels between DynamicLossScaler (ZeRO, Gemini)
    and torch.amp.GradScaler (Booster(mixed_precision="fp16"))."""
    torch.set_num_threads(1)
    plugin = GeminiPlugin(
        precision="fp16", chunk_config_dict={world: {"chunk_size": 6_000}},
        initial_scale=2**10, growth_interval=2,
    )  # fmt: skip
    booster, g, g_opt = _boost(plugin, seed=0)
    _train(booster, g, g_opt, 0, 3, rank, world)
    state = _save(g, g_opt)
    assert state["optim"]["loss_scaler"]["scale"] == 2.0**11  # grew once in 3 clean steps
    plugin = LowLevelZeroPlugin(stage=2, precision="fp16", initial_scale=2**5)
    booster, z, z_opt = _boost(plugin, seed=1)
    _load(z, z_opt, state)
    assert z_opt.optim.scaler.scale == 2.0**11
    booster, d, d_opt = _boost(TorchDDPPlugin(), seed=1, mixed_precision="fp16")
    _load(d, d_opt, state)
    assert d_opt.scaler.get_scale() == 2.0**11
    back = d_opt.full_state_dict()["loss_scaler"]
    booster, z2, z2_opt = _boost(LowLevelZeroPlugin(stage=1, precision="fp16"), seed=1)
    _load(z2, z2_opt, {"model": state["model"], "optim": {**state["optim"], "loss_scaler": back}})
    assert z2_opt.optim.scaler.scale == 2.0**11


def _world2(rank, world, path):
    _chain(rank, world, path)
    _scalers(rank, world)


def test_full_state_moves_between_plugins_and_world_sizes(tmp_path):
    path = str(tmp_path / "state.pt")
    spawn(_world2, 2, args=(path,), backend="gloo", timeout_s=240)
    spawn(_resume_elsewhere, 1, args=(path,), backend="gloo", timeout_s=120)


@pytest.mark.parametrize("plugin", ["none", "zero", "gemini"])
def test_a_state_of_another_model_is_refused(plugin):
    """In one process without a process group (every plugin but DDP runs there)."""
    plugin = {
        "none": None,
        "zero": LowLevelZeroPlugin(stage=1, precision="fp32"),
        "gemini": _gemini(1),
    }[plugin]
    _, model, opt = _boost(plugin, seed=0)
    _train(Booster(plugin=plugin), model, opt, 0, 1, 0, 1)
    state = opt.full_state_dict()
    unknown = {
        **state,
        "state": {**state["state"], "no.such.weight": state["state"]["ln_f.weight"]},
    }
    with pytest.raises(KeyError, match=r"parameters this optimizer does not .*no\.such\.weight"):
        opt.load_full_state_dict(unknown)
    entry = dict(state["state"]["ln_f.weight"], exp_avg=torch.zeros(3))
    wrong = {**state, "state": {**state["state"], "ln_f.weight": entry}}
    with pytest.raises(
        ValueError, match=r"exp_avg of ln_f.weight has 3 elements, the parameter 32"
    ):
        opt.load_full_state_dict(wrong)
    model_state = model.full_state_dict()
    with pytest.raises((KeyError, RuntimeError), match=r"lm_head.weight"):
        model.load_full_state_dict({k: v for k, v in model_state.items() if k != "lm_head.weight"})


@pytest.mark.parametrize("kind", ["zero", "gemini"])
def test_loading_the_optimizer_while_an_update_runs_keeps_its_masters(kind):
    """LowLevelZeroPlugin(cpu_offload=True), GeminiPlugin with its optimizer
    states on the CPU: ``step()`` returns with updates still running on the
    worker; loading the optimizer then (its masters keep their values)
    waits for them before it reads the masters, so the step is not taken
    back."""
    import threading

    def boosted():
        if kind == "zero":
            plugin = LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True)
            return _boost(plugin, seed=0, optimizer="adamw")
        plugin = GeminiPlugin(placement_policy="static", offload_optim_frac=1.0, precision="fp32")
        return _boost(plugin, seed=0)

    booster, model, opt = boosted()
    _train(booster, model, opt, 0, 1, 0, 1)
    saved = opt.full_state_dict()
    inner, opened = opt.optim, threading.Event()
    update = inner._cpu_update
    first = inner._order[0] if kind == "zero" else 0

    def held(unit, *args):  # the first unit's update waits until the load began
        firsts = unit == first if kind == "gemini" else any(b is first for b in unit)
        if firsts:
            assert opened.wait(timeout=30)
        update(unit, *args)

    inner._cpu_update = held
    _train(booster, model, opt, 1, 1, 0, 1)
    threading.Timer(0.3, opened.set).start()
    opt.load_full_state_dict(saved)
    ref_booster, ref_model, ref_opt = boosted()
    _train(ref_booster, ref_model, ref_opt, 0, 2, 0, 1)
    if kind == "zero":
        ref_opt.optim.wait_updates()  # its last step written back
    else:
        ref_model.module.wait_updates()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _boost_batchnorm(rank, world):
    import warnings

    for make in (
        lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
        lambda: GeminiPlugin(precision="fp32"),
    ):
        for sync in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
            if sync:
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                Booster(plugin=make()).boost(model, opt)
            said = [str(w.message) for w in caught if "running statistics" in str(w.message)]
            if sync:
                assert not said, said
            else:
                assert len(said) == 1, said
                assert "(got ['1'])" in said[0] and "convert_sync_batchnorm" in said[0], said


def test_running_statistics_that_stay_per_rank_are_said_once():
    """At two ranks, a BatchNorm's running statistics stay per rank under
    LowLevelZeroPlugin and GeminiPlugin (as under FSDP2, ColossalAI and
    DeepSpeed; torch DDP broadcasts rank 0's): boost says so once, and not
    for SyncBatchNorm."""
    spawn(_boost_batchnorm, 2, backend="gloo", timeout_s=120)


def _save_and_load_batchnorm(rank, world, root):
    import warnings

    def boosted(plugin):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        booster = Booster(plugin=plugin())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the per-rank statistics, said once
            model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return booster, model, opt

    for name, plugin in (
        ("zero2", lambda: LowLevelZeroPlugin(stage=2, precision="fp32")),
        ("gemini", lambda: GeminiPlugin(precision="fp32")),
    ):
        booster, model, opt = boosted(plugin)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        booster.backward(model(x).square().mean(), opt)  # the statistics differ by rank
        opt.step()
        bn = model.unwrap()[1]
        mine = [bn.running_mean.clone(), bn.running_var.clone()]
        ranks = [[torch.empty_like(t) for t in mine] for _ in range(world)]
        for i, t in enumerate(mine):
            dist.all_gather([r[i] for r in ranks], t)
        assert not torch.equal(ranks[0][1], ranks[1][1])
        booster.save_state(f"{root}/{name}", model, opt)  # the per-rank layout
        booster, model, opt = boosted(plugin)
        booster.load_state(f"{root}/{name}", model, opt)
        bn = model.unwrap()[1]
        assert torch.equal(bn.running_mean, ranks[0][0]), name  # rank 0's, both of them
        assert torch.equal(bn.running_var, ranks[0][1]), name


def test_a_per_rank_checkpoint_holds_rank_0s_buffers(tmp_path):
    """Buffers are whole on every rank and may differ (BatchNorm's running
    statistics under LowLevelZeroPlugin and GeminiPlugin): the per-rank
    layout saves rank 0's, as the one-file layout does. The checkpoint
    engine kept one rank's copy of each key, not always the same rank's (a
    running_mean of rank 0 beside a running_var of rank 1)."""
    spawn(_save_and_load_batchnorm, 2, args=(str(tmp_path),), backend="gloo", timeout_s=240)


@pytest.mark.parametrize("plugin", ["none", "zero2"])
def test_a_state_of_other_parameter_groups_is_refused(plugin):
    """Saved with one group, loaded into an optimizer whose biases and norms
    are a group without weight decay (the usual recipe): torch's
    load_state_dict refuses another layout of groups; taking the one saved
    group's values for both once made the no-decay group decay, silently."""

    def boosted(split: bool):
        torch.manual_seed(0)
        model = TinyGPT(CONFIG)
        params = dict(model.named_parameters())
        if split:
            plain = [p for n, p in params.items() if p.dim() < 2]
            groups = [
                {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
                {"params": plain, "weight_decay": 0.0, "lr": 5e-3},
            ]
        else:
            groups = [{"params": list(params.values()), "weight_decay": 0.1}]
        opt = torch.optim.AdamW(groups, lr=1e-2)
        made = LowLevelZeroPlugin(stage=2, precision="fp32") if plugin == "zero2" else None
        booster = Booster(device="cpu") if made is None else Booster(plugin=made)
        model, opt, *_ = booster.boost(model, opt)
        return booster, model, opt

    booster, model, opt = boosted(split=False)
    _train(booster, model, opt, 0, 1, 0, 1)
    full = opt.full_state_dict()
    _, _, other = boosted(split=True)
    groups = [(g["lr"], g["weight_decay"]) for g in other.param_groups]
    with pytest.raises(ValueError, match=r"parameter groups are laid out otherwise than this"):
        other.load_full_state_dict(full)
    assert [(g["lr"], g["weight_decay"]) for g in other.param_groups] == groups
    _, _, same = boosted(split=False)
    same.load_full_state_dict(full)  # the same layout loads
