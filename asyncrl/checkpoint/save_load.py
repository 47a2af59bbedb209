"""Save and resume a run: learner weights, optimizer and schedule, counters, RNG states, and whatever the
run loop hands over as `extra` (data cursor, queued and in-flight prompts, staleness counters), so a
resumed run neither loses nor repeats a prompt.

    path = save_checkpoint(run_dir, state, extra={"cursor": ..., "in_flight": [...]}, keep_last=3)
    extra = load_checkpoint(latest_checkpoint(run_dir), state)
    export_hf(state, "out/policy", tokenizer=tok)     # or export_hf("run/checkpoints/step_00000012", ...)

Layout: `run_dir/checkpoints/step_{step:08d}/` holding `learner.pt` (weights, optimizer, schedule,
counters, model config, RNG), `extra.json`, `meta.json` and `run_config.json` (a copy of the run's
`run_dir/config.json`, with its data fingerprint, when the run wrote one: what a resume compares against).

A save never leaves a half checkpoint: the files go to `step_….tmp/`, are fsynced, the directory is renamed
once complete and `checkpoints/` is fsynced after the rename, so a power loss leaves the old or the new
checkpoint, never a name pointing at missing data. A failed save removes its `.tmp` (as the next save removes
`.tmp` leftovers of a crashed one). A save that cannot fit on the disk raises `CheckpointError` before
writing, or after the failed write, naming the bytes needed and free. Re-saving a step renames the old copy
to `step_N.old` until the new one is in; what an interrupted save leaves, and a checkpoint that does not load,
are settled at the next resume (`asyncrl.checkpoint.repair`). Pruning to `keep_last` never deletes the
checkpoint just written.

Loading puts this run's optimizer settings on the restored optimizer (`apply_optim_config`): a resume with
another `--trainer.optim.lr`, weight decay, betas, eps or schedule trains with them, from the restored step.

`learner.pt` holds only tensors and plain Python values (the model config as a dict, the RNG states as
tensors and ints), so it loads with `torch.load(weights_only=True)`, which unpickles no arbitrary objects;
`extra` must be JSON data (dicts with str keys, lists, tuples, str, numbers, bool, None) and comes back as
parsed JSON (tuples as lists).

With FSDP2 the full state is gathered to rank 0 (the distributed state-dict API), which writes; every rank
loads it back (broadcast from rank 0). The frozen reference model is not saved: it is rebuilt from the
model path at start-up. Nor is a LoRA policy's frozen base: a LoRA checkpoint holds the trained tensors (adapters,
a critic's adapters and value head, their optimizer states) and the LoRA settings ("lora" in learner.pt and
meta.json); the base comes back from --model.path (a resume cannot change it; `export_hf` merges from it).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import pickle
import random
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

from asyncrl.checkpoint.files import CheckpointError, fsync_dir, write_checkpoint_dir
from asyncrl.learner import LearnerState
from asyncrl.learner.state import apply_optim_config
from asyncrl.policies.loading import load_model, save_pretrained
from asyncrl.policies.lora import lora_modules, merge_adapters
from asyncrl.policies.hf_model import HFModelConfig, save_transformers
from asyncrl.policies.model import CausalLM, TransformerConfig

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "describe_checkpoint", "latest_checkpoint",
           "list_checkpoints", "export_hf", "run_model", "run_hub", "lora_base_weights", "fsync_dir", "RUN_CONFIG",
           "read_learner_file", "rng_state", "set_rng_state", "COUNTERS"]

COUNTERS = ("step", "optimizer_steps", "version", "kl_coef", "skipped_updates", "critic_skipped_updates")
"""The learner's counters a checkpoint (and a shard snapshot) holds."""
_STEP_DIR = re.compile(r"step_\d+")  # step_00000012; not step_….tmp / .old / .corrupt
RUN_CONFIG = "run_config.json"
"""The copy of `run_dir/config.json` a checkpoint holds: the config (and data fingerprint) it was trained under."""


def _distributed(state: LearnerState) -> bool:
    return state.group is not None and dist.is_initialized() and dist.get_world_size(state.group) > 1


def _is_writer(state: LearnerState) -> bool:
    return not _distributed(state) or dist.get_rank(state.group) == 0


