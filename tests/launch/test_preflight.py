"""Bad input to `asyncrl train` / `asyncrl eval`: one clear message naming the flag (or the file and row) and
the fix, before any process is spawned and before the run directory is written."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from asyncrl.config import RunConfig
from asyncrl.config.flags import as_flags
from asyncrl.launch.preflight import check_devices, check_model_path, check_run_dir, preflight
from asyncrl.config.presets import PRESETS
from tests.cli_forks import cli_forks
from tests.run_helpers import NO_EVAL

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off", *NO_EVAL]
TEXT = ["--model.path", "random:tiny-smollm2", "--model.tokenizer", "smollm2", "--wandb", "off", *NO_EVAL]


def refused(out, run_dir: pathlib.Path, *expected: str) -> str:
    """The command failed up front: the messages are there, no traceback, no process, no run directory."""
    err = out.stderr
    assert out.returncode != 0, (out.stdout[-2000:], err[-2000:])
    for text in expected:
        assert text in err, (text, err[-3000:])
    assert "Traceback" not in err and "starting " not in err, err[-3000:]
    assert not run_dir.exists()
    return err


def rows_file(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(prompt="What is 2 + 2?", source="mine", truth="4"):
    return {"prompt": [{"role": "user", "content": prompt}], "data_source": source,
            "reward_model": {"ground_truth": truth}}


@pytest.mark.parametrize("args, expected", [
    (["--rollout.top-p", "1.5"], ["--rollout.top-p 1.5 is invalid: must lie in (0, 1]"]),
    (["--rollout.top-p", "0"], ["--rollout.top-p 0.0 is invalid"]),
    (["--rollout.top-k", "0"], ["--rollout.top-k 0 is invalid: must be -1 (off) or >= 1"]),
    # the learner's log-probs do not truncate: training from a truncated distribution would bias every ratio
    (["--rollout.top-p", "0.9"], ["--rollout.top-p 0.9 is invalid: training samples from the full distribution",
                                  "leave --rollout.top-p at 1"]),
    (["--rollout.top-k", "50"], ["--rollout.top-k 50 is invalid: training samples from the full distribution"]),
    (["--placement.agent-devices", "cuda:0"],
     ["--placement.agent-devices cuda:0: cuda:0 requested but CUDA is not available on this machine; use cpu"]),
    (["--placement.trainer-devices", "cuda"], ["--placement.trainer-devices cuda: cuda requested but CUDA"]),
    (["--placement.agent-devices", "gpu0"], ["--placement.agent-devices gpu0: not a device"]),
    (["--rollout.decode-attention", "triton"],
     ["--rollout.decode-attention triton: the Triton decode kernel runs on CUDA, but agents run on cpu",
      "use --rollout.decode-attention auto (SDPA there) or sdpa"]),
    (["--model.path", "/no/such/model"], ["--model.path /no/such/model: does not exist"]),
    (["--model.path", "random:nope"], ["--model.path random:nope: no preset or config.json 'nope'"]),
    (["--async-training.staleness-threshold", "-1"], ["--async-training.staleness-threshold -1.0 is invalid"]),
    (["--async-training.drift-budget", "0"], ["--async-training.drift-budget 0.0 is invalid: must be > 0 nats a token",
                                               "unset to turn it off"]),
    (["--checkpoint-every", "-1"], ["--checkpoint-every -1 is invalid: must be >= 0"]),
    (["--trainer.temperature", "0.5"], ["--trainer.temperature 0.5 is invalid: must equal --rollout.temperature 1.0",
                                        "leave it out and the trainer takes the rollout's"]),
    (["--reward.fn", "nope.py:score"], ["--reward.fn", "nope.py"]),
    (["--env.fn", "nope"], ["--env.fn 'nope': not a built-in environment (calculator, retry)", "PATH.py:NAME"]),
    (["--env.fn", "nope.py:Guess"], ["--env.fn", "nope.py"]),
    (["--env.max-turns", "0"], ["--env.max-turns 0 is invalid: must be >= 1"]),
    (["--env.step-timeout-s", "0"], ["--env.step-timeout-s 0.0 is invalid: must be > 0 seconds"]),
    (["--reward.timeout-s", "0"], ["--reward.timeout-s 0.0 is invalid: must be > 0 seconds"]),
    (["--rollout.backend", "vllm", "--rollout.vllm.gpu-memory-utilization", "1.5"],
     ["--rollout.vllm.gpu-memory-utilization 1.5 is invalid: must lie in (0, 1]"]),
    (["--rollout.backend", "vllm", "--rollout.vllm.kv-cache-gb", "0"],
     ["--rollout.vllm.kv-cache-gb 0.0 is invalid: must be > 0"]),
    (["--trainer.offload", "optimizer", "--placement.trainer-devices", "cpu", "cpu"],
     ["--trainer.offload optimizer is invalid: a group of 2 trainer ranks already splits the optimizer state",
      "--trainer.offload params keeps each rank's shards in host memory"]),
    (["--trainer.max-recoveries", "2", "--placement.launcher", "local"],
     ["--trainer.max-recoveries 2 is invalid: recovers from a trainer rank's fault in a split run: it needs "
      "--placement.launcher rpc"]),
    (["--trainer.max-recoveries", "1", "--placement.launcher", "torchrun"],
     ["--trainer.max-recoveries 1 is invalid", "or torchrun with two or more --placement.trainer-devices"]),
    (["--trainer.max-recoveries", "1", "--trainer.failover", "shrink", "--placement.trainer-devices", "cpu", "cpu",
      "--placement.launcher", "torchrun"], ["--trainer.failover shrink is invalid", "torchrun keeps one process a "
                                            "device; use --trainer.failover replace"]),
    (["--trainer.max-recoveries", "-1"], ["--trainer.max-recoveries -1 is invalid: must be >= 0"]),
    (["--trainer.failover", "shrink", "--placement.trainer-devices", "cpu", "cpu"],
     ["--trainer.failover shrink is invalid: shrinks the trainer group", "give --trainer.max-recoveries 1 or more"]),
    (["--trainer.offload", "params", "--placement.launcher", "local"],
     ["--trainer.offload params is invalid: FSDP2's CPU offload runs in a trainer process",
      "use --placement.launcher rpc"]),
])
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the device cases assume a machine without CUDA")
def test_bad_flags_are_refused_naming_the_flag(tmp_path, args, expected):
    """The checks `asyncrl train` runs before it spawns anything, on the config the command line gives."""
    import tyro
    cfg = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1], args=[*TINY, "--run-dir", str(tmp_path / "run"), *args])
    report = preflight(cfg)
    for text in expected:
        assert any(text in problem for problem in report.problems), (text, report.problems)


NO_CUDA = not __import__("torch").cuda.is_available()
REFUSED = [  # a command's flags, and the line it exits with
    (["--rollout.top-p", "1.5"], "--rollout.top-p 1.5 is invalid: must lie in (0, 1]"),
    (["--placement.agent-devices", "cuda:0"], "--placement.agent-devices cuda:0: cuda:0 requested but CUDA"),
    (["--model.path", "/no/such/model"], "--model.path /no/such/model: does not exist"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """`asyncrl train cpu-demo` with each REFUSED case's flags (the device case only on a machine without CUDA,
    where it is refused), and with two problems at once, each into a run directory of its own; run as forks of
    one prepared process (tests/cli_forks.py). {case: (the process's output, its run directory)}."""
    root = tmp_path_factory.mktemp("refusals")
    cases = {i: args for i, (args, _) in enumerate(REFUSED) if NO_CUDA or "cuda:0" not in args}
    cases["both"] = ["--rollout.top-p", "2", "--model.path", str(root / "missing")]
    runs = {case: root / f"run-{case}" for case in cases}
    commands = [["train", "cpu-demo", *TINY, "--run-dir", str(runs[case]), *args] for case, args in cases.items()]
    outs = cli_forks(commands, cwd=ROOT)
    return {case: (out, runs[case]) for case, out in zip(cases, outs)} | {"missing": root / "missing"}


@pytest.mark.e2e
@pytest.mark.parametrize("case", range(len(REFUSED)))
@pytest.mark.skipif(not NO_CUDA, reason="the device case assumes a machine without CUDA")
def test_the_command_exits_before_spawning_anything(refusals, case):
    out, run_dir = refusals[case]
    expected = REFUSED[case][1]
    err = refused(out, run_dir, expected)
    assert expected in err.rstrip().splitlines()[-1]  # the one line it exits with


@pytest.mark.e2e
def test_every_problem_is_listed_at_once(refusals):
    (out, run_dir), missing = refusals["both"], refusals["missing"]
    err = refused(out, run_dir)
    assert "2 problems" in err and "--rollout.top-p 2.0" in err and f"--model.path {missing}" in err


def _problems(tmp_path, *args) -> list[str]:
    """The problems `asyncrl train cpu-demo ARGS` stops on (the same checks, in this process)."""
    import tyro
    cfg = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1],
                   args=[*TEXT, "--run-dir", str(tmp_path / "run"), *map(str, args)])
    return preflight(cfg).problems


