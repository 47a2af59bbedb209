"""Evaluate a policy on a task: mean reward, pass@k and response length (`asyncrl eval ...`).

    asyncrl eval --model smollm2 --data.task arithmetic --num-prompts 32 --n 4 --k 1 4
    asyncrl eval runs/cpu-demo --data.task arithmetic          # the run's newest checkpoint (or --model RUN_DIR)
    asyncrl eval --model runs/cpu-demo/checkpoints/step_00000012 --data.task arithmetic --out eval.json

    result = evaluate("smollm2", DataConfig(task="arithmetic"), num_prompts=32, n=4, k=(1, 4))

`model` is anything `load_model` opens (an HF directory, a .gguf, 'smollm2', 'random:<preset>'; an
`asyncrl export --merged` directory too), a run directory (`--run-dir` of `asyncrl train`: its newest
checkpoint is taken, and a line says which) or a checkpoint directory `RUN/checkpoints/step_XXXXXXXX`, which is
exported to a temporary HF directory first (a LoRA checkpoint merged with its base: the run's --model.path,
or `base`); its tokenizer comes from the run's config.json (the model path it trained from) unless
`tokenizer` is given. The toy task uses no tokenizer (its prompts and rewards are token ids).

Prompts and rewards are the training ones (`SourceFactory` / `ScorerFactory`): prompts `first_prompt`
... `first_prompt + num_prompts - 1` of the task. Use another `data.seed` (or a `first_prompt` past what
the run consumed) for prompts the run never saw, and the run's data settings (e.g. `--data.system-prompt`,
see its config.json) to score it as it was trained.

Each prompt gets `n` samples from the embedded engine. A sample is *correct* when its reward reaches
`success_threshold` (1.0: the 0/1 task rewards). pass@k is the unbiased estimator from n samples with c
correct, 1 − C(n−c, k) / C(n, k), averaged over prompts.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile
import time
from typing import Annotated, Literal, Sequence

import torch
import tyro
from tqdm import tqdm

from asyncrl.checkpoint import export_hf, list_checkpoints, run_hub, run_model
from asyncrl.config import DataConfig
from asyncrl.config.speculation import SpeculationConfig
from asyncrl.tools.hub import dataset_name, local_model_path, resolve_dataset
from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model
from asyncrl.launch.device_checks import check_devices
from asyncrl.launch.model_checks import check_model_path
from asyncrl.launch.run_spec import ScorerFactory, SourceFactory
from asyncrl.runtime.evaluation import pass_at_k
from asyncrl.tools.seeding import derive_seed
from asyncrl.tracking.console import phase

__all__ = ["pass_at_k", "evaluate", "EvalArgs", "eval_main", "is_checkpoint", "is_run_dir", "resolve_checkpoint"]

_RUN_MARKS = ("checkpoints", "metrics.jsonl", "summary.json", "processes.json")
"""What only a run directory holds (an HF model directory has a config.json too)."""


def is_checkpoint(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / "learner.pt").is_file()


def is_run_dir(path: str | pathlib.Path) -> bool:
    """Whether `path` is a run directory (`asyncrl train --run-dir`): it holds checkpoints/, a run's metrics,
    summary or process list, or a config.json that is a run's."""
    path = pathlib.Path(path)
    if not path.is_dir() or is_checkpoint(path):
        return False
    if any((path / name).exists() for name in _RUN_MARKS):
        return True
    try:
        return "async_training" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def resolve_checkpoint(path: str, argument: str) -> tuple[str, str | None]:
    """What a command reads from `path`: a run directory's newest checkpoint, with a line saying which; anything
    else as it is (None). A run directory without a checkpoint raises ValueError naming `argument` (the
    command-line argument `path` came from) and the fix."""
    if not is_run_dir(path):
        return path, None
    found = list_checkpoints(path)
    if not found:
        raise ValueError(f"{argument} {path}: the run directory holds no checkpoint yet (a run writes one every "
                         "--checkpoint-every versions and when it ends); give a run directory that holds one, or a "
                         "checkpoint directory RUN/checkpoints/step_XXXXXXXX")
    return str(found[-1]), (f"{argument} {path}: taking its newest checkpoint, {found[-1].name} "
                            f"({len(found)} in the run)")


