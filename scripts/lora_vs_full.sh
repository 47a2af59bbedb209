#!/usr/bin/env bash
# LoRA vs full fine-tuning on CPU, as in docs/benchmarks/lora-cpu-2026-11-26.md:
#
#   bash scripts/lora_vs_full.sh OUT [SEEDS...]     # default seeds 0 1 2; one run at a time
#
# Each seed trains `cpu-demo` (full fine-tuning, lr 2e-5) and `cpu-demo-lora` (rank 16, alpha 32, lr 2e-4) for
# their 20 versions, then evaluates each run's last checkpoint on 64 prompts of another task seed (4 samples
# each, temperature 1.0). Prints one row per run and the mean per preset: training reward at versions 1, 5, 10,
# 20, the held-out accuracy, minutes and the bytes of one publication. A run whose eval.json exists is skipped.
set -u
OUT=${1:-runs/lora-vs-full}
shift || true
SEEDS=("${@:-0 1 2}")
read -r -a SEEDS <<< "${SEEDS[*]}"
mkdir -p "$OUT"
EVAL=(--num-prompts 64 --n 4 --temperature 1.0 --max-new-tokens 8 --data.task arithmetic --data.digits 1
      --data.operators + --data.system-prompt "Reply with the result only." --data.seed 1000)

for seed in "${SEEDS[@]}"; do
  for preset in cpu-demo cpu-demo-lora; do
    run="$OUT/$preset-s$seed"
    [ -f "$run/eval.json" ] && continue
    start=$(date +%s)
    python3 -m asyncrl.cli train "$preset" --seed "$seed" --data.seed "$seed" --wandb off --overwrite \
        --run-dir "$run" > "$OUT/$preset-s$seed.log" 2>&1 || { echo "$preset seed $seed failed: see $OUT/$preset-s$seed.log"; exit 1; }
    echo $(( $(date +%s) - start )) > "$run/train_seconds"
    python3 -m asyncrl.cli eval --model "$run/checkpoints/step_00000020" "${EVAL[@]}" --out "$run/eval.json" \
        >> "$OUT/$preset-s$seed.log" 2>&1 || { echo "eval of $run failed: see $OUT/$preset-s$seed.log"; exit 1; }
  done
done

python3 - "$OUT" <<'EOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {}
print("| run | reward v1 | v5 | v10 | v20 | held-out accuracy | minutes | MB / publication |")
print("|---|---|---|---|---|---|---|---|")
for run in sorted(p for p in out.iterdir() if (p / "eval.json").is_file()):
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reward = {m["training/global_step"]: m["critic/score/mean"] for m in metrics}
    accuracy = json.loads((run / "eval.json").read_text())["accuracy"]
    minutes = int((run / "train_seconds").read_text()) / 60
    mb = statistics.mean(m["param_sync/bytes"] for m in metrics) / 1e6
    cells = [reward.get(v, float("nan")) for v in (1, 5, 10, 20)] + [accuracy, minutes, mb]
    rows.setdefault(run.name.rsplit("-s", 1)[0], []).append(cells)
    print(f"| {run.name} | " + " | ".join(f"{c:.2f}" for c in cells[:-2]) + f" | {minutes:.1f} | {mb:.1f} |")
for preset, cells in rows.items():
    mean = [statistics.mean(c[i] for c in cells) for i in range(7)]
    print(f"| **{preset}, mean of {len(cells)}** | " + " | ".join(f"{c:.2f}" for c in mean[:-2])
          + f" | {mean[5]:.1f} | {mean[6]:.1f} |")
EOF