@pytest.fixture(scope="module")
def text_commands(tmp_path_factory, smollm2_tokenizer) -> dict:
    """The commands of the data, dry-run and eval cases below, on files written here, run as forks of one prepared
    process (tests/cli_forks.py). {case: (the process's output, its run directory, its data file)}."""
    root = tmp_path_factory.mktemp("text-commands")
    data = {"unknown": rows_file(root / "unknown.jsonl", [row(source="openai/gsm8k"), row(source="mine")]),
            "dry": rows_file(root / "d.jsonl", [row(source="openai/gsm8k")] * 3 + [row("", source="openai/gsm8k")])}
    runs = {case: root / f"run-{case}" for case in ("unknown", "dry", "eval")}
    commands = {
        "unknown": ["train", "cpu-demo", *TEXT, "--run-dir", runs["unknown"], "--data.path", data["unknown"]],
        "dry": ["train", "cpu-demo", *TEXT, "--run-dir", runs["dry"], "--data.path", data["dry"], "--data.on-empty",
                "drop", "--rollout.temperature", "0.7", "--dry-run"],
        "eval": ["eval", "--model", runs["eval"] / "checkpoints" / "step_00000020", "--data.task", "toy"],
    }
    outs = cli_forks(list(commands.values()), cwd=ROOT)
    return {case: (out, runs[case], data.get(case)) for case, out in zip(commands, outs)}


