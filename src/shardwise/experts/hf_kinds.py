"""Which HuggingFace mixture-of-experts modules and models `expert_parallel` can split exactly, decided by what
their code computes rather than by their class name.

transformers 5 writes the experts of some fifty MoE families (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE,
Granite-MoE, Phi-MoE, Jamba, MiniMax ...) as one generated class: fused ``gate_up_proj`` (E, 2 f, d) and
``down_proj`` (E, d, f) Parameters, an eager ``forward`` that loops over the experts (``act(gate) * up``, then
``down``, weighted by the router), wrapped by ``use_experts_implementation``, whose flags (``has_gate``,
``has_bias``, ``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``) and ``_apply_gate`` select variants
of that formula. An experts module is *fused like Mixtral*, and split by hf_experts.FusedExpertsParallel, when its
eager forward is Mixtral's byte code, its flags are Mixtral's and its gate is the default one; anything else (GPT-OSS's
biased, interleaved, clamped experts; Llama 4's; DBRX's) is refused with the property that differs. The router and
everything outside the experts module stay the model's own code, so routers that differ (DeepSeek-V3's grouped
top-k, Qwen2-MoE's shared expert) need nothing here.

The load-balancing loss (``router_aux_loss_coef > 0``) is a product of batch means (hf_aux.py). `global_aux_model`
accepts a top-level model whose forward is Mixtral's forward (byte code, docstrings aside) and whose
``load_balancing_loss_func`` is Mixtral's: then hf_aux.GlobalRouterLoss makes the loss the global batch's, as for
Mixtral. Byte-code equality is exact for the installed transformers and needs no list to keep up to date; a model
whose code differs is refused, never guessed.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from torch import nn

__all__ = ["GLOBAL_AUX", "MODULE_EXPERTS", "ROW_LOCAL_AUX", "fused_difference", "global_aux_model", "is_one_of"]

#: HuggingFace experts modules holding one module per expert (``expert_<i>``), routed by a dispatch mask.
MODULE_EXPERTS = ("SwitchTransformersExperts",)
#: Top-level models whose load-balancing loss hf_aux makes the global batch's (besides those `global_aux_model`
#: recognises by their code), and those whose router losses are already means over sequences (exact as they are).
GLOBAL_AUX = ("MixtralForCausalLM",)
ROW_LOCAL_AUX = ("SwitchTransformersForConditionalGeneration", "SwitchTransformersEncoderModel",
                 "SwitchTransformersModel")
#: The flags of transformers' ``use_experts_implementation`` under which the eager formula is Mixtral's.
_MIXTRAL_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                  "has_post_expert_norm": False}


def is_one_of(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether `module` is of one of the classes `names`, also once a strategy mixed in a subclass."""
    return any(c.__name__ in names for c in type(module).__mro__)


def _unwrapped(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _consts(code: types.CodeType) -> tuple:
    doc = code.co_consts[0] if code.co_consts and isinstance(code.co_consts[0], str) else None
    return tuple(c for c in code.co_consts if c is not doc)


def _same_code(a: Any, b: Any) -> bool:
    """Whether two functions compile to the same byte code, names and constants (docstrings aside)."""
    a, b = getattr(_unwrapped(a), "__code__", None), getattr(_unwrapped(b), "__code__", None)
    return a is not None and b is not None and a.co_code == b.co_code and a.co_names == b.co_names \
        and a.co_varnames == b.co_varnames and _consts(a) == _consts(b)


def _hf_forward(module: nn.Module) -> Any:
    """The forward the module runs, below shardwise's mixins (strategies mix subclasses in above its class): a
    user's subclass that overrides forward is compared, not the transformers class beneath it."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("shardwise.") and "forward" in vars(cls):
            return vars(cls)["forward"]
    return None


def fused_difference(module: nn.Module) -> str | None:
    """None when `module` computes Mixtral's fused experts (module docstring); else what differs, in words."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    params = dict(module.named_parameters())  # the activation is a child module without parameters
    E = getattr(module, "num_experts", None)
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if sorted(params) != ["down_proj", "gate_up_proj"] or not isinstance(E, int):
        return (f"its parameters are {sorted(params)}, not Mixtral's gate_up_proj and down_proj alone "
                f"(num_experts={E!r})")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != E or down.shape[0] != E \
            or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not (E, 2 f, d) and "
                f"(E, d, f) with E={E}")
    flags = {k: getattr(module, k, v) for k, v in _MIXTRAL_FLAGS.items()}
    if flags != _MIXTRAL_FLAGS:
        differ = [k for k, v in flags.items() if v != _MIXTRAL_FLAGS[k]]
        return (", ".join(f"{k}={flags[k]}" for k in differ) + " (Mixtral's: "
                + ", ".join(f"{k}={_MIXTRAL_FLAGS[k]}" for k in differ) + ")")
    gate, default_gate = getattr(type(module), "_apply_gate", None), getattr(MixtralExperts, "_apply_gate", None)
    if gate is not default_gate:
        return "its _apply_gate is its own, not act(gate) * up"
    if not _same_code(_hf_forward(module), vars(MixtralExperts)["forward"]):
        return "its eager forward is not Mixtral's"
    return None


def global_aux_model(module: nn.Module) -> bool:
    """Whether `module` adds Mixtral's load-balancing loss exactly as MixtralForCausalLM does (module docstring)."""
    if is_one_of(module, GLOBAL_AUX):
        return True
    if not all(hasattr(module, a) for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")):
        return False
    from transformers.models.mixtral import modeling_mixtral

    here = sys.modules.get(_hf_forward(module).__module__) if _hf_forward(module) is not None else None
    return _same_code(_hf_forward(module), vars(modeling_mixtral.MixtralForCausalLM)["forward"]) \
        and _same_code(getattr(here, "load_balancing_loss_func", None), modeling_mixtral.load_balancing_loss_func)
