#!/usr/bin/env bash
# The one-node trainer-group runs behind docs/benchmarks/one-node-4xh100-*.md, on a 4-GPU host:
#
#   bash scripts/gpu_group.sh learner OUT   # Qwen3-1.7B shape, ragged rows: one compiled process (64 rows) beside
#                                           #   2-rank groups (128 rows: 64 a GPU) resharding after forward or not,
#                                           #   eager or compiled, then a 4-rank group (256 rows); and the CUDA tests
#                                           #   of the sharded learner
#   bash scripts/gpu_group.sh async OUT     # 4 GPUs, `asyncrl bench async`: colocated sync on all four beside the
#                                           #   2+2 trainer+rollout split (stale+partial), GSM8K prompts, n 8, up to
#                                           #   1,024 new tokens; TOK (tokenizer dir) and DATA (verl parquet) as in
#                                           #   scripts/gpu_bench.sh; VARIANTS to choose others
#   bash scripts/gpu_group.sh tests OUT     # the CUDA tests of the sharded learner (one GPU), beside nothing else
#
# MODEL (default random:qwen3-1.7b), ROWS (rows a GPU, default 64) and SLOTS (engine slots a GPU, default 256)
# change the shape. Each job has LIMIT seconds.
set -u
STAGE=$1
OUT=${2:-runs/gpu-group}
MODEL=${MODEL:-random:qwen3-1.7b}
ROWS=${ROWS:-64}
LIMIT=${LIMIT:-240}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L=(--model "$MODEL" --workload ragged --no-baseline --steps 4 --warmup-steps 2)

learner() {  # learner NAME GPUS RANKS ARGS...
  local name=$1 gpus=$2 ranks=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout "$LIMIT" python3 scripts/bench_learner.py "${L[@]}" --ranks "$ranks" \
    --rows $((ROWS * ranks)) --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; tail -n 3 "$OUT/$name.log" | cut -c1-400
}

case "$STAGE" in
  learner)
    learner one 0 1 &
    learner group2 1,2 2 &
    CUDA_VISIBLE_DEVICES=3 timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider tests/learner/test_learner_cuda.py -k 'sharded or packed' \
      > "$OUT/cuda_tests.log" 2>&1; echo "== cuda tests (exit $?)"; tail -n 3 "$OUT/cuda_tests.log"
    wait
    learner group2_keep 0,1 2 --no-fsdp-reshard-after-forward &
    learner group2_eager 2,3 2 --no-compile-layers &
    wait
    learner group4 0,1,2,3 4 ;;
  async)
    timeout "$LIMIT" python3 scripts/bench_async.py --devices cuda:0 cuda:1 cuda:2 cuda:3 --model "$MODEL" \
      --tokenizer "${TOK:-.gpu/tok}" --data "${DATA:-.gpu/data/train.parquet}" --n 8 --mini-batch-size 16 \
      --max-new-tokens 1024 --max-prompt-length 512 --slots "${SLOTS:-256}" --gradient-checkpointing --lr 1e-6 \
      --steps "${STEPS:-6}" --no-nccl-reference --out "$OUT/async" --variants ${VARIANTS:-sync stale-partial:split=2+2} \
      > "$OUT/async.log" 2>&1
    echo "== async (exit $?)"; grep '^|' "$OUT/async.log" | tail -n 12 ;;
  group4)
    learner group4 0,1,2,3 4 ;;
  tests)
    CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider tests/learner/test_learner_cuda.py \
      -k sharded > "$OUT/cuda_tests.log" 2>&1; echo "== cuda tests (exit $?)"; grep -v DEBUG "$OUT/cuda_tests.log" | tail -n 5 ;;
  *) echo "unknown stage $STAGE (learner | group4 | async | tests)"; exit 2 ;;
esac
