"""Gemini beyond plain parity: activation checkpointing, fp16 overflow,
evaluation without grad, and state dict round trips (gloo, 2 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}


def _wrap(model, world, dtype=torch.float32):
    ddp = GeminiDDP(
        model, mixed_precision=dtype, chunk_config_dict={world: CHUNKS}, compute_device="cpu"
    )
    return ddp, GeminiOptimizer(
        HybridAdam(list(model.parameters()), lr=1e-3, weight_decay=0.1), ddp
    )


def _train(ddp, opt, steps, rank, start=0):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        loss = ddp(idx, tgt)
        opt.backward(loss.float())
        opt.step()
        losses.append(loss.item())
    return losses


def _checkpointing(rank, world):
    torch.manual_seed(0)
    plain = TinyGPT(CONFIG)
    ckpt = copy.deepcopy(plain)
    for block in ckpt.blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
    a, a_opt = _wrap(plain, world)
    b, b_opt = _wrap(ckpt, world)
    gathers = {"n": 0}
    manager = b.chunk_manager
    real_access = manager.access_chunk

    def counting(chunk, async_op=False):
        if chunk not in manager.accessed_chunks and not chunk.is_gathered:
            gathers["n"] += 1
        return real_access(chunk, async_op)

    manager.access_chunk = counting
    assert _train(a, a_opt, 3, rank) == _train(b, b_opt, 3, rank)
    # The recomputed forward finds its chunks still gathered: per step, each
    # chunk is gathered once for forward and once again for backward.
    assert gathers["n"] == 3 * 2 * len(b.grad_chunks)
    full_a, full_b = a.state_dict(), b.state_dict()
    assert all(torch.equal(full_a[k], full_b[k]) for k in full_a)


def _fp16_overflow(rank, world):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model,
        mixed_precision=torch.float16,
        chunk_config_dict={world: CHUNKS},
        compute_device="cpu",
    )
    opt = GeminiOptimizer(
        HybridAdam(list(model.parameters()), lr=1e-3), ddp, hysteresis=1, initial_scale=1024.0
    )
    before = ddp.state_dict()
    handle = model.lm_head.weight.register_hook(lambda g: g * float("inf") if rank == 0 else g)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=rank)
    opt.backward(ddp(idx, tgt).float())
    assert opt.step() is False
    assert opt.scaler.scale == 512.0
    after = ddp.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    handle.remove()
    opt.backward(ddp(idx, tgt).float())
    assert opt.step() is True
    assert not all(torch.equal(before[k], ddp.state_dict()[k]) for k in before)
    ddp(idx, tgt).float().backward()
    with pytest.raises(
        RuntimeError, match=r"fp16 gradients were not scaled; call optimizer.backward"
    ):
        opt.step()
    # The unscaled gradients were dropped: training goes on from the same parameters.
    opt.backward(ddp(idx, tgt).float())
    assert opt.step() is True


def _eval_without_grad(rank, world):
    torch.manual_seed(0)
    ref = TinyGPT(CONFIG)
    ddp, _ = _wrap(copy.deepcopy(ref), world)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=rank)
    with torch.no_grad():
        got = ddp(idx, tgt)
    torch.testing.assert_close(got, ref(idx, tgt), rtol=1e-6, atol=1e-6)
    # Everything was released again: only shards remain.
    assert not ddp.chunk_manager.accessed_chunks
    assert all(not c.is_gathered for c in ddp.grad_chunks)


def _state_round_trip(rank, world):
    torch.manual_seed(0)
    a, a_opt = _wrap(TinyGPT(CONFIG), world)
    _train(a, a_opt, 3, rank)
    model_state = a.state_dict()
    on_rank_0 = a.state_dict(only_rank_0=True)
    assert (on_rank_0 == {}) == (rank != 0)
    if rank == 0:
        assert all(torch.equal(on_rank_0[k], v) for k, v in model_state.items())
    opt_state = copy.deepcopy(a_opt.state_dict())
    torch.manual_seed(1)  # other weights: loading must replace them
    b, b_opt = _wrap(TinyGPT(CONFIG), world)
    b.load_state_dict(model_state)
    b_opt.load_state_dict(opt_state)
    assert _train(a, a_opt, 3, rank, start=3) == _train(b, b_opt, 3, rank, start=3)
    # An unwrapped model's state dict loads too, and a wrong shape is refused.
    plain = TinyGPT(CONFIG)
    b.load_state_dict(plain.state_dict())
    assert torch.equal(b.state_dict()["tok_emb.weight"], plain.tok_emb.weight)
    bad = dict(plain.state_dict())
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        ValueError, match=r"lm_head.weight has shape \(3, 3\), the model's is \(256, 64\)"
    ):
        b.load_state_dict(bad)
    with pytest.raises(KeyError, match=r"missing \['blocks.0.attn.proj.weight'"):
        b.load_state_dict(
            {k: v for k, v in plain.state_dict().items() if k != "blocks.0.attn.proj.weight"}
        )


def _all(rank, world):
    _checkpointing(rank, world)
    _fp16_overflow(rank, world)
    _eval_without_grad(rank, world)
    _state_round_trip(rank, world)


@pytest.mark.parametrize("world_size", [1, 2])
def test_gemini_features(world_size):
    spawn(_all, world_size, backend="gloo", timeout_s=300)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8, bias=False)
        self.b = torch.nn.Linear(8, 8, bias=False)
        self.c = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x, skip_b):
        h = self.a(x)
        return self.c(h if skip_b else self.b(h)).pow(2).mean()


def _rank_dependent_branch(rank, world, kwargs):
    # Rank 1 skips module b; the write-backs of kept-gathered chunks after a
    # CPU update (all-gathers) must still happen where every rank is.
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _Branchy()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ddp = GeminiDDP(
        model,
        mixed_precision=torch.float32,
        chunk_config_dict={world: {"chunk_size": 64, "keep_gathered": False}},
        compute_device="cpu",
        **kwargs,
    )
    opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-2), ddp)
    ref_opt = HybridAdam(list(ref.parameters()), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.backward(ddp(x, rank == 1))
        opt.step()
        ref(x, rank == 1).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = ddp.state_dict()
    for name, p in ref.module.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_a_module_skipped_on_one_rank_at_zero2_with_offload():
    # ZeRO-2 only: at ZeRO-3 every gather is a collective, so every rank must
    # run the same modules (documented).
    kwargs = dict(shard_param_frac=0.0, offload_optim_frac=1.0)
    spawn(_rank_dependent_branch, 2, args=(kwargs,), backend="gloo", timeout_s=60)


class _Branch(torch.nn.Module):
    """A head used at every step, a branch at some."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 4)
        self.branch = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.head(h) + (self.branch(h) if use_branch else 0)
        return out.square().mean()


