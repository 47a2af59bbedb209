"""A run's Hub names (`asyncrl.tools.hub`) resolved once, before anything starts: the config every process gets
names local files only, and the run's config.json keeps the names with the commits they resolved to.

    local_cfg, named = resolve_run_names(cfg)      # named: {"model.path": Resolved, "eval.data[0]": ...}
    record = named_record(run_record(local_cfg), named)

A resume of a run that recorded a name resolves that name to the recorded commit again (unless the command
gives another name or revision), so a branch that moved on the Hub does not change the weights or the data
under a resumed run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from asyncrl.config import RunConfig
from asyncrl.tools.hub import Resolved, dataset_name, model_name, resolve_dataset, resolve_model

__all__ = ["resolve_run_names", "named_record", "HUB_KEY"]

HUB_KEY = "_hub"
"""Where config.json keeps the resolved names: {field: {"name", "repo", "revision", "commit", "path"}}."""


def _pins(cfg: RunConfig) -> dict[str, dict]:
    """The names a resumed run recorded, by field (nothing for a new run)."""
    if not (cfg.resume or cfg.resume_or_start):
        return {}
    try:
        recorded = json.loads((pathlib.Path(cfg.run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    hub = recorded.get(HUB_KEY) if isinstance(recorded, dict) else None
    return hub if isinstance(hub, dict) else {}


def _commit(pins: dict[str, dict], field: str, given: str) -> str | None:
    pin = pins.get(field)
    return pin.get("commit") if isinstance(pin, dict) and pin.get("name") == given else None


def resolve_run_names(cfg: RunConfig) -> tuple[RunConfig, dict[str, Resolved]]:
    """(`cfg` with every Hub name replaced by its local files, {field: Resolved}); ValueError naming the flag
    when a name does not resolve. A config without Hub names comes back as it is."""
    pins, named = _pins(cfg), {}

    def model(field: str, flag: str, value: str | None) -> str | None:
        if model_name(value) is None:
            return value
        named[field] = resolve_model(value, flag, commit=_commit(pins, field, value))
        return named[field].path

    def dataset(field: str, flag: str, value: str | None) -> str | None:
        if dataset_name(value) is None:
            return value
        named[field] = resolve_dataset(value, flag, commit=_commit(pins, field, value))
        return named[field].path

    new_model = dataclasses.replace(cfg.model, path=model("model.path", "--model.path", cfg.model.path),
                                    tokenizer=model("model.tokenizer", "--model.tokenizer", cfg.model.tokenizer))
    new_data = dataclasses.replace(cfg.data, path=dataset("data.path", "--data.path", cfg.data.path))
    new_eval = dataclasses.replace(cfg.eval, data=tuple(
        dataset(f"eval.data[{i}]", "--eval.data", path) for i, path in enumerate(cfg.eval.data)))
    if not named:
        return cfg, named
    return dataclasses.replace(cfg, model=new_model, data=new_data, eval=new_eval), named


def named_record(record: dict, named: dict[str, Resolved]) -> dict:
    """A run record (`asyncrl.launch.resume_check.run_record`) of the resolved config, with the names as given in
    place of their local paths and the resolutions under HUB_KEY: what config.json holds and a resume
    compares (the same name is the same field; the data fingerprint stays the file's content)."""
    if not named:
        return record
    out = json.loads(json.dumps(record))
    for field, resolved in named.items():
        section, _, key = field.partition(".")
        if key.startswith("data["):
            out[section]["data"][int(key[5:-1])] = resolved.given
        else:
            out[section][key] = resolved.given
    out[HUB_KEY] = {field: resolved.record() for field, resolved in named.items()}
    return out
