"""Expert parallelism for HuggingFace mixture-of-experts models: recognising their MoE blocks and splitting them.

`expert_parallel(model, ep, ...)` (parallel.py) hands a HuggingFace model here when it finds one of these experts
modules (transformers 5.x):

* fused experts, ``MixtralExperts`` (``MixtralForCausalLM``) and every experts module that computes what it does
  (hf_kinds.py: Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, Granite-MoE, Phi-MoE ...; GPT-OSS's and Llama 4's,
  stored transposed; Llama 4's block is replaced too, hf_experts.Llama4MoeParallel): ``gate_up_proj``
  (E, 2 f, d) and ``down_proj`` (E, d, f) Parameters. Each rank of `ep` keeps rows ``[p E/ep, (p+1) E/ep)`` of
  both as ShardedParameters answering for (E, ...), declared like shardwise's own MoE layer: boxes along dim 0 over
  `ep`, replicated over `edp`;
* experts as modules, ``SwitchTransformersExperts`` (``SwitchTransformersForConditionalGeneration``): a ModuleDict
  of ``expert_<i>`` MLPs. Expert i belongs to ep rank ``i // (E / ep)``, which keeps its module unchanged; on every
  other rank each of its weights becomes an *empty* ShardedParameter answering for the weight's shape. The layout
  declares each expert weight as split over `ep` into one whole box (its owner's) and empty boxes (the others'),
  replicated over `edp`: `sw.full_state_dict` gathers it from its owner, `sw.clip_grad_norm_` counts it once (the
  empty pieces add nothing), checkpoints save and load it on its owner only, and DDP averages it over `edp`
  (`replica_groups.data_parallel_group`), exactly as for a fused slice. Every rank keeps the same parameter names and shapes
  (`model.parameters()` looks like the model), and memory for the other ranks' experts is not held.

The blocks' routers stay HuggingFace's code (hf_experts.py runs the dispatch). Gradients: x 1 / ep on every expert
weight of this rank (slices.py), averaged over `edp` by `sw.DDP` over dp (sharded over edp by `sw.ZeRO` / `sw.FSDP`:
sharding/expert_units.py). Losses: Mixtral's load-balancing loss is a product of batch means, made the global
batch's by `GlobalRouterLoss` (hf_aux.py) when the batch is split (also for models whose forward is Mixtral's:
hf_kinds.py); Switch's auxiliary and z losses are means over sequences (its f and P are per sequence), so equal
per-rank batches already average to one process's.

Refused at wrap time (ValueError naming the value): E not divisible by ep, a router with jitter noise (each rank
would draw its own), ``capacity_factor`` (these routers apply their own capacity), a model already wrapped by any
strategy but tensor or context parallel (which `sw.parallelize` applies first), a model mixing shardwise's MoE
layers with HuggingFace's, a HuggingFace experts module that computes something else (named with what differs),
and a load-balancing loss (``router_aux_loss_coef > 0``) that this module cannot make the global batch's while
``output_router_logits`` is on (hf_aux.refuse_local_router_losses; a call that turns it on later raises).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .. import layout
from .._mixin import mix_in
from ..agreement import check_agreement, describe_parameters, fingerprints
from ..hf_save import from_transformers
from ..comm.base import Communicator
from ..models.moe import MoE
from ..optimizer_guard import mark_replaced, register_wrapped
from ..param_hooks import hook_even_if_frozen
from ..placement import to_comm_device
from ..whole.state_dict import load_full_into_pieces
from .hf_aux import refuse_local_router_losses, share_router_losses
from .hf_experts import FusedExpertsParallel, Llama4MoeParallel, ModuleExpertsParallel
from .hf_kinds import MODULE_EXPERTS, fused_difference, fused_template, is_one_of, llama4_block_difference
from .layer import ExpertGroups
from .slices import expert_piece, scale_gradient

__all__ = ["expert_parallel_hf", "hf_expert_layers"]

WHO = "expert_parallel"
#: Strategies expert parallel may come after (sw.parallelize's order: tp, cp, ep, ..., dp): they leave the experts
#: modules whole (tensor parallel keeps a MoE block whole on every tp rank, as the GPT plan does).
BENEATH = ("tensor_parallel", "context_parallel")


def hf_expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, experts module) of every HuggingFace MoE block of `model` that expert_parallel supports; [] for a model
    without any. ValueError for a HuggingFace experts module of another class (named, with the supported ones)."""
    found = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        cls = type(module).__name__
        if is_one_of(module, MODULE_EXPERTS):
            found.append((name, module))
        elif from_transformers(module) and cls.endswith("Experts"):
            why = fused_difference(module) if hasattr(module, "num_experts") else "it has no num_experts"
            if why is None and fused_template(module) == "llama4":
                why = llama4_block_difference(modules.get(name.rpartition(".")[0]))
            if why is not None:
                raise ValueError(f"{WHO}: {name!r} is a HuggingFace {cls}, a mixture-of-experts layer expert_parallel "
                                 f"does not support: {why}; supported: fused experts that compute Mixtral's "
                                 f"(MixtralExperts, Qwen2/3-MoE, OLMoE, DeepSeek-V3 ...), GPT-OSS's or Llama 4's "
                                 f"(with Llama 4's MoE block) and per-expert modules "
                                 f"{list(MODULE_EXPERTS)} (Switch Transformers)")
            found.append((name, module))
    return found


