#!/usr/bin/env bash
# The runner for a CUDA machine (the device machine has python3, torch with
# CUDA, nvcc and pybind11, but no nox): every command builds the kernels in
# place with CUDA forced on and runs against the sources (PYTHONPATH), from
# the repository root. Logs and tables go to $OUT (default /tmp/out).
#
#   tools/device.sh gpu-tests [PYTEST ARGS]  the tests marked gpu, package by package; exits
#                                            non-zero when one fails (`nox -s gpu` runs this)
#   tools/device.sh core [tests|gpt2|llama]  Gemini core and steady step time:
#       tests   gpu-tests, then the benchmarks in smoke sizes (gemini GPT-2 and LLaMA, zero_shard)
#       gpt2    benchmarks/gemini.py on GPT-2 1.5B: all on the GPU x3, capped with and without clipping
#       llama   benchmarks/gemini.py on a TinyLlama-shape LLaMA x3, benchmarks/zero_shard.py x3
#   tools/device.sh adam       fused-adam: GPU and CPU tests, the main job on the GPU, benchmarks/adam.py
#   tools/device.sh nvme       examples/nvme_offload.py, benchmarks/nvme.py (1B), benchmarks/adam.py on the CPU
#   tools/device.sh nvme-job [FRACTION]  the main job (examples/train_booster.py, 20 steps) with
#                              --nvme-fraction FRACTION (default 0.5): its placement decision and the
#                              optimizer states' bytes on disk (summary.json, chunks.txt in $OUT)
#   tools/device.sh chunk      benchmarks/chunk_comm.py and benchmarks/zero_shard.py
#   tools/device.sh split [FRACTIONS]  gpu_update_fraction: the GPU tests of the device lanes
#                              (ZeRO's and Gemini's; SKIP_TESTS=1: none), the machine's profile ($PROFILE,
#                              as floor measures it), then once per fraction in FRACTIONS (default
#                              "0.25 0.5"), clipped (max_norm 1) and with the floor: benchmarks/zero_shard.py
#                              plain, zero2_offload_cpu, zero2_offload_split (Gemini's lane: see
#                              benchmarks/gemini.py --only gemini_auto_split, benchmarks/scale.py
#                              --gpu-update-fraction)
#   tools/device.sh scale [SIZE [FRACTIONS]]  benchmarks/scale.py: a SIZE (default 8B) GPT under Gemini
#                              with every chunk on the CPU, the GPU capped at 24 GiB, once per HybridAdam
#                              nvme_offload_fraction in FRACTIONS (default "0 1"), states in /tmp; at 8B
#                              give one fraction per call (each run is up to ~9 min: the call limit is 10);
#                              BATCH (default 1), PLAIN_TFLOPS (plain's TFLOPS on the 1.5B model, for the
#                              share), SCALE_ARGS (more scale.py options), SCALE_TIMEOUT (s a run, default 530). The 8B row
#                              of 2026-12-02's third session (4.21 s, 294 TFLOPS): BATCH=24 PLAIN_TFLOPS=291
#                              SCALE_ARGS="--raw-gb 0 --force --steps 3 --pin-memory --max-prefetch 2" ... scale 8B 0;
#                              the fifth session's, split (2.49 s, 332 TFLOPS, timed short: see docs/benchmarks.md): BATCH=16, SCALE_ARGS plus
#                              "--gpu-update-fraction 0.27 --machine PROFILE" (ZEROSTACK_MACHINE_PROFILE=PROFILE); "auto" there
#                              gives 0.0 since 2026-12-06 (every parameter shard on the host: zerostack.gemini's
#                              [Note: "auto" and parameter shards on the host]), and the 8.06B row takes
#                              "--gpu-update-fraction 0" (2.96 s against 3.20 s split on one H100, 2026-12-06 twenty-sixth session)
#   tools/device.sh prefetch [SIZE]  gathers ahead (max_prefetch): their GPU tests (zero-chunk's copy
#                              stream, Gemini's parity and one-process runs), then benchmarks/scale.py SIZE
#                              (default 2B) pinned, every chunk on the CPU, batch BATCH (default 8), once per
#                              max_prefetch in PREFETCHES (default "0 2"), each with --profile (the device's
#                              kernels, copies and idle time; each stream's copies and how long two streams
#                              copied at once; a Chrome trace, trace_D.json.gz), PLAIN_TFLOPS and SCALE_ARGS
#                              as for scale; SKIP_TESTS=1: no tests. Whether the 8.06B split's lane copies
#                              hold up the forward's gathers: SKIP_TESTS=1 BATCH=16 PREFETCHES=2
#                              SCALE_ARGS="--gpu-update-fraction 0.27 --machine PROFILE" ... prefetch 8B
#                              (after `floor profile`, which writes PROFILE)
#   tools/device.sh multi-gpu  several GPUs: integration_tests/multi_gpu.py over NCCL under torchrun
#                              (parity, save, load at other world sizes), then benchmarks/scaling.py
#   tools/device.sh solver [tests] [bench MODELS BUDGETS SOLVERS]
#                              auto-offload: its GPU tests; train_gpt_offload.py per model, budget (GB) and
#                              solver (syn, asyn, gemini: Gemini auto capped at the budget), then plain
#                              per model; logs in $OUT/solver_logs.tgz, ColossalAI's lines in $OUT/solver.txt
#   tools/device.sh cpu-checkpointing [ARGS]  benchmarks/cpu_checkpointing.py (DeepSpeed's
#                              cpu_checkpointing under from_deepspeed_config: peak GPU bytes with and
#                              without it, GPT-2 XL shape, ARGS passed on), after the booster-api GPU
#                              tests of it
#   tools/device.sh floor [PART...]  how far offloaded steps are from their floor (zerostack.shard.step_floor):
#                              clipped, against plain PyTorch in the same process; PARTs in order (default all):
#       profile  benchmarks/machine.py --json $PROFILE (default /tmp/zerostack_machine.json, kept while
#                the machine stays warm; copied to $OUT); the other parts reuse it, measuring it first if absent
#       zero     benchmarks/zero_shard.py --only plain,zero2,zero2_offload,zero2_offload_cpu --max-norms 1 --repeat 3
#       gpt4b    benchmarks/gemini.py 36 x 3072 (4B class) --only plain,gemini_gpu,gemini_auto --cap-gib 24 --max-norms 1 --repeat 3
#       llama    benchmarks/gemini.py --model llama --only plain,gemini_gpu,gemini_auto --cap-gib 12 --max-norms 1 --repeat 3
#       main     the main job on the GPU with --machine (its summary's floor line)
#                FLOOR_ARGS: more options for the benchmarks' parts (e.g. "--switch-interval 0.0005"),
#                LOG_TAG: a suffix for their logs' names (two settings in one call)
#                gemini_auto takes GeminiOptimizer's default under auto placement (gpu_update_fraction
#                "auto": the split where the step-time model finds it faster than CPU Adam alone;
#                gemini_auto_cpu 0.0, gemini_auto_split the machine's share); zero2_offload takes ZeroOptimizer's
#                default ("auto" with cpu_offload: the step-time model's share from $PROFILE, through
#                ZEROSTACK_MACHINE_PROFILE); zero2_offload_cpu every update in CPU Adam
#   tools/device.sh help       this text
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"