def _run_model_path(checkpoint: pathlib.Path) -> str | None:
    """Where the run that wrote `checkpoint` took its tokenizer from (its config.json: --model.tokenizer, else
    --model.path), if recorded."""
    config = checkpoint.resolve().parent.parent / "config.json"
    if not config.is_file():
        return None
    try:
        model = json.loads(config.read_text())["model"]
        return model.get("tokenizer") or model["path"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_source(model: str, tokenizer: str | None, data: DataConfig) -> str:
    """What SourceFactory / ScorerFactory load the tokenizer from ('random:...' means none)."""
    if data.task == "toy":
        return "random:"  # token-level prompts and rewards: the scorer must see ids, not decoded text
    if tokenizer is not None:
        source = local_model_path(tokenizer, "--tokenizer")
    elif is_checkpoint(model):
        source = _run_model_path(pathlib.Path(model))
        if source is None:
            raise ValueError(f"--model {model}: the checkpoint has no run config.json next to its checkpoints/ "
                             "directory to take the tokenizer from; pass --tokenizer PATH")
        field = "model.tokenizer" if (run_model(model) or {}).get("tokenizer") else "model.path"
        source = local_model_path(source, "the run's --" + field, run_hub(model, field))
    else:
        source = model
    if source.startswith("random:") or (pathlib.Path(source).is_dir() and not any(
            (pathlib.Path(source) / name).is_file() for name in _TOKENIZER_FILES)):
        raise ValueError(f"--data.task {data.task}: needs a tokenizer but {source} has none; pass "
                         "--tokenizer smollm2 (or an HF directory with tokenizer files) or use --data.task toy")
    return source


def _check_model(model: str) -> None:
    """A model path that does not exist (or is no model) fails here, naming --model, before anything loads."""
    if is_checkpoint(model):
        return
    path = pathlib.Path(model)
    if path.parent.name == "checkpoints" and not path.exists():
        found = sorted(p.name for p in path.parent.glob("step_*") if p.is_dir()) if path.parent.is_dir() else []
        raise ValueError(f"--model {model}: no such checkpoint; "
                         + (f"{path.parent} holds {', '.join(found)}" if found else
                            f"{path.parent} holds none (train with --checkpoint-every N to write them)"))
    problem, _ = check_model_path(model, "--model")
    if problem is not None:
        raise ValueError(problem)


def _default_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def _generate_with_progress(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]):
    """`engine.generate`, with a progress bar over finished prompts (stderr)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    with tqdm(total=len(ids), desc="eval", unit="prompt", leave=False) as bar:
        while len(done) < len(ids):
            for out in engine.step():
                done[out.request_id] = out
                bar.update(1)
    return [done[i] for i in ids]


def evaluate(model: str, data: DataConfig, *, num_prompts: int = 64, n: int = 4, k: int | Sequence[int] = (1,),
             temperature: float = 1.0, max_new_tokens: int = 256, max_slots: int = 64, seed: int = 0,
             device: str = "cpu", tokenizer: str | None = None, dtype: str = "auto", first_prompt: int = 0,
             max_prompt_length: int = 1024, success_threshold: float = 1.0, cuda_graphs: bool = True,
             base: str | None = None, speculation: SpeculationConfig | None = None) -> dict:
    """Sample `n` responses for each of `num_prompts` prompts of `data` and score them.

    Returns {"model", "task", "prompts", "n", "samples", "temperature", "mean_reward", "accuracy",
    "pass@<k>" for each k, "mean_response_length", "truncated_fraction", "reward_errors", "seconds"}, and
    "speculation_acceptance" when speculation drafted.
    Raises ValueError on bad arguments (naming the argument)."""
    ks = (k,) if isinstance(k, int) else tuple(k)
    checks = [(num_prompts >= 1, "num_prompts", num_prompts, ">= 1"), (n >= 1, "n", n, ">= 1"),
              (bool(ks) and all(1 <= x <= n for x in ks), "k", ks, f"values in [1, n={n}]"),
              (temperature >= 0, "temperature", temperature, ">= 0 (0: greedy)"),
              (max_new_tokens >= 1, "max_new_tokens", max_new_tokens, ">= 1"),
              (max_slots >= n, "max_slots", max_slots, f">= n={n} (a prompt's samples run together)"),
              (first_prompt >= 0, "first_prompt", first_prompt, ">= 0")]
    for ok, name, value, want in checks:
        if not ok:
            shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
            raise ValueError(f"--{name.replace('_', '-')} {shown} is invalid: must be {want}")
    model = local_model_path(model, "--model")  # a Hub name: its snapshot in the local cache
    model, taken = resolve_checkpoint(model, "--model")
    if taken is not None:
        phase(taken)
    if dataset_name(data.path) is not None:
        data = dataclasses.replace(data, path=resolve_dataset(data.path, "--data.path").path)
    _check_model(model)
    for problem in check_devices({"--device": (device,)}):
        raise ValueError(problem)
    token_source = _tokenizer_source(model, tokenizer, data)
    source = SourceFactory(data, token_source, max_prompt_length)()
    for _ in range(first_prompt):  # works for generated tasks and prompt files alike
        source.next()
    prompts = [source.next() for _ in range(num_prompts)]
    scorer = ScorerFactory(token_source)()

    torch_dtype = getattr(torch, _default_dtype(dtype, device))
    if is_checkpoint(model):
        with tempfile.TemporaryDirectory(prefix="asyncrl-eval-") as tmp:
            export_hf(model, tmp, base=base)
            policy = load_model(tmp, dtype=torch_dtype, device=device)
    else:
        policy = load_model(model, dtype=torch_dtype, device=device, seed=seed)
    if getattr(policy, "impl", "own") == "hf":
        raise ValueError(f"--model {model}: a {policy.config.model_type} model trains through transformers, and "
                         "`asyncrl eval` generates with the embedded engine, which implements llama, qwen2, qwen3 and "
                         "mistral only; evaluate it during training (--eval.*, on the run's vLLM agents)")

    start = time.perf_counter()
    longest = max(len(p.prompt_ids) for p in prompts)
    engine = Engine(policy, EngineConfig(max_slots=max_slots, max_len=longest + max_new_tokens,
                                         cuda_graphs=cuda_graphs, seed=seed,
                                         speculation=speculation or SpeculationConfig()))
    params = [SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                             seed=derive_seed(seed, first_prompt + i)) for i in range(num_prompts)]
    outputs = _generate_with_progress(engine, [p.prompt_ids for p in prompts], params)

    rewards, correct, lengths, truncated = [], [], [], 0
    for prompt, out in zip(prompts, outputs):
        scores = [scorer.score(prompt, c)[0] for c in out.completions]
        rewards += scores
        correct.append(sum(r >= success_threshold - 1e-6 for r in scores))
        lengths += [len(c.token_ids) for c in out.completions]
        truncated += sum(c.finish_reason == "length" for c in out.completions)
    samples = len(rewards)
    result = {"model": model, "task": data.path or data.task, "prompts": num_prompts, "n": n, "samples": samples,
              "temperature": temperature, "mean_reward": sum(rewards) / samples,
              "accuracy": sum(correct) / samples}
    for x in ks:
        result[f"pass@{x}"] = sum(pass_at_k(n, c, x) for c in correct) / num_prompts
    result.update({"mean_response_length": sum(lengths) / samples, "truncated_fraction": truncated / samples,
                   "reward_errors": scorer.errors, "seconds": time.perf_counter() - start})
    if engine.stats["spec_drafted_tokens"]:  # --speculation.tokens: what the drafts kept
        result["speculation_acceptance"] = engine.stats["spec_accepted_tokens"] / engine.stats["spec_drafted_tokens"]
    return result


@dataclasses.dataclass
class EvalArgs:
    """Evaluate a model or a checkpoint on a task: mean reward, pass@k, response length."""

    run_dir: Annotated[str | None, tyro.conf.Positional, tyro.conf.arg(metavar="[RUN_DIR]")] = None
    """A run directory to evaluate: its newest checkpoint (the same as --model RUN_DIR)."""
    model: str = "smollm2"
    """An HF directory, a .gguf, 'smollm2', 'random:<preset>', a run directory (its newest checkpoint) or a
    checkpoint RUN/checkpoints/step_XXXXXXXX."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    tokenizer: str | None = None
    """Tokenizer source (default: the model; for a checkpoint, the model path in the run's config.json)."""
    base: str | None = None
    """A LoRA checkpoint's base model (default: the run's --model.path, from the checkpoint's run config)."""
    num_prompts: int = 64
    """Prompts to evaluate."""
    first_prompt: int = 0
    """Index of the first prompt (the task's prompt k is fixed by data.seed and k)."""
    n: int = 4
    """Samples per prompt."""
    k: tuple[int, ...] = (1,)
    """pass@k for each of these (each <= n)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    max_new_tokens: int = 256
    max_prompt_length: int = 1024
    max_slots: int = 64
    """Sequences the engine decodes together."""
    success_threshold: float = 1.0
    """A sample counts as correct (for accuracy and pass@k) when its reward reaches this."""
    seed: int = 0
    """Sampling seed (and the seed of 'random:' weights)."""
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bfloat16 on CUDA, float32 otherwise."""
    cuda_graphs: bool = True
    speculation: SpeculationConfig = dataclasses.field(default_factory=SpeculationConfig)
    """Lossless speculative decoding (the same tokens; pays most on greedy evaluation: --speculation.tokens 4)."""
    out: str | None = None
    """Also write the result as JSON here."""


