"""What a trainer group's FSDP2 sharding is asked for (`sharding_options`, `layer_precision`): bf16 layer gathers
only where the group computes under bf16 autocast on GPUs, fp32 gradient reduction, the residual stream uncast."""

from __future__ import annotations

import torch

from asyncrl.config import TrainerConfig
from asyncrl.learner import sharding_options
from asyncrl.learner.sharding import layer_precision


def test_gpus_under_autocast_gather_layers_in_bf16_and_cpus_as_stored():
    assert sharding_options(TrainerConfig(), "cuda") == {"mixed_precision": True, "reshard_after_forward": True}
    assert sharding_options(TrainerConfig(), "cpu")["mixed_precision"] is False
    off = TrainerConfig(autocast_bf16=False, fsdp_reshard_after_forward=False)
    assert sharding_options(off, "cuda") == {"mixed_precision": False, "reshard_after_forward": False}


def test_the_layer_policy_gathers_bf16_reduces_fp32_and_leaves_inputs_alone():
    policy = layer_precision(mixed_precision=True)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert policy.cast_forward_inputs is False  # the residual stream stays fp32, as under autocast in one process
    assert layer_precision(mixed_precision=False) is None


def test_cuda_graphs_with_a_trainer_group_are_refused_naming_the_flag():
    import dataclasses

    import pytest

    from asyncrl.config import RunConfig
    from asyncrl.config.presets import CPU_DEMO as cfg
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, cuda_graphs=True),
                              placement=dataclasses.replace(cfg.placement, trainer_devices=("cpu", "cpu")))
    assert isinstance(cfg, RunConfig)
    with pytest.raises(ValueError, match="--trainer.cuda-graphs.*a group of 2 trainer ranks"):
        cfg.validate()
