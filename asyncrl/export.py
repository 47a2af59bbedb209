"""`asyncrl export RUN_DIR|CHECKPOINT OUT [--merged]`: a checkpoint as a directory other tools open.

    asyncrl export runs/cpu-demo out/policy                                    # the run's newest checkpoint
    asyncrl export runs/cpu-demo/checkpoints/step_00000020 out/policy          # full weights: an HF model dir
    asyncrl export runs/lora/checkpoints/step_00000020 out/adapter             # LoRA: a peft adapter dir
    asyncrl export runs/lora/checkpoints/step_00000020 out/merged --merged     # LoRA: base + s·B·A, an HF dir

* A run directory stands for its newest checkpoint (a line says which); one without a checkpoint is refused.
* A full-weight checkpoint becomes a Hugging Face model directory (config.json, model.safetensors, tokenizer
  files): `transformers.AutoModelForCausalLM.from_pretrained(OUT)` opens it (`export_hf`).
* A LoRA checkpoint with `--merged` becomes the same, its weights W + (alpha / rank)·B·A over the base it
  trained on, in float32 unless `--dtype bfloat16` (bf16 would round most of a small update away).
* A LoRA checkpoint without `--merged` becomes peft's adapter format: adapter_config.json and
  adapter_model.safetensors with peft's key names (`base_model.model.<HF name>.lora_A.weight`), which
  `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT)` loads over the base.

The base of a LoRA checkpoint is the run's `--model.path` (and `--model.seed` for `random:` models), read
from the checkpoint's copy of the run's config (run_config.json; else the run directory's config.json);
`--base PATH` overrides it (a model directory that moved).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Annotated, Literal

import torch
import tyro
from safetensors.torch import save_file

from asyncrl.checkpoint.save_load import describe_checkpoint, export_hf, read_learner_file, run_hub, run_model
from asyncrl.evaluate import is_checkpoint, is_run_dir, resolve_checkpoint
from asyncrl.tools.hub import local_model_path
from asyncrl.launch.run_spec import run_tokenizer
from asyncrl.tracking.console import phase

__all__ = ["ExportArgs", "export_main", "export_adapters"]


def export_adapters(checkpoint: str | pathlib.Path, out_dir: str | pathlib.Path, *,
                    base_name: str | None = None) -> pathlib.Path:
    """Write a LoRA checkpoint's adapters in peft's format (see the module docstring); `base_name` is what
    adapter_config.json records as base_model_name_or_path (default: the run's --model.path)."""
    saved = read_learner_file(pathlib.Path(checkpoint), "export")
    lora = saved.get("lora")
    if lora is None:
        raise ValueError(f"{checkpoint} holds full weights, not LoRA adapters: export it as an HF model "
                         "directory (export_hf)")
    if base_name is None:
        base_name = (run_model(checkpoint) or {}).get("path")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name, "revision": None,
              "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
              "target_modules": list(lora["targets"]), "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
              "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
              "alpha_pattern": {}}
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tensors = {f"base_model.model.{name}": t.detach().to("cpu", torch.float32).contiguous()
               for name, t in saved["policy"].items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


@dataclasses.dataclass
class ExportArgs:
    """Write a checkpoint as a Hugging Face model directory, or a LoRA checkpoint's adapters in peft's format
    (merged with its base: --merged)."""

    checkpoint: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR|CHECKPOINT")]
    """A run directory (its newest checkpoint) or a checkpoint directory RUN/checkpoints/step_XXXXXXXX."""
    out: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="OUT")]
    """The directory to write (new, or empty)."""
    merged: bool = False
    """LoRA checkpoints: write base + (alpha / rank)·B·A as an HF model directory instead of a peft adapter."""
    base: str | None = None
    """LoRA checkpoints: the base model (default: the run's --model.path, from the checkpoint's run config)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights' dtype: auto = the checkpoint's for full weights, float32 for a merged LoRA policy."""
    tokenizer: str | None = None
    """Tokenizer files to write beside the weights (default: the run's --model.tokenizer or --model.path; none
    for random: models)."""


def _tokenizer(args: ExportArgs):
    """The tokenizer to write beside the weights, None when there is none to write."""
    model = run_model(args.checkpoint) or {}
    field = "model.tokenizer" if model.get("tokenizer") else "model.path"
    source = args.tokenizer or model.get("tokenizer") or args.base or model.get("path")
    commit = run_hub(args.checkpoint, field) if source == model.get(field.split(".")[1]) else None
    return run_tokenizer(local_model_path(source, "the tokenizer", commit)) if source else None


def export(args: ExportArgs) -> tuple[pathlib.Path, str]:
    """Write `args.out` as `args` says; returns it and what was written (for the one line the command prints).
    A run directory's newest checkpoint is written, and a line on stderr says which."""
    checkpoint, taken = resolve_checkpoint(args.checkpoint, "RUN_DIR" if is_run_dir(args.checkpoint) else "CHECKPOINT")
    if not is_checkpoint(checkpoint):
        raise ValueError(f"CHECKPOINT {args.checkpoint}: not a checkpoint directory (no learner.pt) nor a run "
                         "directory; give a run directory (its newest checkpoint) or RUN/checkpoints/step_XXXXXXXX")
    out = pathlib.Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; give a new OUT")
    if taken is not None:
        phase(taken)
    args = dataclasses.replace(args, checkpoint=checkpoint)
    lora = describe_checkpoint(args.checkpoint).get("lora")
    if lora is not None and not args.merged:
        return export_adapters(args.checkpoint, out, base_name=args.base), (
            f"LoRA adapters (rank {lora['rank']}, alpha {lora['alpha']:g}) in peft's format")
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    export_hf(args.checkpoint, out, tokenizer=_tokenizer(args), dtype=dtype, base=args.base)
    return out, "the policy merged with its base (an HF model directory)" if lora else "an HF model directory"


def export_main(argv: list[str]) -> None:
    """`asyncrl export RUN_DIR|CHECKPOINT OUT [--merged] [--base PATH] [--dtype ...]`."""
    args = tyro.cli(ExportArgs, args=argv, prog="asyncrl export")
    try:
        out, what = export(args)
    except ValueError as err:
        raise SystemExit(f"asyncrl export: {err}") from None
    print(f"asyncrl export: wrote {what} to {out}", flush=True)
