"""What the planner reads from a model without wrapping it: its parameter count and, when its config says, the
transformer geometry (hidden size, layers, heads, vocabulary, sequence length), its mixture-of-experts layers (the
shardwise MoE, or a HuggingFace MoE's experts modules: parameters inside experts, experts per layer, experts per
token) and what it can be split by.

Read from public attributes only: the shardwise GPT's `config` (d_model, n_layers, n_heads, vocab_size, seq_len) or
a HuggingFace `config` (hidden_size, num_hidden_layers, num_attention_heads, vocab_size, max_position_embeddings;
GPT-2's n_embd, n_layer, n_head, n_positions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["ModelFacts", "model_facts", "count_parameters"]

_FIELDS = {  # our name -> config attribute names, first found wins
    "hidden_size": ("d_model", "hidden_size", "n_embd"),
    "num_layers": ("n_layers", "num_hidden_layers", "n_layer"),
    "num_heads": ("n_heads", "num_attention_heads", "n_head"),
    "vocab_size": ("vocab_size",),
    "seq_len": ("seq_len", "max_position_embeddings", "n_positions"),
}
#: HuggingFace model types with a built-in tensor-parallel plan (tensor_parallel.plans) that takes their modules.
_LLAMA_PLAN = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "qwen2_moe", "qwen3_moe",
               "mixtral", "phimoe", "gpt_oss", "olmo", "olmo2", "olmo3", "olmoe", "phi3", "helium", "exaone4", "glm",
               "smollm3", "starcoder2", "granite", "granitemoe", "cohere", "deepseek_v3", "deepseek_v2", "minicpm3",
               "stablelm", "apertus", "falcon_h1")
_HF_PLANS = {**{model_type: "llama" for model_type in _LLAMA_PLAN}, "gpt2": "gpt2"}


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a weight tied in two places counts once)."""
    return sum(p.numel() for p in model.parameters())


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """num_params and, when known, the geometry; tp_plan: the built-in tensor-parallel plan name, or None;
    pipeline_layers: how many layers a pipeline could split (None: the model cannot be pipelined).
    expert_params: parameters inside the experts of its MoE layers (`models.moe.MoE`: w_in, b_in, w_out, b_out;
    a HuggingFace experts module's parameters; routers and shared experts excluded), 0 for a dense model;
    n_experts / experts_per_token: E and k of those layers (0 when dense); moe_layers: how many there are;
    moe_balance_loss: whether they, or a HuggingFace MoE's routers, add a load-balancing loss (`aux_loss_coef` > 0,
    `router_aux_loss_coef` > 0: a function of the whole batch, which sw.parallelize computes per microbatch under a
    pipeline). The "gpt" and "llama" plans keep MoE layers whole on every tensor-parallel rank (experts replicated
    over tp, not split)."""

    num_params: int
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    tp_plan: str | None = None
    pipeline_layers: int | None = None
    expert_params: int = 0
    n_experts: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0
    moe_balance_loss: bool = False


def _numel_once(tensors: Iterable[torch.Tensor | None]) -> int:
    """Elements of `tensors`, each tensor counted once (a weight shared by two layers); None counts nothing."""
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() for t in unique.values())


def _experts(model: nn.Module) -> dict[str, int]:
    from ..models.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return {}
    names = ("w_in", "b_in", "w_out", "b_out")  # experts.EXPERT_TENSORS (not imported: no cycle)
    params = _numel_once(getattr(layer, name, None) for layer in layers for name in names)
    return {"expert_params": params, "n_experts": layers[0].n_experts, "experts_per_token": layers[0].top_k,
            "moe_layers": len(layers), "moe_balance_loss": any(layer.aux_loss_coef > 0 for layer in layers)}


def _hf_experts(model: nn.Module) -> dict[str, int]:
    """The experts of a HuggingFace MoE model, as expert parallel finds them (experts.hf.hf_expert_layers: Mixtral's
    fused experts and every module computing what they do, Switch's per-expert modules): every parameter of those
    modules (routers and shared experts are outside them: dense), E of the first, k from the config
    (`num_experts_per_tok`; Switch routes each token to 1). An experts module that expert parallel does not support
    is counted as dense (ep cannot split it)."""
    from ..experts.hf import hf_expert_layers  # the experts package imports the planner's neighbours: call time

    try:
        layers = hf_expert_layers(model)
    except ValueError:
        return {}
    if not layers:
        return {}
    params = _numel_once(p for _, module in layers for p in module.parameters())
    per_token = _int_attr(getattr(model, "config", None), ("num_experts_per_tok",)) or 1
    return {"expert_params": params, "n_experts": int(layers[0][1].num_experts), "experts_per_token": per_token,
            "moe_layers": len(layers)}


def _int_attr(config: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_facts(model: nn.Module) -> ModelFacts:
    from ..models.gpt import GPT
    from ..models.hf_parallel import pipeline_builder
    from ..models.hf_router_loss import router_loss_coef

    config = getattr(model, "config", None)
    geometry = {k: _int_attr(config, names) for k, names in _FIELDS.items()} if config is not None else {}
    model_type = getattr(config, "model_type", None)
    tp_plan = "gpt" if isinstance(model, GPT) else _HF_PLANS.get(model_type) if isinstance(model_type, str) else None
    if tp_plan is None and getattr(config, "base_model_tp_plan", None):
        tp_plan = "hf"  # the plan the model's config ships (tensor_parallel/hf_plan.py)
    layers = None
    if hasattr(model, "pipeline_layers") or pipeline_builder(model):
        # the blocks plus the embedding and head layers (hybrid.parallelize's pipeline_layers(), hf_parallel's)
        layers = (geometry.get("num_layers") or 0) + 2 if geometry.get("num_layers") else None
    moe = _experts(model) or _hf_experts(model)
    if router_loss_coef(model) > 0:  # a HuggingFace MoE's router loss: a function of the whole batch too
        moe["moe_balance_loss"] = True
    return ModelFacts(count_parameters(model), tp_plan=tp_plan, pipeline_layers=layers, **geometry, **moe)
