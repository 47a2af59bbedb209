"""The `transformers` model of a config.json on the meta device: every module and parameter shape of the checkpoint's
architecture, built in well under a second for an 8B shape, with no memory taken and no weights read. What must be
known before launch reads it: the planner's exact parameter count (`asyncrl.planning.predict.ModelShape`) and the
preflight's LoRA layers (`asyncrl.launch.preflight.check_lora`), for every type asyncrl does not implement itself.

    model = meta_transformers(model_config_dict("path/to/gemma-3-1b"))
    sum(p.numel() for p in model.parameters())            # tied weights counted once

Repository code never runs (a config that needs it is refused earlier, by `implementations.resolve_impl`).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncrl.policies.hf_model import transformers_config

__all__ = ["meta_transformers", "text_config"]


def meta_transformers(config: dict) -> nn.Module:
    """The `AutoModelForCausalLM` of `config` (a config.json dict) on the meta device.

    Raises:
      ValueError: transformers does not build this config (the message says which type and why).
    """
    from transformers import AutoModelForCausalLM
    model_type = str(config.get("model_type", ""))
    try:
        hf_config = transformers_config({**config, "model_type": model_type})
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise ValueError(f"model_type {model_type!r}: the installed transformers does not build a causal LM from "
                         f"this config ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None


def text_config(model: nn.Module):
    """The text decoder's `PretrainedConfig` of a transformers model (the nested one of a multimodal config)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config
