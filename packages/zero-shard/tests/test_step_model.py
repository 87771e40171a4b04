"""The step-time floor ([Note: step-time floor]) against hand-computed cases,
the CPU/GPU split, its monotonicity in every bandwidth, the JSON round trip
of MachineProfile and the errors of bad inputs."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from zerostack.shard import MachineProfile, step_floor

# Round figures: CPU Adam alone 1 G params/s (28 GB/s), 0.5 G params/s beside the copies.
PROFILE = MachineProfile(
    cpu_adam_bytes_s=28e9,
    h2d_bytes_s=10e9,
    d2h_bytes_s=10e9,
    h2d_both_bytes_s=8e9,
    d2h_both_bytes_s=8e9,
    cpu_adam_with_copies_bytes_s=14e9,
    h2d_with_adam_bytes_s=12e9,
    d2h_with_adam_bytes_s=12e9,
    gpu_adam_params_s=100e9,
    disk_read_bytes_s=4e9,
    disk_write_bytes_s=2e9,
    machine="made up for the test",
)
CPU_ONLY = dataclasses.replace(
    PROFILE,
    cpu_adam_with_copies_bytes_s=None,
    h2d_with_adam_bytes_s=None,
    d2h_with_adam_bytes_s=None,
    gpu_adam_params_s=None,
)
STEP = dict(forward_s=0.1, backward_s=0.2, host_numel=10**9)


def test_cpu_only_floor_is_forward_backward_and_the_exposed_cpu_adam() -> None:
    est = step_floor(CPU_ONLY, **STEP)
    f = est.cpu_only
    assert est.split is None
    assert f.cpu_s == pytest.approx(1.0)  # 1e9 * 28 B / 28 GB/s
    assert f.h2d_s == pytest.approx(0.2)  # 1e9 * 2 B / 10 GB/s
    assert f.backward_s == pytest.approx(0.2)  # max(0.2, gradients 2 GB / 10 GB/s)
    assert f.bound == "cpu" and f.gpu_fraction == 0.0
    assert f.hidden_s == pytest.approx(0.1)  # all of the next forward
    assert f.step_s == pytest.approx(0.1 + 0.2 + 1.0 - 0.1)
    assert est.floor_s == f.step_s and est.best is f


def test_split_equalizes_cpu_and_the_copies_and_lowers_the_floor() -> None:
    est = step_floor(PROFILE, **STEP)
    s = est.split
    assert s is not None
    # (1 - f) 28/14 = (12 f + 2 (1 - f)) / 12  ->  f = 11/17 (d2h would allow 2/3)
    assert s.gpu_fraction == pytest.approx(11 / 17)
    assert s.cpu_s == pytest.approx(12 / 17)
    assert s.h2d_s == pytest.approx(s.cpu_s)
    assert s.d2h_s == pytest.approx(11 / 17)  # 12 B f each back at 12 GB/s
    assert s.gpu_adam_s == pytest.approx(11 / 17 / 100)
    assert s.step_s == pytest.approx(0.2 + 12 / 17 + 11 / 1700)
    assert est.floor_s == s.step_s < est.cpu_only.step_s and est.best is s


def test_split_stops_where_the_busier_direction_meets_cpu_adam() -> None:
    slow_back = dataclasses.replace(PROFILE, d2h_with_adam_bytes_s=4e9)
    s = step_floor(slow_back, **STEP).split
    assert s is not None
    # (1 - f) 2 = 12 f / 4  ->  f = 0.4, before h2d's 11/17
    assert s.gpu_fraction == pytest.approx(0.4)
    assert s.cpu_s == pytest.approx(s.d2h_s) == pytest.approx(1.2)
    assert s.h2d_s == pytest.approx(0.5) and s.bound in ("cpu", "d2h")


def test_split_under_a_disk_bound_stops_where_cpu_adam_meets_the_disk() -> None:
    # disk 1 GB / 4 GB/s + 1 GB / 2 GB/s = 0.75 s; cpu(f) = 2 (1 - f) meets it at f = 0.625,
    # and a larger f only adds the GPU's Adam time
    s = step_floor(PROFILE, **STEP, disk_read_bytes=1e9, disk_write_bytes=1e9).split
    assert s is not None
    assert s.gpu_fraction == pytest.approx(0.625)
    assert s.cpu_s == pytest.approx(s.disk_s) == pytest.approx(0.75)
    assert s.update_s == pytest.approx(0.75 + 0.00625)


def test_host_held_values_cross_both_ways_under_the_split() -> None:
    # Every value on the host (Gemini's host-held shards): a CPU update
    # copies nothing up (h2d 0), a GPU update moves 12 + 2 B each way (the
    # landed gradient up, the new value down), and every gradient lands in backward.
    est = step_floor(PROFILE, **STEP, h2d_bytes_per_param=0, host_value_fraction=1.0)
    s = est.split
    assert s is not None
    # (1 - f) 28/14 = 14 f / 12 (d2h; h2d is the same line)  ->  f = 12/19
    assert s.gpu_fraction == pytest.approx(12 / 19)
    assert s.cpu_s == pytest.approx(s.d2h_s) == pytest.approx(s.h2d_s) == pytest.approx(14 / 19)
    # The same split with the values on the GPU moves 2 B less each way.
    on_gpu = step_floor(PROFILE, **STEP, h2d_bytes_per_param=0).split
    assert on_gpu is not None and on_gpu.gpu_fraction > s.gpu_fraction
    assert on_gpu.d2h_s == pytest.approx(12 * on_gpu.gpu_fraction / 12)
    # and leaves the GPU's gradients there: the backward copies only the CPU's share.
    slow = dataclasses.replace(PROFILE, d2h_bytes_s=1e9)
    kept = step_floor(slow, **STEP, h2d_bytes_per_param=0).split
    landed = step_floor(slow, **STEP, h2d_bytes_per_param=0, host_value_fraction=1.0).split
    assert kept is not None and landed is not None
    assert kept.backward_s == pytest.approx(2 * (1 - kept.gpu_fraction))
    assert landed.backward_s == pytest.approx(2.0)


def test_streamed_parameters_share_the_link_with_the_splits_copies_up() -> None:
    # Every value on the host and streamed: 2 GB cross up for each forward
    # (0.2 s at 10 GB/s alone). After backward, the next forward's 2 GB and
    # the split's 14 B up per GPU update share one link: link(f) = 0.2 + 14 f / 12.
    streamed = dict(h2d_bytes_per_param=0, host_value_fraction=1.0, streamed_bytes=2e9)
    est = step_floor(PROFILE, **STEP, **streamed)
    s = est.split
    assert s is not None
    # CPU Adam plus the GPU's Adam, 2 (1 - f) + 0.01 f, meets the link before
    # it meets the copies alone (f = 12/19 without streaming, above)
    f = (2 - 0.2) / (2 - 0.01 + 14 / 12)
    assert s.gpu_fraction == pytest.approx(f) and s.bound == "link"
    assert s.link_s == pytest.approx(0.2 + 14 * f / 12)
    assert s.step_s == pytest.approx(0.2 + s.link_s)  # backward (0.2) + the link
    assert s.link_s > s.update_s  # the update phase alone would be shorter
    # Without the stream the split takes more of the updates; with it, the
    # split's step at that share is longer than at the share chosen.
    alone = step_floor(PROFILE, **STEP, h2d_bytes_per_param=0, host_value_fraction=1.0).split
    assert alone is not None and alone.gpu_fraction == pytest.approx(12 / 19)
    assert f < 12 / 19
    at_alone = 0.2 + 0.2 + 14 * (12 / 19) / 12
    assert s.step_s < at_alone
    # CPU Adam alone copies nothing up: the stream hides in the forward as before.
    assert est.cpu_only.link_s == pytest.approx(0.2) and est.cpu_only.bound == "cpu"
    assert est.cpu_only.step_s == pytest.approx(0.2 + 1.0)
    # Updates that may start in backward share the link with the backward's stream too.
    early = step_floor(PROFILE, **STEP, **streamed, clip_before_update=False).split
    assert early is not None
    assert early.link_s == pytest.approx(0.4 + 14 * early.gpu_fraction / 12)
    assert early.step_s >= early.link_s


@pytest.mark.parametrize("clip", [True, False])
def test_the_split_is_the_shortest_step_over_every_share(clip: bool) -> None:
    # The step is piecewise linear in the share; the split evaluates its
    # breakpoints only. A fine grid of shares, on made-up machines and
    # models, finds no shorter step.
    rng = random.Random(7)
    for _ in range(40):
        profile = MachineProfile(**{
            f.name: rng.uniform(1e9, 2e11) for f in dataclasses.fields(MachineProfile)
            if f.name != "machine"
        })  # fmt: skip
        amounts = dict(
            forward_s=rng.uniform(0, 2), backward_s=rng.uniform(0, 2),
            host_numel=rng.randrange(10**6, 10**10), h2d_bytes_per_param=rng.choice([0, 2]),
            d2h_bytes_per_param=rng.choice([2, 4]), host_value_fraction=rng.random(),
            streamed_bytes=rng.choice([0.0, rng.uniform(0, 2e10)]),
            disk_read_bytes=rng.choice([0.0, rng.uniform(0, 1e10)]),
            forward_hide_fraction=rng.random(), clip_before_update=clip,
        )  # fmt: skip
        split = step_floor(profile, **amounts).split
        assert split is not None
        shortest = min(_step_at(profile, amounts, k / 2000) for k in range(2001))
        assert split.step_s <= shortest * (1 + 1e-9)
        assert split.step_s == pytest.approx(_step_at(profile, amounts, split.gpu_fraction))


def _step_at(profile: MachineProfile, amounts: dict, f: float) -> float:
    """The split's step at share ``f``, from the step written out by hand
    (see [Note: step-time floor]), every resource at its "all at once" rate."""
    n, g, values = (
        amounts["host_numel"],
        amounts["d2h_bytes_per_param"],
        amounts["host_value_fraction"],
    )
    up_bytes = amounts["h2d_bytes_per_param"]
    lane = 12 + values * g
    stream = amounts["streamed_bytes"] / profile.h2d_bytes_s
    forward = max(amounts["forward_s"], stream)
    backward = max(
        amounts["backward_s"], stream, n * g * (1 - f * (1 - values)) / profile.d2h_bytes_s
    )  # fmt: skip
    h2d = n * (lane * f + up_bytes * (1 - f)) / profile.h2d_with_adam_bytes_s
    update = max(
        n * (1 - f) * 28 / profile.cpu_adam_with_copies_bytes_s, h2d,
        n * lane * f / profile.d2h_with_adam_bytes_s,
        amounts["disk_read_bytes"] / profile.disk_read_bytes_s,
    ) + n * f / profile.gpu_adam_params_s  # fmt: skip
    hide = amounts["forward_hide_fraction"] * forward
    if amounts["clip_before_update"]:
        return backward + max(forward + max(0.0, update - hide), stream + h2d)
    return max(forward + max(backward, update - hide), 2 * stream + h2d)


def test_of_equal_steps_the_split_takes_the_smallest_share() -> None:
    # A forward that hides every update: the step is forward + backward at
    # every share, and the split gives the GPU none.
    s = step_floor(PROFILE, forward_s=5.0, backward_s=1.0, host_numel=10**8).split
    assert s is not None and s.gpu_fraction == 0.0
    assert s.step_s == pytest.approx(6.0)
    early = step_floor(
        PROFILE, forward_s=0.0, backward_s=5.0, host_numel=10**8, clip_before_update=False
    ).split  # fmt: skip
    assert early is not None and early.gpu_fraction == 0.0


def test_a_gpu_adam_slower_than_cpu_adam_gets_no_share() -> None:
    slow_gpu = dataclasses.replace(PROFILE, gpu_adam_params_s=1e8)
    s = step_floor(slow_gpu, **STEP).split
    assert s is not None and s.gpu_fraction == 0.0


def test_nvme_bound_floor() -> None:
    est = step_floor(CPU_ONLY, **STEP, disk_read_bytes=8e9, disk_write_bytes=8e9)
    f = est.cpu_only
    assert f.disk_s == pytest.approx(2.0 + 4.0)  # read then write on one disk
    assert f.bound == "disk"
    assert f.step_s == pytest.approx(0.1 + 0.2 + 6.0 - 0.1)


def test_forward_that_hides_the_whole_update_leaves_forward_and_backward() -> None:
    est = step_floor(CPU_ONLY, forward_s=0.5, backward_s=1.0, host_numel=10**8)
    assert est.cpu_only.update_s == pytest.approx(0.1)
    assert est.cpu_only.hidden_s == pytest.approx(0.1)
    assert est.floor_s == pytest.approx(1.5)


def test_hiding_depends_on_clipping_and_the_forward_share() -> None:
    early = step_floor(CPU_ONLY, **STEP, clip_before_update=False).cpu_only
    assert early.hidden_s == pytest.approx(0.3)  # forward and backward
    assert early.step_s == pytest.approx(1.0)
    none = step_floor(CPU_ONLY, **STEP, forward_hide_fraction=0.0).cpu_only
    assert none.hidden_s == 0.0 and none.step_s == pytest.approx(1.3)
    half = step_floor(CPU_ONLY, **STEP, forward_hide_fraction=0.5).cpu_only
    assert half.step_s == pytest.approx(1.25)


def test_gradients_slower_than_backward_lengthen_it() -> None:
    slow = dataclasses.replace(CPU_ONLY, d2h_bytes_s=5e9)  # 2 GB of gradients: 0.4 s
    assert step_floor(slow, **STEP).cpu_only.backward_s == pytest.approx(0.4)


def test_no_host_updates_is_forward_plus_backward() -> None:
    est = step_floor(PROFILE, forward_s=0.1, backward_s=0.2, host_numel=0)
    assert est.split is None and est.floor_s == pytest.approx(0.3)


RATES = [f.name for f in dataclasses.fields(MachineProfile) if f.name != "machine"]


@pytest.mark.parametrize("name", RATES)
def test_floor_never_rises_with_a_faster_resource(name: str) -> None:
    cases = [
        dict(STEP, disk_read_bytes=1e9, disk_write_bytes=1e9),
        dict(STEP, disk_read_bytes=8e9, disk_write_bytes=8e9),
        dict(forward_s=0.5, backward_s=0.05, host_numel=10**9),
        dict(STEP, h2d_bytes_per_param=4, d2h_bytes_per_param=4),
    ]
    for case in cases:
        before = step_floor(PROFILE, **case)
        for scale in (1.5, 4.0, 100.0):
            faster = dataclasses.replace(PROFILE, **{name: getattr(PROFILE, name) * scale})
            after = step_floor(faster, **case)
            assert after.floor_s <= before.floor_s + 1e-12, (name, case, scale)


def test_the_bound_resource_lowers_the_floor() -> None:
    base = step_floor(CPU_ONLY, **STEP).floor_s
    faster = dataclasses.replace(CPU_ONLY, cpu_adam_bytes_s=56e9)
    assert step_floor(faster, **STEP).floor_s == pytest.approx(base - 0.5)


def test_profile_json_round_trip(tmp_path) -> None:
    for profile in (PROFILE, MachineProfile(cpu_adam_bytes_s=1.5e10)):
        path = tmp_path / "machine.json"
        profile.save(path)
        loaded = MachineProfile.load(path)
        assert loaded == profile
        assert json.loads(path.read_text())["h2d_bytes_s"] == profile.h2d_bytes_s
    assert MachineProfile(cpu_adam_bytes_s=1.5e10).h2d_bytes_s is None


def test_profile_json_with_unknown_or_no_object_raises(tmp_path) -> None:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"cpu_adam_bytes_s": 1e10, "pcie_gbps": 3}))
    with pytest.raises(ValueError, match=r"MachineProfile: unknown fields \(got \['pcie_gbps'\]\)"):
        MachineProfile.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object \(got list\)"):
        MachineProfile.load(path)


@pytest.mark.parametrize("value", [-1.0, 0.0, math.nan, math.inf])
@pytest.mark.parametrize("name", ["cpu_adam_bytes_s", "h2d_bytes_s", "disk_write_bytes_s"])
def test_bad_bandwidth_raises(name: str, value: float) -> None:
    kwargs = {"cpu_adam_bytes_s": 1e10, name: value}
    with pytest.raises(
        ValueError, match=rf"MachineProfile: {name} must be a finite number > 0 \(got .*\); measure"
    ):
        MachineProfile(**kwargs)


def test_bandwidth_of_the_wrong_type_raises() -> None:
    with pytest.raises(
        TypeError, match=r"MachineProfile: h2d_bytes_s must be a number \(got '5'\)"
    ):
        MachineProfile(cpu_adam_bytes_s=1e10, h2d_bytes_s="5")
    with pytest.raises(TypeError, match=r"cpu_adam_bytes_s must be a number \(got None\)"):
        MachineProfile(cpu_adam_bytes_s=None)


@pytest.mark.parametrize("hide", [-0.1, 1.5, math.nan])
def test_hide_fraction_outside_zero_one_raises(hide: float) -> None:
    with pytest.raises(ValueError, match=r"step_floor: forward_hide_fraction must be"):
        step_floor(PROFILE, **STEP, forward_hide_fraction=hide)


@pytest.mark.parametrize("values", [-0.5, 1.01, math.inf])
def test_host_value_fraction_outside_zero_one_raises(values: float) -> None:
    with pytest.raises(ValueError, match=r"step_floor: host_value_fraction must be"):
        step_floor(PROFILE, **STEP, host_value_fraction=values)


@pytest.mark.parametrize(
    "name", ["forward_s", "backward_s", "host_numel", "disk_read_bytes", "h2d_bytes_per_param"]
)
def test_negative_amount_raises(name: str) -> None:
    kwargs = dict(STEP, **{name: -1})
    with pytest.raises(ValueError, match=rf"step_floor: {name} must be finite and >= 0 \(got -1\)"):
        step_floor(PROFILE, **kwargs)


def test_traffic_without_its_bandwidth_raises() -> None:
    bare = MachineProfile(cpu_adam_bytes_s=1e10)
    with pytest.raises(
        ValueError,
        match=r"copy 2 B per parameter H2D but the profile has no "
        r"h2d_bytes_s \(got None\); measure",
    ):
        step_floor(bare, **STEP)
    up_only = MachineProfile(cpu_adam_bytes_s=1e10, h2d_bytes_s=1e10)
    with pytest.raises(ValueError, match=r"D2H but the profile has no d2h_bytes_s \(got None\)"):
        step_floor(up_only, **STEP)
    # gradients that never cross need no D2H bandwidth
    assert step_floor(up_only, **STEP, d2h_bytes_per_param=0).floor_s == pytest.approx(3.0)
    # no PCIe traffic: the CPU alone suffices
    assert step_floor(
        bare, **STEP, h2d_bytes_per_param=0, d2h_bytes_per_param=0
    ).floor_s == pytest.approx(0.2 + 2.8)
    no_disk = dataclasses.replace(PROFILE, disk_write_bytes_s=None)
    with pytest.raises(ValueError, match=r"disk_write_bytes is 1e\+06 .* \(got None\)"):
        step_floor(no_disk, **STEP, disk_write_bytes=1e6)


def test_gpu_held_updates_lengthen_the_backward_at_the_gpu_adam_rate() -> None:
    base = step_floor(CPU_ONLY, **STEP).cpu_only
    with pytest.raises(ValueError, match=r"gpu_numel is 1e\+09 .* no gpu_adam_params_s"):
        step_floor(CPU_ONLY, **STEP, gpu_numel=10**9)
    with_gpu = dataclasses.replace(CPU_ONLY, gpu_adam_params_s=100e9)
    f = step_floor(with_gpu, **STEP, gpu_numel=10**9).cpu_only
    assert f.backward_s == pytest.approx(base.backward_s + 0.01)  # 1e9 / 100 G params/s
    assert f.step_s == pytest.approx(base.step_s + 0.01)
    assert step_floor(with_gpu, **STEP, gpu_numel=0).cpu_only == base


def test_parameters_streamed_from_the_host_bound_forward_and_backward() -> None:
    # Gemini's host-held shards: 3 GB cross for forward and again for backward
    # at 10 GB/s (0.3 s each), longer than both passes; their updates stay on
    # the host (no copy at the update).
    est = step_floor(CPU_ONLY, **STEP, h2d_bytes_per_param=0, streamed_bytes=3e9)
    f = est.cpu_only
    assert f.forward_s == pytest.approx(0.3) and f.backward_s == pytest.approx(0.3)
    assert f.h2d_s == 0.0 and f.hidden_s == pytest.approx(0.3)  # the longer forward hides more
    assert f.step_s == pytest.approx(0.3 + 0.3 + 1.0 - 0.3)
    # A stream shorter than the passes changes nothing.
    short = step_floor(CPU_ONLY, **STEP, h2d_bytes_per_param=0, streamed_bytes=1e8).cpu_only
    assert short.forward_s == 0.1 and short.backward_s == pytest.approx(0.2)
    bare = MachineProfile(cpu_adam_bytes_s=1e10, d2h_bytes_s=1e10)
    with pytest.raises(ValueError, match=r"streamed_bytes is 1e\+06 but the profile has no h2d"):
        step_floor(bare, **STEP, h2d_bytes_per_param=0, streamed_bytes=1e6)
