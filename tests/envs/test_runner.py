"""EpisodeRunner on the embedded engine: an episode's tokens are exactly the engine's turns plus the
environment's tokens; environment tokens are masked and carry no log-prob; versions are the sampling
weights'; the token budget and turn limit hold; a failing environment ends only its own episode."""

from __future__ import annotations

import pytest

from asyncrl.envs import EpisodeRunner
from asyncrl.policies import Engine, SamplingParams
from asyncrl.types import Prompt
from tests.envs.helpers import (ENV_TOKENS, AsyncEcho, Echo, EvenTurns, Garbage, Hangs, NaNReward, Raises,
                                Recording, run_episodes, runtime)
from tests.policies.helpers import small_config, tiny_model


@pytest.fixture
def engine():
    return Recording(Engine(tiny_model(0), small_config(max_slots=8, max_len=64)))


PROMPT = Prompt([5, 9, 11, 13], data_source="toy", index=0)


@pytest.mark.parametrize("factory", [Echo, AsyncEcho], ids=["sync", "async"])
def test_an_episode_is_the_engines_turns_plus_the_environment_tokens_byte_for_byte(engine, factory):
    runner = EpisodeRunner(engine, runtime(factory, max_turn_tokens=4))
    params = SamplingParams(n=2, max_new_tokens=40, seed=7)
    group = run_episodes(runner, engine, [PROMPT], params)["p0"]
    runner.close()
    assert group.env_rewards == [None, None]  # Echo gives no reward: the reward function scores
    assert group.env_stats["episodes"] == 2 and group.env_stats["turns"] == 6
    first = engine.outputs["p0.t0"]
    for i, completion in enumerate(group.completions):
        turns = [first.completions[i]] + [engine.outputs[f"p0.e{i}.t{t}"].completions[0] for t in (1, 2)]
        expected, mask, logprobs, versions = [], [], [], []
        for t, turn in enumerate(turns):
            # every turn's prompt was the episode so far, never re-encoded
            prompt = first.prompt_ids if t == 0 else engine.outputs[f"p0.e{i}.t{t}"].prompt_ids
            assert prompt == PROMPT.prompt_ids + expected
            env = [] if t == 2 else [ENV_TOKENS[0] + t, ENV_TOKENS[1]]
            expected += turn.token_ids + env
            mask += [True] * len(turn.token_ids) + [False] * len(env)
            logprobs += turn.logprobs + [0.0] * len(env)
            versions += turn.versions + [turn.versions[-1]] * len(env)
        assert completion.token_ids == expected
        assert completion.loss_mask == mask
        assert completion.logprobs == logprobs and completion.versions == versions
    # turns 2 and 3 continued their session's K/V: only the last sampled token and the environment's two were new
    later = [engine.outputs[f"p0.e{i}.t{t}"] for i in (0, 1) for t in (1, 2)]
    assert all(out.cached_prompt_tokens == len(out.prompt_ids) - 3 for out in later)
    stats = group.env_stats
    assert stats["later_turn_prompt_tokens"] == sum(len(out.prompt_ids) for out in later)
    assert stats["reused_prompt_tokens"] == engine.stats["session_reused_tokens"] == stats[
        "later_turn_prompt_tokens"] - 3 * len(later)
    assert engine.num_held == 0  # sessions are freed when their episodes end


def test_a_weight_update_between_turns_stamps_the_new_version_on_later_tokens_only(engine):
    runner = EpisodeRunner(engine, runtime(Echo, max_turn_tokens=4))

    def update(eng):
        named = [(n, p.detach() * 1.001) for n, p in eng.model.named_parameters()]
        eng.update_weights(named, version=1)

    group = run_episodes(runner, engine, [PROMPT], SamplingParams(n=1, max_new_tokens=40, seed=3),
                         between_turns=update)["p0"]
    runner.close()
    c = group.completions[0]
    first_turn = len(engine.outputs["p0.t0"].completions[0].token_ids)
    assert set(c.versions[:first_turn]) == {0}
    assert c.versions[first_turn:first_turn + 2] == [0, 0]  # the environment's answer to a version-0 turn
    assert set(c.versions[first_turn + 2:]) == {1}


