"""The tensor-parallel plan a HuggingFace model ships (``plan="hf"``), read in shardwise's styles.

transformers gives most decoder families a plan, ``config.base_model_tp_plan`` (module-name patterns relative to
the base model -> style names), and its causal-LM classes one for their head (``_tp_plan``, ``{"lm_head":
"colwise_gather_output"}``); its own ``tp_plan="auto"`` applies them with DTensor. 146 configs of transformers 5.23
carry one, GPT-NeoX's, Phi's and Nemotron's among them, which plan "llama" does not know. Their forwards already
compute on local shards (every attention reshapes by ``-1`` heads), so each style is one of shardwise's:

==================================================  =============================================================
``colwise``                                          ``Colwise()``
``rowwise``                                          ``Rowwise()``
``colwise_gather_output``, ``colwise_rep``           ``Colwise(gather_output=True)`` (OLMo 2's q/k/v, Phi-3's
                                                     fused qkv_proj: every rank then runs the whole attention)
``rowwise_split_input``, ``rowwise_rep``             ``Rowwise(input_is_parallel=False)``
``packed_colwise`` on a Linear                       ``Colwise(fused=2)`` (a [gate | up] projection)
``embedding_rowwise``                                ``Vocab()``
``replicated_with_grad_allreduce``                   ``Heads()`` (Qwen 3's, Gemma 3's per-head q_norm / k_norm)
``local_params`` on an attention, ``colwise`` on     ``HeadRows()`` on the attention (Granite SWA's, MiMo-V2's
its parameters                                       ``sinks``: each rank keeps its heads' rows; head_rows.py)
``sequence_parallel``                                ``Sequence()``
``replicate``                                        left whole
``moe_tp_experts`` (and the ``packed_colwise`` /     the experts stay whole on every rank, as under plan "llama":
``rowwise`` / ``packed_rowwise`` of their            split them over the ``ep`` axis
parameters)
==================================================  =============================================================

Any other style (``mla_kv_a_proj``: use plan "llama", which splits DeepSeek-V3's latent attention; ``all_reduce``,
``moe_identity_expert``, ``embedding_colwise``) is a ValueError naming it, as is a model without a plan.
A pattern that matches nothing in this model is skipped (a family's plan covers its variants, as HuggingFace's own
loader skips it); a head tied to an embedding the plan leaves whole stays whole with it. A parameter of an attention
whose heads the plan splits, which the plan leaves whole (Doge's `A`), is refused here; anything else the plan leaves
whole that runs on split activations is refused at the first optimizer step (replica_grads.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .styles import Colwise, HeadRows, Heads, Rowwise, Sequence, Style, Vocab, check_divides, pattern_matches

__all__ = ["hf_plan", "HF_STYLES"]

#: HuggingFace's style names and what they are here (None: the module stays whole on every rank).
HF_STYLES: dict[str, Style | None] = {
    "colwise": Colwise(), "rowwise": Rowwise(),
    "colwise_gather_output": Colwise(gather_output=True), "colwise_rep": Colwise(gather_output=True),
    "rowwise_split_input": Rowwise(input_is_parallel=False), "rowwise_rep": Rowwise(input_is_parallel=False),
    "packed_colwise": Colwise(fused=2), "embedding_rowwise": Vocab(), "replicated_with_grad_allreduce": Heads(),
    "sequence_parallel": Sequence(), "replicate": None,
}
_EXPERTS = "moe_tp_experts"
_LOCAL_PARAMS = "local_params"  # an attention that reads its own parameters' rows of this rank's heads
_EXPERT_PARAMS = ("packed_colwise", "rowwise", "colwise", "packed_rowwise")  # styles of the experts' parameters
_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value")


def _text_config(model: nn.Module) -> Any:
    """The model's config, or its text part for a multimodal one (which holds the decoder's plan and head counts)."""
    config = getattr(model, "config", None)
    return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config


def _config_plan(model: nn.Module) -> tuple[dict[str, str], str]:
    """The base model's plan with each pattern prefixed by where the base model lives, and that prefix."""
    plan = (getattr(_text_config(model), "base_model_tp_plan", None)
            or getattr(getattr(model, "config", None), "base_model_tp_plan", None))
    if not plan:
        raise ValueError(f"parallelize: plan='hf' needs a HuggingFace model whose config carries a tensor-parallel "
                         f"plan (config.base_model_tp_plan), got {type(model).__name__} without one; use plan "
                         f"'llama', or pass a dict of module-name pattern -> style")
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    return {prefix + pattern: style for pattern, style in plan.items()}, prefix


