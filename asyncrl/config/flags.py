"""Config fields as the user types them on the command line (tyro's naming), for messages and --dry-run.

    flag("async", "staleness_threshold")   # '--async-training.staleness-threshold'
    as_flags(cfg)                           # ['--model.path smollm2', ..., 'algorithm:grpo', ...]
    given_flags(["--rollout.max_slots=32"]) # frozenset({'--rollout.max-slots'})
"""

from __future__ import annotations

import dataclasses
import shlex

__all__ = ["flag", "shown", "fail", "is_placeholder", "as_flags", "algorithm_command", "given_flags"]

_FLAG_PREFIX = {"run": "", "async": "async-training."}


def flag(owner: str, field: str) -> str:
    """The command-line flag of a config field, as the user types it: ('async', 'staleness_threshold') ->
    '--async-training.staleness-threshold'; ('run', 'checkpoint_every') -> '--checkpoint-every'. Algorithm
    classes ('DAPO') map to '--algorithm.…'."""
    if owner in _FLAG_PREFIX:
        prefix = _FLAG_PREFIX[owner]
    elif owner[:1].isupper():
        prefix = "algorithm."
    else:
        prefix = owner + "."
    return "--" + (prefix + field).replace("_", "-")


def shown(value) -> str:
    """A value as it is typed after its flag: tuples space-separated, strings bare."""
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) or "(empty)"
    return str(value)


def is_placeholder(value) -> bool:
    """A preset's stand-in for a value the user must give (a path in angle brackets, '<...>')."""
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")


def fail(owner: str, field: str, value, want: str) -> None:
    """Raise the ValueError of an invalid config value: '--rollout.top-p 1.5 is invalid: must lie in (0, 1]'."""
    raise ValueError(f"{flag(owner, field)} {shown(value)} is invalid: {want}")


_ALGORITHM_COMMANDS = {"GRPO": "grpo", "DrGRPO": "dr-grpo", "DAPO": "dapo", "GSPO": "gspo", "CISPO": "cispo",
                       "RLOO": "rloo", "ReinforcePP": "reinforce-pp", "PPO": "ppo"}
"""Algorithm config class (`asyncrl.config.algorithm`) -> its subcommand, by class name: that module imports
this one for its messages."""


def algorithm_command(algorithm) -> str:
    """The `algorithm:NAME` subcommand of an algorithm config (GRPO -> 'grpo', DrGRPO -> 'dr-grpo')."""
    return _ALGORITHM_COMMANDS[type(algorithm).__name__]


def as_flags(cfg) -> list[str]:
    """The command-line arguments that give exactly `cfg` (a RunConfig, after `asyncrl train PRESET`): what
    --dry-run prints."""

    def leaves(obj, prefix: str):
        for field in dataclasses.fields(obj):
            if field.name in ("dry_run", "algorithm"):
                continue
            value, dashed = getattr(obj, field.name), field.name.replace("_", "-")
            if dataclasses.is_dataclass(value):
                yield from leaves(value, f"{prefix}{dashed}.")
            elif isinstance(value, bool):
                yield f"--{prefix}{dashed}" if value else f"--{prefix}no-{dashed}"
            elif isinstance(value, (tuple, list)):
                yield " ".join([f"--{prefix}{dashed}", *(shlex.quote(str(v)) for v in value)])
            else:
                yield f"--{prefix}{dashed} {shlex.quote(str(value))}"

    return [*leaves(cfg, ""), f"algorithm:{algorithm_command(cfg.algorithm)}", *leaves(cfg.algorithm, "algorithm.")]


def given_flags(args: list[str]) -> frozenset[str]:
    """The flags a command line gives, as `flag` spells them ('--rollout.max_slots=32' -> '--rollout.max-slots'):
    what the user chose, as opposed to a preset's or a default value. tyro's result does not tell the two apart
    (a value typed equal to the preset's is the same object), so this reads the arguments; tyro takes no
    abbreviations, so a flag is always typed whole."""
    return frozenset(a.partition("=")[0].replace("_", "-") for a in args if a.startswith("--"))
