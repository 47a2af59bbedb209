"""Fixtures of the `asyncrl.policies` tests: the packaged SmolLM2, converted once into the suite's own GGUF cache
(tests/conftest.py's smollm2_cache: a fresh clone's run converts it, and no test touches ~/.cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    """SmolLM2-135M-Instruct via `load_model('smollm2')` (read from the suite's converted copy)."""
    from asyncrl.policies import load_model
    return load_model("smollm2")
