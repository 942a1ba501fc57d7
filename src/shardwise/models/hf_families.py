"""The HuggingFace decoder families `sw.parallelize` splits into pipeline stages as it splits Llama, and what each one's
forward does outside its decoder layers, which the stages (hf_stages.py) must do too.

A Llama-shaped forward is: the token embedding, the decoder layers (given the causal or sliding-window mask, the
positions and the rotary embeddings), the final norm, ``lm_head``. The families listed here do that, plus at most
(checked against each family's source in transformers 5.x, and by tests/test_parallelize_hf_families.py against one
process):

* an embedding multiplier (Granite, Granite-MoE, HyperCLOVA X: ``inputs_embeds * embedding_multiplier``; AFMoE's
  muP ``* hidden_size ** 0.5``):
  `embedding_multiplier`; dropout of the embeddings in training (StarCoder2's ``embedding_dropout``, Phi's
  ``embed_dropout``, GPT-NeoX's ``emb_dropout``): `embedding_dropout`; the final norm applied to the embeddings too
  (nanochat's ``norm`` before the layers): `normed_embeddings`;
* modules under other names (Phi's and Persimmon's final norm ``final_layernorm``; GPT-NeoX's (Pythia's) base model
  ``gpt_neox`` with ``embed_in`` and ``final_layer_norm``; Falcon's ``transformer`` with ``word_embeddings``, ``h``
  and ``ln_f``): `module_paths`;
* arguments its layers take besides Llama's (Falcon's ``alibi``, None for its rotary models; ALiBi Falcons, whose
  biases the forward builds from the padding mask, are refused by name): `layer_arguments`;
* no rotary module at all (Kimi-Linear: its latent attention layers use no positions): `module_paths` leaves it out;
* a transform of the head's input (MiniCPM3 divides the hidden states by ``logits_scaling``): `HeadInput`; of the
  logits (Granite divides by ``logits_scaling``, HyperCLOVA X multiplies by it, Cohere and Cohere 2 multiply by
  ``logit_scale``, Gemma 2, Gemma 3 and nanochat cap them as ``cap * tanh(logits / cap)`` with
  ``final_logit_softcapping``): `LogitsOutput`; both read at call time from the config as the model's forward
  reads it;
* rotary embeddings per layer type (Gemma 3's local layers rotate by another base, OLMo 3's too:
  ``rotary_emb(x, positions, layer_type)``): `rotary_layer_type`; per layer (Granite SWA's ``rotary_embs``, one per
  base of ``layer_rope_theta``, none for a layer of base 0): `layer_rotary`.

Granite-MoE is Granite's forward plus Mixtral's router loss (experts.hf_kinds.global_aux_model), which
hf_router_loss.py carries through the stages.

transformers generates many families from these ("modular" files): Arcee, InternLM 3, ERNIE 4.5, GLM-4, Seed-OSS,
Hunyuan, DeepSeek-V2, GLM-4-MoE ... run Llama's, OLMoE's or DeepSeek-V3's forwards with layers of their own.
`pipeline_kinds` accepts such a model when its base model's forward and its causal LM's forward are, byte for byte,
those of listed families (experts.hf_kinds.same_code: names and constants too, docstrings aside), and takes the
extras of the families they are: what happens outside the layers is then what the stages do. Any other family is
refused by name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["LLAMA_SHAPED", "HeadInput", "LogitsOutput", "base_model", "embedding_dropout", "embedding_multiplier",
           "layer_arguments", "layer_rotary", "module_paths", "normed_embeddings", "pipeline_kinds",
           "rotary_layer_type"]

#: ``config.model_type`` of the families split as Llama (module docstring).
LLAMA_SHAPED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe",
                "qwen3_moe", "gpt_oss", "olmo", "olmo2", "olmo3", "olmoe", "phi3", "phimoe", "helium", "exaone4", "glm",
                "smollm3", "starcoder2", "granite", "granitemoe", "cohere", "deepseek_v3", "ministral", "cohere2",
                "phi", "nemotron", "stablelm", "persimmon", "minimax_m2", "hy_v3", "minicpm3", "hyperclovax",
                "nanochat", "gpt_neox", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "llama4_text", "cwm",
                "cohere2_moe", "exaone_moe", "mellum", "afmoe", "granite_swa", "granitemoe_swa", "falcon",
                "deepseek_v32", "longcat_flash", "minimax", "kimi_linear")
#: an embedding multiplier and logits divided by logits_scaling
_GRANITE = ("granite", "granitemoe", "granite_swa", "granitemoe_swa")
_THETA_PER_LAYER = ("granite_swa", "granitemoe_swa")  # rotary_embs by layer_rope_theta; 0: no rotary (NoPE)
_MULTIPLIED = (*_GRANITE, "hyperclovax")  # inputs_embeds * embedding_multiplier

_SOFTCAPPED = ("gemma2", "gemma3_text", "nanochat")
_SCALED = ("cohere", "cohere2", "cohere2_moe")  # logits times logit_scale
_TIMES_LOGITS_SCALING = ("hyperclovax",)  # logits times config.logits_scaling (muP)
_FINAL_LAYERNORM = ("phi", "persimmon")  # the final norm named final_layernorm
_NO_ROTARY = ("kimi_linear",)  # no rotary module: its latent attention layers use no positions (NoPE)


def pipeline_kinds(model: nn.Module) -> tuple[str, str] | None:
    """(the listed family whose base-model forward the base model (``model.model``) runs, the one whose causal-LM
    forward `model` runs): the model's own type twice for a listed family, the families whose byte code its forwards
    are for one generated from them (module docstring), None for any other model."""
    from ..experts.hf_kinds import model_forward, same_code

    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in LLAMA_SHAPED:
        return kind, kind
    base = base_model(model)
    if base is None:
        return None
    forwards, mine = _listed_forwards(), (model_forward(base), model_forward(model))
    matches = tuple(next((k for k, theirs in forwards.items() if same_code(mine[i], theirs[i])), None) for i in (0, 1))
    return matches if None not in matches else None


@functools.cache
def _listed_forwards() -> dict[str, tuple[Any, Any]]:
    """model type -> (its base model's forward, its causal LM's forward), for the listed families transformers has."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    found = {}
    for kind in LLAMA_SHAPED:
        names = [auto.MODEL_MAPPING_NAMES.get(kind), auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)]
        classes = [getattr(transformers, n if isinstance(n, str) else n[0], None) if n else None for n in names]
        if None not in classes:
            found[kind] = (vars(classes[0]).get("forward"), vars(classes[1]).get("forward"))
    return found