def _run_dir_checkpoint(run_dir: str, model: str) -> str:
    """RUN_DIR's newest checkpoint (saying which), refusing anything but a run directory and a --model beside it."""
    if model != EvalArgs.model:
        raise ValueError(f"RUN_DIR {run_dir} and --model {model} both name what to evaluate; give one of them")
    if not is_run_dir(run_dir):
        raise ValueError(f"RUN_DIR {run_dir}: not a run directory (it holds no checkpoints/, metrics.jsonl or run "
                         "config.json); give the --run-dir of a run, or --model for a model or a checkpoint")
    checkpoint, taken = resolve_checkpoint(run_dir, "RUN_DIR")
    phase(taken)
    return checkpoint


def eval_main(args: list[str]) -> None:
    """`asyncrl eval [RUN_DIR] [...]`: print the result as one JSON line (and write --out)."""
    a = tyro.cli(EvalArgs, args=args, prog="asyncrl eval")
    try:
        model = a.model if a.run_dir is None else _run_dir_checkpoint(a.run_dir, a.model)
        result = evaluate(model, a.data, num_prompts=a.num_prompts, n=a.n, k=a.k,
                          temperature=a.temperature, max_new_tokens=a.max_new_tokens, max_slots=a.max_slots, seed=a.seed, device=a.device,
                          tokenizer=a.tokenizer, dtype=a.dtype, first_prompt=a.first_prompt,
                          max_prompt_length=a.max_prompt_length, success_threshold=a.success_threshold,
                          cuda_graphs=a.cuda_graphs, base=a.base, speculation=a.speculation)
    except ValueError as err:
        raise SystemExit(f"asyncrl eval: {err}") from None
    print(json.dumps(result), flush=True)
    if a.out:
        path = pathlib.Path(a.out)
        if path.parent != pathlib.Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