@pytest.mark.parametrize(("uses", "said"), [((True, False, True, False), 1), ((False,) * 4, 0)])
def test_a_parameter_back_after_steps_without_a_gradient_is_said_once(uses, said):
    """Adam counts steps per chunk (as ColossalAI's Gemini): a parameter
    that had no gradient at a step and has one again gets its chunk's count
    for its bias correction, unlike torch's Adam. Said once, when it first
    happens; a parameter never used is not."""
    import warnings

    torch.manual_seed(0)
    model = _Branch()
    ddp = GeminiDDP(model, mixed_precision=torch.float32, chunk_config_dict={1: CHUNKS},
                    compute_device="cpu")  # fmt: skip
    opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-2), ddp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, use in enumerate(uses):
            opt.backward(ddp(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)), use))
            opt.step()
            opt.zero_grad()
    told = [str(w.message) for w in caught if "Adam counts steps per chunk" in str(w.message)]
    assert len(told) == said, told
    if said:
        assert "['branch.weight', 'branch.bias']" in told[0]


def _first_used_late(rank, world, kind, offload):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _Branch()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ddp = GeminiDDP(model, mixed_precision=torch.float32, compute_device="cpu",
                    chunk_config_dict={world: CHUNKS}, offload_optim_frac=offload)  # fmt: skip

    def make(params):
        if kind == "adam-l2":  # the moments only: the step count differs anyway (said above)
            return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, foreach=False)
        extra = {"nesterov": True} if kind == "sgd-nesterov" else {}
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01, **extra)

    opt, ref_opt = GeminiOptimizer(make(list(model.parameters())), ddp), make(ref.parameters())
    # Adam: two steps, the branch's first at the second; a third would see the
    # branch's values, whose bias correction used the chunk's count (said above).
    for step in range(2 if kind == "adam-l2" else 3):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
        x = x.chunk(world)[rank]
        opt.backward(ddp(x, step >= 1))
        opt.step()
        opt.zero_grad()
        ref(x, step >= 1).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got, states = ddp.state_dict(), opt.full_state_dict()["params"]
    case = f"{kind}, offload_optim_frac={offload}"
    for name, p in ref.module.named_parameters():
        if kind == "adam-l2":
            for key in ("exp_avg", "exp_avg_sq"):
                want = ref_opt.state[p][key].flatten()
                torch.testing.assert_close(
                    states[name][key], want, rtol=1e-5, atol=1e-12, msg=f"{case} {name} {key}"
                )
            if name.startswith("branch"):
                continue  # its bias correction used two steps, torch's one
        torch.testing.assert_close(
            got[name], p.detach(), rtol=1e-6, atol=1e-7, msg=f"{case} {name}"
        )


