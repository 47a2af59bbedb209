"""DatasetSource (deterministic per-epoch shuffling, exact resume) and the run's SourceFactory over a prompt
file, plus the GSM8K preset's placeholders."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.config import GRPO, DataConfig, RunConfig
from asyncrl.data.sources import DatasetSource
from asyncrl.data.tasks import render_chat
from asyncrl.config.presets import PRESETS
from asyncrl.launch.run_spec import SourceFactory, build_spec
from asyncrl.types import Prompt

N = 7


def _prompts(n: int = N) -> list[Prompt]:
    return [Prompt([i], ground_truth=str(i), index=i) for i in range(n)]


def _take(source, k: int) -> list[int]:
    return [source.next().index for _ in range(k)]


def test_every_epoch_is_a_permutation_fixed_by_the_seed():
    a, b = DatasetSource(_prompts(), seed=3), DatasetSource(_prompts(), seed=3)
    epochs = [_take(a, N) for _ in range(4)]
    assert [_take(b, N) for _ in range(4)] == epochs  # same seed, same stream
    assert all(sorted(e) == list(range(N)) for e in epochs)  # each epoch visits every row once
    assert len({tuple(e) for e in epochs}) > 1  # and is reshuffled
    assert _take(DatasetSource(_prompts(), seed=4), 3 * N) != [i for e in epochs[:3] for i in e]
    assert _take(DatasetSource(_prompts(), seed=3, shuffle=False), 2 * N) == list(range(N)) * 2


@given(consumed=st.integers(0, 4 * N), seed=st.integers(0, 1000), shuffle=st.booleans())
def test_state_dict_resumes_exactly(consumed, seed, shuffle):
    reference = DatasetSource(_prompts(), seed=seed, shuffle=shuffle)
    expected = _take(reference, consumed + 2 * N)
    source = DatasetSource(_prompts(), seed=seed, shuffle=shuffle)
    _take(source, consumed)
    state = json.loads(json.dumps(source.state_dict()))  # it survives a checkpoint's serialisation
    resumed = DatasetSource(_prompts(), seed=seed, shuffle=shuffle)
    resumed.load_state_dict(state)
    assert _take(resumed, 2 * N) == expected[consumed:]


def _small_jsonl(path, n=12) -> str:
    rows = []
    for i in range(n):
        question = f"What is {i} + {i}?" + (" Think hard." * 60 if i == 5 else "")  # row 5 is too long
        if i % 3:
            rows.append({"prompt": [{"role": "user", "content": question}], "data_source": "openai/gsm8k",
                         "reward_model": {"ground_truth": str(2 * i)}})
        else:
            rows.append({"prompt": question, "ground_truth": str(2 * i), "data_source": "arithmetic"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_source_factory_loads_a_prompt_file(tmp_path, smollm2_tokenizer, caplog):
    path = _small_jsonl(tmp_path / "small.jsonl")
    data = DataConfig(path=path, seed=5, system_prompt="Answer with the number only.")
    with caplog.at_level(logging.INFO, logger="asyncrl.launch.run_spec"):
        source = SourceFactory(data, "smollm2", max_prompt_length=128)()
    assert isinstance(source, DatasetSource) and len(source.prompts) == 11
    assert "12 rows, 11 kept, 1 filtered (longer than 128 tokens), 0 truncated, 0 empty dropped" in caplog.text
    seen = _take(source, 11)
    assert sorted(seen) == [i for i in range(12) if i != 5]
    assert seen == _take(DatasetSource(source.prompts, seed=5), 11)  # shuffled with data.seed
    prompt = next(p for p in source.prompts if p.index == 4)
    assert prompt.data_source == "openai/gsm8k" and prompt.ground_truth == "8"
    assert prompt.prompt_ids == render_chat(smollm2_tokenizer, "What is 4 + 4?", system="Answer with the number only.")

    ordered = SourceFactory(dataclasses.replace(data, shuffle=False, on_long="truncate"), "smollm2", 128)()
    assert _take(ordered, 12) == list(range(12)) and len(ordered.prompts[5].prompt_ids) == 128


def test_source_factory_errors_name_the_fix(tmp_path):
    path = _small_jsonl(tmp_path / "small.jsonl")
    with pytest.raises(ValueError, match=r"all 12 prompts are longer than --rollout\.max-prompt-length 4 .*"
                                         r"--data\.on-long truncate"):
        SourceFactory(DataConfig(path=path), "smollm2", max_prompt_length=4)()
    with pytest.raises(ValueError, match=r"--model\.path random:tiny-qwen2 has none"):
        SourceFactory(DataConfig(path=path), "random:tiny-qwen2", max_prompt_length=128)()
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no rows"):
        SourceFactory(DataConfig(path=str(tmp_path / "empty.jsonl")), "smollm2", max_prompt_length=128)()


def test_gsm8k_preset_mirrors_the_experiment_and_demands_its_paths():
    _, preset = PRESETS["gsm8k-qwen2.5-0.5b"]
    assert (preset.rollout.n, preset.rollout.temperature, preset.rollout.max_new_tokens) == (8, 1.0, 3072)
    assert preset.trainer.max_response_length == 3072 and preset.trainer.use_dynamic_bsz
    algo = preset.algorithm
    assert type(algo) is GRPO
    assert (algo.clip_ratio_high, algo.kl_loss_coef, algo.kl_loss_type) == (0.28, 0.001, "low_var_kl")
    assert (algo.overlong_buffer_len, algo.overlong_penalty_factor, algo.loss_agg_mode) == (512, 1.0, "token-mean")
    a = preset.async_training
    assert (a.staleness_threshold, a.trigger_parameter_sync_step, a.require_batches) == (0.2, 4, 1)
    assert a.partial_rollout
    assert preset.placement.trainer_devices == ("cuda:0",) and preset.placement.agent_devices == ("cuda:1",)

    with pytest.raises(ValueError, match=r"--model\.path <.*> is invalid: it is a preset placeholder; "
                                         r"pass --model\.path "):
        preset.validate()
    with_model = dataclasses.replace(preset, model=dataclasses.replace(preset.model, path="/models/qwen"))
    with pytest.raises(ValueError, match=r"--data\.path <.*> is invalid: .* --data\.path .*`asyncrl data "
                                         r"convert-gsm8k --src "):
        with_model.validate()
    ready = dataclasses.replace(with_model, data=dataclasses.replace(preset.data, path="data/gsm8k/train.parquet"))
    ready.validate()
    spec = build_spec(ready)  # wires the file into the trainer's source factory
    assert spec.source_factory.data.path == "data/gsm8k/train.parquet"
    assert spec.source_factory.max_prompt_length == ready.rollout.max_prompt_length
    bad = dataclasses.replace(ready, data=dataclasses.replace(ready.data, path="train.csv"))
    with pytest.raises(ValueError, match=r"--data\.path train\.csv is invalid: must be a \.jsonl or \.parquet file"):
        bad.validate()
    assert RunConfig().data.path is None  # the other presets keep their procedural tasks


def test_random_model_reading_text_prompts_needs_a_tokenizer_at_startup():
    cfg = dataclasses.replace(PRESETS["cpu-demo"][1], model=dataclasses.replace(PRESETS["cpu-demo"][1].model,
                                                                                  path="random:tiny-qwen2"))
    with pytest.raises(ValueError, match=r"--model\.tokenizer None is invalid: --model\.path random:tiny-qwen2 has no tokenizer.*set --model\.tokenizer"):
        cfg.validate()
    cfg.model.tokenizer = "smollm2"
    cfg.validate()  # a random model of a real shape may borrow a tokenizer
    spec = build_spec(cfg)
    assert spec.source_factory.model_path == "smollm2" and spec.scorer_factory.model_path == "smollm2"
