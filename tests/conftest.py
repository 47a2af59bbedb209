"""Test settings shared by the whole suite."""

import os
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, settings

GSM8K_DIR = pathlib.Path(os.environ.get("ASYNCRL_GSM8K_DIR", pathlib.Path(__file__).parent / "fixtures" / "gsm8k"))

# Property tests: enough examples to find edge cases, bounded so the suite stays fast on 2 CPU cores.
settings.register_profile("default", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# One intra-op thread for the whole suite: the models here are tiny, and on a 2-core machine a second
# thread only adds an OpenMP barrier per small matmul (10-50x slower when trainer and agent threads
# share the cores). Tests that need more set it themselves.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """pyproject's hang guard for every test (`timeout = 900`) scaled like every other deadline of the suite
    (tests/timing.py); tests with their own `timeout` marker keep it (they derive it from timing.py too).
    Files holding a `slow` test run first (a stable sort, so each file's own order stands): the workers of a
    parallel run (`-n 2 --dist loadfile`, whole files each) then end on short files instead of one of them
    waiting on a long one."""
    from tests.timing import limit
    ini = float(config.getini("timeout") or 0)
    for item in items:
        if ini > 0 and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit(ini)))
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """ASYNCRL_CACHE pointed at one fresh directory for the whole session (subprocesses inherit it): the
    packaged SmolLM2 GGUF is converted once per run, and the tests never touch ~/.cache."""
    root = tmp_path_factory.mktemp("asyncrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCRL_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def gsm8k_test_file() -> pathlib.Path:
    """GSM8K's test split (1,319 rows of {"question", "answer"}; MIT), vendored under tests/fixtures."""
    return GSM8K_DIR / "test.jsonl"


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_cache):
    """SmolLM2-135M-Instruct's tokenizer (the first load converts the GGUF into the session cache: ~20-40 s;
    subprocesses inherit ASYNCRL_CACHE and find it there)."""
    from asyncrl.policies import load_tokenizer, smollm2_gguf_path
    return load_tokenizer(smollm2_gguf_path())
