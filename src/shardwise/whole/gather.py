"""Gather one parameter to its dense tensor from its placement, whatever strategies split it.

Two steps, innermost sharding last undone first: (1) the flat ranges of the ZeRO / FSDP shard group are
all-gathered into this rank's tensor-parallel slice; (2) the slices of the tensor-parallel group are all-gathered
and each rank's boxes are written into the dense tensor. Ranks may hold pieces of different sizes (a parameter
split unevenly by a sharding unit), so each all-gather pads to the largest piece and the placement's per-rank
ranges say which elements are real. Collective over the placement's groups, in placement order on every rank.
"""

from __future__ import annotations

import math

import torch

from .. import layout
from ..comm.base import Communicator
from ..placement import comm_device
from ..sharded_tensor import local as local_piece

__all__ = ["gather_full", "write_held"]


def _all_gather_padded(comm: Communicator, piece: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's 1-D `piece` (rank r's has sizes[r] elements), in rank order, on `piece`'s device.

    Gathered on the communicator's device: a CPU-offloaded shard travels through the GPU under NCCL."""
    width = max(sizes)
    device = comm_device(comm)
    padded = torch.zeros(width, dtype=piece.dtype, device=device)
    padded[: piece.numel()].copy_(piece)
    out = torch.empty(width * comm.size, dtype=piece.dtype, device=device)
    comm.all_gather(out, padded)
    out = out.to(piece.device)
    return [out[r * width : r * width + n] for r, n in enumerate(sizes)]


def _local_slice(pl: layout.Placement, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's whole tensor-parallel slice of `tensor` (default `pl.param`), flattened: the shard group's flat
    ranges gathered."""
    mine = local_piece(pl.param if tensor is None else tensor).detach().reshape(-1)
    group = pl.flat_group
    if group is None or group.size == 1:
        return mine
    ranges = list(pl.flat_by_rank)
    pieces = _all_gather_padded(group, mine, [hi - lo for lo, hi in ranges])
    local = torch.empty(pl.local_numel, dtype=mine.dtype, device=mine.device)
    for (lo, hi), piece in zip(ranges, pieces):
        local[lo:hi].copy_(piece)
    return local


def gather_full(pl: layout.Placement, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The dense tensor of `pl` (global shape, the parameter's dtype and device). Collective.

    tensor: gather this tensor instead of `pl.param`, one shaped like it and laid out the same way on every rank (its
    gradient: `gather_full(pl, pl.param.grad)`); every rank of the placement's groups must pass one."""
    local = _local_slice(pl, tensor)
    group = pl.box_group
    if group is None or group.size == 1:
        whole = local.view(pl.stored_shape())
        return whole if pl.stored_perm is None else whole.permute(*layout.inverse_perm(pl.stored_perm))
    sizes = [math.prod(pl.stored_shape(boxes)) for boxes in pl.boxes_by_rank]
    full = torch.empty(pl.shape, dtype=local.dtype, device=local.device)
    for boxes, data in zip(pl.boxes_by_rank, _all_gather_padded(group, local, sizes)):
        for box, view in layout.slice_views(pl, data.view(pl.stored_shape(boxes)), boxes):
            full[layout.box_slices(box)] = view
    return full


@torch.no_grad()
def write_held(pl: layout.Placement, target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the elements `pl` holds out of the dense tensor `full` into `target` (shaped like pl.param)."""
    for box, view in layout.held_views(pl, target.detach()):
        view.copy_(full[layout.box_slices(box)])
