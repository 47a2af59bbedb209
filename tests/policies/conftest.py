"""Fixtures of the `asyncrl.policies` tests: the packaged SmolLM2, converted once per session into a
private GGUF cache (so the test exercises the conversion and never touches ~/.cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    """SmolLM2-135M-Instruct via `load_model('smollm2')` (first load converts the GGUF: ~20–40 s)."""
    from asyncrl.policies import load_model
    return load_model("smollm2")
