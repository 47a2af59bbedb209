"""Memory that fits, decided before launch (`asyncrl.launch.memory_checks`, run by the preflight): every GPU's
predicted peak against a fake device-memory source; refusals name the flag as typed and the value that fits; a
--rollout.max-slots the user did not give is lowered to fit; GPUs listed twice for a trainer group are refused."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from asyncrl.config import RunConfig
from asyncrl.config.flags import given_flags
from asyncrl.config.presets import PRESETS
from asyncrl.launch.memory_checks import MemoryCheck, check_memory
from asyncrl.launch.preflight import preflight
from asyncrl.planning.command import model_shape

GIB = 2**30
H100 = (int(79.1 * GIB), int(79.6 * GIB))  # (free, total) of an idle H100 80GB


class FakeMemory:
    """Every GPU has `free` of `total` bytes; records which GPUs were asked about."""

    def __init__(self, free: int = H100[0], total: int = H100[1]):
        self.free, self.total, self.asked = free, total, []

    def free_and_total(self, index: int) -> tuple[int, int]:
        self.asked.append(index)
        return self.free, self.total


@pytest.fixture
def two_gpus(monkeypatch):
    """The device check sees two GPUs (this machine may have none); nothing else touches CUDA before launch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def fully_async_8b(tmp_path, **rollout) -> RunConfig:
    """The qwen3-8b-lora preset's documented fully-async recipe: trainer and agent processes sharing cuda:0."""
    cfg = PRESETS["qwen3-8b-lora"][1]
    return dataclasses.replace(
        cfg, run_dir=str(tmp_path / "run"), wandb="off",
        async_training=dataclasses.replace(cfg.async_training, colocated=False, staleness_threshold=0.5),
        rollout=dataclasses.replace(cfg.rollout, **rollout))


def test_the_8b_lora_recipe_runs_with_its_slots_lowered_when_not_given(tmp_path, two_gpus):
    """At the preset's 128 slots cuda:0 needs 85.5 GiB (trainer 37.4 + engine 48.0, contexts included) of the
    75.1 left after a 5 % margin: the trainer's 32.7 GiB of states and activations plus the 13 % its allocator holds
    beyond them (another process shares its GPU), and its 0.5 GiB context. Each slot is 1024 x 147,456 + 4 x
    151,936 B = 0.141 GiB, so 48 slots (a multiple of n = 8) fit at 74.1 GiB and 56 do not. Measured on an H100:
    at 80 slots (the check without the allocator's slack) the agent failed to allocate in its third adapter merge;
    the trainer held 35.9 GiB reserved for 31.7 allocated."""
    memory = FakeMemory()
    report = preflight(fully_async_8b(tmp_path), given=given_flags(["--async-training.no-colocated"]), memory=memory)
    assert report.ok, report.problems
    assert memory.asked == [0]
    assert report.config.rollout.max_slots == 48 and report.spec.rollout.max_slots == 48
    assert any(n.startswith("memory: --rollout.max-slots lowered from 128 to 48") for n in report.notes), report.notes


def test_slots_the_user_gave_are_refused_naming_the_flag_and_the_value_that_fits(tmp_path, two_gpus):
    cfg = fully_async_8b(tmp_path)
    report = preflight(cfg, given=given_flags(["--rollout.max-slots", "128"]), memory=FakeMemory())
    assert report.problems == [
        "--rollout.max-slots 128: cuda:0 needs 85.5 GiB (trainer 37.4 + engine 48.0: KV cache 18.1 GiB for 128 slots "
        "of 1,024 tokens) but has 79.1 GiB free, 75.1 after a 5% margin; --rollout.max-slots 48 fits (or "
        "--async-training.colocated, --placement.agent-devices on another GPU)"]
    assert "--rollout.max-slots 128" in report.failure("asyncrl train")
    python_api = preflight(cfg, memory=FakeMemory())  # no flags: every value of the config was chosen
    assert python_api.problems == report.problems
    assert preflight(fully_async_8b(tmp_path, max_slots=48), memory=FakeMemory()).ok
    assert not preflight(fully_async_8b(tmp_path, max_slots=56), memory=FakeMemory()).ok


def test_a_layout_that_fits_says_each_gpus_peak_and_cpu_devices_are_not_asked(tmp_path, two_gpus):
    colocated = dataclasses.replace(PRESETS["qwen3-8b-lora"][1], run_dir=str(tmp_path / "run"), wandb="off")
    report = preflight(colocated, given=frozenset(), memory=FakeMemory())
    assert report.ok and report.config.rollout.max_slots == 128  # the engine frees its KV cache while training
    assert any(f.startswith("memory: cuda:0 64.6 of 79.1 GiB free") and "16.1 shared" in f for f in report.facts)
    cpu = dataclasses.replace(PRESETS["cpu-demo"][1], run_dir=str(tmp_path / "cpu"), wandb="off")
    memory = FakeMemory()
    assert preflight(cpu, given=frozenset(), memory=memory).ok and memory.asked == []


def test_when_no_slot_count_fits_the_trainer_flags_are_named():
    """Full fine-tuning of the 8B shape in fp32 beside its engine: 16 x 8,190,735,360 B = 122 GiB of states alone;
    no --rollout.max-slots fits, and no micro-batch budget either, so the message names what would."""
    cfg = PRESETS["qwen3-8b-lora"][1]
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0),
                              async_training=dataclasses.replace(cfg.async_training, colocated=False))
    check = check_memory(cfg, model_shape(cfg.model.path), FakeMemory(), slots_given=False)
    assert check.max_slots is None and len(check.problems) == 1
    assert check.problems[0].startswith("--rollout.max-slots 128: cuda:0 needs ")
    assert "even at --rollout.max-slots 8 (--rollout.n)" in check.problems[0]
    assert "--trainer.offload optimizer" in check.problems[0]


