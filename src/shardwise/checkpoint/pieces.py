"""What a rank holds, described strategy-independently: named boxes of global tensors (from shardwise.layout).

A *piece* is one box ((start, size) per dim) of a global tensor and the local tensor holding it. Every strategy
maps onto this through its placements: DDP and plain modules hold the whole box of every parameter; tensor
parallel holds its boxes; ZeRO / FSDP hold the part of each that intersects their flat shard, which
`layout.held_views` cuts into plain boxes. Optimizer state shaped like the parameter (Adam's exp_avg,
exp_avg_sq) follows the parameter's pieces; other state (the step count) is a whole, replicated tensor.

Names: "param/<name>", "buffer/<name>", "optim/<param name>/<state key>", with the original model's names (the
first name of a tied parameter), so they match across strategies and layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .. import layout
from ..whole.optim_state import follows_param, localize_loaded_state, optimizer_names

__all__ = ["Piece", "local_pieces", "dtype_name"]


@dataclasses.dataclass
class Piece:
    name: str
    shape: list[int]  # of the global tensor
    dtype: str
    box: layout.Box
    tensor: torch.Tensor  # local, box-shaped
    follows_param: bool = False

    @property
    def key(self) -> str:
        return f"{self.name}@" + ",".join(f"{s}+{n}" for s, n in self.box)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "shape": self.shape, "dtype": self.dtype, "box": [list(b) for b in self.box],
                "follows_param": self.follows_param, "nbytes": layout.box_numel(self.box) * self.tensor.element_size()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _whole(name: str, value: torch.Tensor) -> Piece:
    return Piece(name, list(value.shape), dtype_name(value.dtype), layout.full_box(value.shape), value.detach())


def local_pieces(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Piece]:
    """Every piece of parameters, persistent buffers and optimizer state this rank holds (empty ones skipped)."""
    pieces: list[Piece] = []
    for pl in layout.placements(model).values():
        for box, data in layout.held_views(pl, pl.param.detach()):
            pieces.append(Piece(f"param/{pl.name}", list(pl.shape), dtype_name(pl.param.dtype), box, data))
    for name, b in layout.buffers(model).items():
        pieces.append(_whole(f"buffer/{name}", b))
    if optimizer is not None:
        localize_loaded_state(model, optimizer)  # full-size state torch's load_state_dict left: this rank's pieces
        owners = optimizer_names(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                pl = owners.get(id(p))
                if pl is None:
                    raise ValueError("the optimizer holds a parameter that is not in the model; build it after wrapping")
                for key, value in optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        continue  # plain numbers are saved in the metadata (see save.py)
                    name = f"optim/{pl.name}/{key}"
                    if follows_param(value, p):
                        pieces += [Piece(name, list(pl.shape), dtype_name(value.dtype), box, data, True)
                                   for box, data in layout.held_views(pl, value.detach())]
                    else:
                        pieces.append(_whole(name, value))
    return pieces
