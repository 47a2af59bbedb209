"""asyncrl: asynchronous RL post-training of language models in PyTorch.

Public API, one name at a time. Submodules: `asyncrl.algos` (pure RL math), `asyncrl.rewards` (pure
reward functions). Nothing runs at import.
"""

from asyncrl import algos, rewards

__version__ = "0.1.0"

__all__ = ["algos", "rewards", "__version__"]
