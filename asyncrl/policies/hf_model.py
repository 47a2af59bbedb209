"""Any `transformers` causal LM as an asyncrl policy: the `HFCausalLM` wrapper that the learner trains like its own
`CausalLM` (`--model.impl hf`; auto for every type asyncrl does not implement itself).

    model = load_hf("path/to/gemma-3-1b", dtype=torch.bfloat16, device="cuda:0")   # probed on load
    hidden = model(tokens, positions, documents=layout)        # final hidden states [B, S, H], as CausalLM
    logp = linear_logprobs(hidden, model.lm_head.weight, targets, temperature=t / model.logit_scale)

What the learner relies on, and how this class provides it:
* `forward(input_ids, positions, *, documents)` -> final hidden states: the HF base model (`hf.model`) with
  `use_cache=False` (a cache would defeat position-id packing) and asyncrl's document-causal attention registered
  as the attention implementation (`asyncrl.policies.hf_attention`). Where packing is unsafe (hybrid linear-
  attention layers leak state across documents) the packed row is run as padded rows and put back in place.
* `lm_head` and `logit_scale`: logits = logit_scale · lm_head(hidden), soft-capped where `logit_softcap` is set
  (then the learner takes the plain head: `logits()`); `features` says which, and why.
* `blocks()`: the FSDP2 / checkpointing units, from the model's `_no_split_modules`.
* `checkpoint_tensors(name, tensor)`: in-memory names -> checkpoint names (transformers 5 fuses MoE experts in
  memory; publications, vLLM and exports use the checkpoint's names).
* `config`: `HFModelConfig`, the facts the rest of asyncrl reads (vocabulary, eos ids, tied head, the HF config).
The module tree is the HF model's own (`model.*`, `lm_head`), so parameter names are the HF model's.
Repository code never runs: `trust_remote_code` stays off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any

import torch
from torch import Tensor, nn

from asyncrl.policies.attention_layouts import DocumentLayout
from asyncrl.policies.hf_attention import register_document_attention
from asyncrl.policies.hf_probes import HFFeatures, checkpoint_names, probe_model
from asyncrl.policies.model_files import generation_eos_ids, safetensors_files

__all__ = ["HFCausalLM", "HFModelConfig", "HFFeatures", "load_hf", "random_hf", "random_transformers",
           "transformers_config", "save_transformers", "checkpoint_names"]  # HFFeatures, checkpoint_names: hf_probes

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HFModelConfig:
    """What asyncrl reads of an HF-path model's config (the text config of a nested one)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hf_config: dict  # the full config.json dict, written back on export
    impl: str = "hf"
    sliding_window: int | None = None  # the embedded engine's concern only; vLLM handles windows itself

    @classmethod
    def from_transformers(cls, config, generation_eos: Any = None) -> "HFModelConfig":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        eos = generation_eos if generation_eos is not None else getattr(text, "eos_token_id", None)
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(model_type=str(config.model_type), vocab_size=int(text.vocab_size),
                   hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
                   tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), eos_token_ids=eos_ids,
                   bos_token_id=getattr(text, "bos_token_id", None), hf_config=config.to_dict())


def _logit_transform(text_config) -> tuple[float, float | None]:
    """(scale, softcap) of the logits the HF model computes from lm_head(hidden): Granite divides by
    `logits_scaling`, Cohere multiplies by `logit_scale`, Gemma 2/3 soft-cap at `final_logit_softcapping`."""
    scale = 1.0
    if getattr(text_config, "logits_scaling", None):
        scale /= float(text_config.logits_scaling)
    if getattr(text_config, "logit_scale", None):
        scale *= float(text_config.logit_scale)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return scale, float(softcap) if softcap else None


