"""Fixtures of the data tests: the SmolLM2 tokenizer (from the suite's shared session cache). The GSM8K
test split comes from tests/conftest.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_cache):
    """SmolLM2-135M-Instruct's tokenizer (the first load converts the GGUF: ~20-40 s)."""
    from asyncrl.policies import load_tokenizer, smollm2_gguf_path
    return load_tokenizer(smollm2_gguf_path())


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
