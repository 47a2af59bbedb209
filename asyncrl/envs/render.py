"""Environment tokens: observations rendered once through the chat template, never re-encoding the model's.

The trajectory is one token sequence: the prompt, the model's first turn exactly as sampled, the tokens that
close that turn and open the next as the chat template writes them (the end-of-turn separator the model did
not generate, the tool or user message, the assistant header), the model's second turn, and so on. Only the
environment's part is rendered here, as the difference between two renderings of a probe conversation, so
the model's tokens are never decoded and encoded again (re-tokenising a conversation drifts from what the
engine produced — a missing separator compounds every turn).

    renderer = ChatRenderer(tokenizer)
    env_tokens = renderer.after_turn(model_turn_ids) + renderer.observation([{"role": "tool", "content": "42"}])
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["ChatRenderer", "TokenRenderer", "observation_messages"]

_PROBE = "asyncrl probe 7319"


def observation_messages(observation, role: str = "user") -> list[dict[str, Any]]:
    """An observation as chat messages: a string is one message of `role`."""
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    return [dict(m) for m in observation]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)  # transformers 5: BatchEncoding


class ChatRenderer:
    """Renders observations with a Hugging Face tokenizer's chat template (tokenizers without one: plain text).

    Raises ValueError at construction when the template re-renders earlier turns once a new message follows
    them (then no token-exact continuation exists)."""

    def __init__(self, tokenizer, tools: Sequence[Mapping[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._base = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        if self.templated:
            self._base_ids = self._render(self._base, generation_prompt=False)
            self.turn_end = self._turn_end()
        else:
            self._base_ids, self.turn_end = [], []
        self.observation([{"role": "user", "content": "probe"}])  # fails here, not mid-run, on odd templates

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        kwargs = {"tools": self.tools} if self.tools else {}
        return _ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                       tokenize=True, **kwargs))

    def _turn_end(self) -> list[int]:
        """The tokens the template writes after an assistant message's content (e.g. <|im_end|> and a newline)."""
        content = _ids(self.tokenizer.encode(_PROBE, add_special_tokens=False))
        ids = self._base_ids
        for start in range(len(ids) - len(content), -1, -1):
            if ids[start:start + len(content)] == content:
                return ids[start + len(content):]
        raise ValueError("ChatRenderer: cannot find an assistant message's content in the chat template's "
                         "rendering; this template is not supported for multi-turn episodes")

    def after_turn(self, turn_ids: Sequence[int]) -> list[int]:
        """Tokens that close a model turn as the template would: what follows the end-of-turn token the model
        sampled (a newline after <|im_end|>), or the whole end-of-turn sequence when the turn ended otherwise."""
        end = self.turn_end
        if end and turn_ids and turn_ids[-1] == end[0]:
            return list(end[1:])
        return list(end)

    def observation(self, observation) -> list[int]:
        """Token ids of an observation after a closed assistant turn, ending with the next assistant header."""
        if not self.templated:
            text = "\n\n".join(m["content"] for m in observation_messages(observation))
            return _ids(self.tokenizer.encode("\n\n" + text + "\n\n", add_special_tokens=False))
        full = self._render(self._base + observation_messages(observation), generation_prompt=True)
        base = self._base_ids
        if full[:len(base)] != base:
            raise ValueError("the chat template renders earlier turns differently once a new message follows "
                             "them, so a conversation cannot be continued token for token; use a template "
                             "that appends turns (as Qwen2.5, Llama 3 and SmolLM2 do)")
        return full[len(base):]


class TokenRenderer:
    """For tokenizer-free runs (random models, the toy task): observations must be token ids."""

    turn_end: list[int] = []

    def after_turn(self, turn_ids: Sequence[int]) -> list[int]:
        return []

    def observation(self, observation) -> list[int]:
        if isinstance(observation, str) or (observation and not isinstance(observation[0], int)):
            raise ValueError("this run has no tokenizer, so an environment's observation must be token ids")
        return list(observation)
