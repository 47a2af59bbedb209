"""Fixtures of the data tests: the real GSM8K files and the SmolLM2 tokenizer (converted once per session
into a private cache, so the tests never touch ~/.cache)."""

from __future__ import annotations

import os
import pathlib

import pytest

GSM8K_DIR = pathlib.Path(os.environ.get("ASYNCRL_GSM8K_DIR", "/work/shared/data/gsm8k"))


@pytest.fixture(scope="session")
def gsm8k_test_file() -> pathlib.Path:
    """GSM8K's test split (1,319 rows of {"question", "answer"}; MIT)."""
    path = GSM8K_DIR / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K not found at {path}; set ASYNCRL_GSM8K_DIR to a directory holding test.jsonl")
    return path


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """ASYNCRL_CACHE pointed at a fresh directory for the whole session (subprocesses inherit it)."""
    root = tmp_path_factory.mktemp("asyncrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCRL_CACHE", str(root))
        yield root


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
