"""`asyncrl bench`: the engine and learner benchmarks live in `asyncrl_bench`; the scripts are thin wrappers;
every entry point's --help runs and tiny-budget runs produce sane rows."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from asyncrl.policies import ARCH_PRESETS, random_model, token_logprobs
from asyncrl_bench.engine import logprob_mismatch, prefill_flops, step_bytes
from asyncrl_bench.flops import body_params, row_lengths, train_flops
from asyncrl_bench.learner import LearnerBenchArgs, bench_learner, groups_for
from tests.cli_forks import cli_forks
from tests.run_helpers import ROOT, cli, needs_vllm, vllm_one_thread
from tests.timing import limit
from tests.tolerances import FORWARD_DEPTH, close_tol

SMOLLM2_HIDDEN = 576  # SmolLM2-135M's hidden size


def dlogp_tol(row: dict, hidden_size: int, prefix: str = "") -> float:
    """Bound on a bench row's largest |Δ log-prob| per token (engine vs a training forward, both float32):
    tests/tolerances.py's forward model (FORWARD_DEPTH reductions of hidden_size terms) at the row's largest
    |logit|. One wrong token fails it; a bound on the mean let one token in 16 be off by 1e-2."""
    return close_tol(torch.float32, row[f"{prefix}max_abs_logit"], terms=hidden_size, depth=FORWARD_DEPTH)


TINY_ENGINE = ["--model", "random:tiny-qwen2", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "2",
               "--prompt-len", "8", "--new-tokens", "8"]


@pytest.mark.e2e
def test_bench_usage_and_help():
    usage, unknown, out = cli_forks([["bench", "--help"], ["bench", "nope"], ["bench", "engine", "--help"]], cwd=ROOT)
    assert usage.returncode == 0 and "engine" in usage.stdout and "learner" in usage.stdout
    assert unknown.returncode != 0 and "unknown benchmark 'nope'" in unknown.stderr
    assert out.returncode == 0
    for flag in ("--model", "--backends", "--batch-sizes", "--prompt-len", "--new-tokens", "--data", "--n", "--out"):
        assert flag in out.stdout, flag


@pytest.mark.e2e
def test_engine_bench_smoke_run(tmp_path):
    target = tmp_path / "bench.json"
    out = cli("bench", "engine", *TINY_ENGINE, "--out", str(target))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(target.read_text())
    assert len(rows) == 1 and json.loads(out.stdout.strip().splitlines()[-1]) == rows[0]
    row = rows[0]
    assert row["batch"] == 2 and row["device"] == "cpu" and row["new_tokens"] == 8
    # decode_step_ms is the run less its prefill timed apart: 0 when a busy machine made the prefill alone slower
    assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["decode_step_ms"] >= 0
    assert row["ratio"] == row["ours_tok_s"] / row["hf_tok_s"]
    # the prompts' prefill alone is timed apart; the decode step is the rest of the run over its 7 decode steps
    # (the prefill samples the first token)
    run_s = 2 * 8 / row["ours_tok_s"]
    assert row["prompt_tokens"] == 2 * 8 and row["ours_prefill_s"] > 0 and row["decode_steps"] == 7
    assert row["decode_step_ms"] == pytest.approx(max(run_s - row["ours_prefill_s"], 0) / row["decode_steps"] * 1e3,
                                                  rel=1e-6)
    assert row["ours_prefill_tok_s"] == pytest.approx(16 / row["ours_prefill_s"])
    assert row["ours_mean_len"] == row["hf_mean_len"] == 8  # EOS ignored: every sample is forced to full length
    # fp32 on CPU: every token's engine log-prob matches a training forward's
    assert row["max_abs_dlogp"] <= dlogp_tol(row, ARCH_PRESETS["tiny-qwen2"]["hidden_size"]), row


@pytest.mark.e2e
def test_engine_bench_refuses_bad_backends():
    twice, unknown = cli_forks([["bench", "engine", *TINY_ENGINE, "--backends", "asyncrl", "asyncrl"],
                                ["bench", "engine", *TINY_ENGINE, "--backends", "sglang"]], cwd=ROOT)
    assert twice.returncode != 0 and "--backends asyncrl asyncrl" in twice.stderr
    assert unknown.returncode != 0 and "sglang" in unknown.stderr


def test_engine_bench_on_a_prompt_file_stops_at_eos(tmp_path, smollm2_tokenizer, gsm8k_test_file):
    """The RL-like workload: GSM8K prompts through the chat template, n samples each, generated until EOS by
    SmolLM2's real weights (so lengths differ), on our engine and on HF generate."""
    from asyncrl.data.files import convert_gsm8k
    from asyncrl_bench.engine import EngineBenchArgs, bench_engine
    lines = gsm8k_test_file.read_text().splitlines()[:3]
    (tmp_path / "raw.jsonl").write_text("\n".join(lines) + "\n")
    convert_gsm8k(tmp_path / "raw.jsonl", tmp_path / "gsm8k.jsonl")
    args = EngineBenchArgs(model="smollm2", device="cpu", dtype="float32", backends=("asyncrl", "hf"),
                           batch_sizes=(2,), new_tokens=48, data=str(tmp_path / "gsm8k.jsonl"), n=2, seeded=True)
    [row] = bench_engine(args)
    assert row["n"] == 2 and row["workload"].endswith("gsm8k.jsonl") and row["prompt_len"] > 40
    assert 0 < row["ours_mean_len"] <= 48 and 0 < row["hf_mean_len"] <= 48
    assert row["ratio"] == row["ours_tok_s"] / row["hf_tok_s"]
    assert row["max_abs_dlogp"] <= dlogp_tol(row, SMOLLM2_HIDDEN), row
    with pytest.raises(ValueError, match="fewer than --batch-sizes 5"):
        bench_engine(dataclasses.replace(args, batch_sizes=(5,)))


