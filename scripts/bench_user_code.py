"""What running a sync reward plug-in in worker processes costs: groups scored per second by a `Scorer` with the
agent's worker pool (`--placement.user-code-workers`) against the same scorer calling the reward in its own
thread (`--placement.user-code-workers 0`, where a hang cannot be cut off), in one process, same completions.

    python scripts/bench_user_code.py                                   # the word-length example's reward
    python scripts/bench_user_code.py --groups 50 --workers 1 2 4

The workers are started (and their imports done) before the clock starts, as in a run, where they start with
the agent. Prints one row per pool size: groups/s in workers, groups/s in the thread, and their ratio.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import sys
import time

import tyro

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.data.scoring import Scorer  # noqa: E402
from asyncrl.rewards.plugin import RewardTable  # noqa: E402
from asyncrl.rpc.agent_server import USER_CODE_MODULES  # noqa: E402
from asyncrl.rpc.worker_pool import WorkerPool  # noqa: E402
from asyncrl.types import Completion, Prompt  # noqa: E402


@dataclasses.dataclass
class Args:
    reward: str = str(ROOT / "examples" / "word_length" / "reward.py") + ":score"
    """--reward.fn spec of the sync reward to score with."""
    groups: int = 400
    """Groups scored per measurement."""
    n: int = 8
    """Completions per group (--rollout.n)."""
    workers: tuple[int, ...] = (1, 2)
    """Pool sizes to measure."""


def _groups(count: int, n: int) -> list[tuple[Prompt, list[Completion]]]:
    rng = random.Random(0)
    out = []
    for index in range(count):
        prompt = Prompt([1, 2, 3], data_source="word_length", ground_truth=str(rng.randint(1, 9)), index=index)
        completions = [Completion(token_ids=[rng.randint(1, 9) for _ in range(4)], logprobs=[0.0] * 4,
                                  versions=[0] * 4, finish_reason="stop") for _ in range(n)]
        out.append((prompt, completions))
    return out


def _groups_per_s(scorer: Scorer, groups) -> float:
    start = time.perf_counter()
    futures = [scorer.submit_group(prompt, completions) for prompt, completions in groups]  # as the agent does
    for future in futures:
        future.result()
    return len(groups) / (time.perf_counter() - start)


def main(args: Args) -> list[dict]:
    table = RewardTable.from_specs([args.reward])
    groups = _groups(args.groups, args.n)
    inline = _groups_per_s(Scorer(table), groups)
    rows = []
    for size in args.workers:
        pool = WorkerPool(size, name="bench-user-code", preload=USER_CODE_MODULES)
        try:
            scorer = Scorer(table, workers=pool)
            _groups_per_s(scorer, groups[:size * 2])  # start every worker and load the reward there
            pooled = _groups_per_s(scorer, groups)
        finally:
            pool.close()
        rows.append({"workers": size, "groups_per_s_workers": pooled, "groups_per_s_thread": inline,
                     "ratio": pooled / inline})
    print(f"{args.reward}: {args.groups} groups of {args.n}")
    print(f"{'workers':>8s} {'groups/s in workers':>20s} {'groups/s in thread':>19s} {'ratio':>7s}")
    for row in rows:
        print(f"{row['workers']:8d} {row['groups_per_s_workers']:20.0f} {row['groups_per_s_thread']:19.0f} "
              f"{row['ratio']:7.3f}")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