def _refuse(model: nn.Module, layers: list[tuple[str, nn.Module]], ep: Communicator, dp: Communicator,
            capacity_factor: float | None) -> None:
    """The wrap-time checks of the module docstring (local and symmetric: every rank raises alike)."""
    if capacity_factor is not None:
        raise ValueError(f"{WHO}: capacity_factor={capacity_factor!r} applies to shardwise's MoE layer; a HuggingFace "
                         f"router applies its own capacity (Switch: config.expert_capacity, per sequence): pass "
                         f"capacity_factor=None")
    if any(s.name not in BENEATH for s in layout.strategies(model)):
        applied = " + ".join(s.name for s in layout.strategies(model))
        raise ValueError(f"{WHO}: the model is already wrapped ({applied}); apply expert parallel to the plain (or "
                         f"tensor / context parallel) HuggingFace model first, then sw.DDP over the data-parallel "
                         f"group")
    if any(isinstance(m, MoE) for m in model.modules()):
        raise ValueError(f"{WHO}: the model mixes shardwise MoE layers with HuggingFace experts modules; expert "
                         f"parallel splits one kind per model")
    for name, module in layers:
        if module.num_experts % ep.size:
            raise ValueError(f"{WHO}: MoE layer {name!r} has n_experts={module.num_experts}, which ep={ep.size} does "
                             f"not divide; n_experts must be a multiple of ep")
    for name, module in model.named_modules():
        noise = getattr(module, "jitter_noise", 0.0)
        if isinstance(noise, (int, float)) and noise > 0:
            raise ValueError(f"{WHO}: {name!r} has router jitter noise {noise} (config.router_jitter_noise): each rank "
                             f"would draw its own noise and no layout reproduces one process; set it to 0")
    refuse_local_router_losses(model, dp, WHO)


def _split_fused(module: nn.Module, prefix: str, ep: Communicator) -> tuple[list[nn.Parameter], dict[int, tuple]]:
    """This rank's slices of ``gate_up_proj`` / ``down_proj``; (replaced parameters, id(new) -> boxes by rank)."""
    per_rank = module.num_experts // ep.size
    lo, replaced, boxes = ep.rank * per_rank, [], {}
    for attr, old in list(module.named_parameters(recurse=False)):  # weights and GPT-OSS's biases: (E, ...)
        with torch.no_grad():
            piece = old.detach()[lo:lo + per_rank].clone()
        new = expert_piece(old, piece, f"{prefix}.{attr}", ep, WHO)
        setattr(module, attr, new)
        replaced.append(old)
        rest = tuple((0, n) for n in old.shape[1:])
        boxes[id(new)] = tuple((((r * per_rank, per_rank), *rest),) for r in range(ep.size))
    return replaced, boxes


