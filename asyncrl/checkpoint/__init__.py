"""Checkpoints: save and resume everything a run needs (`save_load`), written so a crash or a full disk never
leaves a half checkpoint (`files`), and chosen on resume with the damaged ones set aside (`repair`).

    from asyncrl.checkpoint import save_checkpoint, load_checkpoint, latest_checkpoint
"""

from asyncrl.checkpoint.files import CheckpointError, fsync_dir
from asyncrl.checkpoint.save_load import (RUN_CONFIG, describe_checkpoint, export_hf, latest_checkpoint,
                                          list_checkpoints, load_checkpoint, lora_base_weights, run_hub, run_model,
                                          save_checkpoint)

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "describe_checkpoint", "latest_checkpoint",
           "list_checkpoints", "export_hf", "run_model", "run_hub", "lora_base_weights", "fsync_dir", "RUN_CONFIG"]
