"""scripts/wallclock_race.py: each mode's run configuration, the refusals before anything runs, and the race's
summary over finished runs (run directories holding a summary.json are not run again: here, written by hand)."""

from __future__ import annotations

import json

import pytest

from scripts.wallclock_race import RaceArgs, race_config, run_race

KEY = "val-core/arithmetic/reward/mean@4"


def test_sync_is_colocated_on_every_device_and_async_splits_them():
    args = RaceArgs(devices=("cpu", "cpu"), budget_s=30, seeds=(3,))
    sync, asyn = race_config(args, "sync", 3), race_config(args, "async", 3)
    assert sync.async_training.colocated and sync.async_training.staleness_threshold == 0
    assert sync.placement.trainer_devices == sync.placement.agent_devices == ("cpu", "cpu")
    assert not asyn.async_training.colocated and asyn.async_training.partial_rollout
    assert asyn.placement.trainer_devices == ("cpu",) and asyn.placement.agent_devices == ("cpu",)
    for cfg in (sync, asyn):
        assert cfg.async_training.time_budget_s == 30 and cfg.eval.every_versions == args.eval_every
        assert cfg.seed == cfg.data.seed == 3 and cfg.data.task == "arithmetic"
        cfg.validate()


def test_bad_races_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--devices cpu: give at least 2"):
        race_config(RaceArgs(devices=("cpu",)), "sync", 0)
    with pytest.raises(ValueError, match="--eval-data-path is needed"):
        race_config(RaceArgs(data_path="train.jsonl"), "async", 0)
    with pytest.raises(ValueError, match="--modes fast: choose from sync, async"):
        race_config(RaceArgs(), "fast", 0)


def _finished(run_dir, published: list[float], accuracy: dict[int, float]) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": v, "wall_s": w, **({KEY: accuracy[v], "val/version": v} if v in accuracy else {})}
            for v, w in enumerate(published, start=1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text("{}")


def test_the_race_summary_over_finished_runs(tmp_path):
    args = RaceArgs(devices=("cpu", "cpu"), seeds=(0, 1), target=0.5, out=str(tmp_path))
    _finished(tmp_path / "sync" / "seed0", [10, 20, 30, 40], {2: 0.3, 4: 0.55})  # 30 s after the first version
    _finished(tmp_path / "sync" / "seed1", [10, 20, 30, 40], {2: 0.3, 4: 0.45})  # never
    _finished(tmp_path / "async" / "seed0", [10, 15, 20, 25], {2: 0.52, 4: 0.6})  # 5 s
    _finished(tmp_path / "async" / "seed1", [10, 15, 20, 25], {2: 0.4, 4: 0.58})  # 15 s
    result = run_race(args)
    times = {(r["mode"], r["seed"]): r["time_to_target"] for r in result["runs"]}
    assert times == {("sync", 0): 30.0, ("sync", 1): None, ("async", 0): 5.0, ("async", 1): 15.0}
    assert result["race"]["async_median"] == 10.0 and result["race"]["sync_reached"] == 1
    text = (tmp_path / "race.md").read_text()
    assert "| sync | 1 | never | 0.450 | 2 |" in text and "Median async / sync" in text
    assert "The interval's low end is 0" in text  # half of sync's runs never reached it: some resamples' medians
    assert json.loads((tmp_path / "race.json").read_text())["race"]["async_reached"] == 2


def test_each_mode_warms_up_once_unrecorded_and_not_when_nothing_is_left_to_run(tmp_path, monkeypatch):
    import scripts.wallclock_race as race
    from scripts.wallclock_race import warmup_configs

    args = RaceArgs(devices=("cpu", "cpu"), seeds=(2, 3), budget_s=100, warmup_s=15, out=str(tmp_path))
    warm = warmup_configs(args)
    assert sorted(warm) == ["async", "sync"]
    for mode, cfg in warm.items():
        assert cfg.async_training.time_budget_s == 15 and cfg.run_dir == str(tmp_path / "warmup" / mode)
        assert cfg.async_training.colocated == (mode == "sync") and cfg.seed == 2
    assert warmup_configs(RaceArgs(warmup_s=0)) == {}
    trained = []
    monkeypatch.setattr(race, "train", lambda cfg: _finished(tmp_path / cfg.run_dir, [1, 2], {2: 0.9})
                        or trained.append(cfg.run_dir))
    run_race(args)
    assert trained == [str(tmp_path / "warmup" / "sync"), str(tmp_path / "warmup" / "async")] + [
        str(tmp_path / mode / f"seed{seed}") for seed in (2, 3) for mode in ("sync", "async")]
    trained.clear()
    run_race(args)  # every run finished: no warm-up either
    assert trained == []