@pytest.mark.e2e
def test_script_wrappers_keep_working():
    # the documented `PYTHONPATH=. python scripts/bench_engine.py ...` command, and the names other scripts import
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for script, flag in (("scripts/bench_engine.py", "--batch-sizes"), ("scripts/bench_learner.py", "--rows")):
        out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=limit(120))
        assert out.returncode == 0 and flag in out.stdout, out.stderr[-2000:]
    from scripts.bench_engine import Args as EngineArgs, main as engine_main, step_bytes as script_step_bytes
    from scripts.bench_learner import Args as LearnerArgs, groups_for as script_groups_for, main as learner_main
    assert EngineArgs().batch_sizes == (64, 256) and LearnerArgs().rows == 16
    assert callable(engine_main) and callable(learner_main)
    assert script_step_bytes is step_bytes and script_groups_for is groups_for


@torch.no_grad()
def test_one_wrong_token_log_prob_fails_the_bound_that_a_mean_let_pass():
    """The mismatch the engine bench reports, on 'engine' log-probs that are a training forward's own (exact)
    except one token of 16 off by 1e-2 (the smallest bug tests/tolerances.py guards against)."""
    model = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1), seed=0)
    prompt, tokens = [5, 9, 11], torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = torch.tensor([prompt + tokens])
    exact = token_logprobs(model.logits(model(seq))[0, len(prompt) - 1:-1], seq[0, len(prompt):]).tolist()

    def row(logprobs):
        completion = SimpleNamespace(token_ids=tokens, logprobs=logprobs)
        return logprob_mismatch(model, [SimpleNamespace(prompt_ids=prompt, completions=[completion])])

    hidden = model.config.hidden_size
    right = row(exact)
    assert right["max_abs_dlogp"] <= dlogp_tol(right, hidden) < 1e-3
    wrong = row([lp + (1e-2 if i == 7 else 0.0) for i, lp in enumerate(exact)])
    assert wrong["mean_abs_dlogp"] < 1e-3  # the old check, `mean < 1e-3`, passed this
    assert wrong["max_abs_dlogp"] > dlogp_tol(wrong, hidden)


def test_learner_bench_tiny_run(tmp_path):
    args = LearnerBenchArgs(model="random:tiny-qwen2", device="cpu", rows=4, group_size=2, prompt_len=4,
                            response_len=4, steps=1, baseline=False, gradient_checkpointing=False,
                            out=str(tmp_path / "learner.json"))
    row = bench_learner(args)
    assert row["ours_tok_s"] > 0 and row["tokens_per_row"] == 8 and "hf_tok_s" not in row
    assert row["workload"] == "fixed" and row["tokens_per_step"] == 32 and row["response_tokens_per_step"] == 16
    assert row["ours_mfu"] is None  # no peak FLOP/s on CPU
    assert json.loads((tmp_path / "learner.json").read_text()) == row
    groups = groups_for(args, 256, seed=0)
    assert len(groups) == 2 and all(len(g.completions) == 2 and len(g.prompt_ids) == 4 for g in groups)


