"""`asyncrl plan`: reads the benches' --out files (rows in their real format), prints every layout with the
recommended one marked and the `asyncrl train` flags that run it (flags `asyncrl train` parses), writes --out, and
refuses bad input naming the flag and the fix; `asyncrl bench plan` measures briefly what no file gives."""

from __future__ import annotations

import json

import pytest

from asyncrl.planning import WORKLOADS, ModelShape, plan
from asyncrl.planning.command import plan_main, rates_from_rows, train_flags
from asyncrl_bench.cli import bench_main
from asyncrl.policies.loading import ARCH_PRESETS
from asyncrl.launch.train_command import run_config
from tests.cli_forks import cli_forks
from tests.run_helpers import ROOT

# what `asyncrl bench learner --rows 64 --out F` writes (asyncrl_bench.learner._learner_row + our columns) ...
LEARNER_ROW = {"device": "NVIDIA H100 80GB HBM3", "model": "random:qwen2.5-0.5b", "workload": "fixed", "rows": 64,
               "tokens_per_row": 320.0, "tokens_per_step": 20480.0, "response_tokens_per_step": 16384.0,
               "max_tokens_per_micro_batch": 16384, "pack_sequences": True, "gradient_checkpointing": True,
               "checkpoint_scope": "mlp", "compile_layers": True, "fused_optimizer": True, "offload": "none",
               "param_dtype": "float32", "ours_tok_s": 62314.0, "ours_mfu": 0.179, "ours_peak_gib": 18.5}
# ... and what `asyncrl bench engine --out F` writes: one row per batch size
ENGINE_ROWS = [{"device": "NVIDIA H100 80GB HBM3", "model": "random:qwen2.5-0.5b", "dtype": "bfloat16", "batch": b,
                "n": 1, "workload": "random 128-token prompts", "prompt_len": 128, "new_tokens": 512,
                "ours_tok_s": tok_s, "ours_mean_len": 512.0, "decode_step_ms": ms, "hf_tok_s": hf, "ratio": tok_s / hf}
               for b, tok_s, ms, hf in ((64, 22921.0, 2.80, 1129.0), (256, 56349.0, 4.54, 4481.0))]


@pytest.fixture
def files(tmp_path):
    learner, engine = tmp_path / "learner.json", tmp_path / "engine.json"
    learner.write_text(json.dumps(LEARNER_ROW))
    engine.write_text(json.dumps(ENGINE_ROWS))
    return learner, engine


def test_plan_reads_the_bench_files_and_prints_every_layout(files, tmp_path, capsys):
    learner, engine = files
    out = tmp_path / "plan.json"
    plan_main(["--model", "random:qwen2.5-0.5b", "--gpus", "2", "--learner-json", str(learner), "--engine-json",
               str(engine), "--out", str(out)])
    text = capsys.readouterr().out
    written = json.loads(out.read_text())
    expected = plan(ModelShape.from_hf(ARCH_PRESETS["qwen2.5-0.5b"]), WORKLOADS["gsm8k"],
                    rates_from_rows(LEARNER_ROW, ENGINE_ROWS), 2)
    assert [p["placement"] for p in written["placements"]] == ["1 trainer + 1 agent", "colocated sync (2)"]
    for row, p in zip(written["placements"], expected.predictions):
        assert row["trained_tok_s"] == pytest.approx(p.trained_tok_s) and row["recommended"] == (p is expected.best)
        assert f"{p.trained_tok_s:,.0f}" in text
    assert written["recommended"] == expected.best.layout.name
    assert written["rates"]["engine"] == [[64.0, 22921.0], [256.0, 56349.0]] and written["rates"]["learner_compiled"]
    marked = [line for line in text.splitlines() if line.startswith("* ")]
    assert len(marked) == 1 and expected.best.layout.name in marked[0]
    run_line = text.splitlines()[-1].strip()
    assert run_line == "asyncrl train PRESET " + " ".join(train_flags(expected.best))
    assert "494M parameters" in text and "note:" not in text  # the files measured the --model asked about


def test_a_file_of_another_model_is_named(files, capsys):
    learner, engine = files
    plan_main(["--model", "random:qwen2.5-1.5b", "--learner-json", str(learner), "--engine-json", str(engine)])
    assert "note: --learner-json measured random:qwen2.5-0.5b, not --model random:qwen2.5-1.5b" in capsys.readouterr().out


