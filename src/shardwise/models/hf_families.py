"""The HuggingFace decoder families `sw.parallelize` splits into pipeline stages as it splits Llama, and what each one's
forward does outside its decoder layers, which the stages (hf_stages.py) must do too.

A Llama-shaped forward is: the token embedding, the decoder layers (given the causal or sliding-window mask, the
positions and the rotary embeddings), the final norm, ``lm_head``. The families listed here do that, plus at most
(checked against each family's source in transformers 5.x, and by tests/test_parallelize_hf_families.py against one
process):

* an embedding multiplier (Granite, Granite-MoE: ``inputs_embeds * embedding_multiplier``): `embedding_multiplier`;
  dropout of the embeddings in training (StarCoder2's ``embedding_dropout``): `embedding_dropout`;
* a transform of the logits (Granite divides by ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2 and
  Gemma 3 cap them as ``cap * tanh(logits / cap)`` with ``final_logit_softcapping``): `LogitsOutput`, read at call
  time from the config as the model's forward reads it;
* rotary embeddings per layer type (Gemma 3's local layers rotate by another base, OLMo 3's too:
  ``rotary_emb(x, positions, layer_type)``): `rotary_layer_type`.

Granite-MoE is Granite's forward plus Mixtral's router loss (experts.hf_kinds.global_aux_model), which
hf_router_loss.py carries through the stages. A family that does anything else outside its layers is not listed, and
`sw.parallelize` refuses it by name (Cohere 2 and others are untested).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["LLAMA_SHAPED", "LogitsOutput", "embedding_dropout", "embedding_multiplier", "rotary_layer_type"]

#: ``config.model_type`` of the families split as Llama (module docstring).
LLAMA_SHAPED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe",
                "qwen3_moe", "gpt_oss", "olmo", "olmo2", "olmo3", "olmoe", "phi3", "phimoe", "helium", "exaone4", "glm",
                "smollm3", "starcoder2", "granite", "granitemoe", "cohere", "deepseek_v3")
_GRANITE = ("granite", "granitemoe")  # an embedding multiplier and a logit scale

_SOFTCAPPED = ("gemma2", "gemma3_text")


def embedding_multiplier(model: nn.Module) -> float | None:
    """Granite's multiplier of the token embeddings (None: the family has none)."""
    if model.config.model_type in _GRANITE:
        return float(model.model.embedding_multiplier)
    return None


def embedding_dropout(model: nn.Module) -> float:
    """StarCoder2's dropout probability of the token embeddings in training (0.0: the family has none)."""
    if model.config.model_type == "starcoder2":
        return float(model.model.embedding_dropout)
    return 0.0


class LogitsOutput:
    """What the family's causal LM does to ``lm_head``'s output before returning it (module docstring); the
    identity for Llama's. The config is read at each call, as the model's forward reads it."""

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config
        self.kind = model.config.model_type
        self.logit_scale = getattr(model, "logit_scale", None) if self.kind == "cohere" else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.kind in _SOFTCAPPED and self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            return torch.tanh(logits / cap) * cap  # transformers' order: / cap, tanh, * cap
        if self.kind in _GRANITE:
            return logits / self.config.logits_scaling
        if self.kind == "cohere":
            return logits * self.logit_scale
        return logits

    def __repr__(self) -> str:
        return f"LogitsOutput({self.kind})"


def rotary_layer_type(rotary_emb: nn.Module, config: Any, index: int) -> str | None:
    """The layer type decoder layer `index` rotates by, for a rotary module that takes one (Gemma 3, OLMo 3); None for
    one rotation shared by every layer."""
    if "layer_type" not in inspect.signature(rotary_emb.forward).parameters:
        return None
    return config.layer_types[index]