def _first_used_late_all(rank, world):
    """Every optimizer, with the step on the device and on the CPU, in one
    spawn (spawning costs seconds)."""
    for kind in ("sgd-weight-decay", "sgd-nesterov", "adam-l2"):
        for offload in (0.0, 1.0):
            _first_used_late(rank, world, kind, offload)


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_first_used_after_its_chunks_first_step_starts_from_torchs_state(world):
    """Its chunk's first step created the state over it, which held
    ``weight_decay * p`` where torch creates none before the parameter's
    first gradient: SGD's momentum then took 0.9 of it (3.2e-4 off torch
    after two steps), Adam-L2's moments (1.1e-2). Now its slices of a state
    the step created are zeros."""
    spawn(_first_used_late_all, world, backend="gloo", timeout_s=120)


def test_sgds_dampening_with_a_parameter_first_used_late_is_said_once():
    torch.manual_seed(0)
    model = _Branch()
    ddp = GeminiDDP(model, mixed_precision=torch.float32, chunk_config_dict={1: CHUNKS},
                    compute_device="cpu")  # fmt: skip
    sgd = torch.optim.SGD(list(model.parameters()), lr=0.1, momentum=0.9, dampening=0.5)
    opt = GeminiOptimizer(sgd, ddp)
    with pytest.warns(UserWarning, match=r"with SGD's dampening its first momentum is"):
        for step in range(3):
            opt.backward(ddp(torch.randn(4, 8), step >= 1))
            opt.step()
            opt.zero_grad()


class _AddBias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.bias  # saves nothing: its gradient comes before the recompute


class _Recomputed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.add = _AddBias()  # registered last: the last chunk, reduced first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: self.add(self.lin(t)), x, use_reentrant=False).square().mean()


@pytest.mark.parametrize("keep_gathered", [True, False])
def test_a_forward_recomputed_after_its_chunks_reduce_runs(keep_gathered):
    """Activation checkpointing without early stop recomputes the whole
    segment in backward, after the last chunk was reduced (its gradients
    written over its parameters): a kept-gathered chunk's tensors, unbound by
    the reduce, are bound again for it; the step equals torch's."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    torch.manual_seed(0)
    model = _Recomputed()
    ref = copy.deepcopy(model)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, compute_device="cpu",
        chunk_config_dict={1: {"chunk_size": 20, "keep_gathered": keep_gathered}},
    )  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(list(model.parameters()), lr=0.1), ddp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with set_checkpoint_early_stop(False):
        opt.backward(ddp(x))
        ref(x).backward()
    assert opt.step()
    ref_opt.step()
    ddp.wait_updates()
    state = ddp.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(
            state[name], value, rtol=0, atol=4 * torch.finfo(torch.float32).eps
        )


def test_the_users_module_run_between_backward_and_step_is_refused():
    """model.unwrap() (the user's module, as Hugging Face's generate() runs
    it) between a backward and its step computed with the reduced gradients
    in place of the parameters, silently (logits 0.85 off torch's); it raises
    as GeminiDDP's own forward does, and runs after the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ddp = GeminiDDP(model, mixed_precision=torch.float32, compute_device="cpu")
    opt = GeminiOptimizer(torch.optim.SGD(list(model.parameters()), lr=0.1), ddp)
    x = torch.randn(3, 4)
    opt.backward(ddp(x).square().mean())
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"GeminiDDP: the forward of module 0 between a backward and its optimizer\.step\(\) \(through model\.unwrap\(\) or a submodule\)"):  # fmt: skip
        model(x)
    assert opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ddp(x))
