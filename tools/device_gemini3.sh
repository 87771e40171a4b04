#!/usr/bin/env bash
# Device call: the Gemini benchmark again with expandable allocator segments
# (the capped runs OOMed on fragmentation), and the 5B model under the cap.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ZEROSTACK_BUILD_CUDA=1 python3 packages/fused-adam/hatch_build.py > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
timeout 250 python3 benchmarks/gemini.py --steps 4 --warmup 1 --static-fracs 0.25,0.5 2>&1 | tee "$OUT/bench_gemini.log" | grep -E "^\||Gemini auto|OOM" | tail -24
timeout 170 python3 benchmarks/gemini.py --only gemini_auto --lazy --layers 24 --dim 4096 --heads 32 --steps 2 --warmup 1 2>&1 | tee "$OUT/bench_gemini_large.log" | grep -E "^\||Error|Gemini auto|OOM|model:" | tail -12
