"""Host <-> device moves of a GPT-2 XL layer stack: as chunks vs tensor by tensor.

The parameters of GPT-2 XL's 48 transformer blocks (1.47B, bf16: 2.9 GB) are
moved host->device and device->host three ways, in one run:

* chunks: registered in a ChunkManager (chunk size from
  search_chunk_configuration), shards in pinned memory, each chunk one
  ``shard_move(non_blocking=True)``;
* tensor by tensor, pageable: ``p.to(device)`` per parameter, what
  ``model.cuda()`` does with an ordinary model (the key peer);
* tensor by tensor, pinned: each parameter in its own pinned buffer.

Against the pinned PCIe bandwidth, measured in the same run with one 1 GiB
pinned tensor each way. The floor of a move is bytes / that bandwidth.

    python benchmarks/chunk_comm.py            # needs CUDA
    python benchmarks/chunk_comm.py --layers 4 # smaller
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

from zerostack.chunk import ChunkManager, search_chunk_configuration
from zerostack.testing import GPTConfig, TinyGPT


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first run warms caches and allocators


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=48,
        help="GPT-2 XL blocks whose parameters are moved (default %(default)s)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed moves per way; the median is shown (default %(default)s)",
    )
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("chunk_comm: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    config = GPTConfig.gpt2_xl(num_layers=a.layers)
    with torch.device("meta"):
        blocks = TinyGPT(config).blocks
    shapes = [p.shape for p in blocks.parameters()]
    nbytes = sum(s.numel() for s in shapes) * 2
    print(f"[chunk-bench] {len(shapes)} tensors, {nbytes / 1e9:.2f} GB bf16", file=sys.stderr)

    # Pinned PCIe bandwidth.
    big_h = torch.empty(2**29, dtype=torch.bfloat16, pin_memory=True)
    big_d = torch.empty(2**29, dtype=torch.bfloat16, device=dev)
    h2d_bw = big_h.numel() * 2 / timed(lambda: big_d.copy_(big_h, non_blocking=True), a.repeats)
    d2h_bw = big_h.numel() * 2 / timed(lambda: big_h.copy_(big_d, non_blocking=True), a.repeats)
    big_h = big_d = None  # free before the next measurements

    rows = []
    # Tensor by tensor, pageable and pinned.
    for pinned in (False, True):
        host = [torch.ones(s, dtype=torch.bfloat16, pin_memory=pinned) for s in shapes]
        on_dev: list[torch.Tensor] = []

        def h2d(host=host, on_dev=on_dev):
            on_dev[:] = [t.to(dev, non_blocking=True) for t in host]

        def d2h(host=host, on_dev=on_dev):
            for h, d in zip(host, on_dev, strict=True):
                h.copy_(d, non_blocking=True)

        t_h2d = timed(h2d, a.repeats)
        t_d2h = timed(d2h, a.repeats)
        rows.append((f"tensor by tensor, {'pinned' if pinned else 'pageable'}", t_h2d, t_d2h))
        del host, on_dev
        torch.cuda.empty_cache()

    # Chunks.
    params = [torch.nn.Parameter(torch.ones(s, dtype=torch.bfloat16)) for s in shapes]
    holder = torch.nn.ParameterList(params)
    cfg, _, _ = search_chunk_configuration(
        holder, search_range_m=64, search_interval=1600, min_chunk_size_m=32
    )
    key = next(iter(cfg))
    manager = ChunkManager(cfg, compute_device=dev)
    for p in params:
        manager.register_tensor(p, "fp16_param", key, cpu_offload=True, pin_memory=True)
    manager.close_all_groups()
    chunks = manager.chunks()

    def chunks_to(device):
        for c in chunks:
            manager.move_chunk(c, device, non_blocking=True)

    times_h2d, times_d2h = [], []
    for _ in range(a.repeats + 1):  # the first round warms the pinned host allocator
        torch.cuda.synchronize()
        start = time.perf_counter()
        chunks_to(dev)
        torch.cuda.synchronize()
        mid = time.perf_counter()
        chunks_to("cpu")
        torch.cuda.synchronize()
        times_h2d.append(mid - start)
        times_d2h.append(time.perf_counter() - mid)
    chunk_bytes = sum(c.chunk_size for c in chunks) * 2
    rows.append(
        (f"chunks ({len(chunks)} x {cfg[key]['chunk_size'] / 2**20:.1f}M elements)",
         statistics.median(times_h2d[1:]), statistics.median(times_d2h[1:]))
    )  # fmt: skip

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print("\n## Chunk moves host <-> device\n")
    print(
        f"- date: {date}; command: `python {' '.join(sys.argv)}`; GPU {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(
        f"- {a.layers} GPT-2 XL blocks: {len(shapes)} tensors, {nbytes / 1e9:.2f} GB bf16; median of {a.repeats}"
    )
    print(
        f"- pinned PCIe bandwidth, same run: H2D {h2d_bw / 1e9:.1f} GB/s, D2H {d2h_bw / 1e9:.1f} GB/s"
    )
    print(
        f"- chunk padding: {chunk_bytes / nbytes - 1:.2%} extra bytes moved; chunk rows count only the parameters' bytes\n"
    )
    print(
        "| method | H2D GB/s | % of pinned H2D | D2H GB/s | % of pinned D2H | H2D vs tensor by tensor (pageable) |"
    )
    print("|---|---|---|---|---|---|")
    base = rows[0][1]
    for name, th, td in rows:
        print(f"| {name} | {nbytes / th / 1e9:.1f} | {100 * nbytes / th / h2d_bw:.0f}% | {nbytes / td / 1e9:.1f} | "
              f"{100 * nbytes / td / d2h_bw:.0f}% | {base / th:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
