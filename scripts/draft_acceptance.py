"""What the model-free drafts would keep, for many draft settings at the cost of one generation: generate once
without speculation, then replay each group's samples growing a token of agreement at a time and ask the drafts
(`asyncrl.policies.drafts.DraftIndex`) what they would propose at each step, keeping what plain decoding drew.

    python scripts/draft_acceptance.py --model smollm2 --data gsm8k.parquet --prompts 8 --n 8 --temperature 1
    python scripts/draft_acceptance.py --model smollm2 --data gsm8k.parquet --prompts 8 --n 1 --temperature 0

Printed per (draft length, suffix match range): the acceptance (drafted tokens kept / drafted), the tokens a
speculative step gives a row (1 + kept drafts), and the tokens drafted a row-step (what the verifying forward
checks). Siblings are replayed in lockstep (a row-step each per round), as a speculative engine runs them; the
engine's own figure is `asyncrl bench speculation` (`tokens_per_spec_row_step`), which this replay reproduced to
within 0.01 on SmolLM2 (2026-11-28).
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import torch

from asyncrl.data.files import load_prompt_file
from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model, load_tokenizer
from asyncrl.policies.drafts import DraftIndex
from asyncrl.policies.speculation import accepted_length


@dataclasses.dataclass
class Args:
    model: str = "smollm2"
    data: str = "data/gsm8k/test.parquet"
    """Prompt file (verl's format)."""
    prompts: int = 8
    n: int = 8
    temperature: float = 1.0
    new_tokens: int = 256
    tokens: tuple[int, ...] = (1, 2, 4, 8)
    """Draft lengths."""
    matches: tuple[str, ...] = ("1-3", "2-4", "3-6", "4-8")
    """Suffix match ranges, min-max."""
    seed: int = 0


def replay(groups: list[tuple[list[int], list[list[int]]]], tokens: int, min_match: int, max_match: int) -> dict:
    """Drafts over (prompt, samples) groups replayed in lockstep: the acceptance and tokens per row-step."""
    drafted = kept_drafts = row_steps = 0
    for prompt, samples in groups:
        drafts, grown = DraftIndex(min_match=min_match, max_match=max_match), [[] for _ in samples]
        while any(len(g) < len(s) for g, s in zip(grown, samples)):
            for i, sample in enumerate(samples):
                done = len(grown[i])
                if done == len(sample):
                    continue
                draft = drafts.propose("group", prompt, grown, i, min(tokens, len(sample) - done - 1))
                kept = accepted_length(draft, sample[done:done + len(draft) + 1])
                grown[i].extend(sample[done:done + kept])
                drafted, kept_drafts, row_steps = drafted + len(draft), kept_drafts + kept - 1, row_steps + 1
    return {"acceptance": kept_drafts / max(drafted, 1), "tokens_per_row_step": 1 + kept_drafts / row_steps,
            "drafted_per_row_step": drafted / row_steps}


def main(args: Args) -> list[dict]:
    model = load_model(args.model, dtype=torch.float32, device="cpu", seed=args.seed)
    prompts, _ = load_prompt_file(args.data, load_tokenizer(args.model), max_prompt_length=1024)
    ids = [p.prompt_ids for p in prompts[:args.prompts]]
    params = [SamplingParams(n=args.n, temperature=args.temperature, max_new_tokens=args.new_tokens,
                             seed=args.seed + i) for i in range(len(ids))]
    engine = Engine(model, EngineConfig(max_slots=len(ids) * args.n, max_len=max(map(len, ids)) + args.new_tokens))
    groups = [(o.prompt_ids, [c.token_ids for c in o.completions]) for o in engine.generate(ids, params)]
    rows = []
    for tokens, match in itertools.product(args.tokens, args.matches):
        low, high = map(int, match.split("-"))
        row = {"temperature": args.temperature, "n": args.n, "draft_tokens": tokens, "match": match,
               **replay(groups, tokens, low, high)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args))
