"""Sync vs async training runs on the same devices (same as `asyncrl bench async`); see asyncrl_bench/async_runs.py."""

import sys

from asyncrl_bench.async_runs import main

if __name__ == "__main__":
    main(sys.argv[1:])
