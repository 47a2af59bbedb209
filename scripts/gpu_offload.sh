#!/usr/bin/env bash
# The offload runs behind BENCHMARKS.md ("Offload: full fine-tuning of an 8B shape on one GPU"), one stage per
# call, on one GPU. The ragged RL workload of the learner benchmark (64 rows, ~86k tokens a step, budget 8,192,
# MLP-only recompute: an 8B shape's activations at the learner's default budget without recompute would not fit),
# 3 timed steps after two warm-up steps (asyncrl bench learner --warmup-steps), random weights:
#
#   bash scripts/gpu_offload.sh small OUT   # Qwen3-1.7B shape, fp32 weights: --offload none / optimizer / params
#   bash scripts/gpu_offload.sh big   OUT   # Qwen3-8B shape: full fine-tune with --offload optimizer and bf16
#                                           #   weights (fp32 master + moments on the host), then rank-32 LoRA
#   bash scripts/gpu_offload.sh params8b OUT  # Qwen3-8B shape, bf16 weights, --offload params (FSDP2 CPU offload)
#
# Each run prints one JSON row (tok/s, MFU, peak GPU GiB, peak host GiB) and writes OUT/NAME.json.
set -u
STAGE=$1
OUT=${2:-runs/gpu-offload}
LIMIT=${LIMIT:-420}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BENCH=(bench learner --workload ragged --rows 64 --steps 3 --max-tokens-per-micro-batch 8192 --gradient-checkpointing
       --checkpoint-scope mlp --no-baseline)

run() {  # run NAME ARGS...: the learner benchmark with ARGS, its log in OUT/NAME.log
  local name=$1; shift
  timeout "$LIMIT" python3 -m asyncrl.cli "${BENCH[@]}" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; tail -n 2 "$OUT/$name.log" | cut -c1-1500
}

case $STAGE in
  small)
    for mode in none optimizer params; do run "1.7b-$mode" --model random:qwen3-1.7b --offload "$mode"; done ;;
  again)  # the no-offload baseline once more, after other runs warmed the machine (order effects)
    run 1.7b-none-again --model random:qwen3-1.7b --offload none ;;
  big)
    run 8b-optimizer --model random:qwen3-8b --offload optimizer --param-dtype bfloat16
    run 8b-lora --model random:qwen3-8b --lora.rank 32 --lora.alpha 32 ;;
  params8b)
    run 8b-params --model random:qwen3-8b --offload params --param-dtype bfloat16 ;;
  *) echo "unknown stage $STAGE (small, again, big, params8b)"; exit 2 ;;
esac
