#!/usr/bin/env bash
# Issue 7, on a several-GPU device kind (not yet lent): the multi-rank checks
# over NCCL under torchrun at 2 and all GPUs, Gemini checkpoints reloaded at
# other world sizes, then weak scaling at 1, 2, 4, 8 GPUs. The device's
# NVLink multicast variables are left as they are set there.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
ZEROSTACK_BUILD_CUDA=1 python3 packages/fused-adam/hatch_build.py > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
R="torchrun --nproc-per-node"
for n in 2 "$N"; do
  timeout 300 $R "$n" integration_tests/multi_gpu.py parity 2>&1 | tee "$OUT/parity_$n.log" | tail -2
done
timeout 120 $R 2 integration_tests/multi_gpu.py save --path "$OUT/ck.pt" 2>&1 | tail -1
for n in 1 "$N"; do
  timeout 120 $R "$n" integration_tests/multi_gpu.py load --path "$OUT/ck.pt" 2>&1 | tail -1
done
rm -f "$OUT/ck.pt"
for n in 1 2 4 8; do
  [ "$n" -le "$N" ] || break
  timeout 400 $R "$n" benchmarks/scaling.py --steps 4 --warmup 1 2>&1 | tee "$OUT/scaling_$n.log" | grep "^|"
done
