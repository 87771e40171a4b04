"""launch_from_torch: under torchrun (2 processes, gloo) it joins the group,
seeds every RNG and is idempotent; without torchrun's variables it says
which are missing. launch: ColossalAI's `colossalai.launch` in processes the
script starts itself (torch.multiprocessing.spawn). Both take ColossalAI's
`config={}` and `verbose` as its programs pass them, and refuse a config
with settings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from zerostack.booster import launch, launch_from_torch

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

SCRIPT = textwrap.dedent(
    """
    import os, random
    import numpy as np
    import torch
    import torch.distributed as dist
    from zerostack.booster import launch, launch_from_torch

    torch.set_num_threads(1)
    launch_from_torch(config={}, seed=7, timeout=60, verbose=False)  # as ColossalAI's docs
    rank = int(os.environ["RANK"])
    assert dist.is_initialized() and dist.get_world_size() == 2 and dist.get_rank() == rank
    assert dist.get_backend() == "gloo"  # no CUDA here
    drawn = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(7); np.random.seed(7); torch.manual_seed(7)
    assert drawn[:2] == (random.random(), float(np.random.rand()))
    assert torch.equal(drawn[2], torch.rand(3))
    group = dist.group.WORLD
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        del os.environ[name]  # idempotent: the group is kept, the env not read again
    launch_from_torch(seed=8)
    drawn = torch.rand(2)
    torch.manual_seed(8)
    assert dist.group.WORLD is group and torch.equal(drawn, torch.rand(2))
    launch_from_torch({})  # ColossalAI's older positional config: seed 1024
    drawn = torch.rand(2)
    torch.manual_seed(1024)
    assert torch.equal(drawn, torch.rand(2))
    del group  # no reference may outlive destroy_process_group
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    dist.destroy_process_group()
    print(f"launched rank {rank}", flush=True)
    """
)


SPAWN_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from zerostack.booster import launch

    def run(rank, world_size, port):
        torch.set_num_threads(1)
        launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port, seed=5)
        assert dist.get_world_size() == world_size and dist.get_rank() == rank
        assert dist.get_backend() == "gloo"  # no CUDA here
        drawn = torch.rand(3)
        torch.manual_seed(5)
        assert torch.equal(drawn, torch.rand(3))
        try:
            launch(rank=rank, world_size=world_size, host="localhost", port=port)
        except RuntimeError as error:
            assert "a process group exists already" in str(error), error
        else:
            raise AssertionError("a second launch was accepted")
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        dist.destroy_process_group()
        print(f"launched rank {rank}", flush=True)

    if __name__ == "__main__":
        mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_it_joins_seeds_and_is_idempotent(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script),
    ]  # fmt: skip
    # A new session: on a timeout the whole group (torchrun's workers too) is killed.
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            stdout, stderr = proc.communicate()
            raise AssertionError(f"timed out:\n{stdout}{stderr}") from None
    assert proc.returncode == 0, stdout + stderr
    assert "launched rank 0" in stdout and "launched rank 1" in stdout


def test_launch_in_spawned_processes_joins_and_seeds(tmp_path):
    script = tmp_path / "spawn_launch.py"
    script.write_text(SPAWN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    run = subprocess.run(
        [sys.executable, str(script), str(_free_port())], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "launched rank 0" in run.stdout and "launched rank 1" in run.stdout


@pytest.fixture
def no_group():
    assert not dist.is_initialized()  # the parent test process never joins a group


def test_missing_variables_are_named(monkeypatch, no_group):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(
        RuntimeError,
        match=r"launch_from_torch: torchrun's environment variables are missing \(got none for "
        r"WORLD_SIZE, LOCAL_RANK, MASTER_PORT\); start the script with `torchrun",
    ):
        launch_from_torch()
    assert not dist.is_initialized()


def test_bad_values_are_refused(monkeypatch, no_group):
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"WORLD_SIZE must be an integer \(got 'two'\)"):
        launch_from_torch()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"timeout must be > 0 seconds \(got 0\)"):
        launch_from_torch(timeout=0)
    assert not dist.is_initialized()


def test_launch_checks_its_arguments_before_joining(no_group):
    ok = dict(rank=0, world_size=1, host="localhost", port=29500)
    cases = [
        (dict(rank=1), ValueError, r"launch: rank must be in \[0, world_size\) \(got rank=1, "),
        (dict(rank=-1), ValueError, r"rank must be in \[0, world_size\)"),
        (dict(port=0), ValueError, r"launch: port must be in 1\.\.65535 \(got 0\)"),
        (dict(port="29500"), TypeError, r"launch: port must be an int \(got '29500'\)"),
        (dict(world_size=True), TypeError, r"launch: world_size must be an int \(got True\)"),
        (dict(host=""), TypeError, r"launch: host must be a non-empty str"),
        (dict(local_rank=0.5), TypeError, r"launch: local_rank must be an int or None"),
        (dict(timeout=0), ValueError, r"launch: timeout must be > 0 seconds \(got 0\)"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            launch(**{**ok, **change})
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: launch_from_torch(config={"fp16": {"mode": 1}}), NotImplementedError,
         r"launch_from_torch: ColossalAI's config is not read \(got \['fp16'\]\); .*"
         r"call launch_from_torch without config, or with config=\{\}"),
        (lambda: launch_from_torch({"parallel": {}}), NotImplementedError,
         r"config is not read \(got \['parallel'\]\)"),
        (lambda: launch_from_torch(config="config.py"), NotImplementedError,
         r"config is not read \(got 'config.py'\)"),
        (lambda: launch_from_torch("nccl"), TypeError,
         r"launch_from_torch: seed must be an int \(got 'nccl'\); ColossalAI's later versions "
         r"take backend first: pass the arguments by keyword"),
        (lambda: launch(config={"zero": {}}, rank=0, world_size=1, host="localhost", port=1),
         NotImplementedError, r"launch: ColossalAI's config is not read \(got \['zero'\]\)"),
        (lambda: launch(0, 1, "localhost", 1, seed=1.5), TypeError,
         r"launch: seed must be an int \(got 1.5\)"),
    ],
)  # fmt: skip
def test_colossalai_config_with_settings_is_refused(monkeypatch, no_group, call, error, match):
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(error, match=match):
        call()
    assert not dist.is_initialized()
