"""`asyncrl` command line: train, agent, eval, export, bench, plan, data, report.

    asyncrl train cpu-demo                          # the default job (what `make train` runs)
    asyncrl train --help
    asyncrl agent --join HOST:PORT --device cuda:3  # one more rollout agent for a running job
    asyncrl export RUN/checkpoints/step_00000020 OUT --merged   # an HF model directory (LoRA: merged)

Each command lives in its own module, imported when it runs: this module is what every process a run spawns
imports again as its `__main__` (multiprocessing's spawn), so it imports nothing of the library itself.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main", "COMMANDS"]

COMMANDS = {
    "train": "asyncrl.train_command:train_main",
    "agent": "asyncrl.train_command:agent_main",
    "eval": "asyncrl.evaluate:eval_main",
    "export": "asyncrl.export:export_main",
    "bench": "asyncrl_bench.cli:bench_main",  # a separate package beside the library
    "plan": "asyncrl_bench.plan:plan_main",  # beside the benchmarks it can run
    "data": "asyncrl.data.cli:data_main",
    "report": "asyncrl.report:report_main",
}
"""command -> module:function that takes the command's arguments."""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: asyncrl {" + ",".join(COMMANDS) + "} ...   (asyncrl <command> --help for details)")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module, function = COMMANDS[argv[0]].split(":")
    getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    main()
