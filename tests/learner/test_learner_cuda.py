"""CUDA variants of the learner's packing and head checks: varlen flash attention against per-document SDPA,
the compiled head against the eager one, and a bf16-autocast packed step against the padded one, with
compiled layers and MLP-only checkpointing. Skipped without a GPU (CI has none; run on a lent GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.config import GRPO
from asyncrl.learner import build_learner, linear_logprobs, policy_gradients
from asyncrl.policies import ARCH_PRESETS, random_model
from asyncrl.policies.attention_layouts import DocumentLayout, _varlen_attention
from tests.learner_helpers import on_policy, synthetic_groups, trainer_config

pytestmark = [pytest.mark.e2e,  # inductor and Triton compile their kernels with gcc in other processes
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16 = torch.bfloat16


def test_varlen_attention_exists_and_equals_per_document_attention():
    """torch's varlen flash attention (GQA: 4 query heads over 2 K/V heads) against SDPA per document."""
    assert _varlen_attention() is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = (37, 1, 250, 64)
    total = sum(lens)
    q = torch.randn(1, 4, total, 64, device="cuda", dtype=BF16, generator=gen)
    k, v = (torch.randn(1, 2, total, 64, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 37, 38, 288, 352], device="cuda", dtype=torch.int32)
    layout = DocumentLayout(lens, cu)
    flash = layout.attend(q, k, v).float()
    per_doc = layout.attend(q.float(), k.float(), v.float())  # fp32: the per-document SDPA path
    # bf16 inputs and output: relative L2 error ~1e-2; a wrong mask or document boundary gives O(1)
    assert float((flash - per_doc).norm() / per_doc.norm()) < 2e-2


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_compiled_head_equals_the_eager_head(entropy_grad):
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(3000, 256, device="cuda", generator=gen)
    w = torch.randn(5000, 256, device="cuda", generator=gen) * 0.1
    y = torch.randint(0, 5000, (3000,), device="cuda", generator=gen)
    g = torch.randn(3000, device="cuda", generator=gen)
    out = []
    for compiled in (False, True):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=BF16):
            logp, ent = linear_logprobs(a, b, y, temperature=0.8, chunk_tokens=1024, compiled=compiled)
        ((logp * g).sum() + ((ent * g).sum() if entropy_grad else 0)).backward()
        out.append((logp, ent, a.grad, b.grad))
    # the same bf16 logits reduced in fp32 in another order: log π and H agree to fp32 round-off; the
    # gradients pass through a bf16 cast before their matmuls, so a last-bit difference can flip a rounding
    for k, (eager, compiled) in enumerate(zip(*out)):
        rel = float((compiled - eager).detach().norm() / eager.detach().norm())
        assert rel < (1e-5 if k < 2 else 1e-2), (k, rel)


@pytest.mark.parametrize("variant", [{}, {"compile_layers": True}, {"gradient_checkpointing": True,
                                                                     "checkpoint_scope": "mlp"}],
                         ids=["plain", "compiled-layers", "mlp-checkpointing"])
def test_packed_bf16_gradient_equals_the_padded_one(variant):
    """Under bf16 autocast the two layouts round differently (flash varlen vs SDPA over padded rows); the
    gradients agree to bf16 accuracy (relative L2 distance; a wrong position or mask moves it by O(1))."""
    policy = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1), seed=0)
    groups = on_policy(policy, synthetic_groups(6, 4, seed=2, prompt_lens=(2, 40), response_lens=(1, 60)))
    policy = policy.cuda()
    grads = {}
    for packed in (False, True):
        cfg = trainer_config(use_dynamic_bsz=True, max_tokens_per_micro_batch=256, pack_sequences=packed, **variant)
        grads[packed] = policy_gradients(build_learner(copy.deepcopy(policy), cfg, GRPO()), groups)
    num = sum(float((grads[True][k] - grads[False][k]).norm() ** 2) for k in grads[False]) ** 0.5
    den = sum(float(g.norm() ** 2) for g in grads[False].values()) ** 0.5
    assert den > 0 and num / den < 0.05, num / den


