"""The controller's records (`asyncrl.runtime.controller`): when the checkpoint policy is due. The loop itself
runs in tests/rpc/test_local_run.py and tests/rpc/test_resume.py (in process, with real agents)."""

from __future__ import annotations

from asyncrl.runtime.controller import CheckpointPolicy


def test_a_checkpoint_is_due_every_k_versions_only_with_a_run_directory():
    assert [v for v in range(1, 8) if CheckpointPolicy("runs/x", every=3).due(v)] == [3, 6]
    assert not any(CheckpointPolicy("runs/x", every=0).due(v) for v in range(1, 8))  # 0: only at the end
    assert not any(CheckpointPolicy(None, every=1).due(v) for v in range(1, 8))  # no run directory: never
    assert CheckpointPolicy().keep == 3
