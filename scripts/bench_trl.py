"""Peer baseline: TRL's `GRPOTrainer` on GSM8K, timed per optimizer step.

Runs TRL's synchronous GRPO loop (transformers `generate`, no vLLM) with the hyperparameters of our GSM8K
benchmark and measures, per optimizer step, the wall time from `on_step_begin` to `on_step_end` (CUDA
synchronised): one generation round for the step's `prompts-per-step × n` completions, the reward, the
advantage, the forward/backward passes over all micro-batches and the optimizer step. The first
`--warmup-steps-excluded` steps are left out of the summary. Tokens come from TRL's own counters:
`num_input_tokens_seen` (prompt + completion tokens of every trained sequence, padding excluded, gathered
over all processes) and `completions/mean_length` (gathered over all processes).

    # CPU smoke run
    python scripts/bench_trl.py --model DIR --data tests/fixtures/gsm8k/test.jsonl \
        --steps 2 --prompts-per-step 2 --n 2 --max-completion-length 16 --out trl.json
    # 2 GPUs, data parallel (one process per GPU)
    torchrun --nproc-per-node 2 scripts/bench_trl.py --model /models/Qwen2.5-0.5B-Instruct \
        --data gsm8k/train.jsonl --num-generations 8 --bf16 --gradient-checkpointing --out trl.json

(torchrun takes `--n` for an abbreviation of its own options, hence `--num-generations` there.)

Needs `trl` (not an asyncrl dependency, so this is a script outside the test suite: without TRL it stops at
once, saying how to install it). TRL-specific choices are commented where the config is built;
tests/bench/test_bench_trl.py checks what needs no TRL (arguments, batch geometry, prompts, reward, summary).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from asyncrl.data.files import GSM8K_INSTRUCTION  # noqa: E402
from asyncrl.rewards import gsm8k_ground_truth, gsm8k_reward  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--data", required=True, help='GSM8K jsonl: {"question": ..., "answer": "... #### 42"}')
    p.add_argument("--n", "--num-generations", dest="n", type=int, default=8,
                   help="completions per prompt (under torchrun spell it --num-generations: torchrun rejects --n)")
    p.add_argument("--prompts-per-step", type=int, default=32, help="prompts per optimizer step, all processes")
    p.add_argument("--per-device-batch-size", type=int, default=8,
                   help="completions per forward/backward micro-batch and process (capped at the step's share)")
    p.add_argument("--max-completion-length", type=int, default=1024)
    p.add_argument("--max-prompt-length", type=int, default=512, help="longer chat-templated prompts are dropped")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup-steps-excluded", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON result path (written by rank 0)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps_excluded:
        p.error("--steps must exceed --warmup-steps-excluded")
    return args


def require_trl() -> None:
    """Stop with the fix when TRL (or the `datasets` it brings) is not installed."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"scripts/bench_trl.py needs TRL, which asyncrl does not depend on ({err}); install it "
                         f"into this environment: {sys.executable} -m pip install trl") from None


def step_geometry(args: argparse.Namespace, world: int) -> tuple[int, int, int]:
    """(completions per optimizer step, completions per micro-batch and process, micro-batches per step): the
    step's prompts-per-step × n completions split evenly over `world` processes and whole micro-batches."""
    completions_per_step = args.prompts_per_step * args.n
    if completions_per_step % world:
        raise SystemExit(f"prompts-per-step × n = {completions_per_step} is not divisible by {world} processes")
    per_process = completions_per_step // world
    micro = min(args.per_device_batch_size, per_process)
    if per_process % micro:
        raise SystemExit(f"{per_process} completions per process are not divisible by micro-batch {micro}")
    return completions_per_step, micro, per_process // micro


def load_prompts(path: str, tokenizer, max_prompt_length: int) -> list[dict]:
    """GSM8K rows as TRL conversational prompts, phrased as `asyncrl data convert-gsm8k` does. TRL 1.16 has no
    max_prompt_length, so prompts longer than it are dropped here (our `on_long="filter"`)."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = [{"role": "user", "content": f"{row['question']} {GSM8K_INSTRUCTION}"}]
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= max_prompt_length:
                rows.append({"prompt": prompt, "ground_truth": gsm8k_ground_truth(row["answer"])})
    if not rows:
        raise SystemExit(f"{path}: no prompt fits in {max_prompt_length} tokens")
    return rows


def gsm8k(completions, ground_truth, **_) -> list[float]:
    """TRL reward function: our strict GSM8K reward on the decoded completion text."""
    return [gsm8k_reward(c[0]["content"] if isinstance(c, list) else c, truth)
            for c, truth in zip(completions, ground_truth)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _grpo_config(args: argparse.Namespace, micro: int, accumulation: int):
    """TRL's GRPOConfig for our hyperparameters (the TRL-specific choices are commented)."""
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        # Batch geometry: one optimizer step = per_device_train_batch_size × processes × accumulation
        # = prompts-per-step × n completions, and steps_per_generation = accumulation makes the generation
        # batch that same size, so each step runs exactly one generation round (num_iterations=1: no reuse).
        num_generations=args.n,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_iterations=1,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature, top_p=1.0, top_k=0,
        # Loss: "dapo" sums the clipped per-token losses and divides by the number of completion tokens in
        # the whole step (gathered over processes and micro-batches) = verl's loss_agg_mode "token-mean" over
        # the optimizer batch. Advantages: (r - group mean) / group std ("group" scaling), as GRPO.
        loss_type="dapo", scale_rewards="group",
        epsilon=0.2, epsilon_high=0.28,
        beta=0.0,  # no KL term, so TRL loads no reference model
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=1.0,
        # TRL defaults bf16 and gradient checkpointing to True; set both explicitly. Weights stay fp32 (TRL's
        # default load dtype), bf16 is autocast, for training and for `generate` alike.
        bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing,
        use_vllm=False, use_cpu=not torch.cuda.is_available(),  # use_cpu: torchrun on CPU runs DDP over gloo
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; True costs a graph walk per step
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
        seed=args.seed, disable_tqdm=True,
    )