def test_compiled_layers_serve_every_packed_length_with_one_graph():
    """Packed micro-batches of ragged lengths on either side of inductor's fusion thresholds (at hidden 512:
    rows < 2·512, rows < 4096, rows·512 < 5·2^20, and above them all) reuse one compiled layer graph: the
    first call compiles, the others compile nothing (before `layer_compile_options`, three graphs)."""
    from torch._dynamo.utils import counters
    from asyncrl.learner.state import layer_compile_options
    assert layer_compile_options(), f"torch {torch.__version__}: no mix-order reduction option to set"
    shape = dict(ARCH_PRESETS["tiny-qwen2"], hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                 num_key_value_heads=4, num_hidden_layers=2, max_position_embeddings=16384)
    policy = random_model(shape, seed=0).cuda()
    build_learner(policy, trainer_config(compile_layers=True, gradient_checkpointing=True, checkpoint_scope="mlp"),
                  GRPO())
    frames = []
    for total in (600, 3000, 6000, 12000, 700):
        lengths = (total // 3, total - total // 3)
        cu = torch.tensor([0, lengths[0], total], device="cuda", dtype=torch.int32)
        positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
        tokens = torch.randint(0, 256, (1, total), device="cuda")
        before = counters["frames"]["ok"]
        with torch.autocast("cuda", dtype=BF16):
            hidden = policy(tokens, positions, documents=DocumentLayout(lengths, cu))
        hidden.float().square().mean().backward()
        frames.append(counters["frames"]["ok"] - before)
    assert frames[0] >= 1 and frames[1:] == [0, 0, 0, 0], frames


@pytest.mark.parametrize("scope,graphs", [("layer", True), ("model", False), ("model", True)])
def test_cuda_graphs_and_model_scope_give_the_compiled_layers_gradient_over_two_steps(scope, graphs):
    """--trainer.cuda-graphs (the compiled region replayed as CUDA graphs over bucketed packed micro-batches)
    and --trainer.compile-scope model give the compiled layers' gradients (bf16 accuracy), at the start and after
    two steps that record and replay the graphs, with gradients accumulated over micro-batches. The reference is
    the layer-compiled learner at the same weights: two trajectories of AdamW in bf16 drift apart by chance (a
    10-13 % gradient distance after two steps was measured on an H100), so only gradients at equal weights are
    compared."""
    from asyncrl.learner import train_step
    policy = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1), seed=0)
    groups = on_policy(policy, synthetic_groups(6, 4, seed=2, prompt_lens=(2, 40), response_lens=(1, 60)))
    policy = policy.cuda()

    def learner(variant: bool):
        cfg = trainer_config(use_dynamic_bsz=True, max_tokens_per_micro_batch=256, pack_sequences=True, lr=1e-4,
                             compile_layers=True, gradient_checkpointing=True, checkpoint_scope="mlp",
                             compile_scope=scope if variant else "layer", cuda_graphs=graphs and variant)
        return build_learner(copy.deepcopy(policy), cfg, GRPO())

    state, reference = learner(True), learner(False)
    before = {k: v.detach().float().clone() for k, v in state.policy.state_dict().items()}
    distances = [_relative_distance(policy_gradients(state, groups), policy_gradients(reference, groups))]
    for _ in range(2):
        train_step(state, groups)
    reference.policy.load_state_dict(state.policy.state_dict())
    distances.append(_relative_distance(policy_gradients(state, groups), policy_gradients(reference, groups)))
    moved = _relative_distance({k: v.float() for k, v in state.policy.state_dict().items()}, before)
    assert moved > 1e-6, moved  # the steps changed the weights the second gradients are taken at
    assert all(d < 0.05 for d in distances), distances


def _relative_distance(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over every tensor of two gradient dicts (full tensors, fp32)."""
    assert a.keys() == b.keys()
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in b) ** 0.5
    den = sum(float(v.norm() ** 2) for v in b.values()) ** 0.5
    assert den > 0
    return num / den


@pytest.mark.parametrize("reshard", [True, False])
def test_a_sharded_group_with_bf16_gathers_and_compiled_layers_is_as_accurate_as_one_process(reshard):
    """A trainer group's layout (FSDP2 over a group of one, as `shard_model` with `sharding_options` builds it:
    bf16 layer gathers, fp32 gradient reduction, layers compiled between their gathers) against one compiled
    process under autocast, both measured against the fp32 gradient (no autocast, eager): the group's
    distance from it is at most twice the one process's (bf16 rounding of the gathered norm weights and
    of each micro-batch's gradient before its fp32 reduction), and the sharded layers did compile."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import DeviceMesh

    from asyncrl.learner import shard_model, sharding_options
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    policy = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1), seed=0)
    groups = on_policy(policy, synthetic_groups(6, 4, seed=2, prompt_lens=(2, 40), response_lens=(1, 60)))
    policy = policy.cuda()
    grads = {}
    for variant in ("group", "one", "fp32"):  # the group first: the layers' frames compile there
        cfg = trainer_config(use_dynamic_bsz=True, max_tokens_per_micro_batch=256, pack_sequences=True,
                             compile_layers=variant != "fp32", autocast_bf16=variant != "fp32",
                             fsdp_reshard_after_forward=reshard)
        model, group = copy.deepcopy(policy), None
        if variant == "group":
            options = sharding_options(cfg, "cuda")
            assert options == {"mixed_precision": True, "reshard_after_forward": reshard}
            shard_model(model, DeviceMesh.from_group(dist.group.WORLD, "cuda"), **options)
            group = dist.group.WORLD
        if variant == "group":
            torch._dynamo.reset()  # compiled code of an earlier test (same layer code) would be reused unseen
        before = counters["frames"]["ok"]
        state = build_learner(model, cfg, GRPO(), group=group)
        grads[variant] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float()
                          for k, v in policy_gradients(state, groups).items()}
        if variant == "group":
            assert counters["frames"]["ok"] > before, "the sharded layers did not compile"
    one, group = _relative_distance(grads["one"], grads["fp32"]), _relative_distance(grads["group"], grads["fp32"])
    assert group <= 2 * one + 1e-3, (group, one)