def test_a_trainer_gpu_that_does_not_fit_names_the_micro_batch_budget_that_does():
    """Qwen3-1.7B shape, fp32, no recompute, alone on a GPU with 60 GiB free (56.8 after the 5 % margin of its
    63.2): states 16 x 1,720,574,976 B = 25.64 GiB; activations at 16,384 tokens: 41 x 28 x 2048 = 2,351,104 B a
    token, 35.87 GiB, the LM-head chunk 8 x 4096 x 151,936 B = 4.64 GiB, the bf16 casts 2 x 1,720,574,976 B = 3.20
    GiB; with the 0.5 GiB context 69.9 GiB. The budget left for tokens is 56.8 - 25.64 - 0.5 - 4.64 - 3.20 = 22.8
    GiB, 10,423 tokens: 10,240 is the largest multiple of 1,024 that fits."""
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="random:qwen3-1.7b"),
                              placement=dataclasses.replace(cfg.placement, trainer_devices=("cuda:0",),
                                                            agent_devices=("cuda:1",)))
    check = check_memory(cfg, model_shape(cfg.model.path), FakeMemory(free=60 * GIB, total=int(60 / 0.95 * GIB)))
    assert len(check.problems) == 1, check.problems
    assert check.problems == [
        "--trainer.max-tokens-per-micro-batch 16384: cuda:0 needs 69.9 GiB (trainer 69.9) but has 60.0 GiB free, 56.8 "
        "after a 5% margin; --trainer.max-tokens-per-micro-batch 10240 fits; or --trainer.offload optimizer, "
        "--trainer.gradient-checkpointing --trainer.checkpoint-scope layer"]


def test_vllm_beside_the_trainer_is_told_the_fraction_that_fits():
    """vLLM takes --rollout.vllm.gpu-memory-utilization of the GPU's total: beside the 0.5B trainer's 30.3 GiB
    (default knobs: no recompute, 16,384 tokens: 26.4 GiB, 13 % allocator slack, its 0.5 GiB context), 0.5 x 79.6 =
    39.8 GiB and the agent's 0.5 GiB context make 70.6 of the 75.1 GiB left after the margin: fits; 0.9 (71.6 GiB)
    does not, and (75.1 - 30.3 - 0.5) / 79.6 = 0.556 -> 0.55 is the fraction that fits."""
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="random:qwen2.5-0.5b"),
                              placement=dataclasses.replace(cfg.placement, trainer_devices=("cuda:0",),
                                                            agent_devices=("cuda:0",)))
    shape = model_shape(cfg.model.path)
    assert not check_memory(cfg, shape, FakeMemory(), vllm=True).problems
    greedy = dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, vllm=dataclasses.replace(cfg.rollout.vllm, gpu_memory_utilization=0.9)))
    (problem,) = check_memory(greedy, shape, FakeMemory(), vllm=True).problems
    assert problem.startswith("--rollout.vllm.gpu-memory-utilization 0.9: cuda:0 needs ")
    assert problem.endswith("--rollout.vllm.gpu-memory-utilization 0.55 fits")


def test_torchrun_jobs_are_not_checked():
    cfg = fully_async_8b(pathlib.Path("/nonexistent"))
    cfg = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, launcher="torchrun"))
    memory = FakeMemory()
    assert check_memory(cfg, model_shape(cfg.model.path), memory) == MemoryCheck()
    assert memory.asked == []


@pytest.mark.parametrize("devices, colocated", [(("cuda:0", "cuda:0"), False), (("cuda", "cuda:0"), True)])
def test_a_gpu_listed_twice_for_the_trainer_group_is_refused_before_spawn(tmp_path, two_gpus, devices, colocated):
    cfg = PRESETS["cpu-demo"][1]
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "run"), wandb="off",
                              async_training=dataclasses.replace(cfg.async_training, colocated=colocated),
                              placement=dataclasses.replace(cfg.placement, trainer_devices=devices,
                                                            agent_devices=devices if colocated else ("cpu",)))
    report = preflight(cfg, given=frozenset(), memory=FakeMemory())
    assert report.problems == [
        f"--placement.trainer-devices {' '.join(devices)}: cuda:0 is listed twice; a trainer group runs one rank per "
        "GPU (NCCL refuses two ranks on one GPU: \"Duplicate GPU detected\"); list each GPU once "
        "(--placement.trainer-devices cuda:0)"]


def test_given_flags_reads_what_was_typed():
    assert given_flags(["--rollout.max_slots=32", "--lora.rank", "8", "algorithm:dapo", "--async-training.no-colocated"]
                       ) == {"--rollout.max-slots", "--lora.rank", "--async-training.no-colocated"}


def test_a_trainer_gpu_short_beside_vllm_agents_names_the_trainer_flags():
    """vLLM agents on GPUs of their own fit; the trainer's GPU does not (full fine-tuning of the 8B shape in fp32):
    the message is the trainer's (it used to divide by vLLM's share of a GPU that has none, and raise)."""
    cfg = PRESETS["qwen3-8b-lora"][1]
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0),
                              rollout=dataclasses.replace(cfg.rollout, backend="vllm"),
                              async_training=dataclasses.replace(cfg.async_training, colocated=False),
                              placement=dataclasses.replace(cfg.placement, trainer_devices=("cuda:0",),
                                                            agent_devices=("cuda:1",)))
    (problem,) = check_memory(cfg, model_shape(cfg.model.path), FakeMemory(), vllm=True).problems
    assert problem.startswith("--trainer.max-tokens-per-micro-batch ")
    assert "cuda:0 needs " in problem and "--trainer.offload optimizer" in problem
