#!/usr/bin/env bash
# Device call (one H200) for the Gemini core and steady-step-time issues:
#   tools/device_core.sh tests    build the kernels, run every test marked gpu, smoke the benchmarks
#   tools/device_core.sh gpt2     benchmarks/gemini.py on GPT-2 1.5B: all on the GPU x3, capped with and without clipping
#   tools/device_core.sh llama    benchmarks/gemini.py on a TinyLlama-shape LLaMA x3, benchmarks/zero_shard.py x3
# Logs go to $OUT (the device tool's output folder).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ZEROSTACK_BUILD_CUDA=1 python3 packages/fused-adam/hatch_build.py > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
table() { grep -E "^\||^- |Error|error|Traceback" "$1" | tail -"${2:-30}"; }
case "${1:-tests}" in
tests)
  for t in packages/*/tests integration_tests; do
    timeout 200 python3 -m pytest "$t" -m gpu -q -p no:cacheprovider 2>&1 | tail -4
  done | tee "$OUT/gpu_tests.log"
  timeout 120 python3 benchmarks/gemini.py --layers 2 --steps 2 --warmup 1 --max-norms 0,1 --static-fracs 0.5 > "$OUT/smoke_gpt2.log" 2>&1; table "$OUT/smoke_gpt2.log" 12
  timeout 120 python3 benchmarks/gemini.py --model llama --only plain,gemini_gpu --steps 2 --warmup 1 > "$OUT/smoke_llama.log" 2>&1; table "$OUT/smoke_llama.log" 8
  timeout 100 python3 benchmarks/zero_shard.py --layers 2 --steps 2 --warmup 1 --only plain,zero2 > "$OUT/smoke_zero.log" 2>&1; table "$OUT/smoke_zero.log" 8
  ;;
gpt2)
  timeout 280 python3 benchmarks/gemini.py --only plain,gemini_gpu --repeat 3 --steps 12 --warmup 3 > "$OUT/gpt2_gpu.log" 2>&1; table "$OUT/gpt2_gpu.log" 14
  timeout 280 python3 benchmarks/gemini.py --only gemini_auto,gemini_static --static-fracs 0.5 --max-norms 0,1 --steps 12 --warmup 3 > "$OUT/gpt2_capped.log" 2>&1; table "$OUT/gpt2_capped.log" 12
  ;;
llama)
  timeout 280 python3 benchmarks/gemini.py --model llama --only plain,gemini_gpu --repeat 3 --steps 12 --warmup 3 > "$OUT/llama_gpu.log" 2>&1; table "$OUT/llama_gpu.log" 14
  timeout 280 python3 benchmarks/zero_shard.py --only plain,zero2 --repeat 3 --steps 12 --warmup 3 > "$OUT/zero_gpu.log" 2>&1; table "$OUT/zero_gpu.log" 14
  ;;
esac
