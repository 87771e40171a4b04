"""``gpu_update_fraction="auto"`` (see [Note: gpu_update_fraction="auto"]):
the share comes from the step-time model over the machine's profile, read
from ``ZEROSTACK_MACHINE_PROFILE`` or measured once per process; 0.0, with
the reason in the log, where no split can run."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import pytest
import torch

from zerostack.shard import (
    PROFILE_ENV,
    MachineProfile,
    ZeroConfig,
    ZeroOptimizer,
    _machine,
    best_gpu_update_fraction,
    measure_machine,
    resolve_gpu_update_fraction,
    split_beats_cpu_only,
    step_floor,
)
from zerostack.testing import GPTConfig, TinyGPT

needs_fused_adam = pytest.mark.skipif(
    importlib.util.find_spec("zerostack.fused_adam") is None,
    reason="CPU Adam is zerostack-fused-adam's",
)
# The H200 host of docs/benchmarks.md ("The machine's profile"), rounded.
PROFILE = MachineProfile(
    cpu_adam_bytes_s=111.6e9, h2d_bytes_s=55e9, d2h_bytes_s=55e9,
    cpu_adam_with_copies_bytes_s=88.5e9, h2d_with_adam_bytes_s=35.3e9,
    d2h_with_adam_bytes_s=46e9, gpu_adam_params_s=140.5e9,
)  # fmt: skip
CUDA = torch.device("cuda", 0)  # named only: nothing runs on it with a profile file


def test_the_share_is_the_floors_best_split_and_does_not_depend_on_the_model_size():
    f = best_gpu_update_fraction(PROFILE)
    # cpu(f) meets the H2D line: (1 - f) 28 / 88.5 = (12 f + 2 (1 - f)) / 35.3
    assert f == pytest.approx((28 * 35.3 - 2 * 88.5) / (28 * 35.3 + 10 * 88.5))
    for numel in (10**6, 10**9, 10**11):
        split = step_floor(PROFILE, forward_s=0, backward_s=0, host_numel=numel).split
        assert split is not None and split.gpu_fraction == pytest.approx(f)
    # fp32 parameters cross at 4 B: the H2D line is busier, the share smaller
    assert 0 < best_gpu_update_fraction(PROFILE, h2d_bytes_per_param=4) < f


def test_no_share_without_the_all_at_once_figures_or_when_the_split_is_slower():
    assert best_gpu_update_fraction(dataclasses.replace(PROFILE, h2d_with_adam_bytes_s=None)) == 0
    # PCIe that barely moves: any GPU share makes the update phase longer
    slow = dataclasses.replace(PROFILE, h2d_with_adam_bytes_s=1e8, d2h_with_adam_bytes_s=1e8)
    assert best_gpu_update_fraction(slow) == 0.0


def test_auto_reads_the_profile_file_and_logs_what_it_chose(tmp_path, monkeypatch, caplog):
    path = tmp_path / "machine.json"
    PROFILE.save(path)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    monkeypatch.setattr(_machine, "measure_machine", _must_not_measure)
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        f = resolve_gpu_update_fraction("ZeroOptimizer", "auto", CUDA, None)
    assert f == pytest.approx(best_gpu_update_fraction(PROFILE))
    assert f"chose {f:.3f}" in caplog.text and str(path) in caplog.text
    assert "CPU Adam 111.6 GB/s alone, 88.5 beside copies" in caplog.text


def test_a_profile_that_cannot_be_taken_raises_unless_auto_is_only_the_default(
    tmp_path, monkeypatch
):
    # An explicit "auto" that cannot read its profile raises; GeminiOptimizer's
    # default under auto placement (required=False) steps everything in CPU
    # Adam instead, and says why once.
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(
        RuntimeError, match=r"could not take the machine's profile on rank\(s\) \[0\]"
    ):
        resolve_gpu_update_fraction("GeminiOptimizer", "auto", CUDA, None)
    with pytest.warns(UserWarning, match=r"missing\.json.*left at its default: every host-held"):
        f = resolve_gpu_update_fraction("GeminiOptimizer", "auto", CUDA, None, required=False)
    assert f == 0.0


def _ranks_agree(rank, world, folder):
    # Each rank's own profile (ranks of one host measure beside each other):
    # a later rank's CPU Adam is slower, so alone it would give the GPU more.
    import os

    import torch.distributed as dist

    def profile_of(r):
        return dataclasses.replace(PROFILE, cpu_adam_with_copies_bytes_s=(88.5 - 20 * r) * 1e9)

    path = os.path.join(folder, f"machine{rank}.json")
    profile_of(rank).save(path)
    os.environ[PROFILE_ENV] = path
    share = [best_gpu_update_fraction(profile_of(r)) for r in range(world)]
    assert len(set(share)) == world  # alone, every rank would choose another share
    # Every rank takes the first rank's share, over the default group and a subgroup.
    assert resolve_gpu_update_fraction("ZeroOptimizer", "auto", CUDA, None) == share[0]
    later = dist.new_group([1, 2])  # every rank creates it; ranks 1 and 2 use it
    if rank > 0:
        got = resolve_gpu_update_fraction("ZeroOptimizer", "auto", CUDA, None, group=later)
        assert got == share[1], (rank, got)
    # A rank that cannot split: 0.0 on every rank.
    why = "no lane here" if rank == 2 else None
    assert resolve_gpu_update_fraction("ZeroOptimizer", "auto", CUDA, why) == 0.0
    # A rank whose profile file is missing: every rank raises, none waits.
    if rank == 1:
        os.environ[PROFILE_ENV] = os.path.join(folder, "missing.json")
    with pytest.raises(
        RuntimeError, match=r"could not take the machine's profile on rank\(s\) \[1\]"
    ):
        resolve_gpu_update_fraction("ZeroOptimizer", "auto", CUDA, None)


def test_ranks_agree_on_one_share_and_fail_together(tmp_path):
    from zerostack.testing import spawn

    spawn(_ranks_agree, 3, args=(str(tmp_path),), backend="gloo")


# [Note: a placement weighed with its split]: auto placement's two plans, as
# step_floor's amounts (bf16 parameters on the GPU, the rest GPU-held).
ALONE = dict(host_numel=3_663_000_000, gpu_numel=577_000_000)
SPLIT = dict(host_numel=3_776_000_000, gpu_numel=464_000_000)


F = best_gpu_update_fraction(PROFILE)  # the share "auto" takes on PROFILE's machine


def _floors(profile, alone, split, f=F):
    a = step_floor(profile, forward_s=0, backward_s=0, **alone).cpu_only.step_s
    b = step_floor(profile, forward_s=0, backward_s=0, gpu_fraction=f, **split).split
    return a, b.step_s


def test_a_floor_at_a_given_share():
    best = step_floor(PROFILE, forward_s=0, backward_s=0, **SPLIT).split
    at = step_floor(PROFILE, forward_s=0, backward_s=0, gpu_fraction=F, **SPLIT).split
    assert at.gpu_fraction == F and at.step_s == pytest.approx(best.step_s)
    for f in (0.0, 0.2, 0.8, 1.0):
        other = step_floor(PROFILE, forward_s=0, backward_s=0, gpu_fraction=f, **SPLIT).split
        assert other.gpu_fraction == f and other.step_s > best.step_s * (1 + 1e-9), f
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"gpu_fraction must be in \[0, 1\] or None"):
            step_floor(PROFILE, forward_s=0, backward_s=0, gpu_fraction=bad, **SPLIT)


def test_the_split_is_kept_where_its_floor_is_the_shorter(tmp_path, monkeypatch, caplog):
    path = tmp_path / "machine.json"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    monkeypatch.setattr(_machine, "measure_machine", _must_not_measure)
    PROFILE.save(path)
    a, b = _floors(PROFILE, ALONE, SPLIT)
    assert b < a  # the H200 profile: 3% more host-held updates, a shorter floor
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        assert split_beats_cpu_only("GeminiOptimizer", CUDA, F, ALONE, SPLIT)
    assert f": {b:.3f} s a step" in caplog.text and f"(3,663,000,000: {a:.3f} s)" in caplog.text
    assert caplog.text.rstrip().endswith(": the split")
    # The split's plan keeps n more updates on the host: the first n (in
    # steps of 10**6) whose floor is not shorter keeps CPU Adam alone, the
    # one before it the split.
    n = next(
        n
        for n in range(ALONE["host_numel"], 3 * ALONE["host_numel"], 10**6)
        if _floors(PROFILE, ALONE, dict(host_numel=n, gpu_numel=0))[1] >= a
    )
    for host, split in ((n - 10**6, True), (n, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
            got = split_beats_cpu_only("GeminiOptimizer", CUDA, F, ALONE, dict(host_numel=host))
        assert got == split
        assert caplog.text.rstrip().endswith(": the split" if split else ": CPU Adam alone")
    # The share the split runs at is the one weighed: all of it in the GPU's
    # Adam is H2D-bound, longer than CPU Adam alone.
    assert _floors(PROFILE, ALONE, SPLIT, 1.0)[1] > a
    assert not split_beats_cpu_only("GeminiOptimizer", CUDA, 1.0, ALONE, SPLIT)
    # No host-held update under either plan: nothing to split, said.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        assert not split_beats_cpu_only(
            "GeminiOptimizer", CUDA, F, dict(host_numel=0), dict(host_numel=0)
        )
    assert "no host-held update to split: CPU Adam alone" in caplog.text


def test_a_profile_gone_since_auto_read_it_keeps_cpu_adam_alone(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "missing.json"))
    with caplog.at_level(logging.WARNING, logger="zerostack.shard._machine"):
        assert not split_beats_cpu_only("GeminiOptimizer", CUDA, F, ALONE, SPLIT)
    assert "the split was not weighed" in caplog.text and "missing.json" in caplog.text


def _ranks_weigh_alike(rank, world, folder):
    # Rank 1's CPU Adam is so fast that alone it would keep CPU Adam alone;
    # every rank takes rank 0's answer (the split).
    import os

    fast = dataclasses.replace(
        PROFILE, cpu_adam_bytes_s=1e13, cpu_adam_with_copies_bytes_s=1e13
    )  # fmt: skip
    profile = fast if rank == 1 else PROFILE
    path = os.path.join(folder, f"machine{rank}.json")
    profile.save(path)
    os.environ[PROFILE_ENV] = path
    a, b = _floors(profile, ALONE, SPLIT)
    assert (b < a) == (rank != 1)
    assert split_beats_cpu_only("GeminiOptimizer", CUDA, F, ALONE, SPLIT)


def test_ranks_take_the_first_ranks_weighing(tmp_path):
    from zerostack.testing import spawn

    spawn(_ranks_weigh_alike, 2, args=(str(tmp_path),), backend="gloo")


def test_host_held_values_weigh_the_share(tmp_path, monkeypatch):
    # Parameters that live on the host: no value crosses up after a CPU
    # update, and under the split the gradient crosses up and the value down.
    path = tmp_path / "machine.json"
    PROFILE.save(path)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    got = resolve_gpu_update_fraction("GeminiOptimizer", "auto", CUDA, None, 2, 1.0)
    want = best_gpu_update_fraction(
        PROFILE, h2d_bytes_per_param=0, d2h_bytes_per_param=2, host_value_fraction=1.0
    )
    assert got == pytest.approx(want) and want != pytest.approx(best_gpu_update_fraction(PROFILE))


def test_streamed_parameters_lower_the_share(tmp_path, monkeypatch):
    # Parameters streamed for each forward share the link with the split's
    # copies up (see [Note: step-time floor]): "auto" gives the GPU less.
    path = tmp_path / "machine.json"
    PROFILE.save(path)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    values = dict(h2d_bytes_per_param=0, d2h_bytes_per_param=2, host_value_fraction=1.0)
    plain = best_gpu_update_fraction(PROFILE, **values)
    streamed = best_gpu_update_fraction(PROFILE, **values, streamed_bytes_per_param=2)
    assert 0 < streamed < plain
    got = resolve_gpu_update_fraction(
        "GeminiOptimizer", "auto", CUDA, None, 2, 1.0, streamed_bytes_per_param=2
    )
    assert got == pytest.approx(streamed)


def _must_not_measure(*args, **kwargs):
    raise AssertionError("measured although a profile file was given")


def test_without_a_file_the_machine_is_measured_once_per_process_and_device(monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setattr(_machine, "_measured", {})
    calls = []

    def fake(device):
        calls.append(device)
        return PROFILE

    monkeypatch.setattr(_machine, "measure_machine", fake)
    first = resolve_gpu_update_fraction("GeminiOptimizer", "auto", CUDA, None)
    again = resolve_gpu_update_fraction("ZeroOptimizer", "auto", CUDA, None)
    assert first == again == pytest.approx(best_gpu_update_fraction(PROFILE))
    assert calls == [CUDA]


def test_auto_chooses_nothing_where_no_split_can_run_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        assert resolve_gpu_update_fraction("X", "auto", torch.device("cpu"), None) == 0.0
        assert resolve_gpu_update_fraction("X", "auto", CUDA, "no host-held update") == 0.0
    assert "chose 0.0: the compute device is cpu" in caplog.text
    assert "chose 0.0: no host-held update" in caplog.text
    assert resolve_gpu_update_fraction("X", 0.25, CUDA, None) == 0.25


def test_auto_is_the_only_word_taken():
    assert ZeroConfig(gpu_update_fraction="auto").gpu_update_fraction == "auto"
    with pytest.raises(TypeError, match=r"a number in \[0, 1\] or 'auto' \(got 'fast'\)"):
        ZeroConfig(gpu_update_fraction="fast")
    with pytest.raises(TypeError, match=r"X: gpu_update_fraction must be a number"):
        resolve_gpu_update_fraction("X", True, CUDA, None)


@needs_fused_adam
def test_measuring_on_the_cpu_gives_cpu_adam_alone():
    profile = measure_machine(numel=2**16, warmup=0, repeats=1)
    assert profile.cpu_adam_bytes_s > 0
    assert profile.h2d_bytes_s is None and profile.gpu_adam_params_s is None
    assert best_gpu_update_fraction(profile) == 0.0
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure_machine(repeats=0)


@needs_fused_adam
def test_zero_optimizer_auto_on_the_cpu_steps_everything_in_cpu_adam(caplog):
    model = TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2))
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        zero = ZeroOptimizer(
            torch.optim.AdamW(model.parameters()), cpu_offload=True, gpu_update_fraction="auto"
        )
    assert zero.gpu_update_fraction == 0.0 and zero._lane is None
    assert "ZeroOptimizer: gpu_update_fraction='auto' chose 0.0" in caplog.text


@needs_fused_adam
def test_zero_optimizer_auto_names_what_keeps_the_split_off(caplog):
    model = TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2))
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        off = ZeroOptimizer(torch.optim.AdamW(model.parameters()), gpu_update_fraction="auto")
        sgd = ZeroOptimizer(
            torch.optim.SGD(TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2)).parameters(),
                            lr=0.1),
            cpu_offload=True, gpu_update_fraction="auto",
        )  # fmt: skip
    assert off.gpu_update_fraction == sgd.gpu_update_fraction == 0.0
    assert "chose 0.0: cpu_offload is off" in caplog.text
    assert "chose 0.0: gpu_update_fraction steps Adam/AdamW in fused-adam's kernels (got SGD)" in (
        caplog.text
    )


@needs_fused_adam
def test_cpu_offload_takes_auto_by_default(monkeypatch, caplog):
    import zerostack.shard._optimizer as zero_module

    real, calls = zero_module.resolve_gpu_update_fraction, []

    def record(api, fraction, device, *args, required=True, **kwargs):
        calls.append((fraction, required))
        return real(api, fraction, device, *args, required=required, **kwargs)

    monkeypatch.setattr(zero_module, "resolve_gpu_update_fraction", record)

    def build(**kw):
        model = TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2))
        return ZeroOptimizer(torch.optim.AdamW(model.parameters()), **kw)

    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        offloaded = build(cpu_offload=True)
    # The default, not the user's ask: a profile that cannot be taken warns
    # and steps every update in CPU Adam (required=False).
    assert calls == [("auto", False)]
    assert offloaded.gpu_update_fraction == 0.0 and offloaded._lane is None
    assert "gpu_update_fraction='auto' chose 0.0: the compute device is cpu" in caplog.text
    calls.clear()
    assert build().gpu_update_fraction == 0.0 and calls == []  # no cpu_offload: nothing to split
    assert build(cpu_offload=True, gpu_update_fraction=0.25).gpu_update_fraction == 0.25
    assert calls == [(0.25, True)]


@needs_fused_adam
def test_auto_chooses_nothing_for_a_model_with_a_non_contiguous_parameter(caplog):
    # The device lane writes parameters as flat pieces: a channels_last
    # convolution keeps the default (and "auto") at 0.0, with the reason,
    # where it would raise for an explicit share.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3))
    model = model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        zero = ZeroOptimizer(torch.optim.AdamW(model.parameters()), cpu_offload=True)
    assert zero.gpu_update_fraction == 0.0 and zero._lane is None
    assert "chose 0.0: a parameter (shape (8, 3, 3, 3)" in caplog.text
    assert "is not contiguous" in caplog.text
    with pytest.raises(NotImplementedError, match="is not contiguous"):
        ZeroOptimizer(
            torch.optim.AdamW(model.parameters()), cpu_offload=True, gpu_update_fraction=1.0
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_fused_adam
def test_auto_on_cuda_measures_the_machine_and_splits(monkeypatch, caplog):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setattr(_machine, "_measured", {})
    model = TinyGPT(GPTConfig(num_layers=2, dim=64, num_heads=2)).cuda().to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        zero = ZeroOptimizer(
            torch.optim.AdamW(model.parameters()), cpu_offload=True, module=model,
            gpu_update_fraction="auto", reduce_bucket_size=4096,
        )  # fmt: skip
    # Every GPU's Adam is far faster than CPU Adam and PCIe moves both ways
    # at once: the model puts some, not all, of the updates on the GPU.
    assert 0.0 < zero.gpu_update_fraction < 1.0, caplog.text
    assert "measured this machine" in caplog.text
    assert zero._lane is not None
    # cpu_offload's default is "auto": the same share (measured once per process).
    other = TinyGPT(GPTConfig(num_layers=2, dim=64, num_heads=2)).cuda().to(torch.bfloat16)
    default = ZeroOptimizer(
        torch.optim.AdamW(other.parameters()), cpu_offload=True, module=other,
        reduce_bucket_size=4096,
    )  # fmt: skip
    assert default.gpu_update_fraction == zero.gpu_update_fraction
    assert default._lane is not None


def _passes_its_group(rank, world):
    import inspect

    import torch.distributed as dist

    import zerostack.shard._optimizer as zero_module

    real, groups = zero_module.resolve_gpu_update_fraction, []

    def record(*args, **kwargs):
        groups.append(inspect.signature(real).bind(*args, **kwargs).arguments.get("group"))
        return real(*args, **kwargs)

    zero_module.resolve_gpu_update_fraction = record
    group = dist.new_group(list(range(world)))  # not the default group object
    model = TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2))
    ZeroOptimizer(
        torch.optim.AdamW(model.parameters()), gpu_update_fraction="auto", process_group=group
    )
    assert groups == [group], groups


def test_zero_optimizer_takes_auto_over_its_process_group():
    # "auto" is a collective over the data-parallel group: the optimizer's,
    # not the default group, when the user gave one.
    from zerostack.testing import spawn

    spawn(_passes_its_group, 2, backend="gloo")