def test_the_printed_flags_are_what_asyncrl_train_parses():
    result = plan(ModelShape.from_hf(ARCH_PRESETS["qwen2.5-0.5b"]), WORKLOADS["ragged"],
                  rates_from_rows(LEARNER_ROW, ENGINE_ROWS), 3)
    for p, extra in zip(result.predictions, ({"trainer_dtype": "bfloat16"}, {"lora_rank": 8}, {}, {})):
        cfg = run_config("cpu-demo", train_flags(p, **extra))
        lay, k = p.layout, p.knobs
        assert len(cfg.placement.trainer_devices) == lay.trainer_gpus
        assert len(cfg.placement.agent_devices) == lay.agent_gpus
        shared = set(cfg.placement.trainer_devices) & set(cfg.placement.agent_devices)
        assert bool(shared) == (lay.kind != "split") and cfg.async_training.colocated == (lay.kind == "colocated")
        assert cfg.async_training.staleness_threshold == k.staleness
        assert cfg.async_training.trigger_parameter_sync_step == k.trigger
        assert cfg.trainer.mini_batch_size == k.mini_batch_size and cfg.rollout.n == k.n
        assert cfg.rollout.max_slots == k.slots and cfg.trainer.max_tokens_per_micro_batch == 16384
        assert cfg.trainer.param_dtype == extra.get("trainer_dtype", "float32")
        assert cfg.lora.rank == extra.get("lora_rank", 0)


