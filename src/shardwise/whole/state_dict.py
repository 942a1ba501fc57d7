"""Full (plain) state dicts of a model wrapped with any strategies: gathered from, and loaded into, the layout.

`full_state_dict(model)` returns exactly the keys and shapes of the plain model's `state_dict()` (tied weights under
each of their names, as PyTorch does): every placement is gathered to its dense tensor (see gather.py); a pipeline
stage's rank then exchanges what it holds with the other stages, so every rank gets the whole model.
`load_full_state_dict(model, sd)` copies into each parameter the boxes its placement holds: no communication. A
state dict therefore moves freely between strategies, world sizes and layouts (DDP, ZeRO, FSDP, TP, pipeline).

torch's own `model.load_state_dict(full)` does the same on a ZeRO / FSDP model (`load_full_into_pieces`, a load
pre-hook the sharding engine installs: each full tensor becomes this rank's piece, answering for the whole, before
torch copies it), so a one-process checkpoint resumes unchanged. `model.state_dict()` there holds the pieces
(ShardedTensors that refuse to be pickled, naming sw.full_state_dict), since gathering would be a collective a
rank-0-only save would leave unmatched.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator
from ..comm.objects import all_gather_json
from ..sharded_tensor import as_sharded, local, spec_of
from .gather import iter_gathered, write_held

__all__ = ["exchange_partitions", "full_state_dict", "load_full_into_pieces", "load_full_state_dict",
           "partition_groups"]


def partition_groups(model: nn.Module) -> list[Communicator]:
    """Every group across which ranks hold different parameters (pipeline stages), each once, innermost first."""
    groups: dict[tuple[int, ...], Communicator] = {}
    for record in layout.strategies(model):
        group = record.partitioned_over
        if group is not None and group.size > 1:
            groups.setdefault(tuple(group.global_ranks), group)
    return list(groups.values())


def exchange_partitions(model: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pipeline stages hold different parameters: broadcast each tensor of `local` (name -> dense tensor) from the
    first rank holding it, so every rank returns every stage's. Collective over the pipeline groups."""
    for group in partition_groups(model):
        held = all_gather_json(group, {k: [list(v.shape), str(v.dtype).removeprefix("torch.")]
                                       for k, v in local.items()})
        merged: dict[str, torch.Tensor] = {}
        for owner, names in enumerate(held):
            for name, (shape, dtype) in names.items():
                if name in merged:
                    continue
                # Through the communicator's device (NCCL broadcasts CUDA tensors); the result is on CPU.
                tensor = (local[name] if group.rank == owner else torch.empty(shape, dtype=getattr(torch, dtype)))
                tensor = tensor.to(group.device)
                group.broadcast(tensor, owner)
                merged[name] = tensor.cpu()
        local = merged
    return local


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The plain `state_dict()` of the unwrapped model: original names, full shapes, master dtype, on CPU.

    Collective over every group of the model's strategies (every rank must call it). With `rank0_only=True`, ranks
    other than the model's first get {}.
    """
    out: dict[str, torch.Tensor] = {}
    pls = list(layout.placements(model).values())
    for pl, full in zip(pls, iter_gathered([(pl, None) for pl in pls])):
        full = full.detach().cpu()
        for name in pl.names:
            out[name] = full.clone()
    for name, b in layout.buffers(model).items():
        out[name] = b.detach().cpu().clone()
    out = exchange_partitions(model, out)
    if rank0_only and any(g.rank != 0 for g in layout.reduction_groups(model)):
        return {}
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a plain (full) state dict into `model` under any strategies. Shapes are checked; errors name the key.

    strict: every parameter and persistent buffer the model holds must be in `state_dict`, and (unless the model is
    a pipeline stage, which holds part of the names) nothing else may be.
    """
    expected: set[str] = set()
    for pl in layout.placements(model).values():
        expected.update(pl.names)
        key = next((n for n in pl.names if n in state_dict), None)
        if key is None:
            continue
        value = state_dict[key]
        if tuple(value.shape) != tuple(pl.shape):
            raise ValueError(f"load_full_state_dict: {key!r} has shape {tuple(value.shape)} in the state dict but "
                             f"{tuple(pl.shape)} in the model")
        write_held(pl, pl.param.detach(), value.to(pl.param.device, pl.param.dtype))
    for name, b in layout.buffers(model).items():
        expected.add(name)
        if name in state_dict:
            with torch.no_grad():
                b.copy_(state_dict[name])
    if strict:
        partitioned = layout.is_partitioned(model)
        missing = sorted(expected - state_dict.keys())
        unexpected = [] if partitioned else sorted(state_dict.keys() - expected)
        if missing or unexpected:
            raise ValueError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")


def load_full_into_pieces(model: nn.Module) -> None:
    """Make torch's `model.load_state_dict(sd)` accept full tensors for the sharded parameters of `model` (see the
    module docstring): a load pre-hook turns each into this rank's piece. No communication."""

    def hook(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
        for pl in layout.placements(model).values():
            spec = spec_of(pl.param)
            if spec is None:
                continue
            for name in pl.names:
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and spec_of(value) is None and tuple(value.shape) == pl.shape:
                    piece = torch.empty_like(local(pl.param))
                    write_held(pl, piece, value.to(piece.device, piece.dtype))
                    state_dict[prefix + name] = as_sharded(piece, spec)

    model.register_load_state_dict_pre_hook(hook)
