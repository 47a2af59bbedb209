"""Train with asyncrl: `python scripts/train.py <preset> [--field value ...]` (same as `asyncrl train`).

    python scripts/train.py cpu-demo                     # SmolLM2-135M, fully async, 2-core CPU
    python scripts/train.py cpu-demo --help
"""

import sys

from asyncrl.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
