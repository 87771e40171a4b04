"""A dead peer ends the job: a rank killed with SIGKILL in the middle of a
Gemini step makes the other rank fail with an error within the process
group's timeout (launch_from_torch(timeout=...)), never hang. Two plain
processes with torchrun's variables (no torchrun agent, which would kill
the survivor itself), gloo."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    import torch
    from zerostack.booster import launch_from_torch
    from zerostack.fused_adam import HybridAdam
    from zerostack.gemini import GeminiDDP, GeminiOptimizer
    from zerostack.testing import GPTConfig, TinyGPT, make_batch

    torch.set_num_threads(1)
    launch_from_torch(seed=0, timeout=20)
    rank = int(os.environ["RANK"])
    config = GPTConfig(bias=False)
    model = TinyGPT(config)
    ddp = GeminiDDP(model, mixed_precision=torch.float32, compute_device="cpu",
                    chunk_config_dict={2: {"chunk_size": 4_000, "keep_gathered": False}})
    opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3), ddp)
    for step in range(4):
        idx, tgt = make_batch(config, 2, 16, seed=10 * step + rank)
        loss = ddp(idx, tgt)
        if step == 2 and rank == 1:
            print(f"rank 1 killing itself mid-step at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.backward(loss)
        opt.step()
        print(f"rank {rank} step {step} done", flush=True)
    print(f"rank {rank} finished", flush=True)
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_killed_mid_step_makes_the_other_fail_not_hang(tmp_path):
    script = tmp_path / "dead_peer.py"
    script.write_text(SCRIPT)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank))  # fmt: skip
        cmd = [sys.executable, str(script)]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        out0, _ = procs[0].communicate(timeout=180)
        ended = time.time()
        out1, _ = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    killed = re.search(r"killing itself mid-step at ([0-9.]+)", out1)
    assert procs[1].returncode == -9 and killed, out1
    # The survivor ends with an error of its own within the 20 s timeout (and
    # its exit) of the kill, and never reaches the end of training. Counted
    # from the kill: start-up takes tens of seconds on a loaded machine.
    assert procs[0].returncode not in (0, None), out0
    assert "rank 0 finished" not in out0 and "Traceback" in out0, out0
    elapsed = ended - float(killed.group(1))
    assert elapsed < 50, f"the surviving rank took {elapsed:.0f} s to fail"
