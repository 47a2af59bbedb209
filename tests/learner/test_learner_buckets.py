"""Bucketed packing for replayed CUDA graphs (`--trainer.cuda-graphs`): each packed micro-batch is padded to a
multiple of `PACK_MULTIPLE` tokens by one padding document and to a multiple of `DOC_MULTIPLE` cu_seqlens
entries by empty documents, and its flash bound rounded up to a power of two. Nothing predicts from the
padding, so the gradient equals the unpadded one (CPU: per-document SDPA, fp32). The CUDA variant, with
the graphs replayed, is in tests/learner/test_learner_cuda.py."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.config import GRPO
from asyncrl.learner import build_learner, policy_gradients
from asyncrl.learner.layout import DOC_MULTIPLE, PACK_MULTIPLE, BucketedLayout, RowLengths, plan_micro_batches
from tests.learner_helpers import on_policy, synthetic_groups, tiny_policy, trainer_config


def test_bucketed_micro_batches_pad_length_documents_and_bound():
    # rows of 5 + 7 = 12 and 3 + 700 = 703 tokens: 715 packed tokens -> 1024 (a 309-token padding document);
    # documents 2 + 1 padding = 3, cu_seqlens 4 entries -> 16 (12 empty documents); bound: longest 703 -> 1024
    tokens = torch.arange(2 * 710).view(2, 710)
    lengths = RowLengths(prompt=[5, 3], response=[7, 700], width=710)
    plain, = plan_micro_batches(tokens, [[0, 1]], lengths, packed=True)
    micro, = plan_micro_batches(tokens, [[0, 1]], lengths, packed=True, bucketed=True)
    assert micro.tokens.shape == (1, 1024) and 1024 % PACK_MULTIPLE == 0
    assert micro.documents.lengths[:3] == (12, 703, 309) and set(micro.documents.lengths[3:]) == {0}
    assert micro.documents.cu_seqlens.shape == (16,) and 16 % DOC_MULTIPLE == 0
    assert micro.documents.cu_seqlens[-1] == 1024 and isinstance(micro.documents, BucketedLayout)
    assert micro.documents.max_len == 1024 and plain.documents.max_len == 703
    assert torch.equal(micro.tokens[0, :715], plain.tokens[0])
    assert torch.equal(micro.positions[0, 715:], torch.arange(309))
    for name in ("predict_at", "targets", "out_rows", "out_cols", "rows"):
        assert torch.equal(getattr(micro, name), getattr(plain, name)), name


def test_bucketed_bound_is_a_power_of_two_within_the_packed_length():
    cu = torch.tensor([0, 100, 612], dtype=torch.int32)
    assert BucketedLayout((100, 512), cu).max_len == 512  # 512 is its own power of two
    assert BucketedLayout((100, 12), torch.tensor([0, 100, 112], dtype=torch.int32)).max_len == 112  # <= length
    assert BucketedLayout((3, 9), torch.tensor([0, 3, 12], dtype=torch.int32)).max_len == 12


@pytest.mark.parametrize("budget", [64, 1000])
def test_bucketed_gradient_equals_the_unpadded_one(budget):
    policy = tiny_policy(0)
    groups = on_policy(policy, synthetic_groups(4, 4, seed=3, prompt_lens=(2, 30), response_lens=(1, 40)))
    grads = {}
    for bucketed in (False, True):
        cfg = trainer_config(use_dynamic_bsz=True, pack_sequences=True, max_tokens_per_micro_batch=budget,
                             cuda_graphs=bucketed)
        grads[bucketed] = policy_gradients(build_learner(copy.deepcopy(policy), cfg, GRPO()), groups)
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_cuda_graphs_need_compiled_packed_layers():
    for off in ("compile_layers", "pack_sequences"):
        with pytest.raises(ValueError, match="cuda-graphs|cuda_graphs"):
            trainer_config(use_dynamic_bsz=True, cuda_graphs=True, **{off: False}).validate()
