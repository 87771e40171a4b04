#!/usr/bin/env bash
# Device call: GPU tests, then the Gemini benchmark (baseline, static only).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
bash tools/gpu_check.sh -rf -x 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | head -30
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
timeout 100 python3 benchmarks/gemini.py --layers 4 --steps 2 --warmup 1 2>&1 | tee "$OUT/bench_gemini_small.log" | tail -12
timeout 420 python3 benchmarks/gemini.py --steps 4 --warmup 1 2>&1 | tee "$OUT/bench_gemini.log" | tail -14
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/smi.txt"
