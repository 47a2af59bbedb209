"""`asyncrl train PRESET ...` parsing: the run's flags may come before or after `algorithm:NAME` (users append
flags at the end), `--help` after the subcommand lists both, and what `--dry-run` prints parses back to the
same config whichever side of the subcommand its flags are put."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.launch.train_command import run_config
from asyncrl.config import DAPO
from asyncrl.config.flags import as_flags
from asyncrl.config.presets import PRESETS

# flags of the run (not of the algorithm), each with its value, and one of the algorithm's
RUN_FLAGS = [("--wandb", "off"), ("--run-dir", "runs/x"), ("--rollout.temperature", "0.7"),
             ("--trainer.optim.lr", "3e-06"), ("--async-training.staleness-threshold", "0")]
ALGORITHM_FLAG = ("--algorithm.kl-loss-coef", "0.001")


def _split(flags: list[str]) -> list[str]:
    return [arg for flag in flags for arg in shlex.split(flag)]


def test_flags_after_the_algorithm_subcommand_apply_to_the_run():
    # what the issue reported refused: a run flag after `algorithm:dapo`
    cfg = run_config("cpu-demo", ["--run-dir", "runs/x", "algorithm:dapo", "--wandb", "off", *ALGORITHM_FLAG,
                                  "--rollout.temperature", "0.7"])
    assert isinstance(cfg.algorithm, DAPO) and cfg.algorithm.kl_loss_coef == 0.001
    assert cfg.run_dir == "runs/x" and cfg.wandb == "off" and cfg.rollout.temperature == 0.7
    # every other field is the preset's (DAPO's own defaults for the algorithm)
    want = run_config("cpu-demo", ["algorithm:dapo"])
    want.run_dir, want.wandb, want.rollout.temperature, want.algorithm.kl_loss_coef = "runs/x", "off", 0.7, 0.001
    assert cfg == want
    assert PRESETS["cpu-demo"][1].wandb != "off"  # the preset itself was not changed by parsing


@settings(max_examples=12)
@given(st.permutations(RUN_FLAGS), st.integers(0, len(RUN_FLAGS)))
def test_the_order_of_the_run_flags_around_the_subcommand_does_not_matter(flags, before):
    """Any order of the run's flags, any number of them before `algorithm:dapo` and the rest after it (the
    algorithm's flag among them), gives the config of the canonical order."""
    args = [a for pair in flags[:before] for a in pair] + ["algorithm:dapo"]
    after = list(flags[before:]) + [ALGORITHM_FLAG]
    args += [a for pair in after for a in pair]
    canonical = [a for pair in RUN_FLAGS for a in pair] + ["algorithm:dapo", *ALGORITHM_FLAG]
    assert run_config("cpu-demo", args) == run_config("cpu-demo", canonical)


def test_an_algorithm_flag_before_its_subcommand_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_config("cpu-demo", [*ALGORITHM_FLAG, "algorithm:dapo"])
    assert exit_.value.code == 2


def test_help_after_the_subcommand_lists_the_run_flags_and_the_algorithm_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_config("cpu-demo", ["algorithm:dapo", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "--wandb" in out and "--run-dir" in out and "--algorithm.overlong-buffer-len" in out


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_dry_run_command_line_gives_the_same_config_with_its_run_flags_on_either_side(preset):
    cfg = run_config(preset, ["algorithm:dapo", "--wandb", "off", *ALGORITHM_FLAG])
    flags = as_flags(cfg)  # the run's flags, then algorithm:dapo, then the algorithm's
    assert run_config(preset, _split(flags)) == cfg
    cut = flags.index("algorithm:dapo")
    assert run_config(preset, _split(flags[cut:cut + 1] + flags[:cut] + flags[cut + 1:])) == cfg  # all after it
    half = cut // 2
    assert run_config(preset, _split(flags[half:cut + 1] + flags[:half] + flags[cut + 1:])) == cfg
