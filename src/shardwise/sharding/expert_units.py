"""Expert-parallel parameters under ZeRO / FSDP: a second family of units, sharded over the expert-data-parallel group.

An expert-parallel model (shardwise.experts) holds, on each rank of the data-parallel group `comm`, only the experts
of its expert-parallel rank: rank p of ep keeps experts [p E/ep, (p + 1) E/ep) of every MoE layer, and the ranks of
`comm` holding the same experts form the expert-data-parallel group edp (size |comm| / ep): Megatron-core's expert
data parallel group, torchtitan's "dp_shard_mod_ep", DeepSpeed-MoE's expert data parallelism (Rajbhandari et al.
2022, arXiv 2201.05596). The placements say so (`replica_groups.data_parallel_group`): such a parameter is split over ranks
of `comm` and replicated over edp inside it.

Flattening those slices into a unit sharded over `comm` would mix different experts in one buffer: the all-gather
would assemble other ranks' experts, the reduce-scatter would average gradients of different experts. So each unit
the wrap policy makes is split in two (`split_plan`): its dense parameters, sharded over `comm` as usual, and its
expert slices, a second unit over the same modules whose flat buffer is split over edp (ZeRO's partitioning,
Rajbhandari et al. 2020, applied inside each replica group of the experts):

* parameters: gathered over edp when the unit's modules run (an all-gather of this rank's experts' edp shards),
  freed with the dense unit (ZeRO-3), kept (ZeRO-1/2);
* gradients: the expert-parallel hook has already multiplied the slice's gradient by 1/ep (it sums the
  contributions of every ep rank's tokens, brought back by the backward all-to-all); the reduce-scatter averages
  over edp. Together that is the mean over `comm` of the ranks' per-batch gradients, as for a dense parameter;
* optimizer state: it follows the master shards, so it is sharded over edp: a rank holds 1/|comm| of each expert
  tensor (E/ep experts, then 1/edp of their flattening), as it holds 1/|comm| of a dense one.

The placements then read: boxes over ep (which experts), a flat range over edp, replicated over nothing; so full
state dicts, clipping (each element counted once: ep x edp ranks = `comm`), replica checks and checkpoints (any
layout onto any other) see the (E, ...) tensors. FSDP's no_shard keeps the slices whole and all-reduces them over
edp (a shard group of one, edp as the replicate group); hybrid_shard, whose shard and replicate groups cut across
edp, is refused, as is gradient compression (the compressors reduce over one group per unit).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .. import layout
from ..comm.base import Communicator
from ..replica_groups import data_parallel_group
from .policy import UnitPlan

__all__ = ["ExpertFamily", "NO_EXPERTS", "expert_family", "split_plan"]


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertFamily:
    """The parameters of a data-parallel group split over ranks of it, and the groups of their units.

    params: the expert slices (empty for a dense model).
    shard: the group their units' flat buffers are split over (edp; a group of one when no other rank holds the same
        experts, or under no_shard).
    replicate: the group their reduced shards are then averaged over (no_shard: edp), or None.
    replicas: the ranks holding the same experts (edp), or None: what the wrap broadcasts their values over.
    """

    params: frozenset[nn.Parameter]
    shard: Communicator | None = None
    replicate: Communicator | None = None
    replicas: Communicator | None = None


NO_EXPERTS = ExpertFamily(frozenset())


def expert_family(module: nn.Module, comm: Communicator, shard: Communicator, who: str,
                  compression: object = None) -> ExpertFamily:
    """The expert slices of `module` relative to the data-parallel group `comm` and the groups their units use, given
    the dense units' shard group `shard` (`comm` itself, or a group of one under no_shard).

    Collective over `comm` when the slices have no replica inside it (ep == |comm|): a group of one is split off.
    ValueError naming the parameter when the groups do not tile `comm`, or for a configuration that cannot shard
    experts (hybrid_shard, compression)."""
    groups: dict[nn.Parameter, Communicator | None] = {}
    for pl in layout.placements(module).values():
        try:
            group = data_parallel_group(pl, comm)
        except ValueError as e:
            raise ValueError(f"{who}: {e}") from None
        if group is not comm:
            groups[pl.param] = group
    if not groups:
        return NO_EXPERTS
    name = next(pl.name for pl in layout.placements(module).values() if pl.param in groups)
    kinds = {None if g is None else tuple(g.global_ranks) for g in groups.values()}
    if len(kinds) > 1:
        raise ValueError(f"{who}: the expert-parallel parameters are replicated over different groups of the "
                         f"data-parallel ranks ({sorted(kinds, key=str)}); one expert-data-parallel group is supported")
    if compression is not None:
        raise ValueError(f"{who}: compression={compression!r} with expert-parallel parameters ({name!r}, split over "
                         f"ranks of the data-parallel group) is not supported: they reduce over their own group, "
                         f"which the compressors do not cover; use compression=None")
    if shard is not comm and shard.size > 1:
        raise ValueError(f"{who}: parameter {name!r} is split over ranks of the data-parallel group (expert "
                         f"parallel); hybrid_shard's shard groups ({shard.size} ranks) cut across its replica group; "
                         f"use sharding='full_shard', 'shard_grad_op' or 'no_shard' (or sw.ZeRO)")
    edp = next(iter(groups.values()))
    if shard is not comm:  # no_shard: whole on every rank, averaged over the ranks holding the same experts
        return ExpertFamily(frozenset(groups), shard, edp, edp)
    return ExpertFamily(frozenset(groups), edp if edp is not None else comm.split(comm.rank), None, edp)


def split_plan(plan: UnitPlan, experts: frozenset[nn.Parameter]) -> tuple[UnitPlan | None, UnitPlan | None]:
    """The plan's dense parameters and its expert slices, as two plans over the same modules (either may be None;
    the root plan always keeps a dense part, possibly empty: the engine hangs the root hooks on it)."""
    mine = [p for p in plan.params if p in experts]
    if not mine:
        return plan, None
    rest = [p for p in plan.params if p not in experts]
    dense = dataclasses.replace(plan, params=rest, locations={p: plan.locations[p] for p in rest}) \
        if rest or plan.is_root else None
    expert = UnitPlan(f"{plan.name} (experts)", plan.modules, mine, {p: plan.locations[p] for p in mine},
                      is_root=plan.is_root)
    return dense, expert
