"""Gemini (ZeRO-3 over chunks) on one GPU, against plain PyTorch and FSDP2
with CPU offload, in one run.

GPT-2 1.5B from config, bf16, activation checkpointing, batch 8 x 1024.
Configurations:

* plain PyTorch (autocast + fused AdamW) with the whole GPU: the ceiling;
* FSDP2 + CPUOffloadPolicy: the peer;
* Gemini static, everything on the GPU;
* with GPU memory capped (``--cap-gib``, default 24, through
  torch.cuda.set_per_process_memory_fraction; run last, the cap stays for the
  process): Gemini auto, and Gemini static with ``offload_optim_frac`` from
  ``--static-fracs``;
* the capped auto row takes GeminiOptimizer's default ``gpu_update_fraction``
  ("auto": the plan with the split weighed against CPU Adam alone, see
  zerostack.gemini's [Note: Gemini's split where the model finds it faster]);
  asked for by name in ``--only``, ``gemini_auto_cpu`` steps every CPU-held
  chunk in CPU Adam (0.0) and ``gemini_auto_split`` takes the share
  ``--gpu-update-fraction`` gives (default auto: the machine's best share,
  not weighed); the static rows step theirs in CPU Adam (their default).

Besides time, each Gemini row gives the exposed CPU-update wait (time the
forward spent waiting for a chunk's CPU step) and the worker's CPU step time
per iteration, of which the rest was hidden behind GPU work.

    python benchmarks/gemini.py
    python benchmarks/gemini.py --layers 4 --steps 3     # quick
"""

from __future__ import annotations

import logging
import sys

import _training as T
import torch
import torch.distributed as dist

from zerostack.chunk import LazyInitContext
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.shard import resolve_gpu_update_fraction
from zerostack.testing import TinyGPT


def gemini(
    config, batch, steps, warmup, label: str, lazy: bool = False, max_norm: float = 0.0,
    nvme: float = 0.0, nvme_dir: str | None = None, split: float | str | None = None,
    **kwargs,
) -> dict:  # fmt: skip
    torch.manual_seed(0)
    if lazy:  # built on meta, materialized on the CPU into the chunks: never whole on the GPU
        with LazyInitContext():
            base = T.build_model(config, None, "cpu")
    else:
        base = T.build_model(config, None, "cuda")
    hidden = config.dim if isinstance(base, TinyGPT) else config.hidden_size
    model = GeminiDDP(base, mixed_precision=torch.bfloat16, hidden_dim=hidden, **kwargs)
    adam = HybridAdam(
        list(base.parameters()), nvme_offload_fraction=nvme, nvme_offload_dir=nvme_dir, **T.HYPER
    )
    opt = GeminiOptimizer(adam, model, max_norm=max_norm, gpu_update_fraction=split)

    def step(loss, backward_only):
        if backward_only:
            opt.backward(loss)
        else:
            opt.step()

    if max_norm > 0:
        label += f", max_norm={max_norm:g}"
    if nvme > 0:
        label += f", nvme_offload_fraction={nvme:g}"
    if model.auto is not None:  # the default's share is weighed at the first step
        share = "auto (default)" if split is None else f"{opt.gpu_update_fraction:.3g}"
        label += f", gpu_update_fraction={share}"
    counters = T.Offload(opt.pipeline.updates, model.wait_updates, lambda: opt.nvme_wait_s)
    result = T.run(label, model, step, batch, steps, warmup, False, counters)
    model.wait_updates()  # profiled steps' updates (ZEROSTACK_BENCH_PROFILE) end here
    amounts = model.step_amounts()
    if amounts["host_numel"]:  # what --machine's floor needs: the placement's traffic, the disk's
        result.update(amounts, disk_bytes=adam.nvme_bytes_on_disk())
    if nvme > 0:  # bytes on disk, and the worker's time waiting for the disk (exposed I/O)
        result["name"] += (
            f" [{adam.nvme_bytes_on_disk() / 1e9:.1f} GB of Adam states on disk, the CPU step "
            f"waited {result['disk_wait_s']:.3f} s/step for it]"
        )
    if model.auto is not None:
        a = model.auto
        result["name"] += (
            f" ({f'{opt.gpu_update_fraction:.3g} weighed, ' if split is None else ''}"
            f"{len(model.grad_chunks) - len(model.offloaded_masters)}/{len(model.grad_chunks)} "
            f"optimizer chunks on the GPU, {a.evictions} evictions"
            + (f", {len(lane)} in the GPU's Adam" if (lane := opt.device_lane_chunks) else "")
            + ")"
        )
    else:
        result["name"] += f" ({len(model.offloaded_masters)}/{len(model.grad_chunks)} on the CPU)"
    opt.close()
    return result