TINY_RAGGED = dict(model="random:tiny-qwen2", device="cpu", rows=4, group_size=2, workload="ragged",
                   prompt_len_min=2, prompt_len_max=6, response_len_min=1, response_len_max=8, steps=1)


def test_learner_bench_ragged_run_against_padded_hf(tmp_path, capsys):
    """Ragged rows end to end: ours packed, HF's padded micro-batches; both credited the same real tokens and
    FLOPs (so the MFU ratio is the tok/s ratio); MFU is null on CPU."""
    args = LearnerBenchArgs(**TINY_RAGGED, max_tokens_per_micro_batch=24, out=str(tmp_path / "learner.json"))
    row = bench_learner(args)
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    print(printed)  # the CPU row, for `pytest -s`
    assert json.loads(printed) == row == json.loads((tmp_path / "learner.json").read_text())
    timed = row_lengths(groups_for(args, 256, seed=2))  # steps 0 and 1 are the (default) warm-up
    assert row["workload"] == "ragged" and row["rows"] == 4
    assert row["tokens_per_step"] == sum(p + r for p, r in timed)
    assert row["response_tokens_per_step"] == sum(r for _, r in timed)
    assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["ratio"] == row["ours_tok_s"] / row["hf_tok_s"]
    assert row["ours_mfu"] is None and row["hf_mfu"] is None
    assert row["peak_flops"] is None and row["roofline_step_s"] is None and "cpu" in row["roofline_note"]
    assert row["model_flops_per_step"] == train_flops(random_model("tiny-qwen2").config,
                                                      body_params(random_model("tiny-qwen2")), timed)


def test_learner_bench_reports_warmup_apart_with_compile_counts(tmp_path):
    """--warmup-steps N: N untimed steps on their own rows, the first one's seconds reported apart; each side's
    compile counts per phase (nothing compiles on CPU: eager layers)."""
    args = LearnerBenchArgs(**dict(TINY_RAGGED, steps=2, warmup_steps=3))
    row = bench_learner(args)
    timed = [row_lengths(groups_for(args, 256, seed=s)) for s in (3, 4)]
    assert row["tokens_per_step"] == sum(p + r for rows in timed for p, r in rows) / 2
    assert row["warmup_steps"] == 3 and row["steps"] == 2 and len(row["ours_step_s"]) == len(row["hf_step_s"]) == 2
    assert 0 < row["ours_first_step_s"] <= row["ours_warmup_s"] and row["hf_first_step_s"] <= row["hf_warmup_s"]
    assert row["ours_tok_s"] == pytest.approx(row["tokens_per_step"] * 2 / sum(row["ours_step_s"]))
    for side in ("ours", "hf"):
        assert set(row[f"{side}_compiles_timed"]) == {"frames", "graphs", "graph_breaks", "recompile_limit_hits"}
        assert row[f"{side}_compiles_timed"]["frames"] == 0
    cold = bench_learner(LearnerBenchArgs(**dict(TINY_RAGGED, warmup_steps=0, baseline=False)))
    assert cold["ours_warmup_s"] == 0 and cold["ours_first_step_s"] == cold["ours_step_s"][0]


def test_groups_for_draws_ragged_lengths_inside_their_ranges():
    args = LearnerBenchArgs(**dict(TINY_RAGGED, rows=32, group_size=4))
    groups = groups_for(args, 256, seed=3)
    assert len(groups) == 8 and all(len(g.completions) == 4 for g in groups)
    prompts = [len(g.prompt_ids) for g in groups]
    responses = [len(c.token_ids) for g in groups for c in g.completions]
    assert all(2 <= n <= 6 for n in prompts) and all(1 <= n <= 8 for n in responses)
    assert len(set(prompts)) > 1 and len(set(responses)) > 1
    assert all(len(c.logprobs) == len(c.token_ids) == len(c.versions) for g in groups for c in g.completions)
    assert row_lengths(groups_for(args, 256, seed=3)) == row_lengths(groups)  # seeded
    assert row_lengths(groups_for(args, 256, seed=4)) != row_lengths(groups)  # a new draw per step
    fixed = groups_for(dataclasses.replace(args, workload="fixed", prompt_len=5, response_len=7), 256, seed=3)
    assert set(row_lengths(fixed)) == {(5, 7)}


