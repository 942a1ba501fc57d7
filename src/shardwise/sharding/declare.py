"""What the sharding engine tells the layout contract: each parameter's flat range, groups and held buffers.

A unit flattens its (possibly tensor-parallel) parameters into one buffer split evenly over the shard group, so a
parameter at offset `o` with `n` elements is held by group rank r as elements [max(r s, o), min((r+1) s, o + n))
minus `o` of its own flattening (s = the shard size). That range refines the placement the model had before
sharding (whole tensors, or tensor-parallel boxes); hybrid and no_shard add the replicate group. A piece stops being
replicated over the group its unit is sharded over: an expert slice, replicated over the expert-data-parallel group
before, is sharded over it now (expert_units.py).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import layout
from ..sharded_tensor import ShardSpec, set_spec
from ..comm.base import Communicator
from .engine import ShardingEngine

__all__ = ["sharded_placements", "engine_memory"]

_STRATEGY_NAMES = {"zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "full_shard": "FSDP full_shard",
                   "shard_grad_op": "FSDP shard_grad_op", "no_shard": "FSDP no_shard",
                   "hybrid_shard": "FSDP hybrid_shard"}


def sharded_placements(engine: ShardingEngine, before: dict[str, layout.Placement]) -> dict[str, layout.Placement]:
    """The placements after sharding, by canonical name in `before`'s order: each shard parameter with its flat
    range. `before` is keyed by the wrapped module's own parameter names (what the units record)."""
    replicate: Communicator | None = engine.replicate_comm
    refined: dict[str, layout.Placement] = {}
    for unit in engine.units:
        group = unit.shard_comm
        for info in unit.infos:
            pl = before[info.name]
            # The piece answers for the ORIGINAL tensor (its name, its shape before tensor parallel split it too).
            if not unit.whole_pieces:
                what = _STRATEGY_NAMES.get(engine.config.name, engine.config.name)
                set_spec(info.shard_param, ShardSpec(torch.Size(pl.shape), pl.name, what, flat=True))
            refined[pl.name] = dataclasses.replace(
                pl, param=info.shard_param, flat=(info.shard_lo, info.shard_hi), flat_group=group,
                flat_by_rank=tuple(unit.piece_of(info.offset, info.numel, r) for r in range(group.size)),
                replicated_over=_replicas(pl.replicated_over, group, unit.replicate_comm))
    group = engine.shard_comm
    around = tuple(g for g in (group, replicate) if g is not None and g.size > 1)
    for pl in before.values():
        if pl.name not in refined:  # a replicated parameter: whole on every rank of the data-parallel groups
            refined[pl.name] = dataclasses.replace(pl, replicated_over=(*pl.replicated_over, *around))
    return {pl.name: refined[pl.name] for pl in before.values()}


def _ranks(group: Communicator) -> tuple[int, ...]:
    return tuple(group.global_ranks)


def _replicas(before: tuple[Communicator, ...], shard: Communicator,
              replicate: Communicator | None) -> tuple[Communicator, ...]:
    """The groups a unit's piece is replicated over: those of the placement before, less the group the unit shards
    it over, plus the unit's replicate group (each group once)."""
    out = tuple(g for g in before if shard.size == 1 or _ranks(g) != _ranks(shard))
    if replicate is not None and replicate.size > 1 and all(_ranks(g) != _ranks(replicate) for g in out):
        out += (replicate,)
    return out


def engine_memory(engine: ShardingEngine) -> layout.MemoryView:
    """Master shards (views of the full buffer in fp32 stage 1/2), kept full buffers, compute shards and flat gradient
    buffers; what CPU offload keeps on the host."""
    return layout.MemoryView(
        params=tuple(u.master for u in engine.units) + tuple(u.full for u in engine.units if u.keep_full)
        + tuple(u.compute_shard for u in engine.units if u.compute_shard is not None),
        grads=tuple(u.grad_buffer for u in engine.units if u.grad_buffer is not None),
        gathered_peak=engine.gathered_peak, gathered_now=engine.memory.live,
        grad_buffer_peak=engine.grad_memory.peak,
        host=tuple(u.master for u in engine.units if u.offload != "none"),
        host_params=tuple(info.shard_param for u in engine.units if u.offload != "none" for info in u.infos))