def _configurations(a, args, wanted):
    """(name, thunk) of every configuration asked for; the capped ones last
    (the cap stays for the process), so a repeat lifts it first."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0)
    yield "plain", lambda: T.plain(*args)
    yield "fsdp2_offload", lambda: T.fsdp2_offload(*args)
    yield "gemini_gpu", lambda: gemini(*args, "Gemini static, all on the GPU")
    if not {"gemini_auto", "gemini_auto_cpu", "gemini_auto_split", "gemini_static"} & set(wanted):
        return
    cap = int(a.cap_gib * 2**30)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    ahead = dict(max_prefetch=a.max_prefetch) if a.max_prefetch else {}
    said = f", max_prefetch {a.max_prefetch}" if a.max_prefetch else ""
    ratio = a.steady_cuda_cap_ratio
    if ratio is not None:  # ColossalAI's GeminiPlugin argument of the same name
        said += f", steady_cuda_cap_ratio {ratio:g}"
    for norm in [float(n) for n in a.max_norms.split(",") if n]:
        label = f"Gemini auto, GPU capped at {a.cap_gib:g} GiB{said}"
        share = a.gpu_update_fraction
        if share == "auto" and "gemini_auto_split" in wanted:  # the machine's share, not weighed
            share = resolve_gpu_update_fraction(
                "benchmarks/gemini.py", "auto", torch.device("cuda", 0), None
            )  # fmt: skip
        for name, split in (("gemini_auto", None), ("gemini_auto_cpu", 0.0),
                            ("gemini_auto_split", share)):  # fmt: skip
            yield (
                name,
                lambda label=label, norm=norm, split=split: gemini(
                    *args, label, a.lazy, norm, split=split,
                    placement_policy="auto", gpu_capacity_bytes=cap,
                    **ahead, **({} if ratio is None else {"steady_cuda_cap_ratio": ratio}),
                ),
            )  # fmt: skip
        for frac in [float(f) for f in a.static_fracs.split(",") if f]:
            label = (
                f"Gemini static offload_optim_frac={frac:g}, GPU capped at {a.cap_gib:g} GiB{said}"
            )
            for nvme in [float(f) for f in a.nvme_fractions.split(",") if f]:
                yield (
                    "gemini_static",
                    lambda frac=frac, label=label, norm=norm, nvme=nvme: gemini(
                        *args,
                        label,
                        a.lazy,
                        norm,
                        nvme,
                        a.nvme_dir,
                        offload_optim_frac=frac,
                        **ahead,
                    ),
                )


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")

    def extra(ap):
        ap.add_argument(
            "--cap-gib",
            type=float,
            default=24.0,
            help="GPU memory cap of the capped rows, GiB (default %(default)s)",
        )
        ap.add_argument(
            "--static-fracs",
            default="0.5,1.0",
            help="comma-separated offload_optim_frac values of the capped static rows (default %(default)s)",
        )
        ap.add_argument("--lazy", action="store_true", help="build the Gemini models lazily")
        ap.add_argument(
            "--nvme-fractions", default="0",
            help="comma-separated nvme_offload_fraction values for the capped static rows",
        )  # fmt: skip
        ap.add_argument("--nvme-dir", default=None, help="where Adam states go (default: temp)")
        ap.add_argument(
            "--max-norms", default="0",
            help="comma-separated max_norm values for the capped Gemini rows (0: no clipping)",
        )  # fmt: skip
        ap.add_argument(
            "--max-prefetch", type=int, default=0,
            help="the capped rows' max_prefetch: chunks gathered ahead (default %(default)s)",
        )  # fmt: skip
        ap.add_argument(
            "--gpu-update-fraction", type=T.fraction_arg, default="auto",
            help="gemini_auto_split (asked for by --only, not in the default set): "
            "GeminiOptimizer(gpu_update_fraction=F), the share of the CPU-held optimizer chunks "
            "stepped by the GPU's Adam, a number in [0, 1] or auto: the machine's best share, "
            "not weighed against CPU Adam alone (default %(default)s)",
        )  # fmt: skip
        ap.add_argument(
            "--steady-cuda-cap-ratio", type=float, default=None,
            help="the capped auto rows' steady_cuda_cap_ratio: the share of the cap that model "
            "data and activations may take (default: GeminiDDP's, 0.9)",
        )  # fmt: skip

    ready = T.setup(
        __doc__,
        "plain,fsdp2_offload,gemini_gpu,gemini_auto,gemini_static",
        extra,
    )
    if ready is None:
        return 2
    a, args = ready
    results: list[dict] = []
    wanted = a.only.split(",")
    for run in range(a.repeat):
        for name, fn in _configurations(a, args, wanted):
            T.measure(results, wanted, name, fn, run)
    T.print_table(
        "Gemini on one GPU",
        results,
        T.describe(a),
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
