"""Multi-turn episodes: environments and tools, token-in/token-out trajectories, the runner that drives them.

    from asyncrl.envs import StepResult, Turn, ToolEnv
"""

from asyncrl.envs.builtin import BUILTIN_ENVS, Calculator, RetryArithmetic
from asyncrl.envs.episode import Episode, EpisodeStats
from asyncrl.envs.protocol import EnvFactory, Environment, Observation, StepResult, Turn
from asyncrl.envs.registry import env_tool_schemas, load_env
from asyncrl.envs.render import ChatRenderer, TokenRenderer
from asyncrl.envs.runner import EnvRuntime, EpisodeGroup, EpisodeRunner
from asyncrl.envs.tools import ToolCall, ToolEnv, calculator, parse_tool_calls, tool_schemas

__all__ = [
    "BUILTIN_ENVS", "Calculator", "RetryArithmetic", "Episode", "EpisodeStats", "EnvFactory", "Environment",
    "Observation", "StepResult", "Turn", "env_tool_schemas", "load_env", "ChatRenderer", "TokenRenderer",
    "EnvRuntime", "EpisodeGroup", "EpisodeRunner", "ToolCall", "ToolEnv", "calculator", "parse_tool_calls",
    "tool_schemas",
]
