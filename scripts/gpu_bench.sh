#!/usr/bin/env bash
# The multi-GPU runs behind BENCHMARKS.md ("Sync vs async on 2 GPUs", "4-GPU scaling"), one stage at a time:
#
#   bash scripts/gpu_bench.sh modes   OUT   # GPUs 0,1: sync / one-step-off / stream / stale-partial (Qwen2.5-0.5B
#                                           #   shape, random weights) + 2 knob sweeps; GPUs 2,3: TRL GRPOTrainer on
#                                           #   the same model, data and hyperparameters, then 2 more sweeps
#   bash scripts/gpu_bench.sh reward  OUT   # SmolLM2-135M-Instruct on GSM8K for a fixed wall-clock budget:
#                                           #   colocated sync on GPUs 0,1 beside stale+partial on GPUs 2,3
#   bash scripts/gpu_bench.sh scale4  OUT   # 4 GPUs: colocated sync vs 2+2 / 1+3 / 3+1 trainer+rollout splits
#
# On a 2-GPU host (`nvidia-h200-x2`) the same runs go one after another on GPUs 0,1:
#   bash scripts/gpu_bench.sh modes2  OUT   # colocated sync vs stale+partial, then stale+partial without
#                                           #   gradient checkpointing
#   bash scripts/gpu_bench.sh reward-sync OUT; bash scripts/gpu_bench.sh reward-async OUT   # the reward stage
#
# Inputs (environment): TOK (tokenizer dir for the random-weight model), DATA (GSM8K in verl's parquet format,
# from `asyncrl data convert-gsm8k`), SMOL (SmolLM2-135M-Instruct as an HF directory or .gguf), TASK=arithmetic
# (the reward stages on the built-in sums task instead of GSM8K, DIGITS per operand).
# BENCH_ARGS: extra `asyncrl bench async` flags for every job (e.g. "--sync-timeout-s 150").
# Every sweep of one stage runs on the same pair of GPUs; the two pairs of a stage run at the same time.
set -u
STAGE=$1
OUT=${2:-runs/gpu-bench}
TOK=${TOK:-.gpu/tok}
DATA=${DATA:-.gpu/data/train.parquet}
SMOL=${SMOL:-smollm2}
LIMIT=${LIMIT:-560}   # seconds per job: partial results (written after each variant) survive the cut
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the knobs of the documented rows, where they differ from a run's defaults (which `bench async` takes otherwise)
COMMON=(--n 8 --mini-batch-size 16 --max-new-tokens 1024 --max-prompt-length 512 --temperature 1.0 --slots 256
        --gradient-checkpointing --threads-per-process 4)
# the reward stages: GSM8K, or (TASK=arithmetic) the built-in sums task, where a 135M model has a signal
if [ "${TASK:-gsm8k}" = arithmetic ]; then REWARD_DATA=(--digits "${DIGITS:-1}"); else REWARD_DATA=(--data "$DATA"); fi
R=(--model "$SMOL" "${REWARD_DATA[@]}" --lr 1e-5 --steps 1000 --time-budget-s "${BUDGET:-400}" --no-nccl-reference)
QWEN=(--model random:qwen2.5-0.5b --tokenizer "$TOK" --data "$DATA" --lr 1e-6 --steps 8)

bench() {  # bench NAME DEVICES... -- ARGS...
  local name=$1; shift
  local devices=()
  while [ "$1" != "--" ]; do devices+=("$1"); shift; done; shift
  timeout "$LIMIT" python3 scripts/bench_async.py --devices "${devices[@]}" --out "$OUT/$name" "$@" ${BENCH_ARGS:-} \
    > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; tail -n 20 "$OUT/$name.log" | grep '^|\|bare broadcast' || tail -n 5 "$OUT/$name.log"
}

trl() {  # TRL's GRPOTrainer, data parallel on GPUs 2,3, same model / data / hyperparameters as QWEN + COMMON
  local model=${TMPDIR:-/tmp}/qwen2.5-0.5b-random  # 1 GB: kept out of OUT
  python3 - "$model" "$TOK" <<'EOF'
import sys, torch
from asyncrl.policies.loading import load_tokenizer, random_model, save_pretrained
save_pretrained(random_model("qwen2.5-0.5b", seed=0), sys.argv[1], tokenizer=load_tokenizer(sys.argv[2]),
                dtype=torch.bfloat16)
EOF
  CUDA_VISIBLE_DEVICES=2,3 timeout 300 torchrun --nproc-per-node 2 --master-port 29533 scripts/bench_trl.py \
    --model "$model" --data "${TRL_DATA:-.gpu/data/train.jsonl}" --num-generations 8 --prompts-per-step 16 \
    --max-completion-length 1024 --max-prompt-length 512 --temperature 1.0 --lr 1e-6 --steps 3 --bf16 \
    --gradient-checkpointing --out "$OUT/trl.json" > "$OUT/trl.log" 2>&1
  echo "== trl (exit $?)"; tail -n 3 "$OUT/trl.log"
}

case "$STAGE" in
  modes)
    bench modes cuda:0 cuda:1 -- "${QWEN[@]}" "${COMMON[@]}" \
      --variants sync one-step-off stream stale-partial "stale-partial:partial=0" &
    (trl; bench sweep_staleness cuda:2 cuda:3 -- "${QWEN[@]}" "${COMMON[@]}" --no-nccl-reference \
      --variants "stale-partial:staleness=0.1" "stale-partial:staleness=1" "stale-partial:trigger=1") &
    wait ;;
  modes2)
    bench modes2 cuda:0 cuda:1 -- "${QWEN[@]}" "${COMMON[@]}" --variants sync stale-partial
    bench modes2_nogc cuda:0 cuda:1 -- "${QWEN[@]}" "${COMMON[@]}" --no-nccl-reference \
      --no-gradient-checkpointing --variants stale-partial ;;
  reward-sync|reward-async)
    bench "${STAGE/-/_}" cuda:0 cuda:1 -- "${R[@]}" "${COMMON[@]}" \
      --variants "$([ "$STAGE" = reward-sync ] && echo sync || echo stale-partial)" ;;
  reward)
    bench reward_sync cuda:0 cuda:1 -- "${R[@]}" "${COMMON[@]}" --variants sync &
    bench reward_async cuda:2 cuda:3 -- "${R[@]}" "${COMMON[@]}" --variants stale-partial &
    wait ;;
  scale4)
    bench scale4 cuda:0 cuda:1 cuda:2 cuda:3 -- "${QWEN[@]}" "${COMMON[@]}" \
      --variants sync "stale-partial:split=2+2" "stale-partial:split=1+3" "stale-partial:split=3+1" ;;
  *) echo "unknown stage $STAGE (modes | reward | scale4 | modes2 | reward-sync | reward-async)"; exit 2 ;;
esac
