"""`asyncrl` command line: train, agent, eval, export, plan, data, report, and the commands other installed
packages add (`bench`, from the benchmarks beside the library).

    asyncrl train cpu-demo                          # the default job (what `make train` runs)
    asyncrl train --help
    asyncrl agent --join HOST:PORT --device cuda:3  # one more rollout agent for a running job
    asyncrl export RUN_DIR OUT --merged             # the newest checkpoint as an HF model directory (LoRA: merged)

Each command lives in its own module, imported when it runs: this module is what every process a run spawns
imports again as its `__main__` (multiprocessing's spawn), so it imports nothing of the library itself.

A package adds a command through the `asyncrl.commands` entry-point group, `NAME = "module:function"`, the
function taking the command's arguments (pyproject.toml declares `bench` that way).
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import entry_points

__all__ = ["main", "COMMANDS", "commands"]

COMMANDS = {
    "train": "asyncrl.launch.train_command:train_main",
    "agent": "asyncrl.launch.train_command:agent_main",
    "eval": "asyncrl.evaluate:eval_main",
    "export": "asyncrl.export:export_main",
    "plan": "asyncrl.planning.command:plan_main",
    "data": "asyncrl.launch.data_command:data_main",
    "report": "asyncrl.tracking.report:report_main",
}
"""command -> module:function that takes the command's arguments."""

ENTRY_POINTS = "asyncrl.commands"


def commands() -> dict[str, str]:
    """The built-in commands and those installed packages declare (a built-in name is never replaced)."""
    added = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS) if ep.name not in COMMANDS}
    return {**COMMANDS, **dict(sorted(added.items()))}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = commands()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in known:
        print("usage: asyncrl {" + ",".join(known) + "} ...   (asyncrl <command> --help for details)")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module, function = known[argv[0]].split(":")
    getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    main()
