"""Which HuggingFace mixture-of-experts modules and models `expert_parallel` can split exactly, decided by what
their code computes rather than by their class name.

transformers 5 writes the experts of some fifty MoE families (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE,
Granite-MoE, Phi-MoE, Jamba, MiniMax ...) as one generated class: fused ``gate_up_proj`` (E, 2 f, d) and
``down_proj`` (E, d, f) Parameters, an eager ``forward`` that loops over the experts (``act(gate) * up``, then
``down``, weighted by the router), wrapped by ``use_experts_implementation``, whose flags (``has_gate``,
``has_bias``, ``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``) and ``_apply_gate`` select variants
of that formula. An experts module is split by hf_experts.FusedExpertsParallel when its eager forward is one of two
templates' byte code with that template's flags: Mixtral's (with the default gate), or GPT-OSS's (weights stored
transposed, biases, and the class's own ``_apply_gate``, which its eager loop calls row by row), or Llama 4's
(weights stored transposed, no biases, every expert run on every token with its input scaled by the router's score:
split with its MoE block, whose forward and router must be Llama 4's too: `llama4_block_difference`); anything else
(DBRX's experts, a subclass with a forward of its own, flags that select another formula) is refused with the
property that differs. The router and everything outside the experts module stay the model's own code, so routers
that differ (DeepSeek-V3's grouped top-k, Qwen2-MoE's shared expert) need nothing here.

The load-balancing loss (``router_aux_loss_coef > 0``) is a product of batch means (hf_aux.py). `global_aux_model`
accepts a top-level model whose forward is Mixtral's forward or Granite-MoE's (byte code, docstrings aside; the
latter adds the same loss to a loss of scaled logits) and whose ``load_balancing_loss_func`` is Mixtral's: then
hf_aux.GlobalRouterLoss makes the loss the global batch's, as for Mixtral. Byte-code equality is exact for the
installed transformers and needs no list to keep up to date; a model whose code differs is refused, never guessed.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from torch import nn

__all__ = ["GLOBAL_AUX", "MODULE_EXPERTS", "ROW_LOCAL_AUX", "computes_router_loss", "fused_difference",
           "fused_template", "global_aux_model", "is_one_of", "llama4_block_difference", "model_forward", "same_code",
           "unwrapped"]

#: HuggingFace experts modules holding one module per expert (``expert_<i>``), routed by a dispatch mask.
MODULE_EXPERTS = ("SwitchTransformersExperts",)
#: Top-level models whose load-balancing loss hf_aux makes the global batch's (besides those `global_aux_model`
#: recognises by their code), and those whose router losses are already means over sequences (exact as they are).
GLOBAL_AUX = ("MixtralForCausalLM",)
ROW_LOCAL_AUX = ("SwitchTransformersForConditionalGeneration", "SwitchTransformersEncoderModel",
                 "SwitchTransformersModel")
#: The flags of transformers' ``use_experts_implementation`` that go with each template's eager formula.
_TEMPLATE_FLAGS = {
    "mixtral": {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                "has_post_expert_norm": False},
    "gpt_oss": {"has_gate": True, "has_bias": True, "is_transposed": True, "is_concatenated": False,
                "has_post_expert_norm": False},
    "llama4": {},
}
_TEMPLATE_PARAMETERS = {"mixtral": ("gate_up_proj", "down_proj"),
                        "gpt_oss": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
                        "llama4": ("gate_up_proj", "down_proj")}


def is_one_of(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether `module` is of one of the classes `names`, also once a strategy mixed in a subclass."""
    return any(c.__name__ in names for c in type(module).__mro__)


def unwrapped(fn: Any) -> Any:
    """`fn` below its decorators (functools.wraps' ``__wrapped__`` chain: transformers' ``can_return_tuple`` ...)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _consts(code: types.CodeType) -> tuple:
    doc = code.co_consts[0] if code.co_consts and isinstance(code.co_consts[0], str) else None
    return tuple(_code_key(c) if isinstance(c, types.CodeType) else c for c in code.co_consts if c is not doc)


def _code_key(code: types.CodeType) -> tuple:
    """What a nested function's code (a lambda, a comprehension) is compared by: its byte code, names, variables and
    constants, not its file and line, which a code object's own equality includes (the same lambda in two generated
    files: Mellum's and Laguna's mask functions)."""
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, _consts(code)


def same_code(a: Any, b: Any) -> bool:
    """Whether two functions compile to the same byte code, names and constants (docstrings aside; nested functions
    by their code, wherever they were compiled)."""
    a, b = getattr(unwrapped(a), "__code__", None), getattr(unwrapped(b), "__code__", None)
    return a is not None and b is not None and a.co_code == b.co_code and a.co_names == b.co_names \
        and a.co_varnames == b.co_varnames and _consts(a) == _consts(b)


def model_forward(module: nn.Module) -> Any:
    """The forward the module runs, below shardwise's mixins (strategies mix subclasses in above its class): a
    user's subclass that overrides forward is compared, not the transformers class beneath it. Its signature names
    the model's arguments, where a wrapper's forward takes ``*args, **kwargs``."""
    for cls in type(module).__mro__:
        forward = vars(cls).get("forward")
        if forward is not None and not cls.__module__.startswith("shardwise.") \
                and not getattr(forward, "_sw_mixin_forward", False):
            return forward
    return None


def computes_router_loss(module: nn.Module) -> bool:
    """Whether `module` is a HuggingFace MoE model that returns a load-balancing loss (``aux_loss``) when its router
    logits are on: its config has ``output_router_logits`` and a forward of its class or a base class (a script's
    subclass calling its transformers forward included) names ``aux_loss``. A causal LM does; the base model, which
    returns the router logits only, does not."""
    if not hasattr(getattr(module, "config", None), "output_router_logits"):
        return False
    for cls in type(module).__mro__:
        code = getattr(unwrapped(vars(cls).get("forward")), "__code__", None)
        if code is not None and not cls.__module__.startswith("shardwise.") \
                and "aux_loss" in code.co_varnames + code.co_names:
            return True
    return False


def _template(module: nn.Module) -> str | None:
    """"mixtral", "gpt_oss" or "llama4" when the module's eager forward is that template's byte code, else None."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    forward = model_forward(module)
    for name, cls in (("mixtral", MixtralExperts), ("gpt_oss", GptOssExperts), ("llama4", Llama4TextExperts)):
        if same_code(forward, vars(cls)["forward"]):
            return name
    return None