@pytest.mark.e2e
def test_data_problems_name_the_file_and_row(tmp_path, text_commands):
    out, run_dir, unknown = text_commands["unknown"]
    refused(out, run_dir,
            f"--reward.fn: no reward function for data_source 'mine' (first at {unknown}:2)",
            "--reward.fn mine=PATH.py:NAME")
    empty = rows_file(tmp_path / "empty.jsonl", [row(source="openai/gsm8k"), row("", source="openai/gsm8k")])
    assert _problems(tmp_path, "--data.path", empty) == [
        f"{empty}:2: the prompt is empty; fix the row, or pass --data.on-empty drop to leave such rows out"]
    missing = tmp_path / "none.jsonl"
    assert _problems(tmp_path, "--data.path", missing) == [f"--data.path {missing}: no such file"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(row(source="openai/gsm8k")) + "\n{oops\n")
    [problem] = _problems(tmp_path, "--data.path", broken)
    assert problem.startswith(f"{broken}:2: not valid JSON")
    long = rows_file(tmp_path / "long.jsonl", [row("word " * 200, source="openai/gsm8k")])
    [problem] = _problems(tmp_path, "--data.path", long)
    assert problem.startswith(f"--data.path {long}: all 1 prompts are longer than --rollout.max-prompt-length 64 "
                              "tokens") and "--data.on-long truncate" in problem
    # the built-in arithmetic task against a too small prompt budget: one message, naming the flag
    [problem] = _problems(tmp_path, "--rollout.max-prompt-length", 8)
    assert problem.startswith("--rollout.max-prompt-length 8 is invalid: the arithmetic task's prompts take")


