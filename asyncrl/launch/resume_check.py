"""What a resume may change: the run's config and data, compared with the checkpoint's, before anything starts.

    record = run_record(cfg)                   # written as run_dir/config.json; each checkpoint keeps a copy
    check = check_resume(cfg, checkpoint_dir)  # check.problems refuse the resume; check.line lists what changed

A run writes `config.json` (every field: `config_record`) with its **data fingerprint** (`data_fingerprint`):
for a prompt file its size and the SHA-256 of its bytes (files up to 1 GiB in full, larger ones by 64 evenly
spread 1 MiB blocks plus the size: about a second either way), for a procedural task its parameters and seed.
Every checkpoint keeps a copy (`run_config.json`), the config it was trained under. A resume compares its own
config with that copy, field by field, and names every difference by its flag. The classes, in one place:

* **fixed** (`FIXED`, refused): the model, its tokenizer and seed, the parameter dtype (the weights and
  optimizer moments come from the checkpoint), the staleness window (`--trainer.mini-batch-size`,
  `--async-training.staleness-threshold / trigger-parameter-sync-step / require-batches`: the admission
  budget is restored from the checkpoint), LoRA's `--lora.rank / alpha / target-modules` (the checkpoint
  holds adapters of that shape and scale, and no base: a full-weight checkpoint cannot become a LoRA run nor
  the reverse; `--lora.dropout` is applied), an adaptive KL controller's `--algorithm.kl-in-reward-coef`
  (its β is restored), and the algorithm itself (`algorithm:NAME`: the loss, the advantage estimator and the
  critic's state come with it).
* **data** (`DATA`, refused unless `--resume-allow-data-change`): the prompt file's content, the `--data.*`
  flags and, for prompt files, `--rollout.max-prompt-length` (which rows are kept). With the flag the run goes
  on with the new data and keeps the data cursor, clamped to it: a position past the new data's end starts
  the next epoch (prompts queued or in flight at the checkpoint are still trained as they were).
  The same file under another path is not a change.
* **harmless** (`HARMLESS`, allowed and listed): logging, checkpoint cadence, run length and time limits,
  timeouts, placement, engine and micro-batching knobs that change speed, not what is learned.
* **applied** (everything else, allowed and listed): they take effect from the resumed step. The optimizer
  and its schedule (`--trainer.optim.*`, the critic's lr) are put on the restored optimizer by
  `load_checkpoint` (`apply_optim_config`), never replaced by the checkpoint's; the loss, sampling, reward
  and environment settings are read afresh by the run.

The allowed changes are listed in one console line (`ResumeCheck.line`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

from asyncrl.config import algorithm as algorithm_config
from asyncrl.checkpoint import RUN_CONFIG
from asyncrl.config import DataConfig, RunConfig
from asyncrl.config.run_config import ALL_LINEAR, LORA_TARGETS
from asyncrl.config.flags import algorithm_command, flag, shown
from asyncrl.launch.hub_run import named_record
from asyncrl.policies.implementations import resolve_impl

__all__ = ["FIXED", "DATA", "HARMLESS", "ResumeCheck", "config_record", "data_fingerprint", "run_record",
           "check_resume"]

_WINDOW = "the staleness window (its admission budget) is restored from the checkpoint"
FIXED = {
    "model.path": "the weights come from the checkpoint and the reference model is rebuilt from this path",
    "model.tokenizer": "the checkpoint's queued and in-flight prompts are token ids of this tokenizer",
    "model.seed": "a random: model's reference is rebuilt from this seed",
    "trainer.param_dtype": "the checkpoint's weights and optimizer moments are in this dtype",
    "trainer.mini_batch_size": _WINDOW,
    "async_training.staleness_threshold": _WINDOW,
    "async_training.trigger_parameter_sync_step": _WINDOW,
    "async_training.require_batches": _WINDOW,
    "lora.rank": "the checkpoint holds adapters of this rank (0: full weights), and the base only through "
                 "--model.path",
    "lora.alpha": "the checkpoint's adapters were trained at this scale (alpha / rank)",
    "lora.target_modules": "the checkpoint holds adapters on exactly these layers",
}
"""Fields that cannot change on resume (dotted field path -> why)."""
DATA = ("data.", "rollout.max_prompt_length")
"""Fields (prefixes) that decide which prompts the data cursor points at."""
HARMLESS = ("wandb", "checkpoint_every", "strict_rewards", "placement.", "async_training.total_versions",
            "async_training.time_budget_s", "async_training.take_timeout_s", "async_training.agent_timeout_s",
            "async_training.sync_timeout_s", "async_training.colocated_sleep", "model.engine_dtype",
            "rollout.backend", "rollout.vllm.", "rollout.max_slots", "rollout.max_concurrent_prompts",
            "rollout.cuda_graphs", "rollout.decode_attention", "trainer.use_dynamic_bsz", "trainer.max_tokens_per_micro_batch",
            "trainer.micro_batch_size", "trainer.logits_chunk_tokens", "trainer.pack_sequences",
            "trainer.gradient_checkpointing", "trainer.checkpoint_scope", "trainer.compile_layers",
            "trainer.compile_scope", "trainer.cuda_graphs", "trainer.fsdp_reshard_after_forward",
            "trainer.fused_optimizer", "trainer.fused_kernels", "trainer.autocast_bf16", "reward.timeout_s",
            "reward.max_concurrency", "reward.error_warn_share", "env.max_concurrency", "algorithm.critic.device")
"""Fields (exact, or prefixes ending in '.') that change speed, logging or limits, not what is learned."""
_NOT_COMPARED = {"run_dir", "dry_run", "resume", "resume_or_start", "overwrite", "resume_allow_data_change"}
_FINGERPRINT = "_data_fingerprint"
_FULL_HASH_BYTES = 2**30
_BLOCK, _BLOCKS = 2**20, 64


def config_record(cfg: RunConfig) -> dict:
    """Every field of `cfg` as JSON data, each dataclass with its "_type" (the form of run_dir/config.json)."""
    def plain(obj):
        if dataclasses.is_dataclass(obj):
            fields = {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            return {"_type": type(obj).__name__, **fields}
        if isinstance(obj, (list, tuple)):
            return [plain(x) for x in obj]
        return obj
    return json.loads(json.dumps(plain(cfg), default=str))


def _file_digest(path: pathlib.Path, size: int) -> tuple[str, str]:
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as file:
        if size <= _FULL_HASH_BYTES:
            while block := file.read(16 * _BLOCK):
                digest.update(block)
            return digest.hexdigest(), "all bytes"
        for i in range(_BLOCKS):
            file.seek(i * (size - _BLOCK) // (_BLOCKS - 1))
            digest.update(file.read(_BLOCK))
    return digest.hexdigest(), f"{_BLOCKS} blocks of 1 MiB"


def data_fingerprint(data: DataConfig) -> dict:
    """What identifies the prompts: a file's size and SHA-256 (see the module docstring), or a task's
    parameters and seed."""
    if data.path is None:
        return {"task": data.task, "digits": data.digits, "operators": data.operators, "seed": data.seed}
    path = pathlib.Path(data.path)
    try:
        size = path.stat().st_size
        sha256, hashed = _file_digest(path, size)
    except OSError as err:
        return {"path": data.path, "error": str(err)}
    return {"path": data.path, "bytes": size, "sha256": sha256, "hashed": hashed}


def run_record(cfg: RunConfig) -> dict:
    """What run_dir/config.json holds: the config and the data fingerprint."""
    return {**config_record(cfg), _FINGERPRINT: data_fingerprint(cfg.data)}


def _leaves(record: dict, prefix: str = "") -> dict[str, object]:
    """'trainer.optim.lr' -> value, for every field of a config record ('_type' and the fingerprint left out)."""
    out = {}
    for key, value in record.items():
        if key.startswith("_"):
            continue
        if isinstance(value, dict) and "_type" in value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _flag(path: str) -> str:
    owner, _, field = path.rpartition(".")
    return flag(owner or "run", field)


def _change(path: str, old, new) -> str:
    return f"{_flag(path)} {shown(old)} -> {shown(new)}"


def _matches(path: str, patterns) -> bool:
    return any(path == p or (p.endswith(".") and path.startswith(p)) for p in patterns)


def _algorithm_name(type_name: str) -> str:
    """'DrGRPO' -> 'algorithm:dr-grpo' (the subcommand), else the class name."""
    try:
        return "algorithm:" + algorithm_command(getattr(algorithm_config, type_name)())
    except (AttributeError, KeyError, TypeError, ValueError):
        return type_name


@dataclasses.dataclass
class ResumeCheck:
    """The comparison of a resume's config and data with its checkpoint's."""

    name: str
    """The checkpoint (step_N)."""
    problems: list[str] = dataclasses.field(default_factory=list)
    """Why the resume is refused: each names the flags and the fix."""
    applied: list[str] = dataclasses.field(default_factory=list)
    """'--flag old -> new' of the changes that take effect from the resumed step."""
    harmless: list[str] = dataclasses.field(default_factory=list)
    """'--flag old -> new' of the changes to logging, limits, placement and speed."""
    data: list[str] = dataclasses.field(default_factory=list)
    """How the data changed (accepted with --resume-allow-data-change)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What could not be compared."""

    @property
    def line(self) -> str | None:
        """The one console line listing what the resume changes (None when nothing)."""
        parts = [f"{label}: {', '.join(items)}" for label, items in (
            ("applied from here", self.applied), ("harmless", self.harmless),
            ("data changed (--resume-allow-data-change; the data cursor is kept, clamped to the new data)",
             self.data)) if items]
        return f"resume from {self.name} changes {'; '.join(parts)}" if parts else None


def _resume_flag(cfg: RunConfig) -> str:
    return "--resume" if cfg.resume else "--resume-or-start"


def _is_data(path: str, cfg: RunConfig) -> bool:
    return _matches(path, DATA) and (path != "rollout.max_prompt_length" or cfg.data.path is not None)


def _compare_fields(old: dict, new: dict, cfg: RunConfig, check: ResumeCheck, same_algorithm: bool) -> list[str]:
    """Sort the changed fields into the check's classes; return the data fields that changed."""
    fixed, data = [], []
    adaptive = old.get("algorithm.kl_target") is not None and new.get("algorithm.kl_target") is not None
    for path in new:
        if path not in old or old[path] == new[path] or path in _NOT_COMPARED:
            continue
        if path.startswith("algorithm.") and not same_algorithm:
            continue  # the algorithm itself is refused
        change = _change(path, old[path], new[path])
        if path in FIXED:
            fixed.append(f"{change} ({FIXED[path]})")
        elif path == "algorithm.kl_in_reward_coef" and adaptive:
            fixed.append(f"{change} (the adaptive KL controller's β is restored from the checkpoint)")
        elif _is_data(path, cfg):
            data.append(path)
        elif _matches(path, HARMLESS):
            check.harmless.append(change)
        else:
            check.applied.append(change)
    if fixed:
        check.problems.append(
            f"{_resume_flag(cfg)}: {check.name} was trained with other values of what a resume cannot change: "
            f"{'; '.join(fixed)}; give them the checkpoint's values, or start a new run (--overwrite, or another "
            "--run-dir)")
    return data


