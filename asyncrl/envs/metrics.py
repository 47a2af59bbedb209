"""EnvTally: what multi-turn episodes did, counted as groups arrive at rank 0 (`group.info.env`).

Per version window:
  env/turns_per_episode, env/step_time_s (mean seconds of an environment step), env/tool_calls_per_episode,
  env/tool_error_share (of tool calls), env/truncated_share (episodes ended by --env.max-turns or the token
  budget), env/trained_token_share (model tokens over all response tokens; the rest are masked environment
  tokens), env/reused_prompt_share (of later turns' prompts, the tokens whose K/V the engine kept from the
  turn before: a held session, vLLM's prefix cache; the rest were prefilled); over the run: env/errors,
  env/timeouts, env/tool_errors.
Single-turn runs report none of these.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["EnvTally"]


class EnvTally:
    def __init__(self):
        self._lock = threading.Lock()
        self._window: collections.Counter = collections.Counter()
        self._total: collections.Counter = collections.Counter()

    def add(self, info: dict | None) -> None:
        if not info:
            return
        with self._lock:
            for key, value in info.items():
                self._window[key] += value
                self._total[key] += value

    def window(self) -> dict:
        """The metrics of the groups that arrived since the last call (empty when no episode ever ran)."""
        with self._lock:
            w, total = self._window, dict(self._total)
            self._window = collections.Counter()
        if not total:
            return {}
        episodes, tokens, calls = max(w["episodes"], 1), max(w["model_tokens"] + w["env_tokens"], 1), w["tool_calls"]
        return {"env/turns_per_episode": w["turns"] / episodes,
                "env/step_time_s": w["env_time_s"] / max(w["env_steps"], 1),
                "env/tool_calls_per_episode": calls / episodes,
                "env/tool_error_share": w["tool_errors"] / calls if calls else 0.0,
                "env/truncated_share": w["truncated"] / episodes,
                "env/trained_token_share": w["model_tokens"] / tokens,
                "env/reused_prompt_share": (w["reused_prompt_tokens"] / w["later_turn_prompt_tokens"]
                                            if w["later_turn_prompt_tokens"] else 0.0),
                "env/episodes": total.get("episodes", 0), "env/errors": total.get("env_errors", 0),
                "env/timeouts": total.get("env_timeouts", 0), "env/tool_errors": total.get("tool_errors", 0)}