def test_the_token_budget_and_the_turn_limit_end_episodes_as_truncated(engine):
    runner = EpisodeRunner(engine, runtime(Echo, max_turn_tokens=4))
    group = run_episodes(runner, engine, [PROMPT], SamplingParams(n=4, max_new_tokens=9, seed=1))["p0"]
    assert all(len(c.token_ids) <= 9 for c in group.completions)
    assert group.env_stats["truncated"] >= 1  # 4 + 2 + 4 > 9: no third turn fits
    limited = EpisodeRunner(engine, runtime(Echo, max_turns=2, max_turn_tokens=4))
    group = run_episodes(limited, engine, [Prompt([7, 9, 11], index=1)], SamplingParams(n=2, max_new_tokens=40))["p1"]
    assert group.env_stats["turns"] == 4 and group.env_stats["truncated"] == 2
    runner.close()
    limited.close()


def test_environment_rewards_are_summed_over_turns(engine):
    runner = EpisodeRunner(engine, runtime(EvenTurns, max_turns=2, max_turn_tokens=4))
    group = run_episodes(runner, engine, [PROMPT], SamplingParams(n=3, max_new_tokens=40, seed=2))["p0"]
    runner.close()
    for i, reward in enumerate(group.env_rewards):
        turns = [engine.outputs["p0.t0"].completions[i], engine.outputs[f"p0.e{i}.t1"].completions[0]]
        expected = sum(sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) / 2 for c in turns)
        assert reward == pytest.approx(expected)


@pytest.mark.parametrize("factory, counter", [(Raises, "env_errors"), (Garbage, "env_errors"),
                                              (NaNReward, "env_errors"), (Hangs, "env_timeouts")],
                         ids=["raises", "garbage", "nan-reward", "times-out"])
def test_a_failing_environment_ends_only_its_episodes_counted_scored_0_and_untrained(engine, factory, counter):
    runner = EpisodeRunner(engine, runtime(factory, max_turn_tokens=4, step_timeout_s=0.5 if factory is Hangs
                                           else None))
    prompts = [Prompt([5, 9, 11], index=0), Prompt([6, 9, 11], index=1)]  # odd rows fail
    groups = run_episodes(runner, engine, prompts, SamplingParams(n=2, max_new_tokens=40, seed=4))
    runner.close()
    good, bad = groups["p0"], groups["p1"]
    assert good.env_stats[counter] == 0 and good.env_stats["turns"] == 6 and good.env_rewards == [None, None]
    assert bad.env_stats[counter] == 2
    assert bad.env_rewards == [0.0, 0.0]
    for c in bad.completions:
        assert not any(c.loss_mask) and c.finish_reason == "abort"


def test_an_episode_carries_the_routes_of_its_latest_routed_turn():
    """A later turn's prompt is the whole episode so far, so its routes (vLLM's, for r3) cover every earlier turn:
    the episode's completion carries the latest ones; a turn without routes keeps the earlier ones."""
    import numpy as np

    from asyncrl.envs.episode import Episode
    from asyncrl.types import Completion
    episode = Episode("s0", prompt_ids=[1, 2], budget=32)
    first, later = np.zeros((3, 2, 2), dtype=np.int16), np.ones((6, 2, 2), dtype=np.int16)
    episode.add_model_turn(Completion([5, 6], [-1.0, -1.0], [0, 0], "stop", routes=first), "a")
    episode.add_env_tokens([7, 8])
    episode.add_model_turn(Completion([9], [-1.0], [0], "stop", routes=later), "b")
    assert episode.completion().routes is later
    episode.add_model_turn(Completion([10], [-1.0], [1], "stop"), "c")
    assert episode.completion().routes is later
