"""DAPO overlong reward shaping (algos.md §6; DAPO arXiv:2503.14476 §3.4)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rewards import overlong_penalty

# L_max = 20, L_buf = 4 ⇒ the buffer starts at L_max − L_buf = 16.
CASES = [
    (0, 0.0),  # far below the buffer
    (10, 0.0),
    (16, 0.0),  # at the buffer start: −(16 − 16)/4 = 0
    (17, -0.25),  # −(17 − 16)/4
    (18, -0.5),  # −(18 − 16)/4
    (19, -0.75),
    (20, -1.0),  # at L_max: −f
    (25, -1.0),  # beyond L_max: floored at −f
]


@pytest.mark.parametrize("length, expected", CASES)
def test_golden_int(length, expected):
    assert overlong_penalty(length, max_response_length=20, buffer_length=4) == expected


def test_golden_tensor_and_penalty_factor():
    lengths = torch.tensor([c[0] for c in CASES])
    out = overlong_penalty(lengths, max_response_length=20, buffer_length=4)
    assert out.dtype == torch.float32 and out.shape == (len(CASES),)
    assert torch.equal(out, torch.tensor([c[1] for c in CASES], dtype=torch.float32))
    # f = 0.5 halves every penalty: at L = 18, −0.5·(18 − 16)/4 = −0.25.
    half = overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty_factor=0.5)
    assert torch.equal(half, torch.tensor([c[1] / 2 for c in CASES], dtype=torch.float32))
    assert overlong_penalty(18, max_response_length=20, buffer_length=4, penalty_factor=0.5) == -0.25


def test_golden_paper_setting():
    # DAPO: L_max 20480, L_buf 4096 ⇒ start 16384; L = 18432 is half way: −(18432 − 16384)/4096 = −0.5.
    kw = dict(max_response_length=20480, buffer_length=4096)
    assert overlong_penalty(16384, **kw) == 0.0
    assert overlong_penalty(18432, **kw) == -0.5
    assert overlong_penalty(20480, **kw) == -1.0


def test_buffer_equal_to_budget():
    # L_buf = L_max: the ramp starts at 0: −(5 − 0)/10 = −0.5.
    assert overlong_penalty(5, max_response_length=10, buffer_length=10) == -0.5
    assert overlong_penalty(0, max_response_length=10, buffer_length=10) == 0.0


@st.composite
def configs(draw):
    l_max = draw(st.integers(1, 5000))
    l_buf = draw(st.integers(1, l_max))
    f = draw(st.floats(0.0, 5.0, allow_nan=False))
    return l_max, l_buf, f


@given(configs(), st.lists(st.integers(0, 10000), min_size=1, max_size=20))
def test_properties(config, lengths):
    l_max, l_buf, f = config
    kw = dict(max_response_length=l_max, buffer_length=l_buf, penalty_factor=f)
    values = [overlong_penalty(n, **kw) for n in lengths]
    assert all(v <= 0 for v in values)
    # Non-increasing in L.
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for a, b in zip(order, order[1:]):
        assert values[a] >= values[b]
    # Zero up to L_max − L_buf, −f (to rounding) at and beyond L_max, never below −f by more than rounding.
    for n, v in zip(lengths, values):
        if n <= l_max - l_buf:
            assert v == 0
        if n >= l_max:
            assert math.isclose(v, -f, rel_tol=1e-12, abs_tol=1e-12)
        assert v >= -f * (1 + 1e-12)
    assert math.isclose(overlong_penalty(l_max, **kw), -f, rel_tol=1e-12, abs_tol=1e-12)
    assert overlong_penalty(l_max - l_buf, **kw) == 0
    # The tensor form agrees with the int form (float32 output).
    out = overlong_penalty(torch.tensor(lengths), **kw)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), torch.tensor(values, dtype=torch.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_response_length=10, buffer_length=11), "buffer_length"),
    (dict(max_response_length=10, buffer_length=0), "buffer_length"),
    (dict(max_response_length=10, buffer_length=-3), "buffer_length"),
    (dict(max_response_length=10, buffer_length=4, penalty_factor=-0.1), "penalty_factor"),
])
def test_rejects_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        overlong_penalty(5, **kwargs)
    with pytest.raises(ValueError, match=name):
        overlong_penalty(torch.tensor([5]), **kwargs)


def test_rejects_bad_lengths():
    kw = dict(max_response_length=10, buffer_length=4)
    with pytest.raises(ValueError, match="length"):
        overlong_penalty(-1, **kw)
    with pytest.raises(ValueError, match="length"):
        overlong_penalty(3.5, **kw)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.ones(2, 3, dtype=torch.long), **kw)