def _base_prefix(model: nn.Module) -> str:
    """The attribute holding the base model: HuggingFace's ``base_model_prefix`` where the model has it (GPT-NeoX's
    ``gpt_neox``), else ``model`` (Llama 4's causal LM names ``language_model`` but holds ``model``)."""
    prefix = getattr(model, "base_model_prefix", "") or "model"
    return prefix if isinstance(getattr(model, prefix, None), nn.Module) else "model"


def base_model(model: nn.Module) -> nn.Module | None:
    """The model's base model (``model.model``; GPT-NeoX's ``model.gpt_neox``)."""
    base = getattr(model, _base_prefix(model), None)
    return base if isinstance(base, nn.Module) else None


def module_paths(model: nn.Module, kind: str | None = None) -> dict[str, str]:
    """Where the model keeps what the stages hold: ``embed_tokens``, ``layers``, ``norm`` (after the last layer),
    ``rotary_emb`` (none for Kimi-Linear, whose layers use no positions) and ``lm_head`` -> their paths in `model`.
    kind: the listed family whose base-model forward the model runs (`pipeline_kinds`; default its own type), which
    names them."""
    kind = kind or model.config.model_type
    prefix = _base_prefix(model)
    layers = "layers"
    if kind == "gpt_neox":  # Pythia's names
        embed, norm = "embed_in", "final_layer_norm"
    elif kind == "falcon":
        embed, layers, norm = "word_embeddings", "h", "ln_f"
    else:
        embed, norm = "embed_tokens", "final_layernorm" if kind in _FINAL_LAYERNORM else "norm"
    paths = {"embed_tokens": f"{prefix}.{embed}", "layers": f"{prefix}.{layers}", "norm": f"{prefix}.{norm}",
             "rotary_emb": f"{prefix}.rotary_emb", "lm_head": "lm_head"}
    if kind in _NO_ROTARY:
        del paths["rotary_emb"]
    return paths


def layer_arguments(model: nn.Module, kind: str | None = None) -> dict[str, Any]:
    """What the family's forward passes each decoder layer besides the hidden states, the mask, the positions and the
    rotary embeddings: Falcon's ``alibi``, None for a rotary Falcon. ValueError for a Falcon with ``alibi=True``: its
    forward builds the biases from the padding mask and folds them into the mask, which the stages do not. kind: as
    for `embedding_multiplier`."""
    if (kind or model.config.model_type) != "falcon":
        return {}
    if model.config.alibi:
        raise ValueError(f"pipeline stages: {type(model).__name__} with alibi=True (ALiBi biases built from the "
                         f"padding mask in its forward) is not split into stages; Falcons with rotary embeddings "
                         f"(alibi=False, as Falcon-7B, -40B and -180B) are")
    return {"alibi": None}


