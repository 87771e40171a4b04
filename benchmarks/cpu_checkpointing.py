"""DeepSpeed's activation_checkpointing.cpu_checkpointing under
LowLevelZeroPlugin.from_deepspeed_config: peak GPU bytes with and without
it, in one run, on one GPU.

GPT-2 XL shape (``--layers/--dim/--heads`` of benchmarks/_training.py),
every block activation-checkpointed, bf16, ZeRO stage 2 from a ds_config
dict. With cpu_checkpointing the tensors autograd saves outside the
checkpointed blocks (the blocks' inputs, the final norm's, the LM head's and
the loss's) live in pinned host memory between forward and backward.
Columns: the step's peak GPU memory (max_memory_allocated over a step), the
bytes the forward leaves on the GPU (allocated after forward minus before),
the bytes the hooks kept on the host, the step time, and ratios against the
run without cpu_checkpointing (the peer).

    python benchmarks/cpu_checkpointing.py                  # GPT-2 XL shape, batch 8 x 1024
    python benchmarks/cpu_checkpointing.py --layers 4 --steps 2 --warmup 1   # quick
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import sys
import time

import _training as T
import torch

from zerostack.booster import Booster, LowLevelZeroPlugin


def measure(config, batch, steps: int, warmup: int, cpu_checkpointing: bool) -> dict:
    ds_config = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
        "activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing},
        "optimizer": {"type": "AdamW", "params": {"lr": T.HYPER["lr"],
                                                  "weight_decay": T.HYPER["weight_decay"]}},
    }  # fmt: skip
    plugin = LowLevelZeroPlugin.from_deepspeed_config(ds_config)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(T.build_model(config, torch.bfloat16))
    idx, tgt = batch
    peaks, kept, times = [], [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = model(idx, tgt)
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated()
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated())
            kept.append(after_forward - before)
    host = getattr(model, "host_activations", None)
    result = dict(
        name=f"cpu_checkpointing {'on' if cpu_checkpointing else 'off'}",
        peak=max(peaks),
        forward_kept=max(kept),
        host=host.saved_bytes if host is not None else 0,
        step_s=statistics.median(times),
        spread=max(times) / min(times),
        loss=loss.item(),
    )
    del model, opt, booster, loss
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    setup = T.setup(__doc__, only="off,on")
    if setup is None:
        return 1
    a, (config, batch, steps, warmup) = setup
    wanted = a.only.split(",")
    results = [
        measure(config, batch, steps, warmup, cpu_checkpointing=name == "on")
        for _ in range(a.repeat)
        for name in ("off", "on")
        if name in wanted
    ]
    peer = next((r for r in results if r["name"].endswith("off")), None)
    gib = 2**30
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print("\n## cpu_checkpointing: peak GPU memory\n")
    print(f"- date: {date}; command: `python {' '.join(sys.argv)}`")
    print(
        f"- GPU {torch.cuda.get_device_name()}, {os.cpu_count()} host cores, torch {torch.__version__}"
    )
    print(f"- {T.describe(a)}; ZeRO-2 (LowLevelZeroPlugin.from_deepspeed_config), AdamW\n")
    print("| configuration | peak GPU GiB | vs off | forward leaves on GPU GiB | vs off | "
          "kept on host GiB | step s | vs off | spread |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = {
            k: f"{r[k] / peer[k]:.3f}" if peer and peer[k] else ""
            for k in ("peak", "forward_kept", "step_s")
        }
        print(f"| {r['name']} | {r['peak'] / gib:.2f} | {ratio['peak']} | "
              f"{r['forward_kept'] / gib:.2f} | {ratio['forward_kept']} | {r['host'] / gib:.2f} | "
              f"{r['step_s']:.3f} | {ratio['step_s']} | {r['spread']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
