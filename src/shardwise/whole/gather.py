"""Gather one parameter to its dense tensor from its placement, whatever strategies split it.

Two steps, innermost sharding last undone first: (1) the flat ranges of the ZeRO / FSDP shard group are
all-gathered into this rank's tensor-parallel slice; (2) the slices of the tensor-parallel group are all-gathered
and each rank's boxes are written into the dense tensor. Ranks may hold pieces of different sizes (a parameter
split unevenly by a sharding unit), so each all-gather pads to the largest piece and the placement's per-rank
ranges say which elements are real. Collective over the placement's groups, in placement order on every rank.

Whole-model tools gather many tensors in a row (`full_state_dict`, `full_optimizer_state_dict`): `iter_gathered`
coalesces step (1) of consecutive tensors sharded over the same group into one all-gather of at most
`BATCH_BYTES`, each tensor in its own padded slot, as FSDP's flat parameters and DeepSpeed's partitioned-parameter
coordinator batch their gathers: a collective's fixed cost (latency, the collective check on gloo) is paid once
per batch instead of once per tensor. Measured on the bench GPT (52 parameters, 5.4 M elements, ZeRO-3, 2 gloo
processes, medians of 4 alternating runs against the per-tensor gathers this replaced): full_state_dict 146 ->
52 ms, full_optimizer_state_dict 252 -> 90 ms. Batches of 4-32 MiB measured alike on 2 CPU cores; 64 MiB was slower
(a fresh buffer's pages are faulted in on every call).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from .. import layout
from ..comm.base import Communicator
from ..placement import comm_device
from ..sharded_tensor import local as local_piece

__all__ = ["BATCH_BYTES", "gather_full", "iter_gathered", "write_held"]

#: Bytes of one coalesced all-gather's output at most (it lives on the communicator's device: a GPU under NCCL). A
#: tensor larger than this is gathered alone.
BATCH_BYTES = 8 << 20


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


Item = tuple[layout.Placement, torch.Tensor]  # a placement and this rank's flattened piece of the tensor to gather


def _piece(pl: layout.Placement, tensor: torch.Tensor | None) -> torch.Tensor:
    """This rank's stored piece of `tensor` (default `pl.param`), flattened."""
    return local_piece(pl.param if tensor is None else tensor).detach().reshape(-1)


def _coalesced_slices(batch: Sequence[Item]) -> list[torch.Tensor]:
    """Each item's whole tensor-parallel slice, flattened: the flat ranges of the shard group (the same group and
    dtype for every item of `batch`) all-gathered in ONE collective, item i in a slot as wide as its largest piece."""
    group = batch[0][0].flat_group
    assert group is not None
    widths = [max(hi - lo for lo, hi in pl.flat_by_rank) for pl, _ in batch]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    total = sum(widths)
    first = batch[0][1]
    device = comm_device(group)
    send = torch.zeros(total, dtype=first.dtype, device=device)
    for (_, mine), offset in zip(batch, offsets):
        send[offset : offset + mine.numel()].copy_(mine)
    gathered = torch.empty(total * group.size, dtype=first.dtype, device=device)
    group.all_gather(gathered, send)
    gathered = gathered.to(first.device)
    slices = []
    for (pl, mine), offset in zip(batch, offsets):
        whole = torch.empty(pl.local_numel, dtype=mine.dtype, device=mine.device)
        for r, (lo, hi) in enumerate(pl.flat_by_rank):
            start = r * total + offset
            whole[lo:hi].copy_(gathered[start : start + hi - lo])
        slices.append(whole)
    return slices


def _batches(items: list[Item]) -> Iterator[list[Item]]:
    """Runs of consecutive items that can share one all-gather: the same shard group (of more than one rank), dtype
    and device, at most BATCH_BYTES gathered. Every input of the decision is the same on every rank of the group
    (widths come from every rank's ranges), so every rank cuts the same batches."""
    run: list[Item] = []
    run_bytes = 0
    for pl, mine in items:
        group = pl.flat_group
        grouped = group is not None and group.size > 1
        size = (max(hi - lo for lo, hi in pl.flat_by_rank) * group.size * mine.element_size()) if grouped else 0
        if run and (not grouped or pl.flat_group is not run[0][0].flat_group or mine.dtype != run[0][1].dtype
                    or mine.device != run[0][1].device or run_bytes + size > BATCH_BYTES):
            yield run
            run, run_bytes = [], 0
        run.append((pl, mine))
        run_bytes += size
        if not grouped:
            yield run
            run, run_bytes = [], 0
    if run:
        yield run


def _undo_boxes(pl: layout.Placement, local: torch.Tensor) -> torch.Tensor:
    """Step (2): the dense tensor from this rank's flattened tensor-parallel slice (the box group's all-gather)."""
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


def iter_gathered(items: Sequence[tuple[layout.Placement, torch.Tensor | None]]) -> Iterator[torch.Tensor]:
    """The dense tensor of each (placement, tensor) of `items` in order, as `gather_full` gives it, with the shard
    groups' all-gathers coalesced (module docstring). A generator: a caller that moves each result off the device
    before asking for the next keeps at most one batch gathered there. Collective: every rank of the placements'
    groups passes the same placements in the same order."""
    pieces = [(pl, _piece(pl, tensor)) for pl, tensor in items]
    for batch in _batches(pieces):
        pl, mine = batch[0]
        if pl.flat_group is None or pl.flat_group.size == 1:
            yield _undo_boxes(pl, mine)
            continue
        for (pl, _), local in zip(batch, _coalesced_slices(batch)):
            yield _undo_boxes(pl, local)


def gather_full(pl: layout.Placement, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The dense tensor of `pl` (global shape, the parameter's dtype and device). Collective.

    tensor: gather this tensor instead of `pl.param`, one shaped like it and laid out the same way on every rank (its
    gradient: `gather_full(pl, pl.param.grad)`); every rank of the placement's groups must pass one."""
    return next(iter_gathered([(pl, tensor)]))


@torch.no_grad()
def write_held(pl: layout.Placement, target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the elements `pl` holds out of the dense tensor `full` into `target` (shaped like pl.param)."""
    for box, view in layout.held_views(pl, target.detach()):
        view.copy_(full[layout.box_slices(box)])
