"""ZeroOptimizer at world size 1 on one GPU, against plain PyTorch and FSDP2
with CPU offload, in one run.

GPT-2 1.5B from config, bf16, activation checkpointing on every block, batch
8 x 1024 tokens. Configurations:

* plain PyTorch: fp32 params, bf16 autocast, torch.optim.AdamW(fused=True)
  (the reference for "no offload");
* ZeRO-2: bf16 params, fp32 masters, ZeroOptimizer(AdamW), states on the GPU;
* ZeRO-2 + cpu_offload (``zero2_offload``): masters and states on the CPU,
  ZeroOptimizer's defaults: ``gpu_update_fraction`` "auto" steps the
  step-time model's share of the offloaded buckets in the GPU's Adam, fed
  over PCIe, beside CPU Adam on the rest, on a worker thread while the
  updated buckets go to the GPU and the next forward starts (each module
  waits for its buckets);
* ZeRO-2 + cpu_offload, CPU Adam alone (``zero2_offload_cpu``): the same
  with ``gpu_update_fraction=0.0``, every update in CPU Adam (as DeepSpeed's
  ZeRO-Offload steps);
* ZeRO-2 + cpu_offload, synchronous (``zero2_offload_sync``): CPU Adam alone
  with ``overlap_cpu_step=False``, every update done inside ``step()``: the
  update phase with the GPU idle, and what the overlap gains;
* ZeRO-2 + cpu_offload, split (``zero2_offload_split``): the same as
  ``zero2_offload`` with ``--gpu-update-fraction`` (a number, or the
  default, auto);
* FSDP2 + CPUOffloadPolicy: fully_shard per block, bf16 MixedPrecisionPolicy,
  torch AdamW on the CPU (the peer for "offload").

For each: tokens/s, peak GPU memory, and the step split into forward+backward
and optimizer step (synchronised between them). Median of --steps after
--warmup.

    torchrun --nproc-per-node 1 benchmarks/zero_shard.py     # or plain python
    python benchmarks/zero_shard.py --layers 4 --steps 3     # quick
    python benchmarks/zero_shard.py --only plain,zero2_offload --max-norms 1 --repeat 3
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys

import _training as T
import torch
import torch.distributed as dist

from zerostack.shard import ZeroOptimizer


def _zero(
    config, batch, steps, warmup, offload: bool, overlap: bool = True, max_norm: float = 0.0,
    fraction: float | str | None = None, bucket: int | None = None, numel: int | None = None,
    overlap_comm: bool = True,
) -> dict:  # fmt: skip
    model = T.build(config, torch.bfloat16)
    zopt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), fused=not offload, **T.HYPER),
        stage=2,
        cpu_offload=offload,
        overlap_cpu_step=overlap,
        **({} if fraction is None else {"gpu_update_fraction": fraction}),
        max_norm=max_norm,  # LowLevelZeroOptimizer's clip_grad_norm: the global norm first
        **({} if bucket is None else {"reduce_bucket_size": bucket}),
        overlap_communication=overlap_comm,
        module=model,  # the forward waits per bucket for the overlapped CPU step
    )

    if numel is not None:
        zopt.cpu_update_numel = numel

    def step(loss, backward_only):
        if backward_only:
            zopt.backward(loss)
        else:
            zopt.step()

    label = "ZeRO-2 (bf16 params, fp32 masters)"
    if offload:
        label = "ZeRO-2 + cpu_offload (CPUAdam, " + ("overlapped)" if overlap else "synchronous)")
    if zopt.gpu_update_fraction > 0:
        label = f"ZeRO-2 + cpu_offload (CPUAdam + GPU Adam, {T.fraction_label(fraction, zopt.gpu_update_fraction)})"
    if max_norm > 0:
        label += f", max_norm={max_norm:g}"
    if bucket is not None:
        label += f", reduce_bucket_size={bucket}"
    if numel is not None:
        label += f", cpu_update_numel={numel}"
    if not overlap_comm:
        label += ", overlap_communication=False"
    counters = T.Offload(zopt._pipe, zopt.wait_updates) if zopt._pipe is not None else None
    result = T.run(label, model, step, batch, steps, warmup, False, counters)
    zopt.wait_updates()  # the last step's CPU updates end here, not in the next row
    if offload:  # every master on the host: what --machine's floor needs
        result["host_numel"] = sum(end - start for start, end in zopt.local_ranges())
    return result


def main() -> int:
    # What gpu_update_fraction="auto" measured and chose (the split row's label has the share).
    logging.basicConfig(format="[%(name)s] %(message)s")
    logging.getLogger("zerostack.shard._machine").setLevel(logging.INFO)

    def extra(ap):
        ap.add_argument(
            "--max-norms", default="0",
            help="comma-separated max_norm values for the ZeRO-2 rows, one row each (0: no "
            "clipping; plain PyTorch and FSDP2 do not clip)",
        )  # fmt: skip
        ap.add_argument(
            "--reduce-bucket-size", default="",
            help="comma-separated reduce_bucket_size values for the ZeRO-2 rows, elements per "
            "gradient bucket (DeepSpeed's zero_optimization.reduce_bucket_size), one set of rows "
            "each (default: ZeroOptimizer's)",
        )  # fmt: skip
        ap.add_argument(
            "--no-overlap-comm", action="store_true",
            help="the ZeRO-2 rows with overlap_communication=False (DeepSpeed's overlap_comm: "
            "false): every gradient reduced in step(), none during backward",
        )  # fmt: skip
        ap.add_argument(
            "--cpu-update-numels", default="",
            help="comma-separated cpu_update_numel values (elements a CPU Adam call gathers from "
            "consecutive buckets; 1: one call per bucket) for the offloaded rows, one row each "
            "(default: ZeroOptimizer's)",
        )  # fmt: skip
        ap.add_argument(
            "--gpu-update-fraction", type=T.fraction_arg, default="auto",
            help="zero2_offload_split's gpu_update_fraction, a number in [0, 1] or auto (the "
            "step-time model's fastest split on this machine; default %(default)s)",
        )  # fmt: skip

    ready = T.setup(
        __doc__,
        "plain,zero2,zero2_offload,zero2_offload_cpu,zero2_offload_sync,zero2_offload_split,"
        "fsdp2_offload",
        extra,
    )
    if ready is None:
        return 2
    a, args = ready
    results: list[dict] = []
    wanted = a.only.split(",")
    norms = [float(n) for n in a.max_norms.split(",") if n]
    numels = [int(n) for n in a.cpu_update_numels.split(",") if n] or [None]
    buckets = [int(n) for n in a.reduce_bucket_size.split(",") if n] or [None]
    for run in range(a.repeat):
        T.measure(results, wanted, "plain", lambda: T.plain(*args), run)
        for norm, bucket in itertools.product(norms, buckets):
            zero = functools.partial(_zero, bucket=bucket, overlap_comm=not a.no_overlap_comm)
            T.measure(
                results, wanted, "zero2", lambda z=zero, n=norm: z(*args, False, max_norm=n), run
            )
            for numel in numels:
                offloaded = functools.partial(zero, numel=numel)
                _offloaded_rows(results, wanted, run, offloaded, args, norm, a.gpu_update_fraction)
        T.measure(results, wanted, "fsdp2_offload", lambda: T.fsdp2_offload(*args), run)
    T.print_table(
        "ZeRO-2 on one GPU",
        results,
        T.describe(a),
    )
    dist.destroy_process_group()
    return 0


def _offloaded_rows(results, wanted, run, zero, args, norm, fraction) -> None:
    """The cpu_offload rows of one run at one max_norm."""
    T.measure(results, wanted, "zero2_offload", lambda: zero(*args, True, max_norm=norm), run)
    T.measure(
        results, wanted, "zero2_offload_cpu",
        lambda: zero(*args, True, max_norm=norm, fraction=0.0), run,
    )  # fmt: skip
    T.measure(
        results, wanted, "zero2_offload_sync",
        lambda: zero(*args, True, overlap=False, max_norm=norm, fraction=0.0), run,
    )  # fmt: skip
    T.measure(
        results, wanted, "zero2_offload_split",
        lambda: zero(*args, True, max_norm=norm, fraction=fraction), run,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