def test_time_steps_counts_compilation_in_the_warmup_only():
    """A function compiled on its first call: one frame in the warm-up, none in the timed steps; a new rank
    of input recompiles it inside the timed steps, and the count shows it."""
    from asyncrl_bench.timing import time_steps
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=True)
    times = time_steps("cpu", lambda n: double(torch.ones(n)), [3, 4, 5, 6], warmup=2)
    assert times.compiles_warmup["frames"] == 1 and times.compiles_timed["frames"] == 0
    assert len(times.step_s) == 2 and times.warmup_s >= times.first_s > 0
    again = time_steps("cpu", lambda shape: double(torch.ones(shape)), [(2,), (2, 3)], warmup=1)
    assert again.compiles_timed["frames"] == 1
    with pytest.raises(ValueError, match="warmup=2 must leave at least one of the 2 steps"):
        time_steps("cpu", lambda n: None, [1, 2], warmup=2)


@pytest.mark.parametrize("change, flag", [
    (dict(response_len_min=0), "--response-len-min 0 must be >= 1"),
    (dict(response_len_min=9, response_len_max=8), "--response-len-min 9 must be <= --response-len-max 8"),
    (dict(prompt_len_min=7, prompt_len_max=6), "--prompt-len-min 7 must be <= --prompt-len-max 6"),
    (dict(prompt_len_max=0), "--prompt-len-max 0 must be >= 1"),
    (dict(rows=6, group_size=4), "--rows 6 must be a positive multiple of --group-size 4"),
    (dict(workload="fixed", response_len=0), "--response-len 0 must be >= 1"),
    (dict(warmup_steps=-1), "--warmup-steps -1 must be >= 0"),
    (dict(ranks=0), "--ranks 0 must be >= 1"),
    (dict(ranks=2), "--ranks 2 times our own trainer group only: add --no-baseline"),
    (dict(ranks=2, baseline=False, offload="optimizer"), "leave --lora.rank at 0 and --offload at none or params"),
    (dict(ranks=3, baseline=False, rows=8, group_size=4), "give at least 12 rows"),
])
def test_learner_bench_refuses_bad_shapes_before_loading(change, flag):
    args = LearnerBenchArgs(**{**TINY_RAGGED, "model": "/no/such/model", **change})  # loading would fail otherwise
    with pytest.raises(ValueError, match=flag):
        bench_learner(args)


@pytest.mark.e2e
def test_learner_bench_cli_names_the_flag():
    out = cli("bench", "learner", "--device", "cpu", "--workload", "ragged", "--response-len-min", "0")
    assert out.returncode != 0 and "asyncrl bench learner: --response-len-min 0 must be >= 1" in out.stderr


def test_train_flops_golden_value():
    """V=100, H=8, L=2, 2 heads × 4 = 8 attention width, N_body=1000; rows (3, 5) and (2, 1):
    tokens 8 + 3 = 11, response tokens 5 + 1 = 6, Σ s² = 64 + 9 = 73;
    6·1000·11 = 66000, 6·100·8·6 = 28800, 6·2·8·73 = 7008; total 101808."""
    from asyncrl.policies.model import TransformerConfig
    config = TransformerConfig.from_hf(dict(model_type="llama", vocab_size=100, hidden_size=8, intermediate_size=16,
                                            num_hidden_layers=2, num_attention_heads=2, head_dim=4))
    assert train_flops(config, 1000, [(3, 5), (2, 1)]) == 101808.0
    assert train_flops(config, 1000, []) == 0.0


def test_body_params_counts_the_decoder_without_embeddings():
    model = random_model("tiny-qwen2")  # tied embeddings: one V × H matrix outside the body
    cfg = model.config
    assert body_params(model) == sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.hidden_size


