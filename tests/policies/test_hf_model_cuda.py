"""The HF path on a GPU, where packed rows take the varlen flash kernel under bf16 autocast (sliding windows and the
attention scale passed to it) and attention sinks the eager formula: log-probs against the transformers model's own
forward, one row at a time, under the same autocast."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.forward import micro_logprobs
from asyncrl.learner.layout import RowLengths, plan_micro_batches
from asyncrl.policies.loading import load_model

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.e2e,  # Triton builds its launchers with gcc on first use
              pytest.mark.filterwarnings("ignore::UserWarning")]

BF16_LOGP_BOUND = 0.08
"""max |Δ log p| between two bf16 computations of the same tiny model (other kernels, other reduction orders); a
document seeing another's keys, a wrong window or scale moves log-probs of this random model by O(0.3..3)."""


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe", "gpt_oss", "phi3"])
def test_packed_flash_logprobs_match_the_transformers_model_under_bf16_autocast(hf_zoo, model_type):
    model = load_model(str(hf_zoo(model_type)), device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [9, 17, 5, 12], [14, 3, 20, 9]  # longer than the zoo's sliding window (8)
    width = max(p + r for p, r in zip(prompts, responses))
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens[i, :p + r] = torch.randint(3, model.config.vocab_size, (p + r,), generator=gen)
    tokens = tokens.cuda()
    lengths = RowLengths(prompts, responses, width)
    micro, = plan_micro_batches(tokens, [list(range(len(prompts)))], lengths, packed=True)
    with torch.no_grad():
        got, _ = micro_logprobs(model, micro, max(responses), autocast=True)
        model.use_native_attention()
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = tokens[i:i + 1, :p + r]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model.hf(input_ids=ids, use_cache=False).logits.float()
            want = torch.log_softmax(logits, -1)[0, p - 1:p + r - 1].gather(-1, ids[0, p:, None])[:, 0]
            assert float((got[i, :r] - want).abs().max()) < BF16_LOGP_BOUND, (model_type, i)


def test_probes_in_bf16_on_the_gpu_keep_packing_for_attention_models_and_turn_it_off_for_the_hybrid(hf_zoo):
    from tests.hf_zoo import ATTENTION_ONLY
    for model_type in ATTENTION_ONLY:
        features = load_model(str(hf_zoo(model_type)), dtype=torch.bfloat16, device="cuda").features
        assert features.packing and features.document_attention, (model_type, features)
    assert not load_model(str(hf_zoo("qwen3_5_text")), dtype=torch.bfloat16, device="cuda").features.packing
