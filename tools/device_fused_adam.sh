#!/usr/bin/env bash
# One device-machine call for fused-adam: build with CUDA, GPU tests, CPU tests,
# the Adam benchmark and the main job on the GPU. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; python3 -V;
  python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-300; free -g; } > "$OUT/machine.txt" 2>&1
bash tools/gpu_check.sh -p no:randomly 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
python3 -c 'import zerostack.fused_adam._adam_cuda as c; print(c.device_info())' | tee -a "$OUT/machine.txt"
python3 -m pytest packages/fused-adam/tests -q -m "not gpu" -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/cpu_tests.log"
python3 examples/train_gpt2.py --steps 60 2>&1 | tr '\r' '\n' | tail -4 | tee "$OUT/train.log"
python3 benchmarks/adam.py --json "$OUT/adam.json" 2>&1 | tee "$OUT/bench_adam.log" | tail -40