def test_a_moe_models_body_counts_its_routed_experts_by_the_share_a_token_runs(hf_zoo):
    """Qwen3-MoE (tiny: 2 of 4 experts a token): the experts' 3-D tensors count half, everything else whole; its MFU
    shape comes from its HF config."""
    from asyncrl.policies import load_model
    from asyncrl_bench.flops import expert_share, flops_config
    model = load_model(str(hf_zoo("qwen3_moe")))
    layers = list(model.model.layers) + [model.model.norm]
    experts = sum(p.numel() for m in layers for n, p in m.named_parameters() if ".experts." in f".{n}.")
    total = sum(p.numel() for m in layers for p in m.parameters())
    assert experts > 0 and expert_share(model.config.hf_config) == 0.5
    assert body_params(model) == total - experts // 2
    shape = flops_config(model)
    assert (shape.num_layers, shape.hidden_size) == (2, model.config.hf_config["hidden_size"])
    assert expert_share({"num_experts": 64, "num_experts_per_tok": 8}) == 0.125 and expert_share({}) == 1.0


def test_step_bytes_counts_weights_once_and_the_kv():
    model = random_model("tiny-qwen2")
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # the tied lm_head is counted once here
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert step_bytes(model, batch=3, attend_len=10) == params * 4 + 3 * 10 * kv
    assert model.dtype == torch.float32


@pytest.mark.e2e
@pytest.mark.slow
def test_engine_bench_times_vllm_on_the_same_prompts(smollm2_cache, monkeypatch):
    """`--backends asyncrl vllm`: vLLM (in a process of its own) generates for the same prompts; its behaviour
    log-probs match a training forward of SmolLM2's real weights as ours do."""
    needs_vllm()
    vllm_one_thread(monkeypatch)
    from asyncrl_bench.engine import EngineBenchArgs, bench_engine
    [row] = bench_engine(EngineBenchArgs(model="smollm2", device="cpu", dtype="float32",
                                         backends=("asyncrl", "vllm", "vllm-llm"),
                                         batch_sizes=(2,), prompt_len=16, new_tokens=8, n=2, seeded=True))
    assert row["ours_mean_len"] == row["vllm_mean_len"] == 8 and "hf_tok_s" not in row
    assert row["ratio_vs_vllm"] == row["ours_tok_s"] / row["vllm_tok_s"]
    assert row["vllm_llm_mean_len"] == 8 and row["ratio_vs_vllm_llm"] == row["ours_tok_s"] / row["vllm_llm_tok_s"]
    # LLM.generate's prefill alone (one new token) is timed too, with its prefix cache off (the warm-up ran them)
    assert 0 < row["vllm_llm_prefill_s"] < 4 * 8 / row["vllm_llm_tok_s"]
    assert row["vllm_llm_prefill_tok_s"] == pytest.approx(2 * 16 / row["vllm_llm_prefill_s"])
    assert row["max_abs_dlogp"] <= dlogp_tol(row, SMOLLM2_HIDDEN), row
    assert row["vllm_max_abs_dlogp"] <= dlogp_tol(row, SMOLLM2_HIDDEN, prefix="vllm_"), row
    # on CPU no roofline is known: printed as null rather than left out; SDPA decodes there
    assert row["peak_bandwidth"] is None and row["roofline_tok_s"] is None and row["decode_attention"] == "sdpa"


def test_learner_bench_with_lora_against_peft_counts_frozen_flops(tmp_path):
    """--lora.rank: both sides train rank-R adapters on a frozen base (ours: asyncrl.policies.lora; HF: peft)
    on the same rows; the FLOPs credited to both are a LoRA step's (4 per frozen weight per token, not 6)."""
    from asyncrl_bench.lora import lora_train_flops
    from asyncrl.config import LoraConfig
    args = LearnerBenchArgs(**TINY_RAGGED, lora=LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj")),
                            out=str(tmp_path / "learner.json"))
    row = bench_learner(args)
    assert row["lora_rank"] == 4 and row["lora_targets"] == ["q_proj", "v_proj"] and row["base_dtype"] == "float32"
    assert row["adapter_params"] == 4 * 2 * ((64 + 64) + (64 + 32))  # 2 layers, r·(in + out) per adapted layer
    assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0
    assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["hf_tok_s"])
    assert row["peak_flops"] is None and row["model_flops_per_step"] > 0 and "ours_first_step_s" in row
    config = random_model("tiny-qwen2").config
    full = train_flops(config, 1000, [(4, 4)])
    assert lora_train_flops(config, 1000, 0, [(4, 4)]) < full  # frozen weights: no weight gradients
    with pytest.raises(ValueError, match="--lora.rank -1 is invalid"):
        LearnerBenchArgs(**TINY_RAGGED, lora=LoraConfig(rank=-1)).validate()


