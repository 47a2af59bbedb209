"""One rule for deriving the seed of a random stream from the run's seed and the stream's coordinates.

    derive_seed(seed, prompt_id)             a prompt's sampling seed
    derive_seed(seed, index, turn)           an episode's turn
    derive_seed(seed, step, epoch)           a learner step's mini-batch shuffle

The result is the same from run to run, differs between coordinates (a polynomial in a large prime, so a
collision needs coordinates near 10⁶ apart in two places at once) and lies in [0, 2⁶³): torch generators,
`random.Random` and vLLM all take it, and it can be derived from again.
"""

from __future__ import annotations

__all__ = ["derive_seed"]

_PRIME = 1_000_003
_RANGE = 2**63


def derive_seed(seed: int, *coordinates: int) -> int:
    """`seed` folded with each coordinate in turn (value · 1,000,003 + coordinate), modulo 2⁶³."""
    value = int(seed)
    for coordinate in coordinates:
        value = value * _PRIME + int(coordinate)
    return value % _RANGE