@pytest.mark.e2e
def test_dry_run_prints_a_command_that_gives_the_same_config_and_starts_nothing(text_commands):
    import shlex

    import tyro
    out, run_dir, data = text_commands["dry"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert not run_dir.exists() and "starting " not in out.stderr
    assert f"ok    data: {data}: 4 rows, 3 kept" in out.stdout
    assert "note  1 rows with an empty prompt are dropped" in out.stdout
    assert "note  the data holds 3 prompts, fewer than a learner step's 4 groups" in out.stdout
    command = out.stdout.split("checks:")[0].replace("\\\n", " ")
    args = shlex.split(command)[3:]  # after `asyncrl train cpu-demo`
    parsed = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1], args=args)
    assert parsed.rollout.temperature == 0.7 and parsed.trainer.temperature is None
    assert parsed.data.path == str(data) and as_flags(parsed) == as_flags(parsed)


def test_cpu_demos_evaluation_needs_held_out_files_on_a_prompt_file_run(tmp_path, smollm2_tokenizer):
    """cpu-demo evaluates held-out sums of its task; trained on a prompt file instead, it has no held-out prompts
    unless --eval.data names some: the run goes ahead without evaluating and the checks say so, naming the flag."""
    import tyro
    data = rows_file(tmp_path / "d.jsonl", [row(source="mine")] * 8)
    base = ["--model.path", "random:tiny-smollm2", "--model.tokenizer", "smollm2", "--wandb", "off",
            "--reward.fn", "mine=asyncrl.rewards.arithmetic:arithmetic_reward", "--run-dir", str(tmp_path / "run")]
    report = preflight(tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1], args=[*base, "--data.path", str(data)]))
    assert report.ok and report.spec.eval_prompts is None, report.problems
    [note] = [n for n in report.notes if n.startswith("evaluation: none")]
    assert f"--data.path {data}" in note and "pass --eval.data PATH" in note
    held = rows_file(tmp_path / "held.jsonl", [row(source="mine")] * 3)
    report = preflight(tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1],
                                args=[*base, "--data.path", str(data), "--eval.data", str(held)]))
    assert report.ok and len(report.spec.eval_prompts()) == 3, report.problems
    assert not [n for n in report.notes if n.startswith("evaluation")]
    assert any(f.startswith("evaluation: 3 held-out prompts (mine), every 5 versions") for f in report.facts)


def test_the_trainer_takes_the_rollout_temperature():
    from asyncrl.launch.run_spec import build_spec
    cfg = RunConfig()
    cfg.rollout.temperature = 0.6
    assert build_spec(cfg).trainer.temperature == 0.6


def test_dapo_overlong_buffer_fits_the_token_budget():
    """`asyncrl train cpu-demo algorithm:dapo` (8 new tokens) once passed every check and then failed in its first
    train step on DAPO's fixed 512-token buffer; the default is now a fifth of the budget, and an explicit
    buffer larger than the budget is refused up front, naming both flags."""
    from asyncrl.config.algorithm import DAPO
    from asyncrl.launch.run_spec import build_spec
    _, preset = PRESETS["cpu-demo"]
    cfg = dataclasses.replace(preset, algorithm=DAPO())
    spec = build_spec(cfg)
    assert spec.algorithm.overlong_buffer(spec.trainer.max_response_length) == 1  # 8 // 5
    cfg = dataclasses.replace(preset, algorithm=DAPO(overlong_buffer_len=512))
    with pytest.raises(ValueError, match=r"--algorithm\.overlong-buffer-len 512 is invalid: .*"
                                         r"--trainer\.max-response-length 8"):
        cfg.validate()
    cfg.trainer = dataclasses.replace(cfg.trainer, max_response_length=None)
    with pytest.raises(ValueError, match=r"--rollout\.max-new-tokens 8"):
        cfg.validate()
    assert DAPO().overlong_buffer(3072) == 614 and DAPO(overlong_buffer_len=0).overlong_buffer(None) == 0


