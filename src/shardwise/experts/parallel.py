"""`expert_parallel(model, ep, ...)`: split the experts of every MoE layer over an expert-parallel group.

What it does to the model (in place; every rank of the data-parallel group calls it on the same dense model):

* each MoE layer's fused expert tensors (``w_in``, ``b_in``, ``w_out``, ``b_out``, all (E, ...)) keep only this
  rank's E / ep experts, rows ``[p E/ep, (p + 1) E/ep)`` for expert-parallel rank p, as ShardedParameters answering
  for the (E, ...) tensor, like tensor-parallel slices (sharded_tensor.py); the router and everything else stay
  whole;
* the layer's forward sends its tokens to their experts' ranks and back (layer.py) and sums the load-balancing
  statistics over the data-parallel group, so the auxiliary loss is the global batch's;
* the layout contract gets the experts' placements: boxes along dim 0 over `ep`, replicated over `edp`, so
  `sw.full_state_dict`, `sw.clip_grad_norm_`, `sw.check_replicas` and checkpoints see the (E, ...) tensors.

Gradients. ep borrows its ranks from data parallel (Megatron-core, torchtitan; DeepSpeed-MoE, Rajbhandari et al.
2022, arXiv 2201.05596): the dp ranks each hold a different part of the global batch and each computes the mean
loss of its part; one process's loss is the mean of those. A dense parameter's gradient is therefore the mean over
dp of the ranks' gradients: `sw.DDP(model, dp)` afterwards, as usual. An expert's gradient on its rank already sums
the contributions of the tokens of every rank of its ep group (the backward all-to-all brought them); the rest of
the batch is on the other ep groups, whose copies of this expert sit on the ranks of `edp`. So each expert gradient
is multiplied by 1 / ep (a gradient hook on the slice), and averaged over `edp` only: DDP over dp sees from the
placements that these parameters are split over ranks of its own group and reduces them over the replica group
they declare inside it (`replica_groups.data_parallel_group`), or not at all when ep == dp. `sw.ZeRO` (stages 1-3) and
`sw.FSDP` (full_shard, shard_grad_op, no_shard) over dp read the same: dense parameters sharded over dp, expert slices
in units of their own sharded over edp, optimizer state with them (sharding/expert_units.py); hybrid_shard is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from .. import layout
from ..agreement import check_agreement, describe_parameters, fingerprints
from ..comm.base import Communicator, is_communicator
from ..compiled import refuse_compiled
from ..mesh import Mesh
from ..models.moe import MoE
from ..optimizer_guard import mark_replaced, register_wrapped
from ..placement import to_comm_device
from ..whole.state_dict import load_full_into_pieces
from .hf import expert_parallel_hf, hf_expert_layers
from .layer import ExpertGroups, ExpertParallelLayer
from .slices import expert_piece
from .._mixin import mix_in

__all__ = ["expert_parallel", "EXPERT_TENSORS"]

WHO = "expert_parallel"
#: The fused per-expert tensors of a MoE layer, split along dim 0 (the expert index).
EXPERT_TENSORS = ("w_in", "b_in", "w_out", "b_out")


def _groups(ep: Any, dp: Any, edp: Any) -> tuple[Communicator, Communicator, Communicator | None]:
    if isinstance(ep, Mesh):
        if dp is not None or edp is not None:
            raise ValueError(f"{WHO}: given a Mesh, dp and edp come from it (mesh.dp_cp, mesh.edp); pass dp=None, "
                             f"edp=None")
        return ep.ep, ep.dp_cp, ep.edp
    for name, value in (("ep", ep), ("dp", dp), ("edp", edp)):
        if value is not None and not is_communicator(value):
            raise ValueError(f"{WHO}: {name} must be a shardwise Communicator (e.g. mesh.{name}) or None, got "
                             f"{type(value).__name__}")
    if ep is None:
        raise ValueError(f"{WHO}: ep must be a Communicator (e.g. mesh.ep) or a Mesh, got None")
    return ep, (ep if dp is None else dp), edp


def _check_groups(ep: Communicator, dp: Communicator, edp: Communicator | None) -> None:
    """Local, symmetric checks (every rank of a consistent layout computes the same answer)."""
    ep_ranks, dp_ranks = set(ep.global_ranks), set(dp.global_ranks)
    if not ep_ranks <= dp_ranks or dp.size % ep.size:
        raise ValueError(f"{WHO}: the ep group (world ranks {sorted(ep_ranks)}) must be made of ranks of the dp group "
                         f"(world ranks {sorted(dp_ranks)}) and its size ep={ep.size} must divide dp={dp.size}: expert "
                         f"parallel borrows its ranks from data parallel (sw.Mesh(comm, ep=...) builds both)")
    if edp is not None:
        edp_ranks = set(edp.global_ranks)
        if not edp_ranks <= dp_ranks or edp.size * ep.size != dp.size or len(edp_ranks & ep_ranks) != 1:
            raise ValueError(f"{WHO}: edp (world ranks {sorted(edp_ranks)}) must be the ranks of dp (world ranks "
                             f"{sorted(dp_ranks)}) holding this rank's experts: size dp / ep = {dp.size // ep.size}, "
                             f"one rank of each ep group")


def _check_capacity(capacity_factor: Any) -> float | None:
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not capacity_factor > 0 or math.isinf(capacity_factor):
        raise ValueError(f"{WHO}: capacity_factor={capacity_factor!r} must be None (dropless) or a finite number > 0 "
                         f"(each expert takes at most ceil(capacity_factor x tokens x k / E) of a rank's assignments)")
    return float(capacity_factor)


def _moe_layers(model: nn.Module, ep: Communicator) -> list[tuple[str, MoE]]:
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers and ep.size > 1:
        raise ValueError(f"{WHO}: ep={ep.size} but the model ({type(model).__name__}) has no MoE layer expert "
                         f"parallel knows: nothing to split (shardwise's MoE: build the GPT with GPTConfig(n_experts=E, "
                         f"...); HuggingFace experts modules named ...Experts; or use ep=1)")
    for name, m in layers:
        if m.n_experts % ep.size:
            raise ValueError(f"{WHO}: MoE layer {name!r} has n_experts={m.n_experts}, which ep={ep.size} does not "
                             f"divide; n_experts must be a multiple of ep")
    return layers


def _split(layer: MoE, prefix: str, ep: Communicator) -> list[nn.Parameter]:
    """Keep this rank's experts of `layer`'s fused tensors (module docstring); return the replaced parameters."""
    per_rank = layer.n_experts // ep.size
    lo, replaced = ep.rank * per_rank, []
    for attr in EXPERT_TENSORS:
        old = getattr(layer, attr)
        if old is None:
            continue
        name = f"{prefix}.{attr}" if prefix else attr
        with torch.no_grad():
            piece = old.detach()[lo:lo + per_rank].clone()
        new = expert_piece(old, piece, name, ep, WHO)  # x 1 / ep and answering for (E, ...): slices.py
        setattr(layer, attr, new)
        replaced.append(old)
    return replaced


def _placements(model: nn.Module, layers: list[tuple[str, MoE]], ep: Communicator,
                edp: Communicator, new_of: dict[int, nn.Parameter]) -> dict[str, layout.Placement]:
    experts = {id(getattr(m, a)): m.n_experts // ep.size for _, m in layers for a in EXPERT_TENSORS
               if getattr(m, a) is not None}
    out = {}
    for name, pl in layout.placements(model).items():
        # A record made before the split (tensor parallel's) still names the whole tensor: follow it to the slice.
        param = new_of.get(id(pl.param), pl.param)
        rows = experts.get(id(param))
        if rows is None:
            out[name] = pl
            continue
        rest = tuple((0, n) for n in pl.shape[1:])
        boxes = tuple((((r * rows, rows), *rest),) for r in range(ep.size))
        out[name] = dataclasses.replace(pl, param=param, boxes=boxes[ep.rank], box_group=ep, boxes_by_rank=boxes,
                                        concat_dim=0,
                                        replicated_over=(*pl.replicated_over, *((edp,) if edp.size > 1 else ())))
    return out


def expert_parallel(model: nn.Module, ep: Communicator | Mesh, *, dp: Communicator | None = None,
                    edp: Communicator | None = None, capacity_factor: float | None = None) -> nn.Module:
    """Split the experts of every MoE layer of `model` over `ep` in place and return the model.

    model: the dense model (a GPT with ``n_experts > 0``, or a HuggingFace MoE model with Mixtral-like fused experts
        (Qwen2/3-MoE, OLMoE, DeepSeek-V3 ...) or Switch Transformers: hf.py), identical on every rank of `dp`, not
        yet wrapped by DDP.
    ep: the expert-parallel Communicator (``mesh.ep``), or a Mesh (then dp = ``mesh.dp_cp``, edp = ``mesh.edp``).
    dp: the group splitting the global batch, whose ranks ep borrows (``mesh.dp`` / ``mesh.dp_cp``); default `ep`
        (ep == dp: every rank of the batch group holds different experts).
    edp: the ranks of dp holding this rank's experts (``mesh.edp``); default: made by splitting dp (collective).
    capacity_factor: None (default) is dropless: the step equals one process's. A number drops, per rank and
        expert, the assignments beyond ceil(capacity_factor x tokens x k / E); each layer's ``stats["dropped"]``
        counts them.
    Then wrap with ``sw.DDP(model, dp)`` (dense gradients averaged over dp, experts over edp) or ``sw.ZeRO(model, dp,
    stage=...)`` (dense parameters sharded over dp, experts over edp), build the optimizer,
    and feed each dp rank its own part of the global batch. With ep of size 1 the experts stay whole and only the
    load-balancing statistics are summed over dp.
    Raises ValueError at wrap time: a model without MoE layer (ep > 1), n_experts not divisible by ep, groups that do
    not nest (ep inside dp, edp = dp / ep), a bad capacity_factor, a model already wrapped by a data-parallel or
    expert-parallel strategy, or ranks holding different models or options.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"{WHO}: model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_compiled(model, WHO)
    ep, dp, edp = _groups(ep, dp, edp)
    _check_groups(ep, dp, edp)
    capacity_factor = _check_capacity(capacity_factor)
    if layout.is_wrapped(model, *layout.DATA_PARALLEL, WHO):
        applied = " + ".join(s.name for s in layout.strategies(model))
        raise ValueError(f"{WHO}: the model is already wrapped ({applied}); apply expert parallel to the plain model "
                         f"first, then sw.DDP over the data-parallel group")
    hf_layers = hf_expert_layers(model)  # HuggingFace MoE blocks (Mixtral's fused experts, Switch's modules): hf.py
    if hf_layers:
        return expert_parallel_hf(model, hf_layers, ep, dp, edp, capacity_factor)
    layers = _moe_layers(model, ep)
    if not layers:
        return model
    check_agreement(dp, WHO, {"parameters": describe_parameters(model), "fingerprints": fingerprints(model),
                              "ep": ep.size, "capacity_factor": capacity_factor})
    if edp is None:
        edp = dp.split(ep.rank, dp.rank)
        _check_groups(ep, dp, edp)
    to_comm_device(model, ep, WHO)
    groups = ExpertGroups(ep, dp, edp)
    replaced = []
    whole = {id(getattr(m, a)): (m, a) for _, m in layers for a in EXPERT_TENSORS if getattr(m, a) is not None}
    for name, layer in layers:
        if ep.size > 1:
            replaced += _split(layer, name, ep)
        mix_in(layer, ExpertParallelLayer, "ExpertParallel")
        layer._ep = groups
        layer.set_batch_group(groups.dp)  # the balance statistics: over the ranks splitting the batch
        layer.capacity_factor = capacity_factor
    mark_replaced(replaced, WHO)
    new_of = {key: getattr(m, a) for key, (m, a) in whole.items()}
    placements = _placements(model, layers, ep, edp, new_of) if ep.size > 1 else layout.placements(model)
    layout.declare(model, layout.Parallelized(
        WHO, (dp,), placements, world=dp,
        options={"ep": ep.size, "edp": edp.size, "dp": dp.size, "capacity_factor": capacity_factor}))
    register_wrapped(model)
    load_full_into_pieces(model)  # torch's load_state_dict of a one-process state dict: each rank's experts
    return model
