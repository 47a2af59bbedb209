"""Tool calling: the parser (Qwen/Hermes tags and Llama JSON, malformed calls as errors, never an exception),
the calculator (right answers, and attacks refused quickly as error messages), the built-in `retry`
environment's step, the chat renderer's environment tokens, and a scripted tool-using episode with a known
reward. The generated attacks on every reader of model text are in tests/rewards/test_adversarial.py."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.data.scoring import Scorer
from asyncrl.envs import (Calculator, ChatRenderer, EnvRuntime, EpisodeRunner, ToolCall, calculator, parse_tool_calls,
                          tool_schemas)
from asyncrl.envs.builtin import BUILTIN_ENVS, RetryArithmetic
from asyncrl.envs.protocol import Turn
from asyncrl.policies import SamplingParams
from asyncrl.rewards import arithmetic_reward
from asyncrl.types import Completion, GenerationOutput, Prompt
from tests.rewards.bounded_calls import bounded_worker  # noqa: F401 - the fixture
from tests.timing import limit


@pytest.mark.parametrize("text, calls, errors", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
     [ToolCall("calculator", {"expression": "2 + 3"})], 0),
    ('First <tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b", "arguments": '
     '"{\\"x\\": 1}"}</tool_call>', [ToolCall("a", {}), ToolCall("b", {"x": 1})], 0),
    ('{"name": "calculator", "parameters": {"expression": "7*6"}}', [ToolCall("calculator", {"expression": "7*6"})], 0),
    ('<|python_tag|>{"name": "f", "parameters": {}}', [ToolCall("f", {})], 0),
    ("The answer is 42.", [], 0),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', [], 1),
    ('<tool_call>{"arguments": {}}</tool_call>', [], 1),
    ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', [], 1),
    ('<tool_call>{"name": "f", "arguments": {}}', [], 1),
])
def test_tool_calls_are_parsed_and_malformed_ones_reported(text, calls, errors):
    found, problems = parse_tool_calls(text)
    assert found == calls and len(problems) == errors


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_the_parser_never_raises(text):
    calls, errors = parse_tool_calls(text)
    assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in calls)
    assert all(isinstance(e, str) for e in errors)


@pytest.mark.parametrize("expression, answer", [
    ("(12 + 30) * 4", "168"),  # 42 * 4
    ("7 / 2", "3.5"),
    ("2**10", "1024"),
    ("1,000 - 1", "999"),  # thousands separators are dropped
    ("10 / 4 * 2", "5"),  # 5.0 is shown as an integer
    ("1 / 3", "0.333333"),  # floats are rounded to 6 decimals
    ("17 // 5 + 17 % 5", "5"),  # 3 + 2
    ("-2**2", "-4"),  # Python precedence
    ("2 ** 1000", str(2 ** 1000)),  # 302 digits: under the 2**1024 cap, computed
    ("1.5e3", "1500"),
])
def test_the_calculator_computes_arithmetic(expression, answer):
    assert calculator(expression) == answer


CALCULATOR_ATTACKS = {
    "python": ("__import__('os').system('true')", "unexpected '_'"),
    "name": ("x + 1", "unexpected 'x'"),
    "truncated": ("2 +", "ends where a number"),
    "right-tower": ("9**9**9**9", "a power would reach 2**1024"),
    "left-tower": ("(((9**64)**64)**64)**64", "a power would reach 2**1024"),
    "countdown-tower": ("12**11**10", "a power would reach 2**1024"),
    "negative-tower": ("(-9)**9**9", "a power would reach 2**1024"),
    "product": (" * ".join(["10**64"] * 10), "a result would reach 2**1024"),
    "big-literal": ("9" * 5000, "has 5000 characters, more than 1000"),
    "long-literal": ("9" * 401, "a number has more than 400 characters"),
    "float-overflow": ("1e308 * 1e308", "too large for a float"),
    "float-power": ("1.0000001 ** (2**1000)", "too large for a float"),
    "exponent-literal": ("1e100000000", "too large for a float"),
    "deep-parentheses": ("(" * 60 + "1" + ")" * 60, "nests deeper than 50 levels"),
    "deep-signs": ("-" * 100_000 + "1", "more than 1000"),
    "long": ("1+" * 100_000 + "1", "more than 1000"),
    "division-by-zero": ("1 / (2 - 2)", "division by zero"),
    "modulo-by-zero": ("(10**300) % 0", "division by zero"),
    "complex": ("(-1) ** 0.5", "not a real number"),
    "unicode-digit": ("٣ + 1", "unexpected '٣'"),
    "caret": ("2 ^ 3", "unexpected '^'"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("expression, why", CALCULATOR_ATTACKS.values(), ids=CALCULATOR_ATTACKS.keys())
def test_the_calculator_refuses_anything_else_quickly(bounded_worker, expression, why):
    outcome = bounded_worker.call(calculator, expression)  # in a child: a hang fails this test, not the suite
    assert outcome.error is not None and outcome.error.startswith("ValueError: cannot evaluate"), outcome
    assert why in outcome.error
    assert outcome.seconds < limit(1.0)


def test_a_refused_expression_is_the_models_error_observation():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "(((9**64)**64)**64)**64"}}</tool_call>'
    result = Calculator(Prompt([1], index=0)).step(Turn(call, (), 0, "stop"))
    message, = result.observation
    assert message["content"].startswith(
        "error: calculator raised ValueError: cannot evaluate '(((9**64)**64)**64)**64': a power would reach 2**1024")
    assert result.tool_calls == 1 and result.tool_errors == 1 and not result.done


@pytest.mark.parametrize("turn, error", [
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "the tool call nests too deeply to be read"),
    ('<tool_call>{"name": "calculator", "arguments": {"x": ' + "1" * 5000 + "}}</tool_call>",
     "the tool call cannot be read: Exceeds the limit (4300 digits)"),
    ('<tool_call>{"name": "' + "n" * 100_000 + '", "arguments": {}}</tool_call>', "error: no tool named 'nnnn"),
])
def test_hostile_tool_calls_become_short_error_messages(turn, error):
    result = Calculator(Prompt([1], index=0)).step(Turn(turn, (), 0, "stop"))
    message, = result.observation
    assert error in message["content"] and len(message["content"]) < 400
    assert result.tool_errors == 1


# --------------------------------------------------------------------------------------------------------------
# the built-in `retry` environment
# --------------------------------------------------------------------------------------------------------------


def _retry(text: str, index: int = 0, truth: str = "42"):
    return RetryArithmetic(Prompt([1], ground_truth=truth, index=3)).step(Turn(text, (), index, "stop"))


def test_retry_is_the_builtin_named_retry():
    assert BUILTIN_ENVS["retry"] is RetryArithmetic


def test_retry_a_right_answer_ends_the_episode_with_a_reward_halved_per_extra_turn():
    first = _retry("The answer is 42.")
    assert first.done and first.reward == 1.0 and first.observation is None
    assert [_retry("42", index).reward for index in range(4)] == [1.0, 0.5, 0.25, 0.125]  # 0.5 ** index
    assert _retry("-1,234", truth="-1234").done  # commas dropped, negative answers
    assert _retry("0042").done  # compared as integers


@pytest.mark.parametrize("text, observation", [
    ("43", "Too high. Try again."),
    ("41", "Too low. Try again."),
    ("-42", "Too low. Try again."),
    ("42 plus 1 is 43", "Too high. Try again."),  # the last integer is the answer
    ("I am not sure.", "No number. Try again."),
    ("", "No number. Try again."),
    ("٤٢", "No number. Try again."),  # non-ASCII digits are not a number
    ("9" * 100_000, "Too high. Try again."),  # past int()'s 4300-digit limit: compared by length, no ValueError
    ("-" + "9" * 100_000, "Too low. Try again."),
])
def test_retry_a_wrong_answer_hears_which_way_and_goes_on(text, observation):
    result = _retry(text)
    assert result.observation == observation and result.reward == 0.0 and not result.done


def test_retry_needs_an_integer_ground_truth():
    with pytest.raises(ValueError, match="row 3 has '4.5'; use --data.task arithmetic"):
        RetryArithmetic(Prompt([1], ground_truth="4.5", index=3))


def test_chat_renderer_appends_what_the_template_writes_between_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    renderer = ChatRenderer(tok)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    answer = tok.encode("6", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    sequence = prompt + answer + renderer.after_turn(answer) + renderer.observation("Too high. Try again.")
    conversation = messages + [{"role": "assistant", "content": "6"}, {"role": "user", "content": "Too high. Try again."}]
    whole = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert sequence == list(whole["input_ids"] if hasattr(whole, "keys") else whole)


class ScriptedEngine:
    """Answers request k with the k-th scripted text (its tokens, then the end-of-turn token): a stand-in for
    a model that calls a tool, then answers."""

    backend = "scripted"
    version = 0

    def __init__(self, tokenizer, script: list[str]):
        self.tok, self.script = tokenizer, iter(script)
        self.stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pending: list[GenerationOutput] = []
        self.prompts: list[list[int]] = []

    def add_request(self, prompt_ids, params, request_id=None, *, sessions=None):
        self.prompts.append(list(prompt_ids))
        comps = []
        for _ in range(params.n):
            ids = self.tok.encode(next(self.script), add_special_tokens=False) + [self.stop]
            comps.append(Completion(ids, [-0.5] * len(ids), [0] * len(ids), "stop"))
        self.pending.append(GenerationOutput(request_id, list(prompt_ids), comps, True))
        return request_id

    def step(self):
        out, self.pending = self.pending, []
        return out

    def end_sessions(self, names):
        pass


def test_a_scripted_tool_using_episode_gets_the_known_reward(smollm2_tokenizer):
    tok = smollm2_tokenizer
    schemas = tool_schemas([calculator])
    script = ['<tool_call>{"name": "calculator", "arguments": {"expression": "37 + 58"}}</tool_call>',
              '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',  # malformed
              "37 + 58 = 95. The answer is 95."]
    engine = ScriptedEngine(tok, script)
    runtime = EnvRuntime(Calculator, ChatRenderer(tok, tools=schemas),
                         lambda ids: tok.decode(ids, skip_special_tokens=False), max_turns=4)
    runner = EpisodeRunner(engine, runtime)
    prompt = Prompt(tok.encode("What is 37 + 58?"), data_source="arithmetic", ground_truth="95", index=0)
    runner.start("p0", prompt, SamplingParams(n=1, max_new_tokens=400))
    groups = []
    for _ in itertools.count():
        for out in engine.step():
            runner.on_output(out)
        groups += runner.poll()
        if groups:
            break
    runner.close()
    group, = groups
    stats = group.env_stats
    assert stats["turns"] == 3 and stats["tool_calls"] == 2 and stats["tool_errors"] == 1
    assert group.env_rewards == [None]  # the calculator leaves scoring to the task's reward function
    text = tok.decode(group.completions[0].token_ids, skip_special_tokens=True)
    assert "tool\n95" in text and "error: the tool call is not valid JSON" in text
    reward = Scorer({"arithmetic": arithmetic_reward}, tokenizer=tok).score_group(prompt, group.completions).rewards
    assert reward == [1.0]
    # the tool's answer reached the model: the last turn's prompt holds it
    assert "95" in tok.decode(engine.prompts[1][len(prompt.prompt_ids):])