def embedding_multiplier(model: nn.Module, kind: str | None = None) -> float | None:
    """Granite's and HyperCLOVA X's multiplier of the token embeddings, AFMoE's sqrt(hidden size) with muP on (None:
    the family has none). kind: the listed family whose base-model forward the model runs (`pipeline_kinds`; default
    its own type)."""
    kind = kind or model.config.model_type
    if kind in _MULTIPLIED:
        return float(base_model(model).embedding_multiplier)
    if kind == "afmoe" and base_model(model).config.mup_enabled:
        return base_model(model).config.hidden_size ** 0.5  # AfmoeModel's muP input scaling
    return None


def embedding_dropout(model: nn.Module, kind: str | None = None) -> float:
    """StarCoder2's, Phi's and GPT-NeoX's dropout probability of the token embeddings in training (0.0: the family
    has none). kind: as for `embedding_multiplier`."""
    kind = kind or model.config.model_type
    base = base_model(model)
    if kind == "starcoder2":
        return float(base.embedding_dropout)
    if kind == "phi":
        return float(base.embed_dropout.p)
    if kind == "gpt_neox":
        return float(base.emb_dropout.p)
    return 0.0


def normed_embeddings(kind: str | None) -> bool:
    """Whether the family's forward applies its final norm to the embeddings too, before the first layer
    (nanochat: one parameterless RMSNorm used twice)."""
    return kind == "nanochat"


class HeadInput:
    """What the family's causal LM does to the final hidden states before ``lm_head`` (MiniCPM3 divides them by
    ``logits_scaling``); the identity for Llama's. kind: the listed family whose causal-LM forward the model runs
    (`pipeline_kinds`; default its own type). The config is read at each call, as the model's forward reads it."""

    def __init__(self, model: nn.Module, kind: str | None = None) -> None:
        self.config = model.config
        self.kind = kind or model.config.model_type

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kind == "minicpm3":
            return hidden / self.config.logits_scaling
        return hidden

    def __repr__(self) -> str:
        return f"HeadInput({self.kind})"


class LogitsOutput:
    """What the family's causal LM does to ``lm_head``'s output before returning it (module docstring); the
    identity for Llama's. kind: the listed family whose causal-LM forward the model runs (`pipeline_kinds`; default
    its own type). The config is read at each call, as the model's forward reads it."""

    def __init__(self, model: nn.Module, kind: str | None = None) -> None:
        self.config = model.config
        self.kind = kind or model.config.model_type
        self.logit_scale = getattr(model, "logit_scale", None) if self.kind in _SCALED else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.kind in _SOFTCAPPED and self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            return torch.tanh(logits / cap) * cap  # transformers' order: / cap, tanh, * cap
        if self.kind in _GRANITE:
            return logits / self.config.logits_scaling
        if self.kind in _SCALED:
            return logits * self.logit_scale
        if self.kind in _TIMES_LOGITS_SCALING:
            return logits * self.config.logits_scaling
        return logits

    def __repr__(self) -> str:
        return f"LogitsOutput({self.kind})"


def layer_rotary(model: nn.Module, kind: str | None, index: int, shared: nn.Module) -> nn.Module | None:
    """The rotary module decoder layer `index` takes its (cos, sin) from: `shared` (the base model's ``rotary_emb``),
    or for Granite SWA the one of ``rotary_embs`` whose base is ``layer_rope_theta[index]``, None for base 0 (the
    layer rotates nothing: NoPE). kind: as for `embedding_multiplier`."""
    if (kind or model.config.model_type) not in _THETA_PER_LAYER:
        return shared
    theta = model.config.layer_rope_theta[index]
    if not theta:
        return None
    return next(r for r in base_model(model).rotary_embs if r.config.rope_parameters["rope_theta"] == theta)


def rotary_layer_type(rotary_emb: nn.Module, config: Any, index: int) -> str | None:
    """The layer type decoder layer `index` rotates by, for a rotary module that takes one (Gemma 3, OLMo 3); None for
    one rotation shared by every layer."""
    if "layer_type" not in inspect.signature(rotary_emb.forward).parameters:
        return None
    return config.layer_types[index]
