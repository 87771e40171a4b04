#!/usr/bin/env bash
# Device call: gemini GPU tests, the Gemini benchmark on GPT-2 1.5B (plain,
# FSDP2 offload, Gemini all-GPU, capped auto and static), then the largest
# model tried under the 24 GiB cap (lazy init, auto).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ZEROSTACK_BUILD_CUDA=1 python3 packages/fused-adam/hatch_build.py > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
python3 -m pytest packages/gemini-placement/tests -m gpu -q -p no:cacheprovider -x > "$OUT/gpu_gemini.log" 2>&1; tail -3 "$OUT/gpu_gemini.log"; grep -E "^E " "$OUT/gpu_gemini.log" | tail -8
timeout 300 python3 benchmarks/gemini.py --steps 4 --warmup 1 --static-fracs 0.25,0.5 2>&1 | tee "$OUT/bench_gemini.log" | grep -E "^\||Error|error|Gemini auto|OOM" | tail -24
timeout 200 python3 benchmarks/gemini.py --only gemini_auto --lazy --layers 24 --dim 4096 --heads 32 --steps 2 --warmup 1 2>&1 | tee "$OUT/bench_gemini_large.log" | grep -E "^\||Error|error|Gemini auto|OOM|model:" | tail -12
free -g | head -2
