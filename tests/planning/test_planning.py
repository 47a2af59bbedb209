"""The split planner's model (asyncrl.planning): golden values worked by hand, and properties over random
measured rates, workloads, layouts and knobs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.planning.predict import (
    FSDP_GROUP, GIB, MIN_GAIN, Knobs, Layout, ModelShape, Rates, Workload, engine_tok_s, layout_of, layouts,
    memory_gib, plan, predict, recommend, sync_seconds,
)
from asyncrl.policies.loading import ARCH_PRESETS

QWEN_05B = ModelShape.from_hf(ARCH_PRESETS["qwen2.5-0.5b"])
# a made-up shape whose bf16 weights (2.25e9 bytes) publish in round times: 0.03 s over NCCL (75e9 B/s), 4.0909 s
# over gloo on one GPU (0.55e9), 0.32143 s colocated (7e9)
SHAPE = ModelShape(params=1_125_000_000, layers=10, hidden=1000, attention_width=1000, kv_width=200,
                   intermediate=3000, vocab=1000)
WORK = Workload(prompt_len=100, response_len=400, max_prompt_len=100, max_response_len=400)  # 500 tokens a sample
RATES = Rates(learner_tok_s=10_000, learner_step_tokens=1000, learner_budget=1000, engine=((100, 5000.0),))
KNOBS = Knobs(mini_batch_size=4, staleness=0.5, trigger=2, n=5, slots=100)  # 20 samples a step


def test_qwen25_05b_shape_counts_its_494m_parameters():
    # embedding 151,936 x 896 = 136,134,656 (tied: no second LM head); per layer q 896x896 + 896, k and v
    # 896x128 + 128 each, o 896x896, MLP 3 x 896 x 4,864, two norms 2 x 896: 14,912,384, x 24 = 357,897,216;
    # final norm 896: 494,032,768
    assert QWEN_05B.params == 494_032_768
    assert QWEN_05B.kv_bytes_per_token == 2 * 24 * (2 * 64) * 2  # K and V, 24 layers, 2 KV heads x 64, bf16
    # the Qwen3-8B shape at rank 32: per layer 2(4096+4096) + 2(4096+1024) + 3(4096+12288) = 75,776, x 36 x 32
    # = 87,293,952 adapter parameters: 349 MB in fp32, what BENCHMARKS.md measured a LoRA publication at
    assert ModelShape.from_hf(ARCH_PRESETS["qwen3-8b"]).lora_params(32) * 4 == 349_175_808


def test_engine_rate_is_interpolated_between_measured_batches():
    points = ((64, 22_921.0), (256, 56_349.0))
    assert engine_tok_s(points, 128) == pytest.approx(22_921 + (56_349 - 22_921) * 64 / 192)  # 34,063.7
    assert engine_tok_s(points, 32) == pytest.approx(22_921 / 2)  # per sequence as fast as at 64
    assert engine_tok_s(points, 1024) == 56_349  # no faster than the largest batch measured


def test_split_golden_values():
    p = predict(SHAPE, WORK, RATES, Layout("split", 1, 1), KNOBS)
    # window int(4 x 1.5 x 2) = 12 prompts x 5 = 60 sequences (< 100 slots) -> 5000 x 60/100 = 3000 tok/s;
    # a step of 20 samples: train 20 x 500 / 10,000 = 1 s, generate 20 x 400 / 3000 = 2.667 s; a batch finishes
    # after 400 x 60 / 3000 = 8 s; one whole step runs ahead ((12 - 8) // 4), so the boundary loses
    # 8 x 1 / 2.667 - 2.667 = 0.333 s; version = 2 x 2.667 + 0.333 + 0.03 (sync) = 5.6967 s
    version = 2 * 8 / 3 + 1 / 3 + 0.03
    assert p.engine_batch == 60 and p.version_s == pytest.approx(version)
    assert p.trained_tok_s == pytest.approx(2 * 20 * 500 / version)  # 3,510.8
    assert p.trainer_idle == pytest.approx(1 - (2 * 1 + 0.03) / version)  # 0.6437
    assert p.rollout_idle == pytest.approx(1 - 2 * 8 / 3 / version)  # 0.0638
    assert p.trainer_capacity_tok_s == 10_000 and p.rollout_capacity_tok_s == pytest.approx(3000 * 500 / 400)


def test_shared_gpu_golden_values():
    p = predict(SHAPE, WORK, Rates(5000, 1000, 1000, ((100, 5000.0),)), Layout("shared", 1, 1), KNOBS)
    # train 2 s, generate 2.667 s a step; per version 4 and 5.333 s alone, a GPU demand of 0.56 x 4 + 0.78 x 5.333
    # = 6.4 s: both slowed 6.4 / 5.333 = 1.2x; boundary 8 x 2 / 2.667 - 2.667 = 3.333 s; sync over gloo 4.0909 s
    stretch, sync = 1.2, 2.25e9 / 0.55e9
    version = stretch * (16 / 3 + 10 / 3) + sync  # 14.4909 s
    assert p.version_s == pytest.approx(version)
    assert p.trained_tok_s == pytest.approx(20_000 / version)  # 1,380.2
    assert p.trainer_idle == pytest.approx(1 - (stretch * 4 + sync) / version)  # 0.3864
    assert p.rollout_idle == pytest.approx(1 - stretch * 16 / 3 / version)  # 0.5583


def test_colocated_golden_values():
    p = predict(SHAPE, WORK, RATES, Layout("colocated", 2, 2), KNOBS)
    # staleness 0, trigger 1: 4 prompts x 5 / 2 engines = 10 sequences each at 5000 x 10/100 = 500 tok/s, one
    # wave of 400 x 10 / 500 = 8 s; train 20 x 500 / (2 x 10,000) = 0.5 s (measured uncompiled: no eager penalty);
    # sync 2.25e9 / 7e9 = 0.3214 s
    version = 8 + 0.5 + 2.25e9 / 7e9
    assert p.knobs.staleness == 0.5 and p.engine_batch == 10  # the knob is kept, colocated runs it at 0
    assert p.version_s == pytest.approx(version)
    assert p.trained_tok_s == pytest.approx(20 * 500 / version)  # 1,133.6
    assert p.trainer_idle == pytest.approx(8 / version) and p.rollout_idle == pytest.approx(1 - 8 / version)
    compiled = predict(SHAPE, WORK, Rates(10_000, 1000, 1000, ((100, 5000.0),), learner_compiled=True),
                       Layout("colocated", 2, 2), KNOBS)
    assert compiled.version_s == pytest.approx(8 + 0.5 / FSDP_GROUP[2] + 2.25e9 / 7e9)  # 2 ranks: 0.82 a GPU


def test_memory_golden_values():
    rates = Rates(62_314, 20_480, 16_384, ((256, 56_349.0),), learner_peak_gib=18.5)
    work = Workload(107, 1024, 512, 1024)
    # trainer states 16 x 494,032,768 = 7,904,524,288 B; the measured 18.5 GiB peak leaves 11,959,699,456 B of
    # activations, which do not shard: 2 ranks hold 3,952,262,144 + 11,959,699,456 = 14.819 GiB each
    one, engine = memory_gib(QWEN_05B, work, rates, Layout("split", 1, 1), 256)
    two, _ = memory_gib(QWEN_05B, work, rates, Layout("split", 2, 2), 256)
    assert one == pytest.approx(18.5) and two == pytest.approx(15_911_961_600 / GIB)
    # engine: bf16 weights 988,065,536 + KV 256 x 1,536 x 12,288 = 4,831,838,208 + logits 256 x 151,936 x 4
    # = 155,582,464 + 1.25 GiB = 6.815 GiB (the 2 x H200 rows measured 6.8)
    assert engine == pytest.approx((988_065_536 + 4_831_838_208 + 155_582_464) / GIB + 1.25)
    shared, none = memory_gib(QWEN_05B, work, rates, Layout("shared", 1, 1), 256)
    assert shared == pytest.approx(one + engine) and none == 0
    # LoRA: a bf16 base (2 B a parameter) and 16 B an adapter parameter, the engine keeping a second base
    lora, lora_engine = memory_gib(QWEN_05B, work, rates, Layout("split", 1, 1), 256, lora_rank=8)
    assert lora == pytest.approx(18.5)  # the measured peak is the peak whatever is trained
    assert lora_engine == pytest.approx(engine + 988_065_536 / GIB)


def test_sync_seconds():
    assert sync_seconds(SHAPE, "split") == pytest.approx(0.03)
    assert sync_seconds(QWEN_05B, "shared", lora_rank=8) == pytest.approx(4 * QWEN_05B.lora_params(8) / 0.55e9)


def test_recommended_staleness_hides_the_boundary_and_is_zero_where_one_side_dominates():
    # mini-batch 4, trigger 2, no staleness: window 8 prompts = 40 sequences at 2000 tok/s; train 1 s, generate
    # 20 x 400 / 2000 = 4 s a step, a batch lasts 8 s: the trainer waits max(4, 8) x 1 / 4 = 2 s a version, one
    # step (4 s) of the slower side hides it: staleness 1 / 2
    knobs = recommend(SHAPE, WORK, RATES, Layout("split", 1, 1), n=5, slots=100, trigger=2, mini_batch_size=4)
    assert knobs == Knobs(4, 0.5, 2, 5, 100)
    # a learner 100 x slower (100 s a step): the 8 s wait is 4 % of a 208 s version, under MIN_GAIN
    slow = Rates(100, 1000, 1000, ((100, 5000.0),))
    assert recommend(SHAPE, WORK, slow, Layout("split", 1, 1), n=5, slots=100, trigger=2,
                     mini_batch_size=4).staleness == 0.0
    # given knobs are kept; colocated sync always runs staleness 0 at trigger 1, its mini-batch filling both
    # engines' 256 slots in one wave: ceil(256 x 2 / 8) = 64 groups
    given = recommend(SHAPE, WORK, RATES, Layout("split", 1, 1), staleness=0.3, mini_batch_size=7)
    assert (given.staleness, given.mini_batch_size) == (0.3, 7)
    assert recommend(SHAPE, WORK, RATES, Layout("colocated", 2, 2), trigger=4, staleness=0.3) == Knobs(64, 0.0, 1, 8, 256)


def test_recommended_mini_batch_fills_the_learner_step_and_the_engine_slots():
    # learner: ceil(1 x 1000 / (5 x 500)) = 1 group; engines: ceil(100 slots x 1 / (2 steps x 5)) = 10 groups
    assert recommend(SHAPE, WORK, RATES, Layout("split", 1, 1), n=5, slots=100, trigger=2).mini_batch_size == 10
    # a learner measured on 40,000-token steps: ceil(2 x 40,000 / 2500) = 32 groups for 2 trainer GPUs
    big = Rates(10_000, 40_000, 1000, ((100, 5000.0),))
    assert recommend(SHAPE, WORK, big, Layout("split", 2, 1), n=5, slots=100, trigger=2).mini_batch_size == 32


def test_layouts_and_layout_of():
    assert [lay.name for lay in layouts(1)] == ["colocated sync (1)", "trainer + agent, 1 GPU"]
    assert layouts(3) == (Layout("split", 1, 2), Layout("split", 2, 1), Layout("colocated", 3, 3))
    assert layout_of(["cuda:0"], ["cuda:1", "cuda:2"], False) == Layout("split", 1, 2)
    assert layout_of(["cuda:0"], ["cuda:0"], False).kind == "shared"
    assert layout_of(["cpu"], ["cpu", "cpu"], False).kind == "shared"  # agents sharing a device
    assert layout_of(["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"], True) == Layout("colocated", 2, 2)


# ----------------------------------------------------------------------------------------------- properties
@st.composite
def engine_points(draw):
    """Physical engine rows: tok/s never falls as the batch grows, and no sequence runs faster in a larger batch."""
    points, batch, tok_s = [], draw(st.integers(1, 64)), draw(st.floats(100, 50_000))
    for _ in range(draw(st.integers(1, 3))):
        points.append((float(batch), tok_s))
        grow = draw(st.floats(1.5, 8))
        batch, tok_s = batch * grow, tok_s * draw(st.floats(1.0, grow))
    return tuple(points)


@st.composite
def cases(draw):
    rates = Rates(draw(st.floats(1000, 200_000)), draw(st.floats(1000, 100_000)), draw(st.sampled_from([4096, 16_384])),
                  draw(engine_points()), draw(st.none() | st.floats(5, 40)), draw(st.booleans()))
    prompt, response = draw(st.integers(8, 1024)), draw(st.integers(8, 2048))
    work = Workload(prompt, response, prompt + draw(st.integers(0, 512)), response + draw(st.integers(0, 2048)))
    knobs = Knobs(draw(st.integers(1, 64)), draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 2.0])),
                  draw(st.integers(1, 8)), draw(st.sampled_from([1, 4, 8, 16])), draw(st.sampled_from([16, 64, 256])))
    shape = draw(st.sampled_from([QWEN_05B, SHAPE, ModelShape.from_hf(ARCH_PRESETS["qwen3-8b"])]))
    return shape, work, rates, knobs


@given(cases(), st.integers(1, 6))
def test_predictions_stay_within_each_sides_capacity_and_idle_fractions_in_0_1(case, gpus):
    shape, work, rates, knobs = case
    for layout in layouts(gpus):
        p = predict(shape, work, rates, layout, knobs)
        assert 0 < p.trained_tok_s <= min(p.trainer_capacity_tok_s, p.rollout_capacity_tok_s) * (1 + 1e-9)
        assert 0 <= p.trainer_idle <= 1 and 0 <= p.rollout_idle <= 1
        assert p.version_s > 0 and p.trainer_gib > 0 and p.agent_gib >= 0


@given(cases(), st.integers(1, 6), st.floats(4, 80))
def test_the_recommended_layout_fits_and_is_the_fastest_that_does(case, gpus, gpu_gib):
    shape, work, rates, _ = case
    result = plan(shape, work, rates, gpus, gpu_gib=gpu_gib)
    fitting = [p for p in result.predictions if max(p.trainer_gib, p.agent_gib) <= gpu_gib]
    assert [p.fits for p in result.predictions] == [p in fitting for p in result.predictions]
    if not fitting:
        assert result.best is None
    else:
        assert result.best.fits and result.best.trained_tok_s == max(p.trained_tok_s for p in fitting)


@given(cases(), st.integers(1, 5))
def test_more_gpus_never_predict_less(case, gpus):
    """Within MIN_GAIN: where staleness would buy less than that, the planner leaves it at 0 and says so."""
    shape, work, rates, knobs = case
    few = plan(shape, work, rates, gpus, n=knobs.n, slots=knobs.slots, trigger=knobs.trigger, gpu_gib=1e6)
    more = plan(shape, work, rates, gpus + 1, n=knobs.n, slots=knobs.slots, trigger=knobs.trigger, gpu_gib=1e6)
    assert more.best.trained_tok_s * (1 + MIN_GAIN) >= few.best.trained_tok_s * (1 - 1e-9)


@given(cases(), st.integers(1, 3), st.integers(1, 3))
def test_recommended_staleness_leaves_no_boundary_wait(case, trainers, agents):
    """Where the planner recommends staleness, nothing is lost at a version boundary: a version takes trigger
    steps of the slower side plus the sync."""
    shape, work, rates, knobs = case
    layout = Layout("split", trainers, agents)
    rec = recommend(shape, work, rates, layout, n=knobs.n, slots=knobs.slots, trigger=knobs.trigger)
    p = predict(shape, work, rates, layout, rec)
    steps = rec.trigger * rec.mini_batch_size * rec.n * work.row_tokens / min(p.trainer_capacity_tok_s,
                                                                              p.rollout_capacity_tok_s)
    if rec.staleness > 0:
        assert p.version_s == pytest.approx(steps + p.sync_s)
    else:
        assert p.version_s >= steps + p.sync_s - 1e-9
