#!/usr/bin/env bash
# The mixture-of-experts runs behind docs/benchmarks/moe-*.md, on a host of 2 or 4 GPUs, after vLLM 0.26 is
# carried and set up (.gpu/vllm26m/setup.sh: vLLM with its MoE kernels):
#
#   bash scripts/gpu_moe.sh r3 OUT       # a Qwen3-30B-A3B-shaped model (LAYERS of its 48 layers, default 6), rank-32
#                                        #   LoRA, fully async with vLLM: trainer cuda:0 + agent cuda:1 with
#                                        #   --trainer.routing-replay r3, beside the same run without replay on
#                                        #   cuda:2 + cuda:3; the learner recomputes pi_old in both, so each reports
#                                        #   the train-rollout log-prob mismatch (rollout_corr/mismatch_kl)
#   bash scripts/gpu_moe.sh one OUT      # only the r3 run, on cuda:0 + cuda:1 (a 2-GPU host; LAYERS=48: the whole shape,
#                                        #   with WEIGHTS=1: its random bf16 weights written once, on the GPU, as an HF
#                                        #   directory both processes load, rather than built in fp32 in each)
#   bash scripts/gpu_moe.sh weights OUT  # only those weights (a warm machine keeps /tmp: `one` then reuses them)
#   bash scripts/gpu_moe.sh learner OUT  # the learner step of an OLMoE-1B-7B-shaped model, full fine-tune, as a
#                                        #   RANKS-rank FSDP2 group (default 4; 6.9 B parameters' fp32 weights, gradients
#                                        #   and AdamW moments are 110 GB: one GPU cannot hold them), ROWS rows a rank
#                                        #   (default 32): tok/s and MFU (active parameters); LEARNER_ARGS: more
#                                        #   `asyncrl bench learner` flags (e.g. --max-tokens-per-micro-batch 4096)
#
# Random weights on the toy task: the runs measure the machinery (routes, mismatch, memory, throughput), not
# learning. LIMIT: seconds a job.
set -u
STAGE=$1
OUT=${2:-runs/gpu-moe}
LAYERS=${LAYERS:-6}
LIMIT=${LIMIT:-420}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/vsite:/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1

weights() {  # weights NAME GPU: the shape's random bf16 weights in /tmp/moe-NAME, once per warm machine
  local name=$1 gpu=$2 t0=$SECONDS
  if [ -f "/tmp/moe-$name/model.safetensors.index.json" ]; then
    echo "== $name: the random weights of an earlier call in /tmp/moe-$name"; return 0
  fi
  CUDA_VISIBLE_DEVICES=$gpu python3 scripts/moe_shapes.py qwen3-30b-a3b "/tmp/moe-$name" --layers "$LAYERS" \
    --weights --device cuda > "$OUT/$name-weights.log" 2>&1 || { echo "== $name: weights failed"; tail -n 5 "$OUT/$name-weights.log"; return 1; }
  echo "== $name: random bf16 weights written in $((SECONDS - t0)) s ($(du -sh "/tmp/moe-$name" | cut -f1))"
}

run() {  # run NAME GPUS REPLAY: a fully async LoRA run of the Qwen3-30B-A3B shape on 2 GPUs
  local name=$1 gpus=$2 replay=$3
  local model="random:/tmp/moe-$name/config.json"
  if [ -n "${WEIGHTS:-}" ]; then
    weights "$name" "${gpus%%,*}" || return
    model="/tmp/moe-$name"
  else
    python3 scripts/moe_shapes.py qwen3-30b-a3b "/tmp/moe-$name" --layers "$LAYERS" > /dev/null
  fi
  CUDA_VISIBLE_DEVICES=$gpus timeout "$LIMIT" python3 -m asyncrl.cli train cpu-demo \
    --model.path "$model" --data.task toy --rollout.backend vllm \
    --placement.trainer-devices cuda:0 --placement.agent-devices cuda:1 --async-training.no-colocated \
    --async-training.staleness-threshold 0.5 --async-training.total-versions "${VERSIONS:-12}" \
    --lora.rank 32 --lora.alpha 32 --trainer.optim.lr 1e-5 --trainer.routing-replay "$replay" \
    --trainer.off-policy.no-use-rollout-log-probs --rollout.n 8 --rollout.max-new-tokens 256 \
    --trainer.max-response-length 256 --rollout.max-prompt-length 64 --rollout.max-slots 128 \
    --trainer.mini-batch-size 16 --trainer.max-tokens-per-micro-batch 8192 \
    --rollout.vllm.gpu-memory-utilization 0.85 --placement.max-run-time-s $((LIMIT - 20)) --run-dir "/tmp/run-$name" \
    --wandb off --eval.every-versions 0 --eval.no-at-start --eval.no-at-end --checkpoint-every 0 > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -E "engine ready|admitted|Error|error:" "$OUT/$name.log" | tail -n 6
  cp "/tmp/run-$name/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
}

summary() {  # one row per run from its metrics (versions after the first)
  python3 - "$OUT" "$@" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
keys = ["rollout_corr/mismatch_kl", "rollout_corr/routing_disagreement", "rollout_corr/routed_fraction",
        "actor/routing_disagreement", "perf/throughput", "timing_s/param_sync", "param_sync/bytes", "actor/pg_clipfrac",
        "actor/ppo_kl", "actor/moe/expert_load_max"]
print("| run | versions | " + " | ".join(keys) + " | trainer peak GiB | agent peak GiB |")
print("|---" * (len(keys) + 4) + "|")
for name in sys.argv[2:]:
    path = out / f"{name}-metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    steady = rows[1:] or rows
    def mean(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return f"{statistics.fmean(values):.4g}" if values else "—"
    peak = lambda key: max((r.get(key, 0.0) for r in rows), default=float("nan"))
    print(f"| {name} | {len(rows)} | " + " | ".join(mean(k) for k in keys)
          + f" | {peak('perf/max_memory_allocated_gb'):.1f} | {peak('rollouter/max_memory_allocated_gb'):.1f} |")
PY
}

case "$STAGE" in
  r3)
    run r3 0,1 r3 &
    run off 2,3 off &
    wait
    summary r3 off | tee "$OUT/summary.md" ;;
  weights)  # only the random weights `one` uses with WEIGHTS=1, for a call of their own before it
    weights r3 0 ;;
  one)
    run r3 0,1 r3
    summary r3 | tee "$OUT/summary.md" ;;
  learner)
    python3 scripts/moe_shapes.py olmoe-1b-7b /tmp/olmoe > /dev/null
    RANKS=${RANKS:-4}
    CUDA_VISIBLE_DEVICES=${GPUS:-0,1,2,3} timeout "$LIMIT" python3 scripts/bench_learner.py --model random:/tmp/olmoe/config.json \
      --ranks "$RANKS" --workload ragged --rows $((${ROWS:-32} * RANKS)) --steps 4 --warmup-steps 2 --no-baseline ${LEARNER_ARGS:-} --out "$OUT/olmoe.json" > "$OUT/olmoe.log" 2>&1
    echo "== olmoe learner (exit $?)"; tail -n 3 "$OUT/olmoe.log" | cut -c1-300
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('ours_tok_s','ours_mfu','ours_peak_gib','tokens_per_step','model_flops_per_step','ours_first_step_s')})" "$OUT/olmoe.json" 2>/dev/null ;;
  *) echo "unknown stage $STAGE (r3 | one | learner)"; exit 2 ;;
esac
