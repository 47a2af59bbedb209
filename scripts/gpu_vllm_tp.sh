#!/usr/bin/env bash
# vLLM on GPUs of its own (issue 49, part 3), on a host of 2 (bare, engine, own) or 4 GPUs (tp-run), after vLLM 0.26
# is carried and set up as .gpu/vllm26/carry.md says (two calls: part0, then part1 + setup.sh):
#
#   bash scripts/gpu_vllm_tp.sh bare OUT     # vLLM alone, no asyncrl, no CUDA in the parent: LLM(tp=2) on GPUs 0,1
#                                            #   with sleep mode and CUDA graphs as the agent asks, then the same with
#                                            #   sleep mode off, eager, and custom all-reduce off (each its own process)
#   bash scripts/gpu_vllm_tp.sh engine OUT   # asyncrl's VLLMEngine as an agent builds it (its model on cuda:0 first,
#                                            #   so the parent holds a CUDA context), 2 shards on cuda:0,1
#                                            #   (device_ids [0, 1]): generate, update every weight, generate again
#   bash scripts/gpu_vllm_tp.sh own OUT      # a training run: trainer cuda:0, agent cuda:1 (vLLM, NCCL weight channel)
#   bash scripts/gpu_vllm_tp.sh tp-run OUT   # a training run: trainer cuda:0, agent cuda:1 with 2 shards (cuda:1,2)
#   bash scripts/gpu_vllm_tp.sh tp-shared OUT  # a training run on 2 GPUs: trainer cuda:0, agent cuda:0 with 2 shards
#                                            #   (cuda:0,1), the first beside the trainer
#
# MODEL (default random:qwen2.5-0.5b: 14 heads, 2 KV heads) and LIMIT (seconds a job, default 300).
set -u
STAGE=$1
OUT=${2:-runs/gpu-vllm-tp}
MODEL=${MODEL:-random:qwen2.5-0.5b}
LIMIT=${LIMIT:-300}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/vsite:/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# the machine's NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are inherited as they are

save_model() {  # save_model DIR: the model as an HF directory, built on the CPU (no CUDA in this process)
  python3 -c "import sys; from asyncrl.policies import load_model; from asyncrl.policies.loading import save_pretrained
save_pretrained(load_model(sys.argv[1]), sys.argv[2])" "$MODEL" "$1"
}

bare() {  # bare NAME SLEEP EAGER CUSTOM_AR
  local name=$1
  timeout "$LIMIT" python3 - /tmp/vtp-model "$2" "$3" "$4" > "$OUT/bare-$name.log" 2>&1 <<'PY'
import sys, time
from vllm import LLM, SamplingParams
path, sleep, eager, custom = sys.argv[1], *(a == "1" for a in sys.argv[2:])
start = time.time()
llm = LLM(path, tensor_parallel_size=2, skip_tokenizer_init=True, enable_sleep_mode=sleep, enforce_eager=eager,
          disable_custom_all_reduce=not custom, gpu_memory_utilization=0.5, max_model_len=512, dtype="bfloat16")
out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=16, logprobs=0,
                   detokenize=False), use_tqdm=False)
print(f"BARE_OK ready in {time.time() - start:.1f} s; tokens {list(out[0].outputs[0].token_ids)}")
PY
  echo "== bare $name sleep=$2 eager=$3 custom_ar=$4 (exit $?)"; grep -E "BARE_OK|Error|error:" "$OUT/bare-$name.log" | tail -n 4
}

run() {  # run NAME ARGS...: a short fully async run (the shape of .gpu/vllm26/run_h100.sh)
  local name=$1; shift
  timeout "$LIMIT" python3 -m asyncrl.cli train cpu-demo --model.path "$MODEL" --data.task toy --rollout.backend vllm \
    --async-training.no-colocated --async-training.staleness-threshold 0.5 --async-training.total-versions 6 \
    --rollout.n 8 --rollout.max-new-tokens 128 --trainer.max-response-length 128 --rollout.max-prompt-length 64 \
    --rollout.max-slots 64 --trainer.mini-batch-size 8 --trainer.optim.lr 1e-6 \
    --rollout.vllm.gpu-memory-utilization 0.5 --run-dir "/tmp/run-$name" --wandb off --eval.every-versions 0 \
    --eval.no-at-start --eval.no-at-end --checkpoint-every 0 "$@" > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -E "engine ready|admitted|weights over|version 6|Error" "$OUT/$name.log" | tail -n 8
  cp "/tmp/run-$name/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
}

case "$STAGE" in
  bare)
    save_model /tmp/vtp-model
    bare agent 1 0 1      # what the agent asks for: sleep mode, CUDA graphs, vLLM's all-reduce choice
    bare no-sleep 0 0 1
    bare eager 1 1 1
    bare no-custom-ar 1 0 0 ;;
  engine)
    timeout "$LIMIT" python3 - "$MODEL" > "$OUT/engine.log" 2>&1 <<'PY'
import sys, time, torch
from asyncrl.config import VLLMConfig
from asyncrl.policies import EngineConfig, SamplingParams, load_model, named_weights
from asyncrl.policies.vllm_engine import build_vllm_engine
model = load_model(sys.argv[1], dtype=torch.bfloat16, device="cuda:0")  # as an agent: the model on its GPU first
start = time.time()
engine = build_vllm_engine(model, EngineConfig(max_slots=16, max_len=256), agent="probe",
                           options=VLLMConfig(tensor_parallel_size=2, gpu_memory_utilization=0.5))
print(f"engine ready in {time.time() - start:.1f} s")
params = SamplingParams(n=2, seed=1, max_new_tokens=16, ignore_eos=True)
first = engine.generate([list(range(3, 40))], params)[0].completions[0]
with torch.no_grad():
    engine.update_weights([(n, t * 1.01) for n, t in named_weights(model)], version=1)
second = engine.generate([list(range(3, 40))], params)[0].completions[0]
assert second.versions == [1] * 16, second.versions
print(f"ENGINE_OK v0 {first.token_ids[:8]} v1 {second.token_ids[:8]}")
PY
    echo "== engine (exit $?)"; grep -E "ENGINE_OK|engine ready|Error" "$OUT/engine.log" | tail -n 4 ;;
  own)
    run own --placement.trainer-devices cuda:0 --placement.agent-devices cuda:1 ;;
  tp-run)
    run tp-run --placement.trainer-devices cuda:0 --placement.agent-devices cuda:1 \
      --rollout.vllm.tensor-parallel-size 2 ;;
  tp-shared)
    run tp-shared --placement.trainer-devices cuda:0 --placement.agent-devices cuda:0 \
      --rollout.vllm.tensor-parallel-size 2 ;;
  *) echo "unknown stage $STAGE (bare | engine | own | tp-run | tp-shared)"; exit 2 ;;
esac
