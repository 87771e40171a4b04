#!/usr/bin/env bash
# Device call 2: fused-adam GPU tests again, Adam benchmark, NVMe benchmark and example.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
bash tools/gpu_check.sh 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
df -h /tmp > "$OUT/disk.txt"; lsblk >> "$OUT/disk.txt" 2>&1; mount | grep -E " / | /tmp " >> "$OUT/disk.txt"
python3 examples/nvme_offload.py 2>&1 | tail -6 | tee "$OUT/nvme_example.log"
python3 benchmarks/nvme.py --params 1B --raw-gb 8 2>&1 | tee "$OUT/bench_nvme.log" | tail -22
python3 benchmarks/adam.py --device cpu --json "$OUT/adam_cpu.json" 2>&1 | tee "$OUT/bench_adam.log" | tail -16
