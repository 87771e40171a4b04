#!/usr/bin/env bash
# Auto-offload on GPT-2 (ColossalAI's run.sh): plan under MEMORY_BUDGET GB, train
# 10 steps, print the step time and the measured peak. Any CUDA GPU.
set -euo pipefail
here="$(dirname "$0")"  # logs go to ./offload_logs of the calling directory, as in ColossalAI
export BATCH_SIZE=${BATCH_SIZE:-64}
export MODEL_TYPE=${MODEL_TYPE:-"gpt2_medium"}
export MEMORY_BUDGET=${MEMORY_BUDGET:-16}
export SOLVER_TYPE=${SOLVER_TYPE:-"asyn"}
export PRECISION=${PRECISION:-"fp16"}

mkdir -p offload_logs

python3 "${here}/train_gpt_offload.py" --model_type="${MODEL_TYPE}" --memory_budget="${MEMORY_BUDGET}" \
  --solver_type="${SOLVER_TYPE}" --batch_size="${BATCH_SIZE}" --precision="${PRECISION}" "$@" 2>&1 \
  | tee "./offload_logs/${MODEL_TYPE}_bs_${BATCH_SIZE}_st_${SOLVER_TYPE}.log"
