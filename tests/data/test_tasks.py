"""The procedural tasks, scored end to end: every generated countdown row is solvable and its solution scores 1
under `countdown_reward`; every arithmetic row's answer scores 1 under `arithmetic_reward`."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.data.tasks import ArithmeticTask, CountdownTask
from asyncrl.rewards import arithmetic_reward, countdown_reward


def solve_countdown(numbers: list[int], target: int) -> str | None:
    """An expression over all `numbers` (each once, + - * and parentheses) equal to `target`, or None.

    Brute force, as a player would: combine any two remaining values with + - * (both orders for -) until one
    is left. Exponential in len(numbers); fine for the task's 3-4 numbers."""
    def search(items: list[tuple[int, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, a_text), (b, b_text) = items[i], items[j]
            rest = [item for k, item in enumerate(items) if k not in (i, j)]
            for value, text in ((a + b, f"({a_text} + {b_text})"), (a * b, f"({a_text} * {b_text})"),
                                (a - b, f"({a_text} - {b_text})")):
                found = search(rest + [(value, text)])
                if found is not None:
                    return found
        return None
    return search([(n, str(n)) for n in numbers])


@pytest.mark.parametrize("count", [3, 4])
@pytest.mark.parametrize("seed", [0, 7])
def test_every_countdown_row_is_solvable_and_its_solution_scores_one(word_tokenizer, count, seed):
    task = CountdownTask(numbers=count, seed=seed)
    for index in range(40):
        numbers, target = task.question(index)
        prompt = task.prompt(index, word_tokenizer)
        assert prompt.ground_truth == f"{target}|{' '.join(map(str, sorted(numbers)))}"
        assert prompt.data_source == "countdown" and prompt.index == index
        assert f"make {target}." in prompt.text and all(str(n) in prompt.text for n in numbers)
        solution = solve_countdown(numbers, target)
        assert solution is not None, f"row {index}: {numbers} -> {target} has no solution"
        assert countdown_reward(f"Let me try.\n{solution}", prompt.ground_truth) == 1.0
        assert countdown_reward(f"{solution} + 1", prompt.ground_truth) == 0.0  # an extra number
        assert countdown_reward(f"({solution}) * 2", prompt.ground_truth) == 0.0


def test_countdown_rows_are_a_pure_function_of_seed_and_index():
    assert CountdownTask(seed=3).question(5) == CountdownTask(seed=3).question(5)
    assert [CountdownTask(seed=3).question(i) for i in range(10)] != [CountdownTask(seed=4).question(i)
                                                                       for i in range(10)]


@given(st.integers(1, 4), st.integers(2, 5), st.sampled_from(["+", "-", "*", "+-*"]), st.integers(0, 10**6))
def test_arithmetic_rows_answer_scores_one(digits, terms, operators, index):
    task = ArithmeticTask(digits=digits, terms=terms, operators=operators)
    expression, answer = task.question(index)
    assert arithmetic_reward(f"{expression} = {answer}", str(answer)) == 1.0
    assert arithmetic_reward(f"{expression} = {answer + 1}", str(answer)) == 0.0


@pytest.mark.parametrize("operators", ["+-", "*", "+-*"])
def test_arithmetic_answers_follow_python_precedence_without_eval(operators):
    task = ArithmeticTask(digits=2, terms=5, operators=operators, seed=11)
    for index in range(200):
        expression, answer = task.question(index)
        assert answer == eval(expression), expression  # the test may eval its own expression; the task does not
