"""Tool calling: the parser (Qwen/Hermes tags and Llama JSON, malformed calls as errors, never an exception),
the calculator, the chat renderer's environment tokens, and a scripted tool-using episode with a known reward."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.data.scoring import Scorer
from asyncrl.envs import (Calculator, ChatRenderer, EnvRuntime, EpisodeRunner, ToolCall, calculator, parse_tool_calls,
                          tool_schemas)
from asyncrl.policies import SamplingParams
from asyncrl.rewards import arithmetic_reward
from asyncrl.types import Completion, GenerationOutput, Prompt


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


def test_the_calculator_computes_arithmetic_and_refuses_anything_else():
    assert calculator("(12 + 30) * 4") == "168" and calculator("7 / 2") == "3.5" and calculator("1,000 - 1") == "999"
    for bad in ("__import__('os')", "2 ** 1000", "x + 1", "2 +"):
        with pytest.raises(ValueError):
            calculator(bad)


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
    stats = group.info["env"]
    assert stats["turns"] == 3 and stats["tool_calls"] == 2 and stats["tool_errors"] == 1
    assert group.env_rewards == [None]  # the calculator leaves scoring to the task's reward function
    text = tok.decode(group.completions[0].token_ids, skip_special_tokens=True)
    assert "tool\n95" in text and "error: the tool call is not valid JSON" in text
    reward = Scorer({"arithmetic": arithmetic_reward}, tokenizer=tok).score_group(prompt, group.completions).rewards
    assert reward == [1.0]
    # the tool's answer reached the model: the last turn's prompt holds it
    assert "95" in tok.decode(engine.prompts[1][len(prompt.prompt_ids):])
