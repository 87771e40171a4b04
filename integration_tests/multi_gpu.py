"""The multi-rank checks of zero-shard and gemini-placement under torchrun:
NCCL on one GPU per rank, or gloo on CPU processes with ``--cpu`` (how this
script itself is tested on machines without GPUs).

    torchrun --nproc-per-node 2 integration_tests/multi_gpu.py parity
    torchrun --nproc-per-node 2 integration_tests/multi_gpu.py save --path /tmp/ck.pt
    torchrun --nproc-per-node 4 integration_tests/multi_gpu.py load --path /tmp/ck.pt

parity: every ZeRO-1/2 and Gemini case of the packages' parity tests
(DDP + torch optimizers as the reference, step by step; fp32/bf16/fp16,
overflow-free and clipped, offload, accumulation, auto placement); every
Booster plugin case of booster-api's parity test (TorchDDPPlugin,
LowLevelZeroPlugin stage 1/2 with and without cpu_offload, GeminiPlugin
static, auto and with the optimizer on the CPU); fp16 overflow on rank 0
only, which every rank must skip (ZeRO-2 with the overlapped CPU step, with
clipping, against DDP step by step).
save/load: Gemini's full optimizer state and model saved at one world size;
training resumed at another gives the losses the saving run went on to give.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
for tests in ("zero-shard", "gemini-placement", "booster-api"):
    sys.path.insert(0, str(ROOT / "packages" / tests / "tests"))

import test_booster_parity as booster_parity  # noqa: E402
import test_gemini_checkpoint as gemini_ckpt  # noqa: E402
import test_gemini_parity as gemini_parity  # noqa: E402
import test_offload_overlap as offload_overlap  # noqa: E402
import test_zero_parity as zero_parity  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "phase",
        choices=["parity", "save", "load"],
        help="parity against DDP, or save / load a checkpoint at --path",
    )
    ap.add_argument(
        "--path",
        default="/tmp/zerostack_multi_gpu.pt",
        help="the checkpoint of save and load (default %(default)s)",
    )
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes")
    a = ap.parse_args()
    if "RANK" not in os.environ:
        print("multi_gpu.py: run it under torchrun", file=sys.stderr)
        return 2
    local = int(os.environ["LOCAL_RANK"])
    if a.cpu:
        device = "cpu"
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    try:
        if a.phase == "parity":
            for case in zero_parity._cases():
                zero_parity._run_case(rank, world, case, device=device)
            for case in gemini_parity.CASES:
                gemini_parity._run_case(rank, world, case, device=device)
            for case in booster_parity.CASES:
                booster_parity._run_case(rank, world, case, device=device)
            offload_overlap._fp16_overflow_parity(rank, world, device=device)
        elif a.phase == "save":
            gemini_ckpt._save(rank, world, a.path, device)
        else:
            gemini_ckpt._load(rank, world, a.path, {}, device)
            gemini_ckpt._load(rank, world, a.path, dict(offload_optim_frac=0.5), device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(f"multi_gpu.py {a.phase}: OK at world size {world} on {device.split(':')[0]} "
              f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