def test_checks_as_functions(tmp_path):
    assert check_devices({"--d": ("cpu", "cuda:1")}, cuda_count=1) == ["--d cuda:1: this machine has 1 GPU (cuda:0..cuda:0)"]
    assert check_devices({"--d": ("cuda:0", "cpu")}, cuda_count=2) == []
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    problem, _ = check_model_path(str(tmp_path / "m"))  # asyncrl's own types only (what `asyncrl eval` runs)
    assert "model_type 'gpt2' is not supported" in problem
    assert check_model_path(str(tmp_path / "m"), impl="auto") == (
        None, f"model: {tmp_path / 'm'} (gpt2; trains through transformers, --model.impl hf)")
    (tmp_path / "file").write_text("x")
    assert "is a file" in check_run_dir(str(tmp_path / "file"))
    assert check_run_dir(str(tmp_path / "new" / "run")) is None
    report = preflight(RunConfig(model=RunConfig().model.__class__(path="random:tiny-qwen2"),
                                 data=RunConfig().data.__class__(task="toy"), run_dir=str(tmp_path / "r")))
    assert report.ok and any(f.startswith("reward of 'toy'") for f in report.facts)


@pytest.mark.e2e
def test_eval_on_a_missing_path_says_so(text_commands):
    out, run_dir, _ = text_commands["eval"]
    missing = run_dir / "checkpoints" / "step_00000020"
    assert out.returncode != 0 and f"--model {missing}: no such checkpoint" in out.stderr
    assert "Traceback" not in out.stderr and "Repo id" not in out.stderr


def test_the_vllm_backend_without_vllm_names_the_install(tmp_path, monkeypatch):
    import importlib.util

    import tyro
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    cfg = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1],
                   args=[*TINY, "--run-dir", str(tmp_path / "run"), "--rollout.backend", "vllm"])
    problems = preflight(cfg).problems
    assert any(p.startswith("--rollout.backend vllm: vLLM is not installed: pip install 'asyncrl[vllm]'")
               for p in problems), problems


def test_bf16_weights_are_noted_with_what_they_lose(tmp_path):
    base = PRESETS["cpu-demo"][1]
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, path="random:tiny-qwen2"),
                              data=dataclasses.replace(base.data, task="toy"), run_dir=str(tmp_path / "run"),
                              trainer=dataclasses.replace(base.trainer, param_dtype="bfloat16"))
    report = preflight(cfg)
    assert report.ok
    assert any(n.startswith("--trainer.param-dtype bfloat16 keeps no fp32 copy") and "--trainer.optim.lr is 2e-05"
               in n for n in report.notes), report.notes
    assert not any("param-dtype" in n for n in preflight(dataclasses.replace(cfg, trainer=base.trainer)).notes)


def _hf_run(tmp_path, model: str, *args: str, algorithm=None) -> RunConfig:
    """cpu-demo on `model` with the toy task and a random model's (absent) tokenizer: the zoo's directories hold
    weights only."""
    import tyro
    cfg = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1],
                   args=["--model.path", model, "--model.tokenizer", "random:tiny-qwen2", "--data.task", "toy",
                         "--wandb", "off", *NO_EVAL, "--run-dir", str(tmp_path / "run"), *args])
    return cfg if algorithm is None else dataclasses.replace(cfg, algorithm=algorithm)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe"])
def test_a_type_transformers_implements_passes_as_an_hf_path_model(tmp_path, hf_zoo, model_type):
    report = preflight(_hf_run(tmp_path, str(hf_zoo(model_type))))
    assert report.ok, report.problems
    assert f"model: {hf_zoo(model_type)} ({model_type}; trains through transformers, --model.impl hf)" in report.facts