def _content_change(old_fp: dict, new_fp: dict, cfg: RunConfig, check: ResumeCheck) -> str | None:
    """How the prompt file's content changed (None when it did not, or was not recorded: then a note)."""
    if "sha256" not in new_fp:
        return None
    if "sha256" not in old_fp:
        if "path" in old_fp:
            check.notes.append(f"{check.name}'s run recorded no content fingerprint of --data.path "
                               f"{old_fp['path']}: the file's content is not compared")
        return None
    if old_fp["sha256"] != new_fp["sha256"]:
        return (f"--data.path {cfg.data.path}: other content (sha256 {new_fp['sha256'][:12]}, {new_fp['bytes']} "
                f"bytes; {check.name}'s {old_fp['sha256'][:12]}, {old_fp['bytes']} bytes)")
    if old_fp["path"] != new_fp["path"]:
        check.harmless.append(f"--data.path {old_fp['path']} -> {new_fp['path']} (same content)")
    return None


def _compare_data(old: dict, new: dict, saved: dict, now: dict, paths: list[str], cfg: RunConfig,
                  check: ResumeCheck) -> None:
    items = [_change(p, old[p], new[p]) for p in paths if p != "data.path"]
    old_fp, new_fp = saved.get(_FINGERPRINT) or {}, now[_FINGERPRINT]
    content = _content_change(old_fp, new_fp, cfg, check)
    if content is not None:
        items.append(content)
    elif "data.path" in paths and ("sha256" not in old_fp or "sha256" not in new_fp):
        items.insert(0, _change("data.path", old["data.path"], new["data.path"]))
    if not items:
        return
    if cfg.resume_allow_data_change:
        check.data.extend(items)
        return
    check.problems.append(
        f"{_resume_flag(cfg)}: the data differs from {check.name}'s: {'; '.join(items)}; its data cursor would point "
        f"into other prompts: give the run {check.name}'s data back, or pass --resume-allow-data-change to go on with "
        "this data (the cursor is kept, clamped to the new data: past its end the next epoch starts)")


