"""FSDP2 with LoRA on 2 CPU processes (gloo) against one process: a sharded LoRA learner (adapters and frozen
base sharded with their layers) trains like an unsharded one, with its base as the KL reference and a PPO
critic of its own; its checkpoint (adapters only) round-trips and its merged export is the trained policy.

One launch of two workers (`tests.lora_helpers.lora_fsdp_worker`) under a hard time limit, as tests/learner/test_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.checkpoint import list_checkpoints
from asyncrl.learner import train_step
from asyncrl.policies import load_pretrained
from asyncrl.policies.lora import is_adapter_name, merged_weights
from tests.dist_helpers import max_diff, run_distributed
from tests.lora_helpers import build_lora, lora_fsdp_worker, trained
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORLD = 2


@pytest.fixture(scope="module")
def sharded(groups, next_groups, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-sharded")
    out, run_dir, export_dir = root / "out", root / "run", root / "export"
    out.mkdir()
    run_distributed(lora_fsdp_worker, out, groups, next_groups, str(run_dir), str(export_dir), world_size=WORLD,
                    timeout=limit(90))
    return dict(ranks=[torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)], run_dir=run_dir,
                export_dir=export_dir)


@pytest.mark.parametrize("algorithm", ["grpo-kl", "ppo"])
def test_a_sharded_lora_step_equals_the_single_process_step(groups, sharded, algorithm):
    initial = trained(build_lora(algorithm))
    state, metrics = train_step(build_lora(algorithm), groups)
    want = trained(state)
    for part in want:
        moved = {k for k in want[part] if not torch.equal(want[part][k], initial[part][k])}
        assert moved and all(is_adapter_name(k) or k.startswith("value_head.") for k in moved), part
    for rank, res in enumerate(sharded["ranks"]):
        got = res[algorithm]
        for part in want:
            assert max_diff(got[part], want[part]) <= 1e-5, (rank, part, max_diff(got[part], want[part]))
        assert got["metrics"]["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
        if algorithm == "grpo-kl":  # π_ref (the base, adapters off) differs from π: the KL is not zero
            mean_kl = sum(r[algorithm]["metrics"]["actor/kl_loss"] for r in sharded["ranks"]) / WORLD
            assert mean_kl == pytest.approx(metrics["actor/kl_loss"], rel=1e-4) and metrics["actor/kl_loss"] > 0


def test_the_sharded_lora_checkpoint_holds_the_adapters_and_round_trips(sharded, next_groups):
    (path,) = list_checkpoints(sharded["run_dir"])
    saved = torch.load(path / "learner.pt", weights_only=True)
    assert all(is_adapter_name(k) for k in saved["policy"])
    assert set(saved["critic"]) == {k for k in sharded["ranks"][0]["ppo"]["critic"]
                                    if is_adapter_name(k) or k.startswith("value_head.")}
    for res in sharded["ranks"]:
        for part in ("policy", "critic"):
            assert max_diff(res["loaded"][part], res["ppo"][part]) == 0, part
            assert max_diff(res["loaded_continued"][part], res["continued"][part]) <= 1e-6, part


def test_the_merged_export_of_a_sharded_lora_learner_is_its_policy(sharded):
    exported = {k: v for k, v in load_pretrained(sharded["export_dir"]).state_dict().items()}
    policy = sharded["ranks"][0]["ppo"]["policy"]
    lora = build_lora("ppo")
    lora.policy.load_state_dict(policy, strict=False)  # the tied lm_head is left out
    want = {k: v.detach() for k, v in merged_weights(lora.policy)}
    assert max_diff({k: exported[k] for k in want}, want) <= 1e-6
