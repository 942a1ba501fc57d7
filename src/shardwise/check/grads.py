"""Full gradients by original name, gathered through the layout as `full_state_dict` gathers parameters.

Each parameter's `.grad` lives where its placement says (a ZeRO flat range, a tensor-parallel box, a whole replica),
so `gather_full(pl, grad)` rebuilds the dense gradient (here `iter_gathered`: all of them, coalesced). A gather is
collective, and a strategy may leave `.grad` None on some ranks and set it on others (the very bug a check hunts),
so the ranks first agree: one all-reduce over the model's groups (`layout.reduction_groups`, the same order on every
rank) of three counts per placement: pieces with elements and a gradient, pieces with elements and none, and pieces
with any gradient (an empty ZeRO shard holds no elements either way). Then every rank gathers the same placements,
substituting zeros for a missing gradient, and names the placements whose ranks disagreed. Pipeline stages hold
different parameters: the counts are agreed within a stage (over every group but the pipeline's), and the stages then
exchange their dense gradients and their lists of disagreeing names (`exchange_partitions`, as `full_state_dict`
exchanges parameters), so every rank returns the whole model's.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator, ReduceOp
from ..placement import comm_device
from ..whole.gather import iter_gathered
from ..whole.state_dict import exchange_partitions, partition_groups
from .pipelines import whole_names

__all__ = ["full_gradients", "data_parallel_group"]


def full_gradients(model: nn.Module) -> tuple[dict[str, torch.Tensor | None], tuple[str, ...]]:
    """({canonical name: the dense gradient on CPU, or None when no rank holds one}, the names whose gradient was
    None on some ranks and a tensor on others). Collective over the model's groups."""
    pls = list(layout.placements(model).values())
    counts = [[float(pl.param.grad is not None and pl.param.numel() > 0),
               float(pl.param.grad is None and pl.param.numel() > 0),
               float(pl.param.grad is not None)] for pl in pls]
    flags = torch.tensor(counts, dtype=torch.float64).reshape(len(pls), 3)
    stages = partition_groups(model)
    for group in layout.reduction_groups(model):
        if any(group.global_ranks == stage.global_ranks for stage in stages):
            continue  # the other stages hold other parameters: nothing to agree on
        flags = flags.to(comm_device(group))
        group.all_reduce(flags, ReduceOp.SUM)
    out: dict[str, torch.Tensor | None] = {}
    split = []
    wanted = []
    for pl, (held, missing, anywhere) in zip(pls, flags.cpu().tolist()):
        out[pl.name] = None
        if held == 0 and (missing > 0 or anywhere == 0):
            continue
        if held > 0 and missing > 0:
            split.append(pl.name)
        wanted.append((pl, pl.param.grad if pl.param.grad is not None else torch.zeros_like(pl.param)))
    for (pl, _), full in zip(wanted, iter_gathered(wanted)):
        out[pl.name] = full.detach().cpu().clone()
    if not stages:
        return out, tuple(split)
    held = exchange_partitions(model, {name: grad for name, grad in out.items() if grad is not None})
    return {name: held.get(name) for name in whole_names(model, list(out))}, tuple(whole_names(model, split))


def data_parallel_group(model: nn.Module) -> Communicator | None:
    """The communicator of the outermost data-parallel strategy (DDP, ZeRO, FSDP), whose ranks feed different slices
    of the global batch; None when no data-parallel strategy is applied (every rank feeds the whole batch)."""
    for record in reversed(layout.strategies(model)):
        if record.name.split(":")[0] in layout.DATA_PARALLEL:
            return record.world
    return None
