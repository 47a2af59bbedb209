#!/usr/bin/env bash
# The LoRA runs behind BENCHMARKS.md ("LoRA on one GPU"), one stage per call, on one GPU:
#
#   bash scripts/gpu_lora.sh bench       OUT   # learner step, Qwen3-8B shape, ragged RL rows, rank 32, budget
#                                              #   8,192 with MLP-only recompute: ours vs transformers + peft
#                                              #   (tok/s, MFU, peak GiB)
#   bash scripts/gpu_lora.sh async8b     OUT   # qwen3-8b-lora fully async, trainer and agent sharing cuda:0
#   bash scripts/gpu_lora.sh offpolicy8b OUT   # the same, one-step-off
#   bash scripts/gpu_lora.sh pub17b      OUT   # Qwen3-1.7B shape fully async: full weights vs rank-32 adapters
#                                              #   (what a publication sends and costs)
#   bash scripts/gpu_lora.sh pub8b       OUT   # the 8B shape fully async with full weights (rank 0, no KL term; needs the
#                                              #   ~139 GB of an H200 with bf16 weights, gradients and AdamW moments)
# (colocated: `asyncrl train qwen3-8b-lora`, the preset itself.)
#
# Random weights on the toy task: the runs measure the machinery (memory, publications, throughput), not
# learning. LIMIT: seconds per job. Each run's table row comes from its metrics.jsonl (versions after the first,
# whose compile and CUDA-graph warm-up is not steady state).
set -u
STAGE=$1
OUT=${2:-runs/gpu-lora}
LIMIT=${LIMIT:-420}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

job() {  # job NAME ARGS...: `asyncrl ARGS...`, its log in OUT/NAME.log
  local name=$1; shift
  timeout "$LIMIT" python3 -m asyncrl.cli "$@" > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -v '^v ' "$OUT/$name.log" | tail -n 3
}

summary() {  # summary RUN_DIR...: one row per run from its metrics
  python3 - "$@" <<'EOF'
import json, pathlib, statistics, sys
print("| run | versions | trained tok/s | param_sync s | param_sync MB | trainer peak GiB | agent peak GiB |")
print("|---|---|---|---|---|---|---|")
for run in sys.argv[1:]:
    path = pathlib.Path(run) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    steady = rows[1:] or rows
    def mean(key):
        values = [r[key] for r in steady if key in r]
        return statistics.mean(values) if values else float("nan")
    def peak(key):
        return max((r.get(key, 0.0) for r in rows), default=float("nan"))
    print(f"| {pathlib.Path(run).name} | {len(rows)} | {mean('perf/throughput'):,.0f} | {mean('timing_s/param_sync'):.3f} | "
          f"{mean('param_sync/bytes') / 1e6:,.1f} | {peak('perf/max_memory_allocated_gb'):.1f} | "
          f"{peak('rollouter/max_memory_allocated_gb'):.1f} |")
EOF
}

ASYNC=(--async-training.no-colocated --async-training.staleness-threshold 0.5 --async-training.total-versions 4
       --rollout.max-slots 64 --wandb off)
case "$STAGE" in
bench)
  job bench8b bench learner --model random:qwen3-8b --workload ragged --rows 64 --steps "${STEPS:-3}" \
      --max-tokens-per-micro-batch 8192 --gradient-checkpointing --checkpoint-scope mlp \
      --lora.rank 32 --lora.alpha 32 --out "$OUT/bench8b.json"
  cat "$OUT/bench8b.json" 2>/dev/null
  ;;
async8b)      # fully async: trainer and agent processes sharing cuda:0
  job async8b train qwen3-8b-lora "${ASYNC[@]}" --run-dir "$OUT/async8b"
  summary "$OUT/async8b" | tee -a "$OUT/summary.md"
  ;;
offpolicy8b)  # one-step-off: the agent generates the next batch with the previous weights
  job offpolicy8b train qwen3-8b-lora "${ASYNC[@]}" --async-training.staleness-threshold 1 \
      --async-training.no-partial-rollout --run-dir "$OUT/offpolicy8b"
  summary "$OUT/offpolicy8b" | tee -a "$OUT/summary.md"
  ;;
pub17b)       # a Qwen3-1.7B shape fully async: full weights vs rank-32 adapters per publication
  for rank in 0 32; do
    job "pub17b-r$rank" train qwen3-8b-lora --model.path random:qwen3-1.7b --lora.rank "$rank" "${ASYNC[@]}" \
        --rollout.max-new-tokens 256 --run-dir "$OUT/pub17b-r$rank"
  done
  summary "$OUT/pub17b-r0" "$OUT/pub17b-r32" | tee -a "$OUT/summary.md"
  ;;
pub8b)        # the 8B shape fully async, full weights: what an 8B publication costs without adapters
  job pub8b-r0 train qwen3-8b-lora --lora.rank 0 --trainer.param-dtype bfloat16 --trainer.optim.lr 1e-5 --algorithm.kl-loss-coef 0 "${ASYNC[@]}" --rollout.max-slots 16 \
      --run-dir "$OUT/pub8b-r0"
  summary "$OUT/pub8b-r0" | tee -a "$OUT/summary.md"
  ;;
*)
  echo "usage: bash scripts/gpu_lora.sh bench|async8b|offpolicy8b|pub17b|pub8b OUT" >&2; exit 2;;
esac
