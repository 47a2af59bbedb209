"""asyncrl: asynchronous RL post-training of language models in PyTorch.

Public API, one name at a time. Submodules: `asyncrl.algos` (pure RL math), `asyncrl.rewards` (pure
reward functions), `asyncrl.policies` (the model and the rollout engine), `asyncrl.types` (records that
cross components). Nothing runs at import.
"""

from asyncrl import algos, policies, rewards, types

__version__ = "0.1.0"

__all__ = ["algos", "policies", "rewards", "types", "__version__"]
