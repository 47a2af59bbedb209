"""`asyncrl bench admission` (asyncrl_bench/admission.py): an agent's admission rule driven on our engine with
heavy-tailed per-sample budgets. The budgets fix every sample's length, so the decode steps and the rows generating
are determined by the rule, not by the machine: twice the groups in flight take the slots finished samples free."""

from __future__ import annotations

import pytest

from asyncrl_bench.admission import AdmissionBenchArgs, bench_admission


def test_twice_the_groups_in_flight_fill_the_slots_that_finished_samples_free(tmp_path):
    args = AdmissionBenchArgs(model="random:tiny-qwen2", device="cpu", slots=16, n=4, in_flight=(1.0, 2.0), groups=24,
                              prompt_len=8, new_tokens=64, tail_ratio=10.0, out=str(tmp_path / "a.json"))
    one, two = bench_admission(args)
    assert (one["prompts_in_flight"], two["prompts_in_flight"]) == (4, 8)
    assert one["tokens"] == two["tokens"]  # the same budgets, generated whole
    assert one["ratio_vs_first"] == 1.0
    # with slots // n groups a group's finished samples leave their slots empty: about E[L] / E[Lmax] generate
    assert one["slots_generating"] == pytest.approx(one["expected_share_at_one"], abs=0.15)
    assert two["slots_generating"] > one["slots_generating"] + 0.1
    assert two["decode_steps"] < one["decode_steps"]
    assert (tmp_path / "a.json").is_file()


@pytest.mark.parametrize("kwargs, message", [
    (dict(slots=2, n=4), "must hold at least one group"),
    (dict(in_flight=(0.0,)), "positive multiples"),
    (dict(tail_ratio=0.5), "--tail-ratio 0.5"),
])
def test_bad_arguments_are_named_before_a_model_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdmissionBenchArgs(device="cpu", **kwargs).validate()
