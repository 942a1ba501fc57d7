"""One flat buffer per dtype and device for many tensors: what the outer all-reduce of local SGD sends, and what a
parameter-server message carries (one message per shard instead of one per tensor)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["group_by_dtype", "pack", "unpack"]


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by (dtype, device), each group in the tensors' order: one collective or message
    per group instead of one per tensor (most models have a single fp32 group)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate `tensors` (same dtype and device, at least one) into one flat tensor (into `out` when given)."""
    if out is None:
        return torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return out


@torch.no_grad()
def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` back into `tensors` (the inverse of `pack`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
