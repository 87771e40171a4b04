#!/usr/bin/env bash
# Device call: GPU tests (gemini parity on CUDA included), then the Gemini
# benchmark, quick shape first, then GPT-2 1.5B.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
bash tools/gpu_check.sh -rf -x 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | head -30
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
timeout 90 python3 benchmarks/gemini.py --layers 4 --steps 2 --warmup 1 --static-fracs 0.5 2>&1 | tee "$OUT/bench_gemini_small.log" | grep -E "^\||Error|error" | tail -12
timeout 330 python3 benchmarks/gemini.py --steps 4 --warmup 1 --static-fracs 0.5,1.0 2>&1 | tee "$OUT/bench_gemini.log" | grep -E "^\||Error|error|auto|OOM" | tail -24
