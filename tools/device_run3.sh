#!/usr/bin/env bash
# Device call 3: GPU tests of every package, chunk moves, ZeRO-2 benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
bash tools/gpu_check.sh -rf 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | head -30
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
python3 benchmarks/chunk_comm.py 2>&1 | tee "$OUT/bench_chunk.log" | tail -12
timeout 400 python3 benchmarks/zero_shard.py --steps 4 --warmup 1 2>&1 | tee "$OUT/bench_zero.log" | tail -14
