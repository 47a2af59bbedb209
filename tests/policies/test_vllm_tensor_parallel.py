"""`VLLMEngine` with --rollout.vllm.tensor-parallel-size 2 on CPU (two vLLM worker processes, one core each):
the behaviour log-probs are the learner's, and an update reaches both shards of replicated, column-parallel and
row-parallel weights; the preflight refuses shardings that cannot work, naming the flag."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from asyncrl.config import RolloutConfig, VLLMConfig
from asyncrl.policies import SamplingParams, load_model
from asyncrl.launch.preflight import check_tensor_parallel
from asyncrl.policies.vllm_calls import engine_args, placement_args
from tests.policies.helpers import forward_logprobs, logprob_tol
from tests.run_helpers import needs_vllm

CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
"""Head size 64 (vLLM's CPU attention has no kernel for 16); 4 heads and 2 KV heads split over 2 shards."""

UPDATED = ("model.layers.0.input_layernorm.weight",                      # replicated
           *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"),  # column-parallel, fused into qkv
           "model.layers.1.mlp.down_proj.weight")                        # row-parallel


@pytest.mark.e2e
@pytest.mark.slow
def test_two_shards_sample_the_learners_distribution_and_take_every_update(tmp_path):
    needs_vllm()
    from tests.policies.vllm_host import EngineHost
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = f"random:{tmp_path}"
    learner = load_model(model)
    initial = copy.deepcopy(learner)
    host = EngineHost(model, max_slots=8, max_len=96, options=VLLMConfig(tensor_parallel_size=2))
    try:
        prompt = list(range(3, 40))
        params = dict(learner.named_parameters())
        for version, scale in ((0, None), (1, 0.5), (2, 1.7)):
            if scale is not None:
                with torch.no_grad():
                    for name in UPDATED:
                        params[name].mul_(scale)
                host.call("update_weights", [(name, params[name].detach().clone()) for name in UPDATED], version)
            out = host.call("generate", [prompt], SamplingParams(n=2, seed=5 + version, max_new_tokens=12,
                                                                ignore_eos=True))[0]
            for c in out.completions:
                assert len(c.token_ids) == 12 and c.versions == [version] * 12
                delta = (torch.tensor(c.logprobs) - forward_logprobs(learner, prompt, c.token_ids)).abs().max()
                tol = logprob_tol(learner, prompt, c.token_ids)
                assert delta < tol, f"version {version}: |Δlogp| {delta:.2e} against the learner (tolerance {tol:.1e})"
                if version:  # the check has power: the initial weights give other log-probs
                    stale = (torch.tensor(c.logprobs) - forward_logprobs(initial, prompt, c.token_ids)).abs().max()
                    assert stale > 10 * tol
        # a part of a fused weight alone would corrupt it: refused, and nothing changes
        with pytest.raises(ValueError, match="q_proj.weight without .*k_proj.weight.*v_proj.weight.*same update"):
            host.call("update_weights", [("model.layers.0.self_attn.q_proj.weight", params[UPDATED[1]])], 3)
        assert host.call("version") == 2
    finally:
        host.close()


def test_shardings_that_cannot_work_are_refused_before_anything_starts():
    assert check_tensor_parallel(1, ("cuda:5",), "smollm2", cuda_count=0) == []
    (heads,) = check_tensor_parallel(2, ("cpu",), "smollm2", cores=2)
    assert heads.startswith("--rollout.vllm.tensor-parallel-size 2: the model's 9 attention heads") and "1, 3, 9" in heads
    (cores,) = check_tensor_parallel(4, ("cpu",), "random:tiny-smollm2", cores=2)
    assert "each shard needs a core of its own; this process may use 2" in cores
    (missing,) = check_tensor_parallel(2, ("cuda:1",), "random:qwen2.5-0.5b", cuda_count=2)
    assert "shards over cuda:1..cuda:2, but this machine has 2 GPUs" in missing
    (shared,) = check_tensor_parallel(2, ("cuda:0", "cuda:1"), "random:qwen2.5-0.5b", cuda_count=4)
    assert "would share GPUs" in shared and "cuda:0 cuda:2" in shared
    assert check_tensor_parallel(2, ("cuda:0", "cuda:2"), "random:qwen2.5-0.5b", cuda_count=4) == []
    with pytest.raises(ValueError, match="--rollout.vllm.tensor-parallel-size 2 is invalid: .*--rollout.backend vllm"):
        RolloutConfig(backend="asyncrl", vllm=VLLMConfig(tensor_parallel_size=2)).validate()
    RolloutConfig(vllm=VLLMConfig(tensor_parallel_size=2)).validate()  # auto: vLLM for some models (build_spec checks)
    with pytest.raises(ValueError, match="--rollout.vllm.tensor-parallel-size 0 is invalid"):
        RolloutConfig(backend="vllm", vllm=VLLMConfig(tensor_parallel_size=0)).validate()


def test_gpu_shards_are_named_to_vllm_by_device_ids_and_the_environment_is_left_alone():
    # an agent on cuda:2 with 2 shards: vLLM's workers take devices 2 and 3 of this process's numbering (vLLM
    # composes device_ids with CUDA_VISIBLE_DEVICES), are processes of their own, started with spawn
    args, env = placement_args("cuda:2", 2, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert args == {"device_ids": [2, 3], "distributed_executor_backend": "mp"}
    assert env == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}  # CUDA_VISIBLE_DEVICES is never rewritten
    # one GPU of its own: vLLM would take cuda:0 (the trainer's) without device_ids; in-process, no env
    assert placement_args("cuda:1", 1) == ({"device_ids": [1]}, {})
    assert placement_args("cuda", 1) == ({"device_ids": [0]}, {})


def test_cpu_shards_split_the_cores_unless_a_binding_is_given():
    assert placement_args("cpu", 1, cores=[0, 1]) == ({}, {})
    args, env = placement_args("cpu", 2, cores=[0, 1, 2, 3, 4])  # 5 cores, 2 each; the fifth is left out
    assert args == {"distributed_executor_backend": "mp"} and env == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert placement_args("cpu", 2, cores=[0, 1], environ={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == (
        {"distributed_executor_backend": "mp"}, {})


def test_engine_args_on_gpu_pin_the_device_without_touching_cuda_visible_devices(monkeypatch, tmp_path):
    set_devices = []
    monkeypatch.setattr(torch.cuda, "set_device", set_devices.append)  # no GPU here: record the call
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # restored after the test, as are the two below
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # a fork of a CUDA process cannot use CUDA: replaced
    args = engine_args(str(tmp_path), VLLMConfig(tensor_parallel_size=2), max_slots=8, max_len=64,
                       dtype=torch.bfloat16, device="cuda:1", kv_bytes=None, seed=0)
    assert args["device_ids"] == [1, 2] and args["tensor_parallel_size"] == 2
    assert args["distributed_executor_backend"] == "mp" and args["enable_sleep_mode"] and not args["enforce_eager"]
    assert set_devices == [torch.device("cuda:1")]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
