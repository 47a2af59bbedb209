"""Test settings shared by the whole suite.

Two tiers, by rule (tests/e2e_rule.py): tests marked `e2e` start other interpreters, the rest run in the test
process; a test that starts an interpreter without the mark fails. `make test-fast` runs `-m "not e2e"`,
`make test-e2e` the rest, `make test` both, the fast tier first.

The order of the files serves both ways of running them. A file's cost is (holds an e2e test, holds a `slow`
test): in-process files, then slow in-process ones, then e2e files, then slow e2e ones.
* In one process the files run cheapest first, so a unit test's failure shows in the first minutes and not
  after half an hour of training runs.
* In an xdist worker (`-n 2 --dist loadfile --no-loadscope-reorder`: whole files, handed out in this order)
  they run costliest first: a worker that takes a long file early lets the other work through the short ones
  meanwhile, and both end together, instead of one worker starting a long file when the queue is almost empty.
Each file's own tests keep their order (the sort is stable).
"""

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import pathlib
import shutil

import pytest
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.e2e_rule", "pytester"]

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


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` took their tests out: a file's cost is what runs of it
def pytest_collection_modifyitems(config, items):
    """pyproject's hang guard for every test (`timeout = 900`) scaled like every other deadline of the suite
    (tests/timing.py: the machine's scale and the number of xdist workers); tests with their own `timeout`
    marker keep it (they derive it from timing.py too). Then the files in the order the module docstring
    explains."""
    from tests.timing import limit
    ini = float(config.getini("timeout") or 0)
    for item in items:
        if ini > 0 and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit(ini)))
    order_files_by_cost(items, costliest_first=hasattr(config, "workerinput"))  # an xdist worker's config


def order_files_by_cost(items: list, *, costliest_first: bool) -> None:
    """Sort `items` in place by their file's cost, (holds an e2e test, holds a slow test); each file's tests keep
    their order (a stable sort, stable reversed too)."""
    cost: dict[pathlib.Path, tuple[bool, bool]] = {}
    for item in items:
        e2e, slow = cost.get(item.path, (False, False))
        cost[item.path] = (e2e or item.get_closest_marker("e2e") is not None,
                           slow or item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: cost[item.path], reverse=costliest_first)


@pytest.fixture(scope="session")
def smollm2_cache(pytestconfig, tmp_path_factory):
    """ASYNCRL_CACHE pointed at the suite's own cache (subprocesses inherit it; the tests never touch ~/.cache),
    with the packaged SmolLM2 GGUF converted into it. The cache lives in pytest's cache directory (.pytest_cache,
    which `make clean` removes) under a key of the converter's source (asyncrl/policies/loading.py) and the
    versions of transformers and gguf: both tiers of `make test` and every xdist worker share one conversion
    (~15 s of CPU each), one worker converting while the others wait on a file lock; a changed converter gets a
    fresh cache."""
    from asyncrl.policies.loading import resolve_model_dir, smollm2_gguf_path
    source = (pathlib.Path(__file__).parents[1] / "asyncrl" / "policies" / "loading.py").read_bytes()
    versions = ",".join(_version(name) for name in ("transformers", "gguf"))
    key = hashlib.sha1(source + versions.encode()).hexdigest()[:12]
    cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider: a private one then
    root = cache.mkdir(f"asyncrl-cache-{key}") if cache is not None else tmp_path_factory.mktemp("asyncrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCRL_CACHE", str(root))
        with _locked(root / ".lock"):
            resolve_model_dir(smollm2_gguf_path())
            if cache is not None:  # an older converter's copy (~0.5 GB) is never read again
                for stale in root.parent.glob("asyncrl-cache-*"):
                    if stale != root:
                        shutil.rmtree(stale, ignore_errors=True)
        yield root


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    with open(path, "w") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def gsm8k_test_file() -> pathlib.Path:
    """GSM8K's test split (1,319 rows of {"question", "answer"}; MIT), vendored under tests/fixtures."""
    return GSM8K_DIR / "test.jsonl"


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_cache):
    """SmolLM2-135M-Instruct's tokenizer (from the GGUF's converted copy in the suite's cache, smollm2_cache;
    subprocesses inherit ASYNCRL_CACHE and find it there)."""
    from asyncrl.policies import load_tokenizer, smollm2_gguf_path
    return load_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="session")
def hf_zoo(tmp_path_factory):
    """`hf_zoo("gemma3_text")`: the directory of the zoo's tiny random model of that type (tests/hf_zoo.py), saved
    once per session (per xdist worker)."""
    from tests.hf_zoo import save_tiny
    root = tmp_path_factory.mktemp("hf-zoo")
    made: dict[str, pathlib.Path] = {}

    def get(model_type: str) -> pathlib.Path:
        if model_type not in made:
            made[model_type] = save_tiny(model_type, root / model_type)
        return made[model_type]

    return get


@pytest.fixture(scope="session")
def net_hosts():
    """Three hosts on one switch, in network namespaces (tests/netns.py): hosta 198.18.0.1, hostb .2 and hostc .3,
    each with its own host name and a hosts file that names all three. Skips with the reason where this machine
    cannot make them (no root, no iproute2); removed at the end, and what a crashed session left at the next start."""
    from tests.netns import NetHosts, unavailable
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    hosts = NetHosts.create(["hosta", "hostb", "hostc"])
    try:
        yield hosts
    finally:
        hosts.remove()
