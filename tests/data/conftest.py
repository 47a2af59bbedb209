"""Fixtures of the data tests: a tokenizer with predictable lengths. The SmolLM2 tokenizer and the GSM8K
test split come from tests/conftest.py."""

from __future__ import annotations

import pytest


class WordTokenizer:
    """A stand-in tokenizer with exact, predictable lengths: one token per whitespace-separated word, plus one
    `<role>` token per message and a final `<assistant>` generation prompt."""

    chat_template = "words"

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def _ids(self, words):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in words]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        words = []
        for message in messages:
            words += [f"<{message['role']}>"] + message["content"].split()
        return self._ids(words + (["<assistant>"] if add_generation_prompt else []))

    def encode(self, text):
        return self._ids(text.split())

    def decode(self, ids, skip_special_tokens=False):
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


@pytest.fixture
def word_tokenizer() -> WordTokenizer:
    return WordTokenizer()
