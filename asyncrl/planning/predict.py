"""The split planner's model (`asyncrl plan`, and a running job's `plan/*` metrics): from measured throughputs,
what each way of placing trainer ranks and rollout agents on N GPUs sustains.

    shape = ModelShape.from_hf(hf_config("qwen2.5-0.5b"))      # parameters, KV bytes per token
    rates = Rates(learner_tok_s=63_000, learner_step_tokens=20_480, learner_budget=16_384,
                  engine=((64, 22_921.0), (256, 56_349.0)))    # `asyncrl bench learner` / `engine` rows
    result = plan(shape, WORKLOADS["gsm8k"], rates, gpus=2)    # every layout, and the best that fits
    result.best.trained_tok_s, result.best.knobs.staleness

Units: tokens/s, seconds, GiB (2**30 bytes). A sample is one response and its prompt; trained tokens count both
(as `perf/total_num_tokens` does). A learner step trains `mini_batch_size` groups of `n` samples; a version is
`trigger` steps and one publication. Assumptions, each one a measurement can overrule:

- the learner's tok/s does not depend on row length (packed micro-batches of one token budget) and scales
  over k FSDP2 ranks at the measured per-GPU efficiency of a compiled group (FSDP_GROUP);
- an engine's tok/s at b sequences decoded together is interpolated between measured batches: linear between
  them, the largest batch's tok/s above, each sequence at the smallest batch's speed below; KV length is ignored;
- every generated sample is trained; responses started together finish after the longest (`max_response_len`);
  the asynchronous layouts run with partial rollout;
- a publication stops both sides (the trainer publishes, agents are paused) for `sync_seconds`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

from asyncrl.planning.memory import GIB, engine_bytes, trainer_state_bytes

__all__ = ["ModelShape", "Workload", "WORKLOADS", "Rates", "Knobs", "Layout", "Prediction", "Plan",
           "engine_tok_s", "memory_gib", "sync_seconds", "layouts", "predict", "recommend", "plan", "layout_of",
           "timeline", "trainer_scale", "group_efficiency", "ADVICE_GAIN"]

Kind = Literal["split", "shared", "colocated"]
SYNC_BYTES_PER_S = {"split": 75e9, "shared": 0.55e9, "colocated": 7e9}
"""A whole publication (docs/benchmarks/: async-2xh200-2026-11-23.md, one-gpu-h100-2026-11-26.md,
lora-h100-2026-11-26.md): 0.99 GB of bf16 weights over NCCL from trainer GPU to agent GPU in 13 ms; trainer and
agent on one GPU through host memory over gloo at 0.52-0.57 GB/s (0.5B, 1.7B, 8B shapes); colocated ranks gather
from FSDP2 and copy in-process in 87-137 ms."""
GPU_BUSY_LEARNER, GPU_BUSY_ENGINE = 0.56, 0.78
"""The share of its time each side keeps a GPU busy (both are host-bound): a learner step 47-66 % (docs/limits.md);
a decode step ~1 ms of host work in 4.54 ms (docs/benchmarks/archive/engine-h100-2026-11-22.md, batch 256). On one shared GPU the two run at
once, slowed only where their summed demand exceeds the GPU."""
FSDP_GROUP = {2: 0.82, 4: 0.66}
"""Per-GPU learner speed of a k-rank FSDP2 group (compiled layers, bf16 layer gathers, groups dealt by tokens) over
one compiled process, measured at the Qwen3-1.7B shape on 4 x H100 (docs/benchmarks/one-node-4xh100-2026-11-27.md:
one process ~38,400 tok/s; 2 ranks 31,410 a GPU; 4 ranks 25,248). Other k: linear in log2 k between and beyond
the measured points (`group_efficiency`)."""
ACTIVATION_BYTES = 32
"""Learner memory above its states, per micro-batch token, layer and hidden unit, where no peak was measured: the
0.5B shape peaked 9-11 GiB above its 7.4 GiB of states at a 16,384 budget (rough: 9.5 GiB at 8,192)."""
MIN_GAIN = 0.05
"""Staleness is recommended only where it raises predicted trained tok/s by at least this fraction."""
ADVICE_GAIN = 0.10
"""A running job names another split only where it predicts at least this much more trained tok/s
(`asyncrl.runtime.plan_view`)."""


_WINDOWED = ("sliding_attention", "chunked_attention")
_FULL = ("full_attention", "attention")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model's parameter count and the sizes behind its KV cache and LoRA adapters."""

    params: int
    layers: int
    hidden: int
    attention_width: int  # heads x head_dim
    kv_width: int  # KV heads x head_dim
    intermediate: int
    vocab: int
    kv_layers: int | None = None  # layers whose K/V grows with the sequence (None: every layer)
    window_layers: int = 0  # sliding-window layers: K/V of their last `window` tokens at most
    window: int = 0
    adapter_width: int | None = None  # Σ (in + out) over every layer LoRA adapts (None: the seven projections)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelShape":
        """From a Hugging Face config dict, counting what the model holds (Qwen2's q/k/v biases, Qwen3's q/k
        norms, a tied or separate LM head); a type asyncrl does not implement: `from_transformers`."""
        from asyncrl.policies.model import SUPPORTED_MODEL_TYPES
        if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
            return cls.from_transformers(cfg)
        hidden, inter, layers, vocab = (int(cfg[k]) for k in ("hidden_size", "intermediate_size",
                                                               "num_hidden_layers", "vocab_size"))
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        width, kv = heads * head_dim, int(cfg.get("num_key_value_heads") or heads) * head_dim
        bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False))
        per_layer = (2 * hidden * width + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
                     + (width + 2 * kv if bias else 0) + (2 * head_dim if cfg.get("model_type") == "qwen3" else 0))
        lm_heads = 1 if cfg.get("tie_word_embeddings", False) else 2
        return cls(layers * per_layer + hidden + lm_heads * vocab * hidden, layers, hidden, width, kv, inter, vocab)

    @classmethod
    def from_transformers(cls, cfg: dict) -> ModelShape:
        """Of any causal LM transformers implements, from its model built on the meta device (no memory, no
        weights): the parameter count exact (tied weights once, every expert), the adapters over every layer
        all-linear adapts (`asyncrl.policies.lora`), and K/V by layer type: `layer_types`' full-attention layers
        grow with the sequence, sliding-window ones hold their window at most, a hybrid's linear-attention or SSM
        layers hold none; a config without `layer_types` counts every layer as full attention (MLA caches less
        than its heads × head_dim: an upper bound there). Raises ValueError where transformers builds no model."""
        from asyncrl.policies.lora import lora_candidates, lora_layers
        from asyncrl.policies.meta_model import meta_transformers, text_config
        model = meta_transformers(cfg)
        text = text_config(model)
        hidden, layers, heads = int(text.hidden_size), int(text.num_hidden_layers), int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        types = list(getattr(text, "layer_types", None) or ["full_attention"] * layers)
        window = int(getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None) or 0)
        windowed = sum(t in _WINDOWED for t in types) if window else 0
        full = sum(t in _FULL or (t in _WINDOWED and not window) for t in types)
        adapted = [model.get_submodule(name) for name in lora_layers(model, lora_candidates(model))]
        return cls(params=sum(p.numel() for p in model.parameters()), layers=layers, hidden=hidden,
                   attention_width=heads * head_dim,
                   kv_width=int(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
                   intermediate=int(getattr(text, "intermediate_size", None) or 0), vocab=int(text.vocab_size),
                   kv_layers=full, window_layers=windowed, window=window,
                   adapter_width=sum(m.in_features + m.out_features for m in adapted))

    def lora_params(self, rank: int) -> int:
        """Adapter parameters at `rank` on every adapted layer (asyncrl's own models: the seven projections):
        rank x (in + out) each."""
        if self.adapter_width is not None:
            return rank * self.adapter_width
        h = self.hidden
        per_layer = 2 * (h + self.attention_width) + 2 * (h + self.kv_width) + 3 * (h + self.intermediate)
        return rank * self.layers * per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of bf16 K and V that one token holds in an engine's cache, in the layers whose cache grows with
        the sequence (sliding-window layers: `kv_bytes`)."""
        return 2 * (self.layers if self.kv_layers is None else self.kv_layers) * self.kv_width * 2

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of bf16 K and V one sequence of `tokens` holds: every growing layer's, and the sliding-window
        layers' for the last `window` tokens at most."""
        return tokens * self.kv_bytes_per_token + min(tokens, self.window) * self.window_layers * self.kv_width * 4


@dataclasses.dataclass(frozen=True)
class Workload:
    """Tokens of one sample: the means (what throughput sees) and the run's limits (what memory sees)."""

    prompt_len: float
    response_len: float
    max_prompt_len: int
    max_response_len: int

    @property
    def row_tokens(self) -> float:
        return self.prompt_len + self.response_len


WORKLOADS = {
    # GSM8K prompts in SmolLM2's chat template (107 tokens mean); a random-weight model runs every response to
    # the 1,024-token limit, as in the bench's GSM8K rows
    "gsm8k": Workload(107, 1024, 512, 1024),
    "ragged": Workload(288, 1040, 512, 2048),  # `bench learner --workload ragged`: uniform 64-512 / 32-2048
}


@dataclasses.dataclass(frozen=True)
class Rates:
    """Measured throughputs: the learner's on one trainer GPU, the engine's on one agent GPU."""

    learner_tok_s: float  # trained tokens (prompt + response) per second
    learner_step_tokens: float  # tokens of the step it was measured on
    learner_budget: int  # its max_tokens_per_micro_batch
    engine: tuple[tuple[float, float], ...]  # (sequences decoded together, generated tok/s), one per batch
    learner_peak_gib: float | None = None  # its peak memory, where measured
    learner_compiled: bool = False  # measured with compiled layers (CUDA), which a 2+ rank group does not run


@dataclasses.dataclass(frozen=True)
class Knobs:
    """The run's knobs the prediction depends on (verl's names; `asyncrl train` flags in `asyncrl.planning.command`)."""

    mini_batch_size: int  # groups per learner step
    staleness: float  # verl's staleness_threshold
    trigger: int  # learner steps per publication
    n: int  # samples per prompt
    slots: int  # sequences one engine decodes together at most


@dataclasses.dataclass(frozen=True)
class Layout:
    """split: k trainer GPUs and `agent_gpus` others, an agent on each; shared: trainer and one agent on one GPU;
    colocated: synchronous, each of the k trainer ranks hosting an engine on its GPU."""

    kind: Kind
    trainer_gpus: int
    agent_gpus: int

    @property
    def name(self) -> str:
        if self.kind == "split":
            return f"{self.trainer_gpus} trainer + {self.agent_gpus} agent"
        return f"colocated sync ({self.trainer_gpus})" if self.kind == "colocated" else "trainer + agent, 1 GPU"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One layout run with `knobs`, as `predict` sees it (tokens/s, seconds, GiB)."""

    layout: Layout
    knobs: Knobs
    trained_tok_s: float
    trainer_capacity_tok_s: float  # what the trainer GPUs alone would train
    rollout_capacity_tok_s: float  # trained tok/s the engines alone would feed (at `engine_batch`)
    trainer_idle: float  # as trainer/idle_ratio: waiting for samples / version time
    rollout_idle: float  # as rollouter/idle_ratio: 1 - engine busy / version time
    version_s: float
    sync_s: float  # one publication
    engine_batch: float  # sequences one engine decodes together
    trainer_gib: float  # peak per trainer GPU (shared, colocated: per GPU, both sides)
    agent_gib: float  # peak per agent GPU (0: no GPU of their own)
    fits: bool
    budget: int  # the learner's max_tokens_per_micro_batch it assumes


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every layout of a number of GPUs, predicted with its recommended knobs."""

    predictions: tuple[Prediction, ...]
    best: Prediction | None  # the highest trained tok/s that fits in memory; None if nothing fits


def engine_tok_s(points: tuple[tuple[float, float], ...], batch: float) -> float:
    """Generated tok/s of one engine decoding `batch` sequences, from measured (batch, tok/s) points."""
    pts = sorted(points)
    if batch <= pts[0][0]:
        return pts[0][1] * batch / pts[0][0]
    for (b0, e0), (b1, e1) in zip(pts, pts[1:]):
        if batch <= b1:
            return e0 + (e1 - e0) * (batch - b0) / (b1 - b0)
    return pts[-1][1]


def group_efficiency(k: int) -> float:
    """Per-GPU speed of a k-rank trainer group over one compiled process (`FSDP_GROUP`; 1.0 for k = 1), linear in
    log2 k through the measured points, at least 0.25."""
    if k <= 1:
        return 1.0
    if k in FSDP_GROUP:
        return FSDP_GROUP[k]
    (k1, e1), (k2, e2) = sorted(FSDP_GROUP.items())[:2]
    slope = (e2 - e1) / (math.log2(k2) - math.log2(k1))
    return max(0.25, e1 + slope * (math.log2(k) - math.log2(k1)))


def trainer_scale(k: int, compiled: bool) -> float:
    """A group of k trainer GPUs trains this many times one GPU's measured tok/s (`compiled`: the measured GPU
    compiled its layers, as the group does; an eager measurement scales linearly)."""
    return k * (group_efficiency(k) if compiled else 1.0)


def _trainer_tok_s(rates: Rates, k: int) -> float:
    return rates.learner_tok_s * trainer_scale(k, rates.learner_compiled)


def memory_gib(shape: ModelShape, work: Workload, rates: Rates, layout: Layout, slots: int, *,
               trainer_dtype: str = "float32", lora_rank: int = 0, offload: str = "none", kv_layout: str = "slot",
               n: int = 8) -> tuple[float, float]:
    """(per trainer GPU, per agent GPU) peak GiB. Trainer: weights, grads and AdamW states (16 bytes a parameter in
    fp32, 8 in bf16; LoRA: a bf16 base and 16 bytes an adapter parameter; `--trainer.offload optimizer`: the
    weights and grads alone, 8 or 4 bytes; `params`: none of them stay) sharded over its ranks, plus activations
    that do not shard (a measured peak above the states, else ACTIVATION_BYTES). Engine: bf16 weights (twice with
    LoRA: it merges from a kept base), the KV cache of `slots` full-length sequences, fp32 logits and
    ENGINE_OVERHEAD_GIB (`kv_layout="shared-prompt"`: responses for every slot and a prompt for every n of them).
    Shared: both on one GPU. Colocated: the KV cache is freed while training (`colocated_sleep`), so it shares its
    memory with the activations."""
    states = trainer_state_bytes(shape, param_dtype=trainer_dtype, lora_rank=lora_rank, offload=offload)
    activations = (max(rates.learner_peak_gib * GIB - states, 0.0) if rates.learner_peak_gib is not None
                   else ACTIVATION_BYTES * rates.learner_budget * shape.layers * shape.hidden)
    shared = kv_layout == "shared-prompt"
    parts = engine_bytes(shape, slots=slots, tokens=work.max_response_len + (0 if shared else work.max_prompt_len),
                         lora=bool(lora_rank), full_base_copy=True)
    if shared:
        parts = dataclasses.replace(parts, kv_cache=parts.kv_cache + max(slots // n, 1) * shape.kv_bytes(
            work.max_prompt_len))
    cache, weights, overhead = parts.kv_cache + parts.logits, parts.weights, parts.overhead
    trainer = states / layout.trainer_gpus + activations
    if layout.kind == "colocated":
        return (trainer - activations + weights + max(activations, cache) + overhead) / GIB, 0.0
    engine = weights + cache + overhead
    return ((trainer + engine) / GIB, 0.0) if layout.kind == "shared" else (trainer / GIB, engine / GIB)


def sync_seconds(shape: ModelShape, kind: Kind, lora_rank: int = 0) -> float:
    """One publication: the bf16 weights (LoRA: the fp32 adapters alone) at SYNC_BYTES_PER_S[kind]."""
    return (4 * shape.lora_params(lora_rank) if lora_rank else 2 * shape.params) / SYNC_BYTES_PER_S[kind]


def layouts(gpus: int) -> tuple[Layout, ...]:
    """Every layout of `gpus` GPUs: k trainer + (gpus - k) agent GPUs, colocated sync on all of them, and on one
    GPU trainer and agent sharing it."""
    splits = tuple(Layout("split", k, gpus - k) for k in range(1, gpus))
    return splits + (Layout("colocated", gpus, gpus),) + ((Layout("shared", 1, 1),) if gpus == 1 else ())


def timeline(kind: Kind, train_s: float, gen_s: float, sync_s: float,
             wait_s: float = 0.0) -> tuple[float, float, float]:
    """(version seconds, trainer idle, rollout idle) of a version in which the trainer group alone would be busy
    `train_s` and each engine alone `gen_s`. Colocated: one after the other, then the sync. Split: at once, the
    slower side setting the pace, plus `wait_s` lost at the version boundary and the sync. Shared: as split, both
    sides slowed by their GPU demand beyond one GPU (GPU_BUSY_*)."""
    if kind == "colocated":
        version = train_s + gen_s + sync_s
        return version, gen_s / version, 1.0 - gen_s / version
    slower = max(train_s, gen_s)
    stretch = max(1.0, (GPU_BUSY_LEARNER * train_s + GPU_BUSY_ENGINE * gen_s) / slower) if kind == "shared" else 1.0
    version = stretch * (slower + wait_s) + sync_s
    return version, max(0.0, 1.0 - (stretch * train_s + sync_s) / version), max(0.0, 1.0 - stretch * gen_s / version)


def _boundary_wait(train_step: float, gen_step: float, wave: float, ahead: int) -> float:
    """Seconds lost at a version boundary with `ahead` whole learner steps of prompts admitted in advance. With
    none, the slower side waits once a version: a trainer for the new version's first samples (an engine batch
    finishes with its longest response, `wave`), agents for the trainer to train what their last batch brought.
    Each step run ahead hides one step of the slower side."""
    first = max(gen_step, wave) * min(train_step, gen_step) / gen_step
    return max(0.0, first - ahead * max(train_step, gen_step))


class _Steps(NamedTuple):
    """One learner step's seconds on each side alone, and what they follow from."""

    steps: int  # learner steps per version
    window: int  # prompts admitted per version
    batch: float  # sequences one engine decodes together
    gen_tok_s: float  # one engine's tok/s at that batch
    train: float  # seconds the trainer group needs for a step's samples
    gen: float  # seconds the engines need to generate them (response_len each)
    wave: float  # seconds an engine batch takes to finish (max_response_len)


def _step_times(work: Workload, rates: Rates, layout: Layout, knobs: Knobs) -> _Steps:
    """An engine decodes what the admission window lets it hold: min(slots, window x n / engines) sequences, with
    window = int(mini_batch_size x (1 + staleness) x trigger) prompts (verl's rule); colocated sync runs staleness 0
    and trigger 1."""
    steps, staleness = (1, 0.0) if layout.kind == "colocated" else (knobs.trigger, knobs.staleness)
    samples = knobs.mini_batch_size * knobs.n
    window = int(knobs.mini_batch_size * (1 + staleness) * steps)
    batch = min(knobs.slots, window * knobs.n / layout.agent_gpus)
    gen = engine_tok_s(rates.engine, batch)
    return _Steps(steps, window, batch, gen, samples * work.row_tokens / _trainer_tok_s(rates, layout.trainer_gpus),
                  samples * work.response_len / (layout.agent_gpus * gen), work.max_response_len * batch / gen)


def _ahead_steps(knobs: Knobs) -> int:
    """Whole learner steps of prompts the admission window holds beyond the version's own (the trainer takes
    whole steps, so a part of one does not count)."""
    window = int(knobs.mini_batch_size * (1 + knobs.staleness) * knobs.trigger)
    return (window - knobs.mini_batch_size * knobs.trigger) // knobs.mini_batch_size


def predict(shape: ModelShape, work: Workload, rates: Rates, layout: Layout, knobs: Knobs, *,
            trainer_dtype: str = "float32", lora_rank: int = 0, offload: str = "none", gpu_gib: float = 79.0,
            kv_layout: str = "slot") -> Prediction:
    """Trained tok/s, idle fractions, publication time and memory per GPU of `layout` run with `knobs`. Colocated
    sync generates a step's samples in waves of `slots`, each lasting until its longest response."""
    t = _step_times(work, rates, layout, knobs)
    sync = sync_seconds(shape, layout.kind, lora_rank)
    if layout.kind == "colocated":
        waves = math.ceil(knobs.mini_batch_size * knobs.n / layout.agent_gpus / t.batch - 1e-9)
        version, trainer_idle, rollout_idle = timeline("colocated", t.train, waves * t.wave, sync)
    else:
        ahead = _ahead_steps(knobs)
        version, trainer_idle, rollout_idle = timeline(layout.kind, t.steps * t.train, t.steps * t.gen, sync,
                                                        _boundary_wait(t.train, t.gen, t.wave, ahead))
    trainer_gib, agent_gib = memory_gib(shape, work, rates, layout, knobs.slots, trainer_dtype=trainer_dtype,
                                        lora_rank=lora_rank, offload=offload, kv_layout=kv_layout, n=knobs.n)
    return Prediction(layout, knobs, t.steps * knobs.mini_batch_size * knobs.n * work.row_tokens / version,
                      _trainer_tok_s(rates, layout.trainer_gpus),
                      layout.agent_gpus * t.gen_tok_s * work.row_tokens / work.response_len, trainer_idle, rollout_idle,
                      version, sync, t.batch, trainer_gib, agent_gib, max(trainer_gib, agent_gib) <= gpu_gib,
                      rates.learner_budget)


def recommend(shape: ModelShape, work: Workload, rates: Rates, layout: Layout, *, n: int = 8, slots: int = 256,
              trigger: int = 4, mini_batch_size: int | None = None, staleness: float | None = None, **kw) -> Knobs:
    """Knobs for `layout`, keeping the given ones. Mini-batch: the fewest groups that give each trainer rank the
    tokens of the step its tok/s was measured on and let the admission window fill every engine's slots without
    staleness. Staleness: the fewest whole learner steps run ahead that hide the version-boundary wait
    (`_boundary_wait`), as staleness = steps / trigger rounded up to 0.01; 0 where that raises trained tok/s by
    less than MIN_GAIN (one side so much faster that the other's wait hardly shows); colocated sync: 0, trigger 1."""
    steps = 1 if layout.kind == "colocated" else trigger
    fill_learner = math.ceil(layout.trainer_gpus * rates.learner_step_tokens / (n * work.row_tokens))
    fill_engines = math.ceil(slots * layout.agent_gpus / (steps * n))
    base = Knobs(mini_batch_size or max(fill_learner, fill_engines, 1), 0.0, steps, n, slots)
    if layout.kind == "colocated" or staleness is not None:
        return base if layout.kind == "colocated" else dataclasses.replace(base, staleness=staleness)
    t = _step_times(work, rates, layout, base)
    ahead = max(1, math.ceil(_boundary_wait(t.train, t.gen, t.wave, 0) / max(t.train, t.gen) - 1e-9))
    stale = dataclasses.replace(base, staleness=math.ceil(100 * ahead / steps - 1e-9) / 100)
    while _ahead_steps(stale) < ahead:  # int() of a product that rounded down
        stale = dataclasses.replace(stale, staleness=round(stale.staleness + 0.01, 2))
    gain = (predict(shape, work, rates, layout, stale, **kw).trained_tok_s
            / predict(shape, work, rates, layout, base, **kw).trained_tok_s)
    return stale if gain >= 1 + MIN_GAIN else base


def plan(shape: ModelShape, work: Workload, rates: Rates, gpus: int, *, n: int = 8, slots: int = 256,
         trigger: int = 4, mini_batch_size: int | None = None, staleness: float | None = None,
         trainer_dtype: str = "float32", lora_rank: int = 0, offload: str = "none", gpu_gib: float = 79.0,
         kv_layout: str = "slot") -> Plan:
    """Every layout of `gpus` GPUs predicted with its recommended knobs (`recommend`); the best one that fits.
    With `offload="optimizer"` only layouts of one trainer GPU (a trainer group shards the state instead)."""
    kw = dict(trainer_dtype=trainer_dtype, lora_rank=lora_rank, offload=offload, gpu_gib=gpu_gib, kv_layout=kv_layout)
    predictions = tuple(predict(shape, work, rates, layout, recommend(
        shape, work, rates, layout, n=n, slots=slots, trigger=trigger, mini_batch_size=mini_batch_size,
        staleness=staleness, **kw), **kw) for layout in layouts(gpus)
        if offload != "optimizer" or layout.trainer_gpus == 1)
    fitting = [p for p in predictions if p.fits]
    return Plan(predictions, max(fitting, key=lambda p: p.trained_tok_s) if fitting else None)


def layout_of(trainer_devices: list[str], agent_devices: list[str], colocated: bool) -> Layout:
    """The layout of a run's devices: colocated; split where every agent has a device of its own; else shared."""
    if colocated:
        return Layout("colocated", len(trainer_devices), len(trainer_devices))
    apart = not set(trainer_devices) & set(agent_devices) and len(set(agent_devices)) == len(agent_devices)
    return Layout("split" if apart else "shared", len(trainer_devices), len(agent_devices))