class HFCausalLM(nn.Module):
    """A `transformers` causal LM behind `CausalLM`'s interface (forward -> hidden states, `lm_head`, `logits`)."""

    impl = "hf"

    def __init__(self, hf: nn.Module, config: HFModelConfig, *, native_attention: str = "sdpa"):
        super().__init__()
        for name, child in hf.named_children():  # the HF tree itself: names stay the model's (model.*, lm_head)
            self.add_module(name, child)
        object.__setattr__(self, "_hf", hf)  # the whole model, unregistered (its modules are ours already)
        head = hf.get_output_embeddings()
        if head is None:
            raise ValueError(f"{config.model_type}: the transformers model has no output embeddings (LM head)")
        if "lm_head" not in self._modules:  # e.g. GPT-NeoX's embed_out: reachable as lm_head, named as the model's
            object.__setattr__(self, "lm_head", head)
        self.config = config
        self.native_attention = native_attention  # the model's own implementation (the attention probe's reference)
        text = hf.config.get_text_config()
        self.logit_scale, self.logit_softcap = _logit_transform(text)
        self.features = HFFeatures(fused_head=self.logit_softcap is None,
                                   reasons=() if self.logit_softcap is None else
                                   (f"final_logit_softcapping={self.logit_softcap:g}: log-probs through logits()",))
        self.checkpoint_scope = "layer"
        self._checkpointing = False

    @property
    def hf(self) -> nn.Module:
        """The `transformers` model (`PreTrainedModel`) whose modules this one holds."""
        return self._hf

    # ------------------------------------------------------------------ what the learner calls
    def forward(self, input_ids: Tensor, positions: Tensor | None = None, *, documents: DocumentLayout | None = None,
                attn_mask: Tensor | None = None) -> Tensor:
        """Final hidden states [B, S, H] of right-padded rows, or of one packed row (`documents`, B == 1)."""
        if attn_mask is not None:
            raise ValueError("HFCausalLM.forward: pass documents=DocumentLayout for packed rows, not an attention mask")
        if documents is not None and not self.features.packing:
            return self._documents_as_rows(input_ids, documents)
        extra = {"asyncrl_documents": documents} if documents is not None else {}
        out = self.hf.base_model(input_ids=input_ids, position_ids=positions, use_cache=False, **extra)
        return out.last_hidden_state

    def _documents_as_rows(self, input_ids: Tensor, documents: DocumentLayout) -> Tensor:
        """A packed row run as right-padded rows, one per document, its hidden states put back packed [1, L, H]."""
        docs = input_ids[0].split(documents.lengths)
        rows = torch.nn.utils.rnn.pad_sequence(list(docs), batch_first=True)
        hidden = self.hf.base_model(input_ids=rows, use_cache=False).last_hidden_state
        return torch.cat([hidden[i, :n] for i, n in enumerate(documents.lengths)])[None]

    def logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [..., V] as the HF model computes them from hidden states (scaled, soft-capped)."""
        z = self.lm_head(hidden).float()
        if self.logit_scale != 1.0:
            z = z * self.logit_scale
        if self.logit_softcap is not None:
            z = torch.tanh(z / self.logit_softcap) * self.logit_softcap
        return z

    def blocks(self) -> list[nn.Module]:
        """The units FSDP2 shards and checkpointing recomputes: modules of a class in `_no_split_modules`."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        found = [m for m in self.hf.base_model.modules() if type(m).__name__ in names]
        if found:
            return found
        lists = [m for m in self.hf.base_model.modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            raise ValueError(f"{self.config.model_type}: no decoder layers found (no _no_split_modules, no ModuleList)")
        return list(max(lists, key=len))

    @property
    def gradient_checkpointing(self) -> bool:
        return self._checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each decoder layer in the backward (transformers' own checkpointing, non-reentrant). The HF
        path recomputes whole layers: an "mlp" scope (asyncrl's own model) is taken as "layer"."""
        if enabled and not self._checkpointing:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif not enabled and self._checkpointing:
            self.hf.gradient_checkpointing_disable()
        self._checkpointing = bool(enabled)

    def checkpoint_tensors(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        """The checkpoint-format (name, tensor) pairs of one in-memory weight: itself for most, per-expert
        slices for experts transformers fuses in memory."""
        from transformers.core_model_loading import revert_weight_conversion
        return list(revert_weight_conversion(self.hf, {name: tensor}).items())

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def use_native_attention(self) -> None:
        """Fall back to the model's own attention implementation (padded rows only: packing goes off too)."""
        self.hf.set_attn_implementation(self.native_attention)


def _native_attention(hf_config) -> str:
    return "eager" if hf_config.model_type in ("gpt_oss",) else "sdpa"


def _wrap(hf: nn.Module, config: HFModelConfig, *, dtype: torch.dtype, device: str | torch.device,
          directory: pathlib.Path | None) -> HFCausalLM:
    native = _native_attention(hf.config)
    hf.set_attn_implementation(register_document_attention())
    hf.config.use_cache = False
    model = HFCausalLM(hf.to(device=device, dtype=dtype).eval(), config, native_attention=native)
    probe_model(model, directory=directory)
    return model


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu") -> HFCausalLM:
    """The `transformers` model of an HF directory (safetensors; no repository code), wrapped and probed."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = pathlib.Path(path)
    safetensors_files(path)  # refuses a directory without safetensors weights, saying how to convert it
    hf_cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), config=hf_cfg, dtype=dtype, trust_remote_code=False,
                                              attn_implementation=register_document_attention())
    eos = generation_eos_ids(path, hf.config.to_dict())  # generation_config.json's, else the config's
    config = HFModelConfig.from_transformers(hf.config, eos or None)
    return _wrap(hf, config, dtype=dtype, device=device, directory=path)


def transformers_config(config: dict):
    """The transformers `PretrainedConfig` of a config.json dict (its model_type's class; no repository code)."""
    from transformers import AutoConfig
    fields = dict(config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_transformers(config: dict, *, seed: int = 0) -> nn.Module:
    """The `transformers` model of `config` (a config.json dict) with transformers' own random initialisation,
    seeded, in float32 on the CPU: the same weights in every process (a learner's `random_hf`, a vLLM agent's
    saved copy)."""
    from transformers import AutoModelForCausalLM
    hf_cfg = transformers_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)


def random_hf(config: dict, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> HFCausalLM:
    """An HF-path model of `config` with random weights (`random_transformers`), wrapped and probed."""
    hf = random_transformers(config, seed=seed)
    return _wrap(hf, HFModelConfig.from_transformers(hf.config), dtype=dtype, device=device, directory=None)


def save_transformers(config: HFModelConfig, weights: dict[str, Tensor], out_dir: str | os.PathLike, *,
                      tokenizer=None, dtype: torch.dtype | None = None) -> pathlib.Path:
    """Write an HF-path model's weights (in-memory names, as its state dict holds them) as a Hugging Face directory
    through transformers' own `save_pretrained`, which writes the checkpoint's names (MoE experts unfused) and
    drops a tied head; `AutoModelForCausalLM.from_pretrained(out_dir)` opens it."""
    from transformers import AutoModelForCausalLM
    hf_cfg = transformers_config(config.hf_config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    ours = {name: t.detach().to("cpu") for name, t in weights.items()}
    if dtype is not None:
        ours = {name: t.to(dtype) if t.is_floating_point() else t for name, t in ours.items()}
    missing, _ = hf.load_state_dict(ours, strict=False, assign=True)
    if config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight if hasattr(hf.model, "embed_tokens") else hf.lm_head.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        raise ValueError(f"save_transformers: no weights for {missing[:5]} ({config.model_type})")
    out = pathlib.Path(out_dir)
    hf.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