# ----------------------------------------------------------------------------- weights_only-safe payload
def rng_state() -> dict:
    """RNG states as tensors, ints, tuples and str (numpy's key array as an int64 tensor)."""
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    out["numpy"] = {"algorithm": str(algorithm), "keys": torch.from_numpy(keys.astype(np.int64)),
                    "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    return out


def set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        saved = rng["numpy"]
        np.random.set_state((saved["algorithm"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                             saved["has_gauss"], saved["cached_gaussian"]))


def _plain(value):
    """A counter as a Python number (numpy and 0-d tensor scalars would not load under weights_only)."""
    return value.item() if hasattr(value, "item") else value


def _model_config(model) -> dict | None:
    """The policy's config (`TransformerConfig`, or an HF-path model's `HFModelConfig`, whose `impl` is "hf") as a
    plain dict, for `export_hf` from a checkpoint."""
    config = getattr(model, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None


def lora_record(model) -> dict | None:
    """The LoRA settings of a policy ({"rank", "alpha", "dropout", "targets"}), None for full weights."""
    modules = list(lora_modules(model))
    if not modules:
        return None
    first = modules[0][1]
    leaves = list(dict.fromkeys(name.rpartition(".")[2] for name, _ in modules))  # model order (own: q, k, v, ...)
    return {"rank": first.rank, "alpha": first.alpha, "dropout": float(getattr(first.dropout, "p", 0.0)),
            "targets": leaves}


def _model_state(model, options: StateDictOptions) -> dict:
    """The full state dict; with `ignore_frozen_params` only the trained tensors (a tied head, a frozen
    parameter under a second name, is dropped too)."""
    out = get_model_state_dict(model, options=options)
    if options.ignore_frozen_params:
        trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        out = {name: t for name, t in out.items() if name in trained}
    return out


def _gather(state: LearnerState) -> dict:
    """Full (unsharded) state dicts, on CPU (on rank 0 only when distributed); a LoRA learner's trained
    tensors only (the frozen base is left out)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                               ignore_frozen_params=lora_record(state.policy) is not None)
    out = {"policy": _model_state(state.policy, options),
           "optimizer": get_optimizer_state_dict(state.policy, state.optimizer, options=options),
           "scheduler": state.scheduler.state_dict()}
    if state.critic is not None:
        out["critic"] = _model_state(state.critic, options)
        out["critic_optimizer"] = get_optimizer_state_dict(state.critic, state.critic_optimizer, options=options)
        out["critic_scheduler"] = state.critic_scheduler.state_dict()
    return out


def _learner_payload(state: LearnerState, gathered: dict) -> dict:
    lora = lora_record(state.policy)
    return {**gathered, "counters": {k: _plain(getattr(state, k)) for k in COUNTERS},
            "config": _model_config(state.policy), "rng": rng_state(), **({"lora": lora} if lora else {})}


def _json_problem(value, where: str) -> str | None:
    """'<where>: <what>' for the first part of `value` that is not JSON data (a type JSON refuses, or a
    non-str key that JSON would turn into a str), else None. Tuples pass: they come back as lists."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return (f"{where}: key {key!r} is a {type(key).__name__}, JSON keys are str; "
                        "convert the keys to str first")
            found = _json_problem(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        return next((found for i, item in enumerate(value) if (found := _json_problem(item, f"{where}[{i}]"))),
                    None)
    return f"{where}: {type(value).__name__} is not JSON-serialisable; convert it to dicts/lists first"


def _extra_json(extra: dict) -> str:
    """`extra` as JSON text; TypeError naming the first value that is not JSON data."""
    problem = _json_problem(extra, "extra")
    if problem:
        raise TypeError(f"save_checkpoint: {problem}")
    return json.dumps(extra, indent=None)


# ------------------------------------------------------------------------------------ writing
def list_checkpoints(run_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The run's published checkpoints, oldest first (not the `.tmp`, `.old` or `.corrupt` directories)."""
    root = pathlib.Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir() and _STEP_DIR.fullmatch(p.name)) \
        if root.is_dir() else []


def latest_checkpoint(run_dir: str | pathlib.Path) -> pathlib.Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _prune(run_dir: str | pathlib.Path, final: pathlib.Path, keep_last: int) -> None:
    """Keep `final` (the checkpoint just written) and the newest `keep_last` − 1 others; delete the rest."""
    others = [p for p in list_checkpoints(run_dir) if p != final]
    for old in others[:max(len(others) - (keep_last - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _run_config_text(run_dir: str | pathlib.Path) -> str | None:
    path = pathlib.Path(run_dir) / "config.json"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def save_checkpoint(run_dir: str | pathlib.Path, state: LearnerState, extra: dict | None = None, *,
                    keep_last: int = 3) -> pathlib.Path:
    """Write a checkpoint of `state` (+ `extra`, JSON data, + a copy of `run_dir/config.json` when there is
    one) and keep it and the newest `keep_last` − 1 others. Call it on every rank of the trainer group; rank
    0 writes. Raises TypeError naming the first part of `extra` that is not JSON data, `CheckpointError` when
    the disk is full; nothing is left behind on failure."""
    if keep_last < 1:
        raise ValueError(f"save_checkpoint: keep_last must be >= 1, got {keep_last}")
    extra_text = _extra_json(extra or {})
    gathered = _gather(state)
    final = pathlib.Path(run_dir) / "checkpoints" / f"step_{state.step:08d}"
    if _is_writer(state):
        meta = {"step": state.step, "version": state.version, "time": time.time(),
                "algorithm": type(state.algorithm).__name__}
        if (lora := lora_record(state.policy)) is not None:
            meta["lora"] = lora
        texts = {"extra.json": extra_text, "meta.json": json.dumps(meta, indent=2)}
        if (run_config := _run_config_text(run_dir)) is not None:
            texts[RUN_CONFIG] = run_config
        write_checkpoint_dir(final, _learner_payload(state, gathered), texts)
        _prune(run_dir, final, keep_last)
    if _distributed(state):
        dist.barrier(group=state.group)
    return final


# ------------------------------------------------------------------------------------ reading
def _unpickler_reason(exc: pickle.UnpicklingError) -> str:
    """What torch's weights_only loader refused, e.g. 'global asyncrl.policies.model.TransformerConfig'."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    return f"global {found.group(1)}" if found else str(exc).strip().splitlines()[0]


def _load_safe(file: pathlib.Path, fix: str) -> dict:
    """`torch.load(file, weights_only=True)`; a ValueError naming the file, what was refused and `fix` when
    it holds pickled Python objects (as files written by older versions do)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{file} holds pickled Python objects that weights_only loading refuses "
                         f"({_unpickler_reason(exc)}); it was written by an older asyncrl: {fix}") from exc


def read_learner_file(path: pathlib.Path, caller: str) -> dict:
    """`path/learner.pt` loaded with weights_only (tensors and plain data only), or a ValueError naming `caller`."""
    if not (path / "learner.pt").is_file():
        raise ValueError(f"{caller}: {path} holds no learner.pt; pass a directory from list_checkpoints()")
    return _load_safe(path / "learner.pt", "export the policy with that version (export_hf) and start a new run "
                      "from the export")


def _load_extra(path: pathlib.Path) -> dict:
    if (path / "extra.json").is_file():
        return json.loads((path / "extra.json").read_text(encoding="utf-8"))
    if (path / "extra.pt").is_file():  # older layout: readable when it holds only plain data
        return _load_safe(path / "extra.pt", "write its content as plain JSON data to extra.json beside it")
    raise ValueError(f"load_checkpoint: {path} holds no extra.json; the checkpoint is incomplete, "
                     "pass another directory from list_checkpoints()")


def load_checkpoint(path: str | pathlib.Path, state: LearnerState) -> dict:
    """Restore `state` in place from a checkpoint directory; return the run's `extra` as parsed JSON (the
    dict given to `save_checkpoint`, with tuples as lists). The optimizers keep their moments but take this
    state's settings (lr, betas, eps, weight decay, schedule at the restored step: `apply_optim_config`)."""
    path = pathlib.Path(path)
    saved = read_learner_file(path, "load_checkpoint")
    extra = _load_extra(path)
    lora = _check_lora(path, saved, state)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=_distributed(state), strict=not lora)
    set_model_state_dict(state.policy, saved["policy"], options=options)
    set_optimizer_state_dict(state.policy, state.optimizer, saved["optimizer"], options=options)
    state.scheduler.load_state_dict(saved["scheduler"])
    if state.critic is not None:
        if "critic" not in saved:
            raise ValueError(f"load_checkpoint: {path} has no critic but this learner has one (algorithm changed?)")
        set_model_state_dict(state.critic, saved["critic"], options=options)
        set_optimizer_state_dict(state.critic, state.critic_optimizer, saved["critic_optimizer"], options=options)
        state.critic_scheduler.load_state_dict(saved["critic_scheduler"])
    for key, value in saved["counters"].items():
        setattr(state, key, value)
    apply_optim_config(state)
    set_rng_state(saved["rng"])
    return extra


def _check_lora(path: pathlib.Path, saved: dict, state: LearnerState) -> bool:
    """Whether the checkpoint holds LoRA adapters; ValueError unless they are exactly this learner's."""
    ours, theirs = lora_record(state.policy), saved.get("lora")
    trained = {n for n, p in state.policy.named_parameters() if p.requires_grad}
    shape = [None if r is None else {**r, "dropout": None} for r in (ours, theirs)]  # dropout may change
    if shape[0] == shape[1] and (theirs is None or set(saved["policy"]) == trained):
        return theirs is not None
    text = [f"LoRA {r['rank']}/{r['alpha']:g} on {' '.join(r['targets'])}" if r else "full weights"
            for r in (theirs, ours)]
    raise ValueError(f"load_checkpoint: {path} holds {text[0]} ({len(saved['policy'])} tensors), this learner "
                     f"trains {text[1]} ({len(trained)}); resume with the checkpoint's --lora.* values")


def describe_checkpoint(path: str | pathlib.Path) -> dict:
    """What a checkpoint directory's meta.json records: {"step", "version", "time", "algorithm"} (and "lora",
    the LoRA settings, for a LoRA checkpoint), without loading its weights."""
    meta = pathlib.Path(path) / "meta.json"
    if not meta.is_file():
        raise ValueError(f"describe_checkpoint: {path} holds no meta.json; pass a directory from list_checkpoints()")
    return json.loads(meta.read_text(encoding="utf-8"))


def _config_from_dict(fields: dict):
    """The `TransformerConfig` (or, with impl "hf", `HFModelConfig`) that `_model_config` stored as a dict."""
    kind = HFModelConfig if fields.get("impl") == "hf" else TransformerConfig
    return kind(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})


def run_model(checkpoint: str | pathlib.Path) -> dict | None:
    """The `model` section (path, seed, tokenizer, ...) of the config a checkpoint was trained under: its
    run_config.json, else its run directory's config.json; None when neither records it."""
    checkpoint = pathlib.Path(checkpoint)
    for file in (checkpoint / RUN_CONFIG, checkpoint.resolve().parent.parent / "config.json"):
        try:
            model = json.loads(file.read_text(encoding="utf-8"))["model"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(model, dict) and "path" in model:
            return model
    return None


def run_hub(checkpoint: str | pathlib.Path, field: str) -> str | None:
    """The commit a run recorded for a Hub name of `field` ("model.path"), None without one."""
    checkpoint = pathlib.Path(checkpoint)
    for file in (checkpoint / RUN_CONFIG, checkpoint.resolve().parent.parent / "config.json"):
        try:
            return json.loads(file.read_text(encoding="utf-8"))["_hub"][field]["commit"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _base_source(checkpoint: str | pathlib.Path, base: str | None) -> tuple[str, int]:
    """(the local path of a LoRA checkpoint's base, its seed): --base, else the run's --model.path (a Hub name
    resolved at the commit the run recorded)."""
    from asyncrl.tools.hub import local_model_path
    if base is not None:
        return local_model_path(base, "--base"), 0
    model = run_model(checkpoint)
    if model is None:
        raise ValueError(f"{checkpoint} holds LoRA adapters, and its base model is not recorded (no "
                         "run_config.json in it, no config.json in its run directory); pass --base PATH, the "
                         "--model.path it trained from")
    return (local_model_path(model["path"], "the run's --model.path", run_hub(checkpoint, "model.path")),
            int(model.get("seed") or 0))


def lora_base_weights(checkpoint: str | pathlib.Path, config, base: str | None = None) -> dict[str, Tensor]:
    """The frozen base of a LoRA checkpoint (float32, CPU) by HF name, checked against the checkpoint's model
    config `config` (a `TransformerConfig`)."""
    path, seed = _base_source(checkpoint, base)
    model = load_model(path, dtype=torch.float32, device="cpu", seed=seed)
    if dataclasses.replace(model.config, hf_config={}) != dataclasses.replace(config, hf_config={}):
        raise ValueError(f"{checkpoint}: the base {path} is not the model its adapters were trained on (another "
                         "architecture or size); pass --base with the --model.path of the run")
    return dict(model.state_dict())


def export_hf(source: LearnerState | str | pathlib.Path, out_dir: str | pathlib.Path, *, tokenizer=None,
              dtype: torch.dtype | None = None, base: str | None = None) -> pathlib.Path:
    """Write the policy as a Hugging Face directory, from a live learner or from a checkpoint directory. A
    LoRA policy is written merged (W + s·B·A, in float32 unless `dtype` says otherwise: bf16 would round most
    small updates away), its base from the checkpoint's run config (--model.path, --model.seed) or `base`."""
    if isinstance(source, LearnerState):
        weights = get_model_state_dict(source.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        config, lora = source.policy.config, lora_record(source.policy)
        if _distributed(source) and not _is_writer(source):
            return pathlib.Path(out_dir)
    else:
        saved = read_learner_file(pathlib.Path(source), "export_hf")
        if saved.get("config") is None:
            raise ValueError(f"export_hf: {source} does not record the model config; export from a live learner")
        weights, config, lora = saved["policy"], _config_from_dict(saved["config"]), saved.get("lora")
        if lora is not None:
            weights = {**lora_base_weights(source, config, base), **weights}
    if lora is not None:
        weights, dtype = merge_adapters(weights, lora), dtype or torch.float32
    if isinstance(config, HFModelConfig):
        return save_transformers(config, weights, out_dir, tokenizer=tokenizer, dtype=dtype)
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return save_pretrained(model, out_dir, tokenizer=tokenizer, dtype=dtype)
