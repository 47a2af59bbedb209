"""Save and resume a run: learner weights, optimizer and schedule, counters, RNG states, and whatever the
run loop hands over as `extra` (data cursor, queued and in-flight prompts, staleness counters), so a
resumed run neither loses nor repeats a prompt.

    path = save_checkpoint(run_dir, state, extra={"cursor": ..., "in_flight": [...]}, keep_last=3)
    extra = load_checkpoint(latest_checkpoint(run_dir), state)
    export_hf(state, "out/policy", tokenizer=tok)     # or export_hf("run/checkpoints/step_00000012", ...)

Layout: `run_dir/checkpoints/step_{step:08d}/` holding `learner.pt` (weights, optimizer, schedule,
counters, RNG), `extra.pt` and `meta.json`; written to a temporary directory first and renamed, so a crash
never leaves a half checkpoint. With FSDP2 the full state is gathered to rank 0 (the distributed
state-dict API), which writes; every rank loads it back (broadcast from rank 0). The frozen reference model
is not saved: it is rebuilt from the model path at start-up.
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

from asyncrl.learner import LearnerState
from asyncrl.policies.loading import save_pretrained

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "export_hf"]

_COUNTERS = ("step", "optimizer_steps", "version", "kl_coef", "skipped_updates", "critic_skipped_updates")


def _distributed(state: LearnerState) -> bool:
    return state.group is not None and dist.is_initialized() and dist.get_world_size(state.group) > 1


def _is_writer(state: LearnerState) -> bool:
    return not _distributed(state) or dist.get_rank(state.group) == 0


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        out["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return out


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np
        np.random.set_state(rng["numpy"])


def _gather(state: LearnerState) -> dict:
    """Full (unsharded) state dicts, on CPU (on rank 0 only when distributed)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {"policy": get_model_state_dict(state.policy, options=options),
           "optimizer": get_optimizer_state_dict(state.policy, state.optimizer, options=options),
           "scheduler": state.scheduler.state_dict()}
    if state.critic is not None:
        out["critic"] = get_model_state_dict(state.critic, options=options)
        out["critic_optimizer"] = get_optimizer_state_dict(state.critic, state.critic_optimizer, options=options)
        out["critic_scheduler"] = state.critic_scheduler.state_dict()
    return out


def list_checkpoints(run_dir: str | pathlib.Path) -> list[pathlib.Path]:
    root = pathlib.Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith((".tmp", ".old"))) \
        if root.is_dir() else []


def latest_checkpoint(run_dir: str | pathlib.Path) -> pathlib.Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: str | pathlib.Path, state: LearnerState, extra: dict | None = None, *,
                    keep_last: int = 3) -> pathlib.Path:
    """Write a checkpoint of `state` (+ `extra`) and keep only the newest `keep_last`. Call it on every rank
    of the trainer group; rank 0 writes."""
    if keep_last < 1:
        raise ValueError(f"save_checkpoint: keep_last must be >= 1, got {keep_last}")
    gathered = _gather(state)
    final = pathlib.Path(run_dir) / "checkpoints" / f"step_{state.step:08d}"
    if _is_writer(state):
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        gathered["counters"] = {k: getattr(state, k) for k in _COUNTERS}
        gathered["config"] = getattr(state.policy, "config", None)  # for export_hf from a checkpoint
        gathered["rng"] = _rng_state()
        torch.save(gathered, tmp / "learner.pt")
        torch.save(extra or {}, tmp / "extra.pt")
        meta = {"step": state.step, "version": state.version, "time": time.time(),
                "algorithm": type(state.algorithm).__name__}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():  # re-saving a step: keep the old copy until the new one is in place
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if _distributed(state):
        dist.barrier(group=state.group)
    return final


def load_checkpoint(path: str | pathlib.Path, state: LearnerState) -> dict:
    """Restore `state` in place from a checkpoint directory; return the run's `extra`."""
    path = pathlib.Path(path)
    if not (path / "learner.pt").is_file():
        raise ValueError(f"load_checkpoint: {path} holds no learner.pt; pass a directory from list_checkpoints()")
    saved = torch.load(path / "learner.pt", map_location="cpu", weights_only=False)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=_distributed(state))
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
    _set_rng_state(saved["rng"])
    return torch.load(path / "extra.pt", map_location="cpu", weights_only=False)


def export_hf(source: LearnerState | str | pathlib.Path, out_dir: str | pathlib.Path, *, tokenizer=None,
              dtype: torch.dtype | None = None) -> pathlib.Path:
    """Write the policy as a Hugging Face directory, from a live learner or from a checkpoint directory."""
    from asyncrl.policies.model import CausalLM
    if isinstance(source, LearnerState):
        weights = get_model_state_dict(source.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        config = source.policy.config
        if _distributed(source) and not _is_writer(source):
            return pathlib.Path(out_dir)
    else:
        saved = torch.load(pathlib.Path(source) / "learner.pt", map_location="cpu", weights_only=False)
        weights, config = saved["policy"], saved.get("config")
        if config is None:
            raise ValueError(f"export_hf: {source} does not record the model config; export from a live learner")
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return save_pretrained(model, out_dir, tokenizer=tokenizer, dtype=dtype)
