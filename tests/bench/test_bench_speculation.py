"""`asyncrl bench speculation` (asyncrl_bench/speculation.py) on CPU, small: both parts run, the speculative runs
give plain decoding's tokens (fp32), and the fields a report reads come out in range; bad flags are refused."""

from __future__ import annotations

import json

import pytest

from asyncrl.policies import save_pretrained
from asyncrl_bench.speculation import SpeculationBenchArgs, bench_speculation
from tests.policies.helpers import tiny_model
from tests.run_helpers import needs_vllm, vllm_one_thread


def test_a_small_cpu_run_reports_both_parts(tmp_path):
    out = tmp_path / "spec.json"
    save_pretrained(tiny_model(seed=3, initializer_range=1.0), tmp_path / "model")  # peaked: some drafts are kept
    rows = bench_speculation(SpeculationBenchArgs(
        model=str(tmp_path / "model"), device="cpu", prompts=3, n=4, new_tokens=24, prompt_len=12, batch_sizes=(2, 5),
        steps=3, tokens=(1, 3), max_rows=64, out=str(out)))
    ends = [r for r in rows if r["kind"] == "end_to_end"]
    costs = [r for r in rows if r["kind"] == "step_cost"]
    assert [r["draft_tokens"] for r in ends] == [1, 3]
    assert [(r["batch"], r["draft_tokens"]) for r in costs] == [(2, 1), (2, 3), (5, 1), (5, 3)]
    for r in ends:
        assert r["identical_share"] == 1.0  # lossless: fp32 gives plain decoding's tokens
        assert r["generated"] == 3 * 4 * 24 and 0.0 < r["acceptance"] <= 1.0 and r["spec_steps"] > 0
        assert r["divergences_per_1k_tokens"] == 0.0 and r["spec_mean_abs_dlogp"] < 1e-4
        assert 1.0 <= r["tokens_per_spec_row_step"] <= 1 + r["draft_tokens"]
        assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["plain_tok_s"])
        assert 0.0 < r["accepted_share"] < 1.0  # kept drafts' share of the generated tokens
    for r in costs:
        assert r["plain_step_ms"] > 0 and r["spec_step_ms"] > 0
        assert r["cost_ratio"] == pytest.approx(r["spec_step_ms"] / r["plain_step_ms"])
    assert json.loads(out.read_text()) == rows


@pytest.mark.parametrize("changes, message", [
    (dict(tokens=(0,)), "--tokens 0"),
    (dict(prompts=-1), "--prompts"),
    (dict(batch_sizes=(0,)), "--batch-sizes"),
    (dict(dtype="float17"), "--dtype float17"),
    (dict(vllm=True, prompts=0), "--vllm"),
])
def test_bad_flags_are_refused(changes, message):
    args = SpeculationBenchArgs(device="cpu", **changes)
    with pytest.raises(ValueError, match=message):
        args.validate()
        args.torch_dtype()


@pytest.mark.e2e
def test_vllm_ngram_speculation_runs_beside_ours_on_the_same_prompts(smollm2_cache, monkeypatch):
    """--vllm: vLLM (in a process of its own) generates the same timed prompts plain and with its n-gram drafts;
    its counters give the acceptance and tokens a step, in the same row as ours."""
    needs_vllm()
    vllm_one_thread(monkeypatch)
    [row] = bench_speculation(SpeculationBenchArgs(
        model="smollm2", device="cpu", dtype="float32", prompts=2, n=2, new_tokens=24, prompt_len=16,
        temperature=0.0, tokens=(3,), batch_sizes=(), vllm=True))
    assert row["generated"] == row["vllm_generated"] == 2 * 2 * 24  # random prompts: every sample runs its budget
    assert 0.0 <= row["vllm_acceptance"] <= 1.0  # greedy SmolLM2 on random prompts repeats itself: drafts were made
    assert 1.0 <= row["vllm_tokens_per_spec_row_step"] <= 1 + 3 and 0.0 <= row["vllm_accepted_share"] < 1.0
    assert row["vllm_speedup"] == pytest.approx(row["vllm_spec_tok_s"] / row["vllm_plain_tok_s"])
    assert row["spec_vs_vllm_spec"] == pytest.approx(row["spec_tok_s"] / row["vllm_spec_tok_s"])
