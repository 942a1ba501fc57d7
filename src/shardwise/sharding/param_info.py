"""Where one original parameter lives in its sharding unit's flat layout (unit.py), and this rank's piece of it.

Its own module because both halves of a unit use it: unit.py builds the records, unit_grads.py reads them when a
gradient arrives."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["ParamInfo"]


@dataclasses.dataclass
class ParamInfo:
    """Where one original parameter lives in its unit's flat layout, and this rank's piece of it."""

    name: str
    shape: torch.Size
    numel: int
    offset: int  # in the flat (unpadded) layout
    requires_grad: bool
    locations: list[tuple[nn.Module, str]]
    shard_lo: int  # this rank's piece: flat elements [shard_lo, shard_hi) of the parameter's own flattening
    shard_hi: int
    shard_param: nn.Parameter
    unsharded: nn.Parameter