usage() { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; }

build() {  # the CPU and CUDA kernels of fused-adam, in place (SKIP_BUILD=1: built already)
  [ "${SKIP_BUILD:-0}" = 1 ] && return 0
  ZEROSTACK_BUILD_CUDA="${ZEROSTACK_BUILD_CUDA:-1}" python3 packages/fused-adam/hatch_build.py \
    > "$OUT/build.log" 2>&1 || { tail -5 "$OUT/build.log"; return 1; }
}

sources() {
  PYTHONPATH="$(ls -d packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
}

table() { grep -E "^\||^- |Error|error|Traceback" "$1" | tail -"${2:-30}"; }

gpu_tests() {  # pytest's exit 5 (no test marked gpu in a folder) is not a failure
  local status=0 rc
  for tests in packages/*/tests integration_tests; do
    [ -d "$tests" ] || continue
    timeout 600 python3 -m pytest "$tests" -m gpu -q -p no:cacheprovider "$@" || {
      rc=$?
      [ $rc -eq 5 ] || status=$rc
    }
  done
  return $status
}

PROFILE="${PROFILE:-/tmp/zerostack_machine.json}"
profile() {  # benchmarks/machine.py's MachineProfile, measured once while the machine stays warm
  if [ "${1:-}" = again ] || [ ! -f "$PROFILE" ]; then
    timeout 300 python3 benchmarks/machine.py --json "$PROFILE" --disk-dir /tmp > "$OUT/machine_profile.log" 2>&1
    echo "machine.py exit $?"; tail -25 "$OUT/machine_profile.log"
  fi
  cp "$PROFILE" "$OUT/" 2>/dev/null
}

machine() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    nproc; free -g | head -2; } > "$OUT/machine.txt" 2>&1
  cat "$OUT/machine.txt"
}

cmd="${1:-help}"
[ $# -gt 0 ] && shift
case "$cmd" in
gpu-tests)
  build || exit 1
  sources
  gpu_tests "$@"
  ;;
core)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  build; sources; machine
  case "${1:-tests}" in
  tests)
    gpu_tests 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|skipped" | tail -20
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
  *) echo "tools/device.sh core: unknown part '$1' (tests, gpt2 or llama)" >&2; exit 2 ;;
  esac
  ;;
adam)
  build; sources; machine
  python3 -c 'import zerostack.fused_adam._adam_cuda as c; print(c.device_info())' | tee -a "$OUT/machine.txt"
  gpu_tests -p no:randomly 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  python3 -m pytest packages/fused-adam/tests -q -m "not gpu" -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/cpu_tests.log"
  python3 examples/train_gpt2.py --steps 60 2>&1 | tr '\r' '\n' | tail -4 | tee "$OUT/train.log"
  python3 benchmarks/adam.py --json "$OUT/adam.json" 2>&1 | tee "$OUT/bench_adam.log" | tail -40
  ;;
nvme)
  build; sources; machine
  { df -h /tmp; lsblk; mount | grep -E " / | /tmp "; } > "$OUT/disk.txt" 2>&1
  python3 examples/nvme_offload.py 2>&1 | tail -6 | tee "$OUT/nvme_example.log"
  python3 benchmarks/nvme.py --params 1B --raw-gb 8 2>&1 | tee "$OUT/bench_nvme.log" | tail -22
  python3 benchmarks/adam.py --device cpu --json "$OUT/adam_cpu.json" 2>&1 | tee "$OUT/bench_adam.log" | tail -16
  ;;
nvme-job)
  build; sources; machine
  run_dir=/tmp/nvme_job  # not under $OUT: the run's state/ checkpoint stays on the machine
  rm -rf "$run_dir"
  python3 examples/train_booster.py --steps 20 --log-every 5 --nvme-fraction "${1:-0.5}" \
    --run-dir "$run_dir" > "$OUT/nvme_job.log" 2>&1
  echo "exit $?"
  grep -E "placement:|nvme_offload_fraction|step +20|chunks \(|  (param|master|optimizer)|Error" "$OUT/nvme_job.log"
  cp "$run_dir/summary.json" "$run_dir/chunks.txt" "$OUT/" 2>/dev/null
  python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print('bytes on disk', s['nvme_bytes'])" \
    "$run_dir/summary.json"
  ;;
split)
  case "${1:-}" in zero|gemini|both)  # the old form: Gemini's split is benchmarks/gemini.py's gemini_auto_split
    echo "tools/device.sh split: give fractions only (ZeRO's rows); Gemini's split: benchmarks/gemini.py --only gemini_auto_split, or scale with SCALE_ARGS=--gpu-update-fraction" >&2
    exit 2 ;;
  esac
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  build; sources; machine
  if [ "${SKIP_TESTS:-0}" != 1 ]; then  # the device lanes' GPU tests live in these three packages
    for tests in packages/fused-adam/tests packages/zero-shard/tests packages/gemini-placement/tests; do
      timeout 300 python3 -m pytest "$tests" -m gpu -q -p no:cacheprovider \
        -k "gpu_update_fraction or functional or step_returns_before_updates" 2>&1 | tail -3
    done | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|skipped"
  fi
  profile
  for f in ${1:-0.25 0.5}; do
    timeout 280 python3 benchmarks/zero_shard.py --only plain,zero2,zero2_offload_cpu,zero2_offload_split \
      --gpu-update-fraction "$f" --max-norms 1 --steps 8 --warmup 2 --machine "$PROFILE" \
      > "$OUT/split_$f.log" 2>&1; echo "exit $?"; table "$OUT/split_$f.log" 20
  done
  ;;
chunk)
  build; sources; machine
  python3 benchmarks/chunk_comm.py 2>&1 | tee "$OUT/bench_chunk.log" | tail -12
  timeout 400 python3 benchmarks/zero_shard.py --steps 4 --warmup 1 2>&1 | tee "$OUT/bench_zero.log" | tail -14
  ;;
scale)
  build; sources; machine
  { df -h /tmp; free -g; } > "$OUT/disk.txt" 2>&1
  for f in ${2:-0 1}; do
    timeout "${SCALE_TIMEOUT:-530}" python3 benchmarks/scale.py --params "${1:-8B}" --nvme-fraction "$f" --nvme-dir /tmp \
      --batch-size "${BATCH:-1}" ${PLAIN_TFLOPS:+--plain-tflops "$PLAIN_TFLOPS"} ${SCALE_ARGS:-} \
      > "$OUT/scale_${1:-8B}_$f.log" 2>&1; echo "exit $?"; grep -vE "^\[scale\] step" "$OUT/scale_${1:-8B}_$f.log" | tail -30
  done
  ;;
prefetch)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  build; sources; machine
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    { timeout 200 python3 -m pytest packages/zero-chunk/tests/test_chunk.py -m gpu -q -p no:cacheprovider
      timeout 400 python3 -m pytest packages/gemini-placement/tests/test_gemini_gpu.py -m gpu -q \
        -p no:cacheprovider; } 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|skipped"
  fi
  for d in ${PREFETCHES:-0 2}; do
    ZEROSTACK_BENCH_TRACE="$OUT/trace_$d.json" timeout 500 python3 benchmarks/scale.py \
      --params "${1:-2B}" --nvme-fraction 0 --raw-gb 0 --force --pin-memory --batch-size "${BATCH:-8}" \
      --max-prefetch "$d" --profile ${PLAIN_TFLOPS:+--plain-tflops "$PLAIN_TFLOPS"} ${SCALE_ARGS:-} \
      > "$OUT/prefetch_$d.log" 2>&1
    echo "exit $?"; grep -E "profile:|^\| [0-9]|TFLOPS|floor|Error" "$OUT/prefetch_$d.log" | tail -8
    gzip -f "$OUT/trace_$d.json" 2>/dev/null
  done
  ;;
multi-gpu)
  # The device's NVLink multicast variables are left as they are set there.
  build; sources; machine
  N=$(nvidia-smi -L | wc -l)
  R="torchrun --nproc-per-node"
  for n in $(printf '%s\n' 2 "$N" | sort -nu); do  # once at 2 when there are 2
    timeout 600 $R "$n" integration_tests/multi_gpu.py parity 2>&1 | tee "$OUT/parity_$n.log" | tail -2
  done
  timeout 120 $R 2 integration_tests/multi_gpu.py save --path "$OUT/ck.pt" 2>&1 | tail -1
  for n in $(printf '%s\n' 1 "$N" | sort -nu); do
    timeout 120 $R "$n" integration_tests/multi_gpu.py load --path "$OUT/ck.pt" 2>&1 | tail -1
  done
  rm -f "$OUT/ck.pt"
  for n in 1 2 4 8; do
    [ "$n" -le "$N" ] || break
    timeout 400 $R "$n" benchmarks/scaling.py --steps 4 --warmup 1 2>&1 | tee "$OUT/scaling_$n.log" | grep "^|"
  done
  ;;
solver)
  build; sources; machine
  logs="$OUT/solver_logs"
  mkdir -p "$logs"
  if [ "${1:-}" = tests ]; then
    shift
    timeout 400 python3 -m pytest packages/auto-offload-solver/tests -m gpu -q -p no:cacheprovider \
      2>&1 | tee "$OUT/solver_tests.log" | tail -15
  fi
  if [ "${1:-}" = bench ]; then
    for model in $2; do
      for budget in $3; do
        for solver in $4; do
          log="$logs/${model}_${budget}_${solver}.log"
          echo "== $model budget=$budget GB solver=$solver" | tee -a "$OUT/solver.txt"
          timeout 240 python3 examples/auto_offload/train_gpt_offload.py --model_type "$model" \
            --memory_budget "$budget" --solver_type "$solver" --batch_size "${BATCH_SIZE:-64}" \
            --precision "${PRECISION:-fp16}" > "$log" 2>&1
          echo "exit $?" >> "$log"
          grep -E "solver_time|tokens/s|exec_time|Error|exit [1-9]" "$log" | tail -5 | tee -a "$OUT/solver.txt"
        done
      done
      [ "${PLAIN:-1}" = 1 ] || continue  # PLAIN=0: no plain peer (a model too large for it)
      log="$logs/${model}_plain.log"
      echo "== $model plain" | tee -a "$OUT/solver.txt"
      timeout 240 python3 examples/auto_offload/train_gpt_offload.py --model_type "$model" \
        --solver_type plain --batch_size "${BATCH_SIZE:-64}" --precision "${PRECISION:-fp16}" > "$log" 2>&1
      grep -E "tokens/s|exec_time|Error" "$log" | tail -3 | tee -a "$OUT/solver.txt"
    done
  fi
  tar czf "$OUT/solver_logs.tgz" -C "$logs" . && rm -r "$logs"
  ;;
floor)
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}"  # set (even empty): kept
  build; sources; machine
  for part in ${*:-profile zero gpt4b llama main}; do
    if [ "$part" = profile ]; then profile again; else profile; fi
    M=(--machine "$PROFILE" ${FLOOR_ARGS:-})
    export ZEROSTACK_MACHINE_PROFILE="$PROFILE"  # "auto": the floor's profile, not a new measure
    case "$part" in
    profile) ;;
    zero)
      timeout 400 python3 benchmarks/zero_shard.py --only plain,zero2,zero2_offload,zero2_offload_cpu \
        --max-norms 1 --repeat 3 "${M[@]}" \
        > "$OUT/floor_zero${LOG_TAG:-}.log" 2>&1; table "$OUT/floor_zero${LOG_TAG:-}.log" 24 ;;
    gpt4b)
      timeout 500 python3 benchmarks/gemini.py --layers 36 --dim 3072 --heads 24 \
        --only plain,gemini_gpu,gemini_auto --cap-gib 24 --max-norms 1 --repeat 3 "${M[@]}" > "$OUT/floor_gpt4b${LOG_TAG:-}.log" 2>&1; table "$OUT/floor_gpt4b${LOG_TAG:-}.log" 24 ;;
    llama)
      timeout 400 python3 benchmarks/gemini.py --model llama \
        --only plain,gemini_gpu,gemini_auto --cap-gib 12 --max-norms 1 --repeat 3 "${M[@]}" > "$OUT/floor_llama${LOG_TAG:-}.log" 2>&1; table "$OUT/floor_llama${LOG_TAG:-}.log" 24 ;;
    main)
      rm -rf /tmp/floor_job
      timeout 200 python3 examples/train_booster.py --steps 40 --log-every 10 --run-dir /tmp/floor_job "${M[@]}" \
        > "$OUT/floor_main.log" 2>&1; echo "exit $?"; grep -A12 "== summary" "$OUT/floor_main.log" ;;
    *) echo "tools/device.sh floor: unknown part '$part'" >&2; exit 2 ;;
    esac
  done
  ;;
cpu-checkpointing)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  build; sources; machine
  timeout 120 python3 -m pytest packages/booster-api/tests/test_deepspeed_cpu_checkpointing.py -m gpu -q \
    -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/cpu_checkpointing_tests.log"
  timeout 450 python3 benchmarks/cpu_checkpointing.py "$@" > "$OUT/cpu_checkpointing.log" 2>&1
  echo "exit $?"; table "$OUT/cpu_checkpointing.log" 12
  ;;
help | -h | --help) usage ;;
*) echo "tools/device.sh: unknown command '$cmd'" >&2; usage >&2; exit 2 ;;
esac