def _step_timer():
    """A TrainerCallback timing each optimizer step (CUDA synchronised) and collecting TRL's logs."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.total_tokens, self.logs, self.generate_s = [], [], [], []
            self._gen = 0.0

        def on_step_begin(self, _args, state, control, **kw):
            _sync()
            self._tokens0, self._gen, self._t0 = state.num_input_tokens_seen, 0.0, time.perf_counter()

        def on_step_end(self, _args, state, control, **kw):
            _sync()
            self.seconds.append(time.perf_counter() - self._t0)
            self.total_tokens.append(int(state.num_input_tokens_seen - self._tokens0))
            self.generate_s.append(self._gen)

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    return StepTimer()


def _summary(args: argparse.Namespace, timer, world: int, completions_per_step: int, prompts: int,
             micro: int, accumulation: int) -> dict:
    """The JSON result: per-step lists, and medians / rates over the timed steps."""
    import transformers
    import trl
    skip = args.warmup_steps_excluded
    mean_len = [log["completions/mean_length"] for log in timer.logs]
    completion_tokens = [round(m * completions_per_step) for m in mean_len]
    timed = sum(timer.seconds[skip:])
    result = {
        "tool": "trl", "trl_version": trl.__version__,
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "world_size": world,
        "steps": timer.seconds,
        "time_per_step_s": statistics.median(timer.seconds[skip:]),
        "completion_tokens_per_s": sum(completion_tokens[skip:]) / timed,
        "total_tokens_per_s": sum(timer.total_tokens[skip:]) / timed,
        "completion_tokens": completion_tokens,
        "total_tokens": timer.total_tokens,
        "generate_s_rank0": timer.generate_s,
        "mean_completion_length": mean_len,
        "clipped_ratio": [log.get("completions/clipped_ratio") for log in timer.logs],
        "grad_norm": [log.get("grad_norm") for log in timer.logs],
        "reward_mean": [log.get("reward") for log in timer.logs],
        "config": {**{k: v for k, v in vars(args).items() if k != "out"},
                   "completions_per_step": completions_per_step, "per_device_train_batch_size": micro,
                   "gradient_accumulation_steps": accumulation, "steps_per_generation": accumulation,
                   "num_iterations": 1, "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28,
                   "beta": 0.0, "prompts_in_dataset": prompts},
    }
    print(f"trl {trl.__version__} world={world}: {result['time_per_step_s']:.2f} s/step (median of "
          f"{args.steps - skip}), {result['completion_tokens_per_s']:.1f} completion tok/s, "
          f"{result['total_tokens_per_s']:.1f} total tok/s, mean completion length "
          f"{statistics.mean(mean_len[skip:]):.1f}, mean reward "
          f"{statistics.mean(r or 0.0 for r in result['reward_mean'][skip:]):.3f}")
    return result


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    completions_per_step, micro, accumulation = step_geometry(args, world)
    require_trl()
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    if torch.cuda.is_available():
        # on torch 2.11 (H200), TRL's masked, left-padded batches got NaN gradients from the cuDNN SDPA backward
        # (anomaly detection named ScaledDotProductCudnnAttentionBackward0) and then crashed in sampling; the
        # memory-efficient kernel is correct on those inputs.
        torch.backends.cuda.enable_cudnn_sdp(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_list(load_prompts(args.data, tokenizer, args.max_prompt_length))

    config = _grpo_config(args, micro, accumulation)
    if config.world_size != world:
        raise SystemExit(f"WORLD_SIZE={world} but the trainer sees {config.world_size} processes")

    timer = _step_timer()
    trainer = GRPOTrainer(model=args.model, reward_funcs=gsm8k, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])

    generate = trainer._generate_single_turn  # this process's share of the step's generation round

    def timed_generate(*a, **kw):
        _sync()
        start = time.perf_counter()
        out = generate(*a, **kw)
        _sync()
        timer._gen += time.perf_counter() - start
        return out

    trainer._generate_single_turn = timed_generate
    trainer.train()

    if not trainer.accelerator.is_main_process:
        return None
    result = _summary(args, timer, world, completions_per_step, len(dataset), micro, accumulation)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
