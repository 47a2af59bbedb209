"""How far an engine's behaviour log-probs lie from a training forward of the same tokens (the benchmarks' mismatch
columns)."""

from __future__ import annotations

import torch

from asyncrl.policies import token_logprobs

__all__ = ["logprob_mismatch"]


@torch.inference_mode()
def logprob_mismatch(model, outs, max_rows: int = 32) -> dict[str, float]:
    """Engine behaviour log-probs vs a training forward of the same tokens (the first `max_rows` samples): the
    mean and the largest |difference| per token, the largest |logit| they come from (the scale a tolerance
    for rounding differences is relative to; tests/tolerances.py) and a k1 estimate of the KL."""
    diffs, kls, worst, scale = [], [], 0.0, 0.0
    samples = [(out.prompt_ids, c) for out in outs for c in out.completions if c.token_ids][:max_rows]
    for prompt_ids, c in samples:
        seq = torch.tensor([prompt_ids + c.token_ids], device=model.device)
        logits = model.logits(model(seq))[0, len(prompt_ids) - 1:-1]
        train = token_logprobs(logits, seq[0, len(prompt_ids):])
        engine = torch.tensor(c.logprobs, device=model.device)
        diffs.append((engine - train).abs().mean().item())
        kls.append((engine - train).mean().item())  # k1 estimate of KL(engine ‖ train) on engine samples
        worst, scale = max(worst, (engine - train).abs().max().item()), max(scale, logits.abs().max().item())
    return {"mean_abs_dlogp": sum(diffs) / len(diffs), "max_abs_dlogp": worst, "max_abs_logit": scale,
            "kl_engine_train": sum(kls) / len(kls)}