def _split_modules(module: nn.Module, prefix: str, ep: Communicator) -> tuple[list[nn.Parameter], dict[int, tuple]]:
    """Expert modules: this rank's stay whole (x 1 / ep on their gradients); the others' weights become empty
    pieces. (replaced parameters, id(parameter) -> boxes by rank: the owner's whole box, empty boxes elsewhere)."""
    per_rank = module.num_experts // ep.size
    replaced, boxes = [], {}
    for e in range(module.num_experts):
        owner, expert = e // per_rank, module[f"expert_{e}"]
        for sub_name, sub in expert.named_modules():
            for attr, old in list(sub.named_parameters(recurse=False)):
                name = ".".join(p for p in (prefix, f"expert_{e}", sub_name, attr) if p)
                whole = tuple((0, n) for n in old.shape)
                empty = ((0, 0), *whole[1:])
                if owner == ep.rank:
                    hook_even_if_frozen(old, "register_hook", scale_gradient(1.0 / ep.size))
                    new = old
                else:
                    new = expert_piece(old, old.detach()[:0].clone(), name, ep, WHO)
                    setattr(sub, attr, new)
                    replaced.append(old)
                boxes[id(new)] = tuple(((whole if r == owner else empty),) for r in range(ep.size))
    return replaced, boxes


def _placements(model: nn.Module, boxes: dict[int, tuple], ep: Communicator, edp: Communicator,
                new_of: dict[int, nn.Parameter]) -> dict[str, layout.Placement]:
    out = {}
    for name, pl in layout.placements(model).items():
        # A record made before the split (tensor parallel's) still names the whole tensor: follow it to the piece.
        param = new_of.get(id(pl.param), pl.param)
        by_rank = boxes.get(id(param))
        if by_rank is None:
            out[name] = pl
            continue
        out[name] = dataclasses.replace(pl, param=param, boxes=by_rank[ep.rank], box_group=ep, boxes_by_rank=by_rank,
                                        concat_dim=0,
                                        replicated_over=(*pl.replicated_over, *((edp,) if edp.size > 1 else ())))
    return out


def expert_parallel_hf(model: nn.Module, layers: list[tuple[str, nn.Module]], ep: Communicator, dp: Communicator,
                       edp: Communicator | None, capacity_factor: Any) -> nn.Module:
    """`expert_parallel` for a HuggingFace model whose experts modules are `layers` (module docstring); the groups
    were checked by the caller. In place; returns the model."""
    if any(p.ndim == 0 for _, m in layers for p in m.parameters()):
        raise ValueError(f"{WHO}: an experts module holds a 0-d parameter, which cannot be placed per expert")
    _refuse(model, layers, ep, dp, capacity_factor)
    check_agreement(dp, WHO, {"parameters": describe_parameters(model), "fingerprints": fingerprints(model),
                              "ep": ep.size, "hf": [type(m).__name__ for _, m in layers]})
    if edp is None:
        edp = dp.split(ep.rank, dp.rank)  # the ranks of dp at this ep coordinate (collective)
    to_comm_device(model, ep, WHO)
    groups = ExpertGroups(ep, dp, edp)
    replaced, boxes = [], {}
    whole = {id(p): (module, name) for _, module in layers for name, p in module.named_parameters()}
    if ep.size > 1:  # with ep = 1 HuggingFace's own experts forward is one process's
        for name, module in layers:
            fused = not is_one_of(module, MODULE_EXPERTS)
            more, placed = (_split_fused if fused else _split_modules)(module, name, ep)
            replaced += more
            boxes.update(placed)
            mix_in(module, FusedExpertsParallel if fused else ModuleExpertsParallel, "ExpertParallel")
            module._sw_ep = groups
            if fused:
                module._sw_template = fused_template(module)
            if fused and module._sw_template == "llama4":  # its block hands it every token: the block dispatches
                mix_in(model.get_submodule(name.rpartition(".")[0]), Llama4MoeParallel, "ExpertParallel")
    new_of = {key: module.get_parameter(name) for key, (module, name) in whole.items()}
    share_router_losses(model, dp, WHO)  # the model itself, or a model inside the user's
    mark_replaced(replaced, WHO)
    layout.declare(model, layout.Parallelized(
        WHO, (dp,), _placements(model, boxes, ep, edp, new_of), world=dp,
        options={"ep": ep.size, "edp": edp.size, "dp": dp.size, "capacity_factor": None,
                 "experts": sorted({type(m).__name__ for _, m in layers})}))
    register_wrapped(model)
    load_full_into_pieces(model)  # torch's load_state_dict of a one-process state dict: each rank's experts
    return model