def test_prefill_flops_count_the_body_the_causal_half_of_attention_and_one_head_row():
    model = random_model("tiny-qwen2")
    cfg = model.config
    width = cfg.num_heads * cfg.head_dim
    one = 2 * body_params(model) * 10 + 2 * cfg.num_layers * width * 10 ** 2 + 2 * cfg.vocab_size * cfg.hidden_size
    assert prefill_flops(model, [10]) == one and prefill_flops(model, [10, 10]) == 2 * one
    # the training step's FLOPs of the same prompt (no response) are three times its forward, less the head row
    assert train_flops(cfg, body_params(model), [(10, 0)]) == 3 * (one - 2 * cfg.vocab_size * cfg.hidden_size)


def test_engine_roofline_is_the_prefill_at_peak_flops_then_the_decode_steps_at_full_bandwidth(monkeypatch):
    """The engine row's roofline: the least time for the whole workload (prefill at peak FLOP/s, then
    new_tokens - 1 decode steps at full bandwidth); null on CPU."""
    import asyncrl_bench.engine as engine_bench
    model = random_model("tiny-qwen2")
    args = engine_bench.EngineBenchArgs(model="random:tiny-qwen2", batch_sizes=(3,), prompt_len=6, new_tokens=5, n=2)
    [work] = engine_bench._workloads(args, model)
    monkeypatch.setattr(engine_bench, "peak_flops", lambda device: 1e9)
    monkeypatch.setattr(engine_bench, "peak_bandwidth", lambda device: 1e8)
    row = engine_bench._roofline(args, model, work, "cuda")
    prefill, step = prefill_flops(model, [6, 6, 6]), step_bytes(model, 6, 6 + 2)  # mean context: 6 + 5 / 2
    assert row["prefill_flops"] == prefill and row["step_bytes"] == step
    assert row["roofline_s"] == pytest.approx(prefill / 1e9 + 4 * step / 1e8)
    assert row["roofline_tok_s"] == pytest.approx(6 * 5 / row["roofline_s"])
    assert row["decode_roofline_tok_s"] == pytest.approx(6 * 1e8 / step)
    one_token = engine_bench._roofline(dataclasses.replace(args, new_tokens=1), model, work, "cuda")
    assert one_token["roofline_s"] == pytest.approx(prefill / 1e9)  # the first token is the prefill's
    monkeypatch.undo()
    assert engine_bench._roofline(args, model, work, "cpu")["roofline_tok_s"] is None


def test_engine_bench_times_both_kv_layouts_on_the_same_prompts(monkeypatch):
    """`--kv-layout both`: the per-slot engine (`ours_*`) and the shared-prompt one (`shared_prompt_*`) on the same
    prompts: the same tokens' count, a smaller cache (24-token prompts stored once for 3 samples instead of 3
    times), the ratio of their tok/s; the shared roofline reads each prompt's K/V once a step."""
    import asyncrl_bench.engine as engine_bench
    args = engine_bench.EngineBenchArgs(model="random:tiny-qwen2", device="cpu", dtype="float32", backends=("asyncrl",),
                                        kv_layout="both", batch_sizes=(2,), prompt_len=24, new_tokens=6, n=3,
                                        seeded=True)
    [row] = engine_bench.bench_engine(args)
    assert row["ours_mean_len"] == row["shared_prompt_mean_len"] == 6 and row["kv_layout"] == "slot"
    assert row["shared_prompt_kv_layout"] == "shared-prompt"
    assert row["shared_prompt_ratio"] == row["shared_prompt_tok_s"] / row["ours_tok_s"]
    # 6 sequences of 30 positions against 2 prompts of 24 and 6 responses of 6
    assert row["shared_prompt_kv_gb"] == pytest.approx(row["ours_kv_gb"] * (2 * 24 + 6 * 6) / (6 * 30))
    model = random_model("tiny-qwen2")
    [work] = engine_bench._workloads(args, model)
    monkeypatch.setattr(engine_bench, "peak_flops", lambda device: 1e9)
    monkeypatch.setattr(engine_bench, "peak_bandwidth", lambda device: 1e8)
    roofline = engine_bench._roofline(args, model, work, "cuda")
    weights = step_bytes(model, 0, 0)
    kv = (step_bytes(model, 1, 1) - weights)  # a position's K/V
    assert roofline["shared_step_bytes"] == pytest.approx(weights + (2 * 24 + 6 * 3) * kv)
    # --system-prompt-len: every prompt begins with the same 16 tokens, read from the first prompt's slot
    system = dataclasses.replace(args, system_prompt_len=16, kv_layout="shared-prompt")
    [work] = engine_bench._workloads(system, model)
    assert work.prompts[0][:16] == work.prompts[1][:16] and work.prompts[0][16:] != work.prompts[1][16:]
    assert engine_bench._roofline(system, model, work, "cuda")["shared_step_bytes"] == pytest.approx(
        weights + (16 + 2 * 8 + 6 * 3) * kv)
    monkeypatch.undo()
    [row] = engine_bench.bench_engine(system)
    assert row["kv_layout"] == "shared-prompt" and row["shared_prefix_tokens"] >= 16 and row["ours_mean_len"] == 6
    with pytest.raises(ValueError, match="--system-prompt-len 24"):
        dataclasses.replace(args, system_prompt_len=24).validate()