def _same_lora_layers(old: dict, new: dict, cfg: RunConfig) -> None:
    """A run from before "all-linear" recorded --lora.target-modules as the seven names of asyncrl's own models,
    which is what all-linear adapts on them: on an own model the two are the same layers, not a change."""
    key = "lora.target_modules"
    if {tuple(old.get(key) or ()), tuple(new.get(key) or ())} != {(ALL_LINEAR,), LORA_TARGETS}:
        return
    try:
        own = resolve_impl(cfg.model.path, cfg.model.impl) == "own"
    except (OSError, ValueError):
        own = False
    if own:
        old[key] = new[key]


def _read_json(file: pathlib.Path) -> dict | None:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_resume(cfg: RunConfig, checkpoint: str | pathlib.Path, *, named: dict | None = None) -> ResumeCheck:
    """Compare `cfg` (and its data) with what the checkpoint directory recorded: its meta.json's algorithm and
    its copy of the run's config.json (see the module docstring for what is refused, applied or harmless).
    `named`: the Hub names `cfg` was resolved from (`asyncrl.launch.hub_run`), compared as names."""
    checkpoint = pathlib.Path(checkpoint)
    check = ResumeCheck(checkpoint.name.removesuffix(".old"))
    saved = _read_json(checkpoint / RUN_CONFIG)
    meta = _read_json(checkpoint / "meta.json") or {}
    saved_algorithm = ((saved or {}).get("algorithm") or {}).get("_type") or meta.get("algorithm")
    ours = type(cfg.algorithm).__name__
    if saved_algorithm is not None and saved_algorithm != ours:
        check.problems.append(
            f"{_resume_flag(cfg)}: {check.name} was trained with {_algorithm_name(saved_algorithm)}, this run asks for "
            f"{_algorithm_name(ours)} (the loss, the advantage estimator and the critic's state come with the "
            f"algorithm): resume with {_algorithm_name(saved_algorithm)}, or start a new run (--overwrite, or "
            "another --run-dir)")
    if saved is None:
        check.notes.append(f"{check.name} holds no copy of its run's config (written by an older asyncrl, or not "
                           "by `asyncrl train`): this run's config and data are not compared with it")
        return check
    now = named_record(run_record(cfg), named or {})
    old, new = _leaves(saved), _leaves(now)
    old.setdefault("lora.rank", 0)  # a run from before LoRA trained full weights
    if not old["lora.rank"] and not new["lora.rank"]:  # no LoRA on either side: its other knobs are unused
        old = {path: value for path, value in old.items() if not path.startswith("lora.")}
    _same_lora_layers(old, new, cfg)
    data = _compare_fields(old, new, cfg, check, same_algorithm=saved_algorithm in (None, ours))
    _compare_data(old, new, saved, now, data, cfg, check)
    return check