def test_given_knobs_and_a_learner_rate_override(files, tmp_path):
    learner, engine = files
    out = tmp_path / "plan.json"
    plan_main(["--gpus", "1", "--learner-json", str(learner), "--engine-json", str(engine), "--prompt-len", "44",
               "--response-len", "256", "--mini-batch-size", "8", "--staleness-threshold", "0.5", "--slots", "128",
               "--learner-tok-s", "40000", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["rates"]["learner_tok_s"] == 40000 and written["workload"]["response_len"] == 256
    shared = next(p for p in written["placements"] if p["layout"]["kind"] == "shared")
    assert shared["knobs"] == {"mini_batch_size": 8, "staleness": 0.5, "trigger": 4, "n": 8, "slots": 128}


BAD = [
    (["--gpus", "0"], "--gpus 0 must be >= 1"),
    (["--slots", "4"], "--slots 4 must be >= --n 8"),
    (["--staleness-threshold", "-1"], "--staleness-threshold -1.0 must be >= 0"),
    (["--lora-rank", "8", "--trainer-dtype", "bfloat16"], "--trainer-dtype bfloat16 with --lora-rank 8"),
    (["--model", "/nowhere/model"], "--model /nowhere/model: no config.json there"),
    (["--learner-json", "{tmp}/missing.json"], "--learner-json {tmp}/missing.json: no such file; write it with "
                                               "`asyncrl bench learner --out {tmp}/missing.json`"),
    (["--learner-json", "{tmp}/engine.json"], "--learner-json {tmp}/engine.json: needs ours_tok_s, tokens_per_step"),
    (["--engine-json", "{tmp}/learner.json"], "--engine-json {tmp}/learner.json: no row with batch and ours_tok_s"),
    (["--engine-json", "{tmp}/broken.json"], "--engine-json {tmp}/broken.json: not a JSON file"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_names_the_flag_and_the_fix(files, tmp_path, monkeypatch, args, message):
    (tmp_path / "broken.json").write_text("{not json")

    def measuring(*_):  # a bad flag is refused before anything is measured
        raise AssertionError("measured before refusing bad input")
    monkeypatch.setattr("asyncrl_bench.plan.BenchRates.learner", measuring)
    monkeypatch.setattr("asyncrl_bench.plan.BenchRates.engine", measuring)
    with pytest.raises(SystemExit) as exit_:
        bench_main(["plan", *(a.format(tmp=tmp_path) for a in args)])
    assert str(exit_.value).startswith("asyncrl bench plan: " + message.format(tmp=tmp_path)), str(exit_.value)


def test_the_product_command_plans_from_files_only_and_names_the_bench_that_measures(files):
    learner, _ = files
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--gpus", "2", "--learner-json", str(learner)])
    assert str(exit_.value).startswith("asyncrl plan: --engine-json missing: `asyncrl plan` plans from measured rates")
    assert "`asyncrl bench engine --out engine.json`" in str(exit_.value)
    assert "`asyncrl bench plan`" in str(exit_.value)


def test_bench_plan_without_files_measures_briefly(tmp_path, capsys):
    """The benches run in this process (tiny model, CPU); their rows are what the planner reads."""
    out = tmp_path / "plan.json"
    bench_main(["plan", "--model", "random:tiny-qwen2", "--device", "cpu", "--gpus", "2", "--prompt-len", "8",
               "--response-len", "8", "--n", "2", "--slots", "8", "--measure-steps", "1", "--out", str(out)])
    text = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert "measured on cpu" in text and written["rates"]["learner_tok_s"] > 0
    assert [b for b, _ in written["rates"]["engine"]] == [8.0]  # one batch: 64 is above --slots 8
    assert not written["rates"]["learner_compiled"]  # layers are compiled on CUDA only
    assert written["recommended"] in {p["placement"] for p in written["placements"]}


def test_a_shared_prompt_plan_measures_groups_and_prints_the_layout_flag(tmp_path, capsys):
    """--kv-layout shared-prompt: the engine is measured in that layout with groups of --n (the rows say so), the
    printed flags carry it, and engine rows of another layout are refused naming the flag."""
    out = tmp_path / "plan.json"
    bench_main(["plan", "--model", "random:tiny-qwen2", "--device", "cpu", "--gpus", "2", "--prompt-len", "8",
               "--response-len", "8", "--n", "2", "--slots", "8", "--measure-steps", "1", "--kv-layout",
               "shared-prompt", "--out", str(out)])
    text = capsys.readouterr().out
    assert "--rollout.kv-layout shared-prompt" in text
    assert [b for b, _ in json.loads(out.read_text())["rates"]["engine"]] == [8.0]  # 4 prompts x 2 samples
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(ENGINE_ROWS))  # per-slot rows (no kv_layout field: the default)
    learner = tmp_path / "learner.json"
    learner.write_text(json.dumps(LEARNER_ROW))
    with pytest.raises(ValueError, match="--engine-json .* measured with --kv-layout slot .* --kv-layout shared-prompt"):
        from asyncrl.planning.command import PlanArgs, run_plan
        run_plan(PlanArgs(model="random:qwen2.5-0.5b", gpus=2, learner_json=str(learner), engine_json=str(engine),
                          kv_layout="shared-prompt"))


@pytest.mark.e2e
def test_the_command_is_registered():
    out, usage = cli_forks([["plan", "--gpus", "0"], ["--help"]], cwd=ROOT)
    assert out.returncode == 1 and "asyncrl plan: --gpus 0 must be >= 1" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert usage.returncode == 0 and "plan" in usage.stdout


def test_an_8b_full_fine_tune_fits_one_gpu_only_with_the_optimizer_offloaded(tmp_path, capsys):
    """Qwen3-8B shape, bf16 weights, one 80 GB GPU, from the learner row measured on an H100 with --offload
    optimizer (examples/plan): with offload the plan fits and its flags carry it; without, AdamW's states do not
    fit beside the weights (the message names --offload optimizer); that row is refused for a plan without
    offload (its peak memory is another layout's)."""
    measured = json.loads((ROOT / "examples/plan/learner-h100-qwen3-8b-offload-optimizer.json").read_text())
    learner, engine = tmp_path / "learner.json", tmp_path / "engine.json"
    engine.write_text(json.dumps(ENGINE_ROWS))
    learner.write_text(json.dumps(measured))
    base = ["--model", "random:qwen3-8b", "--gpus", "1", "--trainer-dtype", "bfloat16", "--slots", "32",
            "--engine-json", str(engine), "--learner-json", str(learner)]
    plan_main([*base, "--offload", "optimizer"])
    text = capsys.readouterr().out
    run_line = text.splitlines()[-1].strip()
    assert run_line.endswith("--trainer.param-dtype bfloat16 --trainer.offload optimizer")
    assert run_config("cpu-demo", run_line.split()[3:]).trainer.offload == "optimizer"  # asyncrl train parses them
    with pytest.raises(SystemExit, match="was measured with --offload optimizer and this plan is for --offload none"):
        plan_main(base)
    learner.write_text(json.dumps(dict(measured, offload="none", ours_peak_gib=None)))
    with pytest.raises(SystemExit) as exit_:
        plan_main(base)
    assert exit_.value.code == 1
    assert "no layout fits in --gpu-memory-gib" in capsys.readouterr().out


def test_the_one_node_report_s_blind_prediction_for_the_1_7b_shape_on_4_gpus(capsys):
    """docs/benchmarks/one-node-4xh100-2026-11-27.md's planner table comes from the transcribed 1.7B rates
    (examples/plan/*qwen3-1.7b*.json): 2 + 2 picked at 44,739 trained tok/s, colocated sync 25,046, so the best
    split is 1.79x sync."""
    plan_main(["--model", "random:qwen3-1.7b", "--gpus", "4",
               "--learner-json", str(ROOT / "examples/plan/learner-h100-qwen3-1.7b.json"),
               "--engine-json", str(ROOT / "examples/plan/engine-h100-qwen3-1.7b.json"),
               "--prompt-len", "110", "--response-len", "1024", "--mini-batch-size", "16",
               "--staleness-threshold", "0.5", "--trigger", "4", "--slots", "256"])
    text = capsys.readouterr().out
    assert "* 2 trainer + 2 agent             44,739" in text
    for row in ("1 trainer + 3 agent             34,359", "3 trainer + 1 agent             37,138",
                "colocated sync (4)              25,046"):
        assert row in text
