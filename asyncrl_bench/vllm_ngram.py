"""vLLM's n-gram speculation beside ours (`asyncrl bench speculation --vllm`): vLLM's offline `LLM.generate`
on the same timed prompts, plain and with `speculative_config={"method": "ngram", ...}` at each --tokens, its
lookup window the drafts' (--rollout.speculation.min-match / max-match). vLLM drafts from a request's own prompt
and response only; ours also from the GRPO siblings and recent responses to the same prompt.

Each `LLM` warms up on the warm-up prompts, then the timed prompts run once; the acceptance and the tokens a
speculative step gives a row come from vLLM's own counters over the timed run (`vllm:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens`). Every `LLM` lives in one process of its own (spawned), one
after another."""

from __future__ import annotations

import dataclasses
import tempfile
import time

import torch

from asyncrl.config import VLLMConfig
from asyncrl.policies import SamplingParams, save_pretrained
from asyncrl.policies.vllm_calls import vllm_generate, vllm_llm
from asyncrl.policies.vllm_engine import kv_cache_bytes
from asyncrl_bench.shared import in_own_process, indexed_device, synchronize

__all__ = ["NgramRun", "vllm_ngram_runs"]

_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens")


@dataclasses.dataclass(frozen=True)
class NgramRun:
    """One `LLM`'s timed run: draft_tokens 0 is plain decoding."""

    draft_tokens: int
    generated: int
    seconds: float
    drafts: int
    drafted: int
    accepted: int

    @property
    def tok_s(self) -> float:
        return self.generated / self.seconds

    @property
    def acceptance(self) -> float | None:
        """Drafted tokens kept / drafted (None: nothing drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accepted_share(self) -> float:
        """Kept draft tokens / tokens generated."""
        return self.accepted / max(self.generated, 1)

    @property
    def tokens_per_spec_row_step(self) -> float | None:
        """Tokens a speculative step gave a row: 1 + the kept draft tokens per draft checked."""
        return 1 + self.accepted / self.drafts if self.drafts else None


def _counters(llm) -> dict[str, int]:
    found = {m.name: int(m.value) for m in llm.get_metrics() if m.name in _COUNTERS}
    return {name: found.get(name, 0) for name in _COUNTERS}


def _worker(model_dir: str, settings: dict, warm_up: list[list[int]], prompts: list[list[int]],
            params: SamplingParams, stop_ids: list[int]) -> list[NgramRun]:
    runs = []
    for k in (0, *settings["tokens"]):
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": settings["min_match"],
                "prompt_lookup_max": settings["max_match"]} if k else None
        llm = vllm_llm(model_dir, VLLMConfig(), max_slots=settings["slots"], max_len=settings["max_len"],
                       dtype=settings["dtype"], device=settings["device"], kv_bytes=settings["kv_bytes"],
                       seed=params.seed or 0, extra={"speculative_config": spec, "disable_log_stats": False})
        vllm_generate(llm, warm_up, params, max_tokens=params.max_new_tokens, stop_ids=stop_ids)
        before = _counters(llm)
        synchronize(settings["device"])
        start = time.perf_counter()
        outs = vllm_generate(llm, prompts, params, max_tokens=params.max_new_tokens, stop_ids=stop_ids)
        seconds = time.perf_counter() - start
        after = _counters(llm)
        drafts, drafted, accepted = (after[name] - before[name] for name in _COUNTERS)
        runs.append(NgramRun(k, sum(len(c.token_ids) for o in outs for c in o.outputs), seconds, drafts, drafted,
                             accepted))
        del llm
    return runs


def vllm_ngram_runs(model, warm_up: list[list[int]], prompts: list[list[int]], params: SamplingParams, *,
                    tokens: tuple[int, ...], min_match: int, max_match: int, max_len: int, dtype: torch.dtype,
                    device: str) -> list[NgramRun]:
    """Plain decoding, then n-gram speculation at each of `tokens`, through vLLM over a saved copy of `model`
    (module docstring); `params` (n samples a prompt, seeded) as our engine's timed run takes them. vLLM samples
    greedily only one sample a request, so at temperature 0 each prompt is sent n times."""
    if params.temperature == 0 and params.n > 1:
        warm_up, prompts = ([p for p in batch for _ in range(params.n)] for batch in (warm_up, prompts))
        params = dataclasses.replace(params, n=1)
    slots = len(prompts) * params.n
    settings = dict(tokens=tuple(tokens), min_match=min_match, max_match=max_match, slots=slots, max_len=max_len,
                    dtype=dtype, device=indexed_device(device),
                    kv_bytes=None if device.startswith("cuda") else kv_cache_bytes(model, slots, max_len))
    stop_ids = sorted(params.stop_ids(model.config.eos_token_ids))
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-vllm-") as directory:
        save_pretrained(model, directory)
        return in_own_process(_worker, directory, settings, warm_up, prompts, params, stop_ids)
