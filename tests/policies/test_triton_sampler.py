"""The Triton sampler (`asyncrl.policies.triton_sampler`) against an fp64 inverse CDF, run by Triton's interpreter on
CPU (compiled where a GPU is), and how the engine chooses its sampler."""

import pytest
import torch

from asyncrl.policies.sampling import plain_sampler, sample_plain
from tests.policies.helpers import run_kernel_cases

pytest.importorskip("triton")


def _case(name: str, seed: int, batch: int, vocab: int, **kw) -> dict:
    gen = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(batch, generator=gen).tolist()
    uniforms[0] = 0.0
    if batch > 1:
        uniforms[-1] = 1.0 - 2 ** -24  # the largest float32 below 1: the last token of positive probability
    temperature = (torch.rand(batch, generator=gen) + 0.3).tolist()
    if batch > 2:
        temperature[1] = 0.0  # greedy
    case = dict(name=name, seed=seed, batch=batch, vocab=vocab, uniforms=uniforms, temperature=temperature,
                spread=3.0, dtype="float32", chunk=512, block=128)
    case.update(kw)
    return case


def _cases() -> list[dict]:
    return [
        _case("one chunk, vocab below it", 0, 4, 300),
        _case("several chunks, ragged last", 1, 5, 2100),
        _case("vocab a multiple of the chunk", 2, 3, 1536),
        _case("bf16 logits read as they are", 3, 4, 1100, dtype="bfloat16"),
        _case("masked bands and tails", 4, 4, 1500, masked={"0": [0, 700], "2": [900, 1500], "3": [100, 1400]}),
        _case("mass on one token", 5, 3, 1300, peaks={"0": [1299, 60.0], "2": [0, 60.0]}),
        _case("flat logits (ties)", 6, 4, 1200, spread=0.0),
        _case("sharp logits", 7, 4, 1000, spread=20.0),
        _case("one row", 8, 1, 700),
    ]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    out = run_kernel_cases("tests.policies.sampler_kernel_cases", _cases())
    assert [r["case"] for r in out] == [c["name"] for c in _cases()]
    return out


@pytest.mark.e2e
def test_each_token_is_where_its_uniform_falls_in_the_fp64_cdf_and_logprobs_match(results):
    assert [(r["case"], r["problems"]) for r in results if r["problems"]] == []


@pytest.mark.e2e
def test_a_row_samples_the_same_alone_or_in_a_batch(results):
    assert all(r["batch_free"] for r in results), [r["case"] for r in results if not r["batch_free"]]


@pytest.mark.e2e
def test_tokens_agree_with_the_torch_sampler(results):
    """The same rule; only a uniform within rounding of a boundary may pick the neighbour (none in these cases)."""
    assert [(r["case"], r["tokens_as_eager"]) for r in results if r["tokens_as_eager"] != r["rows"]] == []


def test_the_engine_keeps_the_torch_sampler_off_cuda():
    assert plain_sampler(True, torch.device("cpu")) is sample_plain
    assert plain_sampler(False, torch.device("cpu")) is sample_plain
