"""The byte model of one role's GPU memory (`asyncrl.planning.memory`): golden values worked out by hand."""

from __future__ import annotations

from asyncrl.planning.command import model_shape
from asyncrl.planning.memory import GIB, engine_bytes, trainer_activation_bytes, trainer_state_bytes
from asyncrl.planning.predict import Layout, Rates, Workload, memory_gib


def test_qwen3_8b_lora_trainer_and_engine_golden():
    """Qwen3-8B shape: 8,190,735,360 parameters, 36 layers, hidden 4096, intermediate 12,288, 8 KV heads of 128,
    vocab 151,936; rank-32 adapters on the seven projections: 87,293,952 parameters.

    Trainer (LoRA: bf16 base, 16 bytes an adapter parameter): 2 x 8,190,735,360 + 16 x 87,293,952
    = 16,381,470,720 + 1,396,703,232 = 17,778,173,952 B (16.56 GiB).
    Activations, whole-layer recompute at 16,384 tokens: per token 4 x 36 x 4096 = 589,824, plus the recomputed
    layer 16 x 4096 + 8 x 12,288 = 163,840: 753,664 x 16,384 = 12,348,030,976; the LM-head chunk 8 x 4096 x 151,936
    = 4,978,638,848; no casts (a bf16 base): 17,326,669,824 B (16.14 GiB). 32.7 GiB in all against the 31.7 GiB
    the fully async trainer peaked at (lora-h100-2026-11-26.md).
    Engine, 64 slots of 1,024 tokens: weights 2 x (8,190,735,360 + the adapted layers' base copy 36 x (2 x 4096 x
    4096 + 2 x 4096 x 1024 + 3 x 4096 x 12,288) = 6,945,767,424) = 30,273,005,568; KV cache 64 x 1024 x (2 x 36 x
    1024 x 2 = 147,456) = 9,663,676,416; logits 4 x 151,936 x 64 = 38,895,616; overhead 1.25 GiB = 1,342,177,280:
    41,317,754,880 B (38.48 GiB) against the 38.3 GiB measured."""
    shape = model_shape("random:qwen3-8b")
    assert trainer_state_bytes(shape, lora_rank=32) == 17_778_173_952
    assert trainer_activation_bytes(shape, budget=16_384, checkpointing="layer", fp32_weights=False) == 17_326_669_824
    engine = engine_bytes(shape, slots=64, tokens=1024, lora=True)
    assert (engine.weights, engine.kv_cache, engine.logits) == (30_273_005_568, 9_663_676_416, 38_895_616)
    assert engine.total == 41_317_754_880


def test_qwen2_5_0_5b_full_fine_tune_golden():
    """Qwen2.5-0.5B shape, 494,032,768 parameters, 24 layers, hidden 896, fp32 weights under bf16 autocast.

    States: 16 x 494,032,768 = 7,904,524,288 B (7.36 GiB); --trainer.offload optimizer keeps 8 bytes a parameter:
    3,952,262,144; bf16 weights halve each (8 and 4 bytes).
    Activations, MLP recompute at 8,192 tokens: 17.5 x 24 x 896 = 376,320 a token, x 8,192 = 3,082,813,440; the
    LM-head chunk 8 x 4096 x 151,936 = 4,978,638,848; the bf16 casts 2 x 494,032,768 = 988,065,536:
    9,049,517,824 B (8.43 GiB; measured 15.7 - 7.36 = 8.3 GiB, learner-h100-2026-11-26.md). Without
    recompute 41 x 24 x 896 = 881,664 a token: 7,222,591,488 + 4,978,638,848 + 988,065,536 = 13,189,295,872.
    A budget below the LM-head chunk bounds the chunk: 1,024 tokens -> 8 x 1024 x 151,936 = 1,244,659,712."""
    shape = model_shape("random:qwen2.5-0.5b")
    assert trainer_state_bytes(shape) == 7_904_524_288
    assert trainer_state_bytes(shape, offload="optimizer") == 3_952_262_144
    assert trainer_state_bytes(shape, param_dtype="bfloat16") == 3_952_262_144
    assert trainer_state_bytes(shape, param_dtype="bfloat16", offload="optimizer") == 1_976_131_072
    assert trainer_activation_bytes(shape, budget=8192, checkpointing="mlp") == 9_049_517_824
    assert trainer_activation_bytes(shape, budget=8192, checkpointing="none") == 13_189_295_872
    small = trainer_activation_bytes(shape, budget=1024, checkpointing="none", fp32_weights=False)
    assert small == 1024 * 881_664 + 1_244_659_712


def test_the_planner_counts_with_the_same_engine_and_states():
    """`memory_gib` (the planner) keeps its engine model: a full bf16 base copy with LoRA (an upper bound of the
    adapted layers' copy), the KV cache and logits of every slot, ENGINE_OVERHEAD_GIB."""
    shape = model_shape("random:qwen2.5-0.5b")
    work, rates = Workload(100, 100, 512, 1024), Rates(1.0, 1.0, 16_384, ((1, 1.0),), learner_peak_gib=20.0)
    trainer, agent = memory_gib(shape, work, rates, Layout("split", 1, 1), 256)
    engine = engine_bytes(shape, slots=256, tokens=1536)
    assert agent == engine.total / GIB and trainer == 20.0


def test_the_planner_sizes_a_shared_prompt_cache_as_its_two_pools():
    """`kv_layout="shared-prompt"`: the responses of every slot and one prompt for every n slots, as the check before
    launch counts them."""
    shape = model_shape("random:qwen2.5-0.5b")
    work, rates = Workload(100, 100, 512, 1024), Rates(1.0, 1.0, 16_384, ((1, 1.0),), learner_peak_gib=20.0)
    _, per_slot = memory_gib(shape, work, rates, Layout("split", 1, 1), 256)
    _, shared = memory_gib(shape, work, rates, Layout("split", 1, 1), 256, kv_layout="shared-prompt", n=8)
    assert (per_slot - shared) * GIB == 256 * shape.kv_bytes(1536) - 256 * shape.kv_bytes(1024) - 32 * shape.kv_bytes(512)