def test_async_rows_print_the_learner_and_engine_rooflines(monkeypatch):
    """`asyncrl bench async` rows: the learner's FLOP bound (its devices at peak over `train_flops` per trained
    token at the run's mean lengths), the engine's bandwidth bound (slots sequences a step, every weight and
    the K/V up to the mean context read once, as trained tokens), and the mode's bound; null on CPU."""
    import asyncrl_bench.async_runs as async_bench
    from asyncrl_bench.async_runs import _meta_model, run_roofline
    model = _meta_model("random:tiny-qwen2")
    row = dict(trainer_devices=["cuda:0", "cuda:1"], agent_devices=["cuda:0", "cuda:1"], slots=2, rows_measured=4,
               tokens_measured=40, response_tokens_measured=24, tokens_per_s=1000.0)
    monkeypatch.setattr(async_bench, "peak_flops", lambda device: 1e15)
    monkeypatch.setattr(async_bench, "peak_bandwidth", lambda device: 1e12)
    colocated = run_roofline(row, model, colocated=True)
    # 4 rows of 4 prompt + 6 response tokens; the engine reads up to 4 + 6/2 = 7 positions of K/V per sequence
    per_token = train_flops(model.config, body_params(model), [(4.0, 6.0)]) / 10
    assert colocated["learner_bound_tok_s"] == pytest.approx(2 * 1e15 / per_token)
    assert colocated["engine_bound_tok_s"] == pytest.approx(2 * 2 * 1e12 / step_bytes(model, 2, 7) * 40 / 24)
    learner, engine = colocated["learner_bound_tok_s"], colocated["engine_bound_tok_s"]
    assert colocated["roofline_tok_s"] == pytest.approx(1 / (1 / learner + 1 / engine))
    split = run_roofline(row, model, colocated=False)
    assert split["roofline_tok_s"] == min(learner, engine) and split["roofline_fraction"] == 1000.0 / min(learner, engine)
    monkeypatch.undo()
    on_cpu = run_roofline(dict(row, trainer_devices=["cpu"], agent_devices=["cpu"]), model, colocated=True)
    assert on_cpu["roofline_tok_s"] is None and "no known peak" in on_cpu["roofline_note"]
    assert _meta_model("/no/such/model") is None


def test_a_group_row_waits_for_its_slowest_rank():
    """Two ranks over 2 timed steps of 1,000 tokens each: rank 1 took 1.5 s, so the group's rate is 2,000 / 1.5
    tokens/s, 666.7 a GPU; each step's seconds are the slower rank's."""
    from asyncrl_bench.learner_group import group_row
    args = LearnerBenchArgs(**{**TINY_RAGGED, "ranks": 2, "baseline": False})
    ranks = [dict(timed_s=1.0, first_s=5.0, step_s=[0.4, 0.6], compiles_timed={"frames": 0}, peak_gib=None),
             dict(timed_s=1.5, first_s=4.0, step_s=[0.9, 0.6], compiles_timed={"frames": 0}, peak_gib=None)]
    row = group_row(args, ranks, tokens=2000.0, flops=1e12)
    assert row["ours_tok_s"] == pytest.approx(2000 / 1.5) and row["ours_tok_s_per_gpu"] == pytest.approx(2000 / 3)
    assert row["ours_step_s"] == [0.9, 0.6] and row["ours_first_step_s"] == 5.0 and row["ours_mfu"] is None