def _head_plan(model: nn.Module) -> dict[str, str]:
    """The causal-LM class's plan for its head, unless the head is tied to an embedding the plan leaves whole."""
    head_plan = dict(getattr(type(model), "_tp_plan", None) or {})
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    for name in list(head_plan):
        weight = getattr(dict(model.named_modules()).get(name), "weight", None)
        if weight is not None and any(weight is e for e in embeddings):
            del head_plan[name]  # tied: the embedding is whole here, so the head stays whole with it
    return head_plan


def _refuse(pattern: str, style: str) -> ValueError:
    known = sorted([*HF_STYLES, _EXPERTS])
    hint = "; plan 'llama' splits DeepSeek-V3's latent attention" if style == "mla_kv_a_proj" else ""
    return ValueError(f"parallelize: plan='hf': the model's plan gives {pattern!r} the style {style!r}, which "
                      f"shardwise does not map{hint}; known styles {known}; pass a plan dict instead")


def hf_plan(model: nn.Module, tp: int) -> dict[str, Style]:
    """The plan dict of `model`'s own HuggingFace plan (see the module docstring), ready for `match_plan`."""
    plan, _ = _config_plan(model)
    plan.update(_head_plan(model))
    modules = dict(model.named_modules())
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    experts = [p for p, s in plan.items() if s == _EXPERTS]
    local_params = {p for p, s in plan.items() if s == _LOCAL_PARAMS}
    out: dict[str, Style] = {}
    for pattern, style in plan.items():
        if style in (_EXPERTS, _LOCAL_PARAMS):
            continue  # a module the plan says computes on this rank's rows of its parameters: those patterns follow
        hits = [name for name in modules if name and pattern_matches(name, pattern)]
        param_hits = not hits and any(pattern_matches(name, pattern) for name in params)
        if not hits and not param_hits:
            continue  # a family's plan covers its variants: Qwen 3 MoE's dense MLPs, in a model of MoE layers only
        if param_hits:  # a parameter of a module
            owner = pattern.rpartition(".")[0]
            if style in _EXPERT_PARAMS and owner in experts:
                continue  # the experts' own parameters: they stay whole with their module
            if style == "colwise" and owner in local_params:
                out[owner] = HeadRows()  # an attention's parameter of one row per head (GPT-OSS-style sinks)
                continue
            raise ValueError(f"parallelize: plan='hf': the model's plan splits the parameter pattern {pattern!r} "
                             f"({style!r}) outside a mixture-of-experts block; shardwise splits modules; pass a "
                             f"plan dict instead")
        if style not in HF_STYLES:
            raise _refuse(pattern, style)
        if HF_STYLES[style] is None:
            continue
        if style == "packed_colwise" and not all(isinstance(modules[n], nn.Linear) for n in hits):
            raise _refuse(pattern, style)
        out[pattern] = HF_STYLES[style]
    _check_heads(model, out, tp)
    _check_attention_parameters(modules, out, plan)
    return out


def _check_attention_parameters(modules: dict[str, nn.Module], plan: dict[str, Style], given: dict[str, str]
                                ) -> None:
    """An attention whose projections the plan splits by heads while it holds a parameter of its own that the plan
    leaves whole (Doge's per-head `A`: every rank would combine all heads' values with its own heads, a shape error
    deep in the forward) is refused here, naming the parameter. A plan that leaves the attention whole (its MLP
    only) leaves such parameters alone."""
    for name, module in modules.items():
        children = dict(module.named_children())
        split = [child for child in _ATTENTION if child in children and any(
            isinstance(style, Colwise) and not style.gather_output and pattern_matches(f"{name}.{child}", pattern)
            for pattern, style in plan.items())]
        own = [n for n, _ in module.named_parameters(recurse=False)]
        rows = any(isinstance(style, HeadRows) and pattern_matches(name, p) for p, style in plan.items())
        if rows:  # "head_rows" splits every parameter of the module: each must be one the model's plan splits
            own = [n for n in own if not any(pattern_matches(f"{name}.{n}", p) and s == "colwise"
                                             for p, s in given.items())]
        if split and own:
            shape = tuple(getattr(module, own[0]).shape)
            raise ValueError(f"parallelize: plan='hf': {name}.{own[0]} {shape} is a parameter of the attention "
                             f"{name} ({type(module).__name__}) besides its projections, which the model's plan "
                             f"splits by heads ({name}.{split[0]}) while it leaves {own[0]} whole on every rank; "
                             f"pass a plan dict that leaves this attention whole, or use tp=1 for this model")


def _check_heads(model: nn.Module, plan: dict[str, Style], tp: int) -> None:
    """A plan splitting attention projections by their output features needs whole heads on every rank."""
    splits_heads = any(isinstance(s, Colwise) and not s.gather_output and p.rsplit(".", 1)[-1] in _ATTENTION
                       for p, s in plan.items())
    text = _text_config(model)
    for attr, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads")):
        value = getattr(text, attr, None)
        if splits_heads and isinstance(value, int):
            check_divides(f"the number of {what} ({attr})", value, tp)
