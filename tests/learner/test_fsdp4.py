"""FSDP2 at 4 ranks (4 CPU processes over gloo) against one process, for several steps: packed GRPO, PPO with
its critic, and LoRA GRPO with the base as its KL reference. After each of 3 train_steps the full weights
(gathered) equal the single process's to a share of the learning rate (Adam turns round-off in nearly cancelling
gradients into a share of lr: tests/tolerances.py, ADAM_SHARE) and the step's metrics to fp32 round-off.

With 7 groups a mini-batch of 2 leaves ranks with one group, and the last mini-batch of each epoch (one group)
leaves three ranks with no rows at all; the ranks' micro-batch counts differ, and the learner pads with empty
micro-batches so the collectives line up. One launch of 4 workers runs every scenario under a hard time limit.
"""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from asyncrl.learner import train_step
from tests.dist_helpers import build, max_diff, ppo, run_distributed, sample_groups
from tests.lora_helpers import build_lora, trained
from tests.timing import limit
from tests.tolerances import adam_weights_tol

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORLD = 4
STEPS = 3
SCENARIOS = ("grpo", "ppo", "lora-grpo-kl", "ppo-sent")
"""`ppo-sent`: PPO as a launched trainer group runs it: rank 0 takes the step through `TrainerGroup.step`, which
sends each follower only its share over a gloo commands group, and the followers take it through `follow_step`."""
METRICS = ("actor/", "critic/", "response_length/")
"""The metrics compared (by prefix): the losses, KL, clip fractions, gradient norms, lr, values, rewards, lengths."""
UPDATE_METRICS = ("actor/", "critic/vf_", "critic/grad_norm")
"""Those every rank reports (the batch's and its preparation's come from rank 0, which holds the whole batch)."""


def _learner(scenario: str, sharded: bool):
    if scenario == "lora-grpo-kl":
        return build_lora("grpo-kl", sharded=sharded)
    return build(scenario.removesuffix("-sent"), sharded=sharded)


def _steps(state, batches, step=train_step) -> list[dict]:
    """`step` on each batch: the full weights (every rank gathers) and the metrics after each step."""
    out = []
    for groups in batches:
        state, metrics = step(state, groups)
        out.append(dict(weights=trained(state), metrics=metrics))
    return out


def _sent_step(commands_group):
    """A step as a launched trainer group takes it: rank 0 sends, the followers receive their shares."""
    from torch import distributed as dist

    from asyncrl.rpc.commands import TrainerGroup, follow_step, receive_command

    def step(state, groups):
        if dist.get_rank() == 0:
            return TrainerGroup(commands_group).step(state, groups)
        header, _ = receive_command(commands_group)
        assert header["cmd"] == "step"
        return follow_step(commands_group, state, header)
    return step


def fsdp4_worker(rank: int, world: int, out: pathlib.Path, batches) -> None:
    from torch import distributed as dist
    commands_group = dist.new_group(backend="gloo")
    res = {scenario: _steps(_learner(scenario, sharded=True), batches,
                            _sent_step(commands_group) if scenario.endswith("-sent") else train_step)
           for scenario in SCENARIOS}
    torch.save(res, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def batches():
    return [sample_groups(7, seed=step, n=3, first_id=100 * step) for step in range(STEPS)]


@pytest.fixture(scope="module")
def single(batches):
    return {scenario: _steps(_learner(scenario, sharded=False), batches) for scenario in SCENARIOS}


@pytest.fixture(scope="module")
def sharded(batches, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp4")
    run_distributed(fsdp4_worker, out, batches, world_size=WORLD, timeout=limit(240))
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_four_ranks_train_like_one_process_step_after_step(scenario, single, sharded):
    for step in range(STEPS):
        want = single[scenario][step]
        for rank, result in enumerate(sharded):
            got = result[scenario][step]
            lrs = {"policy": want["metrics"]["actor/lr"], "critic": ppo().critic.lr}
            for part in want["weights"]:  # after Adam updates: to a share of lr (tests/tolerances.py, ADAM_SHARE)
                error = max_diff(got["weights"][part], want["weights"][part])
                assert error <= adam_weights_tol(lrs[part]), (scenario, step, rank, part, error)
            keys = [k for k in want["metrics"] if k.startswith(METRICS)]
            if rank > 0:  # a follower holds only its share: it reports the updates' metrics, reduced over the group
                keys = [k for k in keys if k.startswith(UPDATE_METRICS)]
            assert len(keys) >= 8 and set(keys) <= got["metrics"].keys(), (scenario, keys)
            for key in keys:
                a, b = got["metrics"][key], want["metrics"][key]
                assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (scenario, step, rank, key, a, b)


def test_the_steps_change_the_weights(single):
    """Guards the comparison above: each scenario's weights move at every step (else equality proves nothing)."""
    for scenario in SCENARIOS:
        steps = single[scenario]
        for before, after in zip(steps, steps[1:]):
            assert max_diff(before["weights"]["policy"], after["weights"]["policy"]) > 1e-6, scenario
