"""`--env.fn`: built-in names, user classes by path, and one message naming the flag for each mistake."""

from __future__ import annotations

import pathlib

import pytest

from asyncrl.envs import Turn, load_env
from asyncrl.envs.builtin import BUILTIN_ENVS
from asyncrl.types import Prompt

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "guess_number" / "env.py"


def write(tmp_path, text: str):
    path = tmp_path / "my_env.py"
    path.write_text(text)
    return path


def test_built_in_names_and_user_classes_load(tmp_path):
    assert load_env("retry") is BUILTIN_ENVS["retry"]
    path = write(tmp_path, "class Guess:\n    def __init__(self, prompt):\n        pass\n\n"
                           "    async def step(self, turn):\n        pass\n")
    assert load_env(f"{path}:Guess").__name__ == "Guess"


@pytest.mark.parametrize("source, name, expected", [
    ("class Guess:\n    pass\n", "Guess", "Guess has no step method; define `def step(self, turn)`"),
    ("class Guess:\n    def step(self, turn):\n        pass\n", "Gess", "did you mean --env.fn"),
    ("GUESS = 3\n", "GUESS", "is not callable (it is int 3); point --env.fn at an environment class"),
    ("import no_such_module_here\n", "Guess", "No module named 'no_such_module_here'"),
])
def test_a_wrong_environment_is_one_message_naming_the_flag(tmp_path, source, name, expected):
    path = write(tmp_path, source)
    with pytest.raises(ValueError) as err:
        load_env(f"{path}:{name}")
    assert str(err.value).startswith(f"--env.fn '{path}:{name}'") and expected in str(err.value), str(err.value)


def test_an_unknown_name_lists_the_built_ins():
    with pytest.raises(ValueError, match=r"not a built-in environment \(calculator, retry\)"):
        load_env("guess")


def test_the_guess_number_example_answers_hints_and_rewards_the_right_guess():
    guess = load_env(f"{EXAMPLE}:Guess")(Prompt([1, 2], ground_truth="13", index=0))
    steps = [guess.step(Turn(text, (5,), i, "stop")) for i, text in enumerate(["10", "I say 15", "hmm", "13"])]
    assert [s.observation for s in steps[:3]] == ["Higher.", "Lower.", "Reply with one whole number from 1 to 20."]
    assert not any(s.done for s in steps[:3]) and steps[3].done
    assert steps[3].reward == pytest.approx(0.7 ** 3)
