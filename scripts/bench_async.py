"""Sync vs async training runs on the same devices (same as `asyncrl bench async`); see asyncrl/bench_async.py."""

import sys

from asyncrl.bench_async import main

if __name__ == "__main__":
    main(sys.argv[1:])