def fused_difference(module: nn.Module) -> str | None:
    """None when `module` computes one of the two fused templates (module docstring); else what differs, in words.

    Mixtral's: ``act(gate) * up`` of ``x W_gu[e]^T`` chunked in halves, then ``W_d[e]^T``, no biases, Mixtral's flags
    and the default gate. GPT-OSS's: ``x W_gu[e] + b_gu[e]`` (weights stored transposed, (E, d, 2 f)), the class's own
    ``_apply_gate`` (GPT-OSS's interleaved, clamped SwiGLU; applied row by row, as the template applies it), then
    ``W_d[e] + b_d[e]``."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    params = dict(module.named_parameters())  # the activation is a child module without parameters
    E = getattr(module, "num_experts", None)
    template = _template(module)
    if template is None:
        return "its eager forward is neither Mixtral's, GPT-OSS's nor Llama 4's"
    names = _TEMPLATE_PARAMETERS[template]
    if sorted(params) != sorted(names) or not isinstance(E, int):
        return (f"its parameters are {sorted(params)}, not the {template} template's {sorted(names)} "
                f"(num_experts={E!r})")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    transposed = template in ("gpt_oss", "llama4")
    d, f2 = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    want_down = (E, f2 // 2, d) if transposed else (E, d, f2 // 2)
    if gate_up.dim() != 3 or gate_up.shape[0] != E or f2 % 2 or tuple(down.shape) != want_down \
            or any(tuple(params[b].shape) != (E, params[w].shape[-1 if transposed else 1])
                   for b, w in (("gate_up_proj_bias", "gate_up_proj"), ("down_proj_bias", "down_proj")) if b in params):
        return (f"its parameters' shapes {({k: tuple(v.shape) for k, v in params.items()})} do not fit the {template} "
                f"template with E={E}")
    want_flags = _TEMPLATE_FLAGS[template]
    flags = {k: getattr(module, k, v) for k, v in want_flags.items()}
    if flags != want_flags:
        differ = [k for k, v in flags.items() if v != want_flags[k]]
        return (", ".join(f"{k}={flags[k]}" for k in differ) + f" (the {template} template's: "
                + ", ".join(f"{k}={want_flags[k]}" for k in differ) + ")")
    gate, default_gate = getattr(type(module), "_apply_gate", None), getattr(MixtralExperts, "_apply_gate", None)
    if template == "mixtral" and gate is not default_gate:  # eager ignores it, the fused kernels apply it
        return "its _apply_gate is its own, not act(gate) * up"
    return None


def llama4_block_difference(block: nn.Module | None) -> str | None:
    """None when `block` (the parent of Llama 4's experts) runs Llama 4's MoE forward with Llama 4's router (byte
    code): the dense sum over experts of ``experts(x * score)`` beside the shared expert, the scores the sigmoid of
    the top-k router logits, 0 elsewhere; else what differs, in words."""
    from transformers.models.llama4.modeling_llama4 import Llama4Router, Llama4TextMoe

    if block is None or not same_code(model_forward(block), vars(Llama4TextMoe)["forward"]):
        return "its MoE block's forward is not Llama4TextMoe's"
    router = getattr(block, "router", None)
    if not isinstance(router, nn.Linear) or not same_code(model_forward(router), vars(Llama4Router)["forward"]):
        return "its MoE block's router is not Llama4Router's"
    return None


def fused_template(module: nn.Module) -> str:
    """"mixtral", "gpt_oss" or "llama4": the template of an experts module `fused_difference` accepted."""
    template = _template(module)
    assert template is not None, "fused_template of an experts module fused_difference did not accept"
    return template


def global_aux_model(module: nn.Module) -> bool:
    """Whether `module` adds Mixtral's load-balancing loss exactly as MixtralForCausalLM does (module docstring)."""
    if is_one_of(module, GLOBAL_AUX):
        return True
    if not all(hasattr(module, a) for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")):
        return False
    from transformers.models.mixtral import modeling_mixtral

    forward = model_forward(module)
    if not any(same_code(forward, template) for template in _loss_forwards(modeling_mixtral)):
        return False
    here = sys.modules.get(forward.__module__)
    return same_code(getattr(here, "load_balancing_loss_func", None), modeling_mixtral.load_balancing_loss_func)


def _loss_forwards(modeling_mixtral: Any) -> list[Any]:
    """The causal-LM forwards that add ``router_aux_loss_coef x load_balancing_loss_func(router_logits, num_experts,
    num_experts_per_tok, attention_mask)`` to the loss exactly as Mixtral's does: Mixtral's, and Granite-MoE's (the
    same, on logits divided by ``config.logits_scaling``; read for transformers 5)."""
    forwards = [vars(modeling_mixtral.MixtralForCausalLM)["forward"]]
    try:
        from transformers.models.granitemoe import modeling_granitemoe
    except ImportError:  # a transformers without Granite-MoE
        return forwards
    return forwards + [vars(modeling_granitemoe.GraniteMoeForCausalLM)["forward"]]
