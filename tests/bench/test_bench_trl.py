"""scripts/bench_trl.py without TRL: TRL is not an asyncrl dependency, so the TRL run itself is a script outside
the suite (its docstring gives the smoke command). Checked here: the arguments, the batch geometry and its
refusals, the prompts and the reward TRL is given, the per-step timer, the JSON summary's arithmetic (with a
stand-in `trl` module for its version), and the refusal, with the fix, when TRL is missing."""

from __future__ import annotations

import json
import statistics
import sys
import types

import pytest

from scripts import bench_trl

SMOKE = ["--model", "m", "--data", "d.jsonl", "--steps", "3", "--prompts-per-step", "2", "--n", "2"]


class WordTokenizer:
    """What load_prompts uses of an HF tokenizer: a chat template and token counts (one token per word)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": text.split()}


def test_arguments_and_their_refusals():
    args = bench_trl.parse_args(SMOKE + ["--num-generations", "4"])  # torchrun's spelling of --n
    assert args.n == 4 and args.steps == 3 and args.warmup_steps_excluded == 1 and not args.bf16
    with pytest.raises(SystemExit) as exit_:
        bench_trl.parse_args(SMOKE + ["--steps", "1"])  # nothing left to time after the excluded warm-up step
    assert exit_.value.code == 2


def test_a_step_is_one_generation_round_split_evenly_over_processes_and_micro_batches():
    args = bench_trl.parse_args(["--model", "m", "--data", "d", "--prompts-per-step", "32", "--n", "8",
                                 "--per-device-batch-size", "8"])
    assert bench_trl.step_geometry(args, world=1) == (256, 8, 32)  # 32 × 8 = 256 = 8 per micro-batch × 32
    assert bench_trl.step_geometry(args, world=2) == (256, 8, 16)  # 128 per process
    small = bench_trl.parse_args(SMOKE + ["--per-device-batch-size", "8"])
    assert bench_trl.step_geometry(small, world=1) == (4, 4, 1)  # the micro-batch is capped at the step's share
    with pytest.raises(SystemExit, match="= 4 is not divisible by 3 processes"):
        bench_trl.step_geometry(small, world=3)
    odd = bench_trl.parse_args(SMOKE + ["--prompts-per-step", "3", "--per-device-batch-size", "4"])
    with pytest.raises(SystemExit, match="6 completions per process are not divisible by micro-batch 4"):
        bench_trl.step_geometry(odd, world=1)


def test_prompts_are_phrased_as_convert_gsm8k_and_long_ones_are_dropped(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Add 2 and 3.", "answer": "2+3=5\n#### 5"},
            {"question": "word " * 50 + "?", "answer": "#### 1,000"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    [kept] = bench_trl.load_prompts(str(data), WordTokenizer(), max_prompt_length=40)
    assert kept == {"prompt": [{"role": "user", "content": f"Add 2 and 3. {bench_trl.GSM8K_INSTRUCTION}"}],
                    "ground_truth": "5"}
    both = bench_trl.load_prompts(str(data), WordTokenizer(), max_prompt_length=100)
    assert [r["ground_truth"] for r in both] == ["5", "1000"]
    with pytest.raises(SystemExit, match="no prompt fits in 3 tokens"):
        bench_trl.load_prompts(str(data), WordTokenizer(), max_prompt_length=3)


def test_the_reward_scores_conversational_and_plain_completions():
    completions = [[{"role": "assistant", "content": "2+3=5 #### 5"}], "#### 4", "The answer is 5"]
    assert bench_trl.gsm8k(completions, ["5", "5", "5"], prompts=None) == [1.0, 0.0, 0.0]


class _State:
    def __init__(self, tokens: int):
        self.num_input_tokens_seen = tokens


def test_the_step_timer_times_each_step_and_keeps_trls_completion_logs():
    timer = bench_trl._step_timer()
    timer.on_step_begin(None, _State(10), None)
    timer._gen += 0.25  # what the wrapped generate adds within the step
    timer.on_step_end(None, _State(50), None)
    timer.on_log(None, None, None, logs={"loss": 0.1})  # a log without completions is not a step's log
    timer.on_log(None, None, None, logs={"completions/mean_length": 6.0, "reward": 0.5})
    assert len(timer.seconds) == 1 and timer.seconds[0] >= 0
    assert timer.total_tokens == [40] and timer.generate_s == [0.25]
    assert timer.logs == [{"completions/mean_length": 6.0, "reward": 0.5}]


def test_the_summary_medians_and_rates_leave_out_the_warmup_step(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(__version__="0.0-stand-in"))
    args = bench_trl.parse_args(SMOKE + ["--out", "x.json"])
    timer = types.SimpleNamespace(
        seconds=[3.0, 1.0, 2.0], total_tokens=[100, 120, 90], generate_s=[2.0, 0.5, 1.0],
        logs=[{"completions/mean_length": m, "reward": r, "grad_norm": 1.0} for m, r in ((8.0, 0.0), (6.0, 0.5),
                                                                                            (4.0, 1.0))])
    result = bench_trl._summary(args, timer, world=1, completions_per_step=4, prompts=7, micro=4, accumulation=1)
    assert result["tool"] == "trl" and result["trl_version"] == "0.0-stand-in" and result["world_size"] == 1
    assert result["time_per_step_s"] == statistics.median([1.0, 2.0]) == 1.5  # step 0 is the warm-up
    assert result["completion_tokens"] == [32, 24, 16]  # mean length × 4 completions
    assert result["completion_tokens_per_s"] == pytest.approx((24 + 16) / (1.0 + 2.0))
    assert result["total_tokens_per_s"] == pytest.approx((120 + 90) / (1.0 + 2.0))
    assert result["reward_mean"] == [0.0, 0.5, 1.0] and result["grad_norm"] == [1.0, 1.0, 1.0]
    config = result["config"]
    assert "out" not in config and config["completions_per_step"] == 4 and config["prompts_in_dataset"] == 7
    assert config["loss_type"] == "dapo" and config["gradient_accumulation_steps"] == 1
    out = capsys.readouterr().out
    assert "1.50 s/step (median of 2)" in out and "mean reward 0.750" in out


def test_without_trl_the_script_stops_at_once_saying_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` fails, whether or not TRL is installed
    with pytest.raises(SystemExit) as exit_:
        bench_trl.main(SMOKE)
    assert "scripts/bench_trl.py needs TRL" in str(exit_.value.code)
    assert f"{sys.executable} -m pip install trl" in str(exit_.value.code)
    # the batch geometry is refused first, without TRL
    with pytest.raises(SystemExit, match="not divisible by micro-batch"):
        bench_trl.main(SMOKE + ["--prompts-per-step", "3", "--per-device-batch-size", "4"])
