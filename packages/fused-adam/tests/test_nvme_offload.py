"""CPUAdam / HybridAdam with states on disk (the [nvme] extra)."""

from __future__ import annotations

import copy
import errno
import gc
import os
import sys

import pytest
import torch
from conftest import (
    HYPER,
    STATE_TOL,
    make_grads,
    make_params,
    run_parity,
    set_grad,
    small_model,
    train_steps,
)

from zerostack.fused_adam import CPUAdam, HybridAdam
from zerostack.fused_adam import _nvme as nvme_bridge

nvme = pytest.importorskip("zerostack.nvme")
BACKENDS = [b for b in nvme.BACKENDS if b == "threads" or b in nvme.tensornvme_backends()]
SIZES = [4097, 7, 1, 300, 2048]


def _nvme_opt(cls, fraction, directory, backend):
    def make(params, **kw):
        return cls(
            params,
            nvme_offload_fraction=fraction,
            nvme_offload_dir=directory,
            nvme_backend=backend,
            **kw,
        )

    return make


@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam], ids=lambda c: c.__name__)
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("given_dir", [True, False], ids=["dir", "tmp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_with_torch_and_with_states_in_ram(cls, fraction, given_dir, backend, tmp_path):
    directory = str(tmp_path) if given_dir else None
    make = _nvme_opt(cls, fraction, directory, backend)
    # L2 mode with weight decay and a div_scale: gradient-scale bugs show.
    run_parity(torch.float32, torch.float32, False, sizes=SIZES, div_scale=4.0, opt_cls=make)
    run_parity(torch.bfloat16, torch.bfloat16, True, sizes=SIZES, div_scale=-1, opt_cls=make)
    # Bit-identical to the same optimizer with every state in RAM.
    on_disk, in_ram = make_params(SIZES, torch.float32), make_params(SIZES, torch.float32)
    a, b = make(on_disk, **HYPER), cls(in_ram, **HYPER)
    for step in range(5):
        for params in (on_disk, in_ram):
            for p, g in zip(params, make_grads(params, torch.float32, step), strict=True):
                p.grad = g
        a.step(div_scale=2.0)
        b.step(div_scale=2.0)
    for x, y in zip(on_disk, in_ram, strict=True):
        assert torch.equal(x, y)
    # The effect: that share of the states really is on disk, not in RAM.
    if fraction == 0.0:
        assert a._nvme is None and a.nvme_bytes_on_disk() == 0
        return
    if fraction == 1.0:
        assert len(a._nvme.keys) == len(SIZES)
    expected = sum(8 * p.numel() for p in a._nvme.keys)
    assert a.nvme_bytes_on_disk() == expected >= 8 * fraction * sum(SIZES) - 8 * max(SIZES)
    assert all("exp_avg" not in a.state[p] for p in a._nvme.keys)


def test_fraction_picks_whole_cpu_params_in_order(tmp_path):
    params = make_params([100, 100, 100, 100], torch.float32)
    opt = CPUAdam(params, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path))
    assert not opt._nvme.keys  # decided at the first step (see [Note: NVMe binding])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    keys = [key for pieces in opt._nvme.keys.values() for key, _, _ in pieces]
    assert keys == ["0.0:0", "0.1:0"]
    assert "exp_avg" not in opt.state.get(params[0], {})


def test_a_share_mostly_left_in_memory_is_said_once(tmp_path):
    """0.3 of [1000, 10, 10] elements: the large parameter does not fit and
    stays in host memory, the two small ones go (20 of 306 elements): the
    share is taken whole and never passed, and one that far short warns."""
    params = make_params([1000, 10, 10], torch.float32)
    opt = CPUAdam(params, nvme_offload_fraction=0.3, nvme_offload_dir=str(tmp_path))
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.warns(UserWarning, match=r"nvme_offload_fraction=0\.3 put 7% of its share on disk "
                      r"\(got 20 of 306 elements\)"):  # fmt: skip
        opt.step()
    assert [key for pieces in opt._nvme.keys.values() for key, _, _ in pieces] == ["0.1:0", "0.2:0"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_params_are_swapped_in_pieces(backend, monkeypatch, tmp_path):
    monkeypatch.setattr(nvme_bridge, "PIECE_NUMEL", 1000)
    make = _nvme_opt(CPUAdam, 1.0, str(tmp_path), backend)
    opt = make(make_params([4097, 7], torch.float32))
    opt.nvme_plan([])  # binds
    assert [(s, e) for _, s, e in next(iter(opt._nvme.keys.values()))] == [
        (0, 1000), (1000, 2000), (2000, 3000), (3000, 4000), (4000, 4097)
    ]  # fmt: skip
    # run_parity also reads every state back through state_dict().
    run_parity(torch.float32, torch.float32, False, sizes=[4097, 7], div_scale=4.0, opt_cls=make)
    run_parity(torch.bfloat16, torch.float32, True, sizes=[2500], div_scale=-1, opt_cls=make)


def test_kept_slices_of_states_on_disk_survive_one_step(monkeypatch, tmp_path):
    # A slice across two pieces (pieces of 1000 elements) keeps its moments
    # through the next step only; the rest of the parameter is stepped.
    monkeypatch.setattr(nvme_bridge, "PIECE_NUMEL", 1000)
    (p,) = make_params([2500], torch.float32)
    opt = CPUAdam([p], nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    p.grad = torch.ones_like(p)
    opt.step()
    before = [t.clone() for t in opt._nvme.snapshot(p)]
    opt.keep_disk_states(p, slice(900, 1100))
    opt.step()
    after = opt._nvme.snapshot(p)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(new[900:1100], old[900:1100])
        assert not torch.equal(new[:900], old[:900]) and not torch.equal(new[1100:], old[1100:])
    moved = [t.clone() for t in after]
    opt.step()  # the request was for one step
    assert not torch.equal(opt._nvme.snapshot(p)[0][900:1100], moved[0][900:1100])
    with pytest.raises(
        TypeError, match=r"elements must be a slice of step 1 \(got slice\(0, 4, 2\)\)"
    ):
        opt.keep_disk_states(p, slice(0, 4, 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_states_come_back_from_disk_when_a_parameter_is_no_longer_host_held(
    backend, monkeypatch, tmp_path
):
    """A wrapper's placement that stops holding a parameter on the host (auto
    placement's plan after a resume): its states come back from disk into the
    state, its disk reservation is given back, and the steps go on exactly as
    with every state in RAM."""
    monkeypatch.setattr(nvme_bridge, "PIECE_NUMEL", 1000)
    on_disk, in_ram = (
        make_params([2500, 300, 7], torch.float32),
        make_params([2500, 300, 7], torch.float32),
    )
    a = CPUAdam(on_disk, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), nvme_backend=backend, **HYPER)  # fmt: skip
    b = CPUAdam(in_ram, **HYPER)
    swapper = a._nvme.swapper

    def steps(n, start):
        for step in range(start, start + n):
            for params in (on_disk, in_ram):
                for p, g in zip(params, make_grads(params, torch.float32, step), strict=True):
                    p.grad = g
            a.step()
            b.step()

    steps(2, 0)
    assert swapper.reserved_bytes == a.nvme_bytes_on_disk() == 8 * 2807
    a.nvme_host_params([on_disk[1]])  # the others leave the host tier
    steps(2, 2)
    assert a.nvme_bytes_on_disk() == swapper.reserved_bytes == 8 * 300
    assert set(a.state[on_disk[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(a.state[on_disk[1]]) == {"step"}
    for x, y in zip(on_disk, in_ram, strict=True):
        assert torch.equal(x, y)
    for p, q in zip(on_disk, in_ram, strict=True):
        if p is not on_disk[1]:
            assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])


def test_states_on_disk_are_not_kept_in_the_state(tmp_path):
    params = make_params([1000, 1000], torch.float32)
    opt = CPUAdam(params, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(set(opt.state[p]) == {"step"} for p in params)


def test_temporary_directory_removed_with_the_optimizer():
    params = make_params([100], torch.float32)
    opt = CPUAdam(params, nvme_offload_fraction=1.0)
    workdir = opt._nvme.swapper.workdir
    params[0].grad = torch.ones(100)
    opt.step()
    assert os.path.isdir(workdir)
    del opt
    gc.collect()
    assert not os.path.exists(workdir)


def test_temporary_directory_removed_after_an_exception():
    seen = {}

    def train():
        params = make_params([100], torch.float32)
        opt = CPUAdam(params, nvme_offload_fraction=1.0)
        seen["dir"] = opt._nvme.swapper.workdir
        set_grad(params[0], torch.ones(100, dtype=torch.float64))
        opt.step()  # raises: unsupported grad dtype

    with pytest.raises(TypeError, match="unsupported dtype"):
        train()
    gc.collect()
    assert not os.path.exists(seen["dir"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_round_trip_and_resume(backend, tmp_path):
    kw = dict(HYPER, nvme_offload_fraction=1.0, nvme_backend=backend)
    straight = small_model()
    straight_opt = CPUAdam(straight.parameters(), **kw)
    expected = train_steps(straight, straight_opt, 6, seed=1)

    first = small_model()
    first_opt = CPUAdam(first.parameters(), **kw)
    got = train_steps(first, first_opt, 3, seed=1)
    path = tmp_path / "ckpt.pt"
    sd = first_opt.state_dict()
    assert sd["state"][0]["exp_avg"].shape == (64, 16)
    torch.save({"model": first.state_dict(), "optim": sd}, path)
    del first, first_opt, sd
    gc.collect()

    ckpt = torch.load(path, mmap=True)
    resumed = small_model()
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = CPUAdam(resumed.parameters(), **kw)
    resumed_opt.load_state_dict(ckpt["optim"])
    got += train_steps(resumed, resumed_opt, 3, seed=1, skip=3)  # the data stream resumes too
    assert got == expected


def test_state_dict_loads_into_an_in_ram_optimizer_and_back(tmp_path):
    disk_model, ram_model = small_model(), small_model()
    disk_opt = CPUAdam(disk_model.parameters(), nvme_offload_fraction=1.0, **HYPER)
    train_steps(disk_model, disk_opt, 2, seed=3)
    ram_model.load_state_dict(disk_model.state_dict())
    ram_opt = torch.optim.AdamW(ram_model.parameters(), foreach=False, **HYPER)
    ram_opt.load_state_dict(copy.deepcopy(disk_opt.state_dict()))  # torch aliases otherwise
    a = train_steps(disk_model, disk_opt, 3, seed=4)
    b = train_steps(ram_model, ram_opt, 3, seed=4)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"cannot create or write the offload directory"):
        CPUAdam(
            make_params([10], torch.float32),
            nvme_offload_fraction=1.0,
            nvme_offload_dir=str(blocker / "x"),
        )


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "zerostack.nvme", None)
    with pytest.raises(ImportError, match=r"pip install 'zerostack-fused-adam\[nvme\]'"):
        CPUAdam(make_params([10], torch.float32), nvme_offload_fraction=0.5)


def test_a_plan_reads_the_next_parameters_while_one_updates(tmp_path):
    # Gemini steps CPU-held chunks one at a time; nvme_plan makes one pipeline
    # over all of them, so the next chunk's reads are in flight meanwhile.
    params = make_params([300, 200, 100], torch.float32)
    ref = [p.detach().clone() for p in params]
    opt = CPUAdam(params, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), **HYPER)
    ram = CPUAdam(ref, **HYPER)
    for step in range(3):
        opt.nvme_plan(params)
        pipe = opt._nvme._open[0]
        for i, (p, q) in enumerate(zip(params, ref, strict=True)):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            q.grad = p.grad.clone()
            opt.step()
            ram.step()
            p.grad = q.grad = None
            if i == 0:  # depth 2: the reads of both later parameters were issued
                assert pipe._next_read == 3
        assert opt._nvme._open is None  # the plan ended with its last parameter
    for p, q in zip(params, ref, strict=True):
        assert torch.equal(p, q)
    assert opt.nvme_bytes_on_disk() == 8 * 600
    # Every piece's read was waited for and timed (microseconds at least):
    # 0.0 would mean the plan's waits went uncounted.
    assert opt.nvme_wait_s > 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_without_gradient_in_a_plan_keeps_its_states_on_disk(backend, tmp_path):
    # GeminiOptimizer plans the chunks it will step; one without a gradient
    # is not stepped, and a parameter stepped outside the plan ends it early. The reads already issued for
    # the rest took their states off disk on tensornvme: they must be there
    # at the next step, as torch's AdamW (which skips a None grad) has them.
    params, ref, opt, torch_opt = _on_disk_beside_torch(backend, tmp_path)
    # Which parameters step, one opt.step() each, after planning all of them.
    schedule = [[0, 1, 2, 3], [0, 2, 3], [3, 0], [1, 2, 3], [0, 1, 2, 3]]
    for step, order in enumerate(schedule):
        grads = make_grads(params, torch.float32, step)
        opt.nvme_plan(params)
        for i in order:
            params[i].grad, ref[i].grad = grads[i], grads[i].clone()
            opt.step()
            torch_opt.step()
            params[i].grad = ref[i].grad = None
        _same_as_torch_with_states_on_disk(opt, params, ref, step)
    _same_states(opt, torch_opt, ref)


@pytest.mark.parametrize("planned", [True, False], ids=["plan", "no-plan"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_update_retried_keeps_its_states_on_disk(backend, planned, monkeypatch, tmp_path):
    # GeminiOptimizer steps one chunk per call and runs a failed update again
    # with the same gradient. The failed call read its states off disk (and
    # those read ahead of it): they go back unchanged, its step is not
    # counted, and the retry matches torch's AdamW, which stepped once.
    from zerostack.fused_adam import _kernels

    real, calls = _kernels.launch, {"n": 0, "fail": -1}

    def launch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["fail"]:
            raise OSError(errno.EIO, "injected kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(_kernels, "launch", launch)
    params, ref, opt, torch_opt = _on_disk_beside_torch(backend, tmp_path)
    for step in range(4):
        grads = make_grads(params, torch.float32, step)
        if planned:
            opt.nvme_plan(params)
        for i in range(len(params)):
            params[i].grad, ref[i].grad = grads[i], grads[i].clone()
            if step in (1, 2) and i == step:  # the first kernel call of this parameter fails
                calls["fail"] = calls["n"] + 1
                with pytest.raises(OSError, match="injected kernel failure"):
                    opt.step()
            opt.step()
            torch_opt.step()
            params[i].grad = ref[i].grad = None
        _same_as_torch_with_states_on_disk(opt, params, ref, step)
    _same_states(opt, torch_opt, ref, steps=4)


def _same_as_torch_with_states_on_disk(opt, params, ref, step):
    """Every state of the four parameters (650 elements, two fp32 moments)
    on disk, and the parameters as torch's AdamW left them."""
    assert opt.nvme_bytes_on_disk() == 8 * 650, f"step {step}"
    for i, (p, q) in enumerate(zip(params, ref, strict=True)):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-6, msg=f"step {step} p{i}")


def _same_states(opt, torch_opt, ref, steps=None):
    """The moments (and the step counts, when given) equal torch's AdamW's."""
    states = opt.state_dict()["state"]
    for i, q in enumerate(ref):
        if steps is not None:
            assert float(states[i]["step"]) == steps
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(states[i][key], torch_opt.state[q][key], **STATE_TOL)


def _on_disk_beside_torch(backend, tmp_path):
    """Four fp32 parameters (650 elements) whose CPUAdam states all live on
    disk, and copies of them under torch's AdamW."""
    params = make_params([300, 200, 100, 50], torch.float32)
    ref = [p.detach().clone() for p in params]
    opt = CPUAdam(
        params, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), nvme_backend=backend,
        adamw_mode=True, **HYPER,
    )  # fmt: skip
    return params, ref, opt, torch.optim.AdamW(ref, foreach=False, **HYPER)