def _config_dir(path: pathlib.Path, config: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_model_transformers_cannot_build_is_refused_naming_the_path(tmp_path):
    remote = _config_dir(tmp_path / "remote", {"model_type": "my_lm", "auto_map": {"AutoConfig": "my.MyConfig"}})
    unknown = _config_dir(tmp_path / "unknown", {"model_type": "my_lm"})
    problems = preflight(_hf_run(tmp_path, remote)).problems
    assert [p for p in problems if p.startswith(f"--model.path {remote}: model_type 'my_lm' is not implemented by the "
                                                "installed transformers and needs its repository's code (auto_map)")]
    problems = preflight(_hf_run(tmp_path, unknown)).problems
    assert [p for p in problems if p.startswith(f"--model.path {unknown}: model_type 'my_lm' is not implemented")]
    assert not [p for p in problems if "auto_map" in p]


def test_what_an_hf_path_model_cannot_do_is_refused_naming_the_flag(tmp_path, hf_zoo):
    from asyncrl.config.algorithm import PPO
    gemma = str(hf_zoo("gemma3_text"))
    [problem] = preflight(_hf_run(tmp_path, gemma, "--model.impl", "own")).problems
    assert problem.startswith(f"--model.impl own: model_type 'gemma3_text' ({gemma}) is not one of asyncrl's own")
    [problem] = preflight(_hf_run(tmp_path, gemma, "--rollout.backend", "asyncrl")).problems
    assert problem.startswith("--rollout.backend asyncrl: the embedded engine implements asyncrl's own models")
    [problem] = preflight(_hf_run(tmp_path, gemma, algorithm=PPO())).problems
    assert problem.startswith(f"algorithm:ppo on {gemma}: the PPO critic runs on asyncrl's own models only; use "
                              "GRPO/DAPO/GSPO/RLOO (or one of asyncrl's own models")
    # an own type made to train through transformers: the critic needs it back on asyncrl's model
    problems = preflight(_hf_run(tmp_path, "random:tiny-qwen2", "--model.impl", "hf", algorithm=PPO())).problems
    assert ("algorithm:ppo on random:tiny-qwen2: the PPO critic runs on asyncrl's own models only; use "
            "GRPO/DAPO/GSPO/RLOO or --model.impl own") in problems
    assert preflight(_hf_run(tmp_path, "random:tiny-qwen2", algorithm=PPO())).ok  # own: as before


def test_lora_targets_and_rank_are_checked_against_an_hf_path_models_layers(tmp_path, hf_zoo):
    phi3 = str(hf_zoo("phi3"))
    report = preflight(_hf_run(tmp_path, phi3, "--lora.rank", "4"))
    assert report.ok, report.problems
    [fact] = [f for f in report.facts if f.startswith("lora:")]
    # per layer 4 × (o 64+64, qkv 64+128, gate_up 64+256, down 128+64) = 4 × 832; 2 layers
    assert "on o_proj qkv_proj gate_up_proj down_proj: 6,656 trained parameters" in fact
    [problem] = preflight(_hf_run(tmp_path, phi3, "--lora.rank", "4", "--lora.target-modules", "q_proj", "o_proj")).problems
    assert problem == (f"--lora.target-modules q_proj o_proj is invalid: ['q_proj'] is not a linear layer of {phi3} "
                       "(phi3); give names among o_proj, qkv_proj, gate_up_proj, down_proj, or all-linear")
    # Qwen3.5's linear-attention gates are 2 wide here: all-linear notes them, naming one refuses it
    hybrid = str(hf_zoo("qwen3_5_text"))
    report = preflight(_hf_run(tmp_path, hybrid, "--lora.rank", "4"))
    assert report.ok, report.problems
    assert [n for n in report.notes if n.startswith("--lora.target-modules all-linear adapts in_proj_b (64 -> 2), "
                                                    "in_proj_a (64 -> 2), not wider than --lora.rank 4")]
    [problem] = preflight(_hf_run(tmp_path, hybrid, "--lora.rank", "4", "--lora.target-modules", "in_proj_a")).problems
    assert problem.startswith(f"--lora.rank 4 is invalid for {hybrid}: in_proj_a (64 -> 2) is not wider than the rank")


def test_tensor_parallel_shards_split_an_hf_path_models_heads(hf_zoo):
    from asyncrl.launch.preflight import check_tensor_parallel
    [problem] = check_tensor_parallel(3, ("cpu",), str(hf_zoo("gemma3_text")), cores=8)
    assert problem.startswith("--rollout.vllm.tensor-parallel-size 3: the model's 2 attention heads")
    assert check_tensor_parallel(2, ("cpu",), str(hf_zoo("gemma3_text")), cores=8) == []
