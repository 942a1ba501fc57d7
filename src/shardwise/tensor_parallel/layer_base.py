"""The base of the tensor-parallel layers and what they share: split checks, the dense initialisers they slice.

Every layer can be built from a dense layer (``from_dense``) or directly, drawing the full dense weight from a
seeded generator exactly as the dense layer would, then keeping its slice; see `layers.py` for the overview.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm.base import Communicator

__all__ = ["TensorParallelLayer", "check_split", "seeded_generator", "dense_linear_init", "as_param"]


def check_split(layer: str, what: str, value: int, parts: int, size: int) -> None:
    if value % (parts * size):
        blocks = f" in {parts} fused blocks" if parts > 1 else ""
        raise ValueError(
            f"{layer}: {what}={value}{blocks} cannot be split across tensor-parallel size {size}; "
            f"{what} must be divisible by {parts * size}"
        )


def seeded_generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def dense_linear_init(out_features: int, in_features: int, bias: bool, seed: int | None):
    """The full weight and bias nn.Linear would draw (kaiming-uniform with fan_in = in_features), on the CPU."""
    gen = seeded_generator(seed)
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    # nn.Linear: kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)); bias the same bound.
    w = torch.empty(out_features, in_features).uniform_(-bound, bound, generator=gen)
    b = torch.empty(out_features).uniform_(-bound, bound, generator=gen) if bias else None
    return w, b


class TensorParallelLayer(nn.Module):
    """Base of the tensor-parallel layers: the group, the sequence-parallel settings, gathering full tensors."""

    comm: Communicator
    sequence_parallel: bool
    sequence_dim: int

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter of this layer gathered to its original (dense) shape, by name. Collective."""
        return {name: self.full_tensor(name) for name, _ in self.named_parameters(recurse=False)}

    def full_tensor(self, name: str) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def global_shape(self, name: str) -> tuple[int, ...]:
        """The dense shape of parameter `name` (what a full state dict holds)."""
        raise NotImplementedError  # pragma: no cover - overridden

    def boxes(self, name: str, rank: int) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """The boxes ((start, size) per dim) of the dense tensor that rank `rank`'s `name` covers, in local
        row-major order; None when the parameter is replicated (the layout contract, see shardwise.layout)."""
        raise NotImplementedError  # pragma: no cover - overridden

    def local_layout(self, name: str) -> tuple[int, tuple[int, ...] | None]:
        """(dim along which this rank's boxes are concatenated, permutation its tensor is stored in); see layout.py."""
        return 0, None


def as_param(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=like.requires_grad)
