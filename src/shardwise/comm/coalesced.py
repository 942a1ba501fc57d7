"""Collectives over many tensors at once: one flat buffer per dtype and device, in chunks, instead of one call per
tensor (what PyTorch DDP does to broadcast the model at wrap time)."""

from __future__ import annotations

import torch

from .base import Communicator

__all__ = ["broadcast_coalesced"]

MB = 1024 * 1024


def broadcast_coalesced(comm: Communicator, tensors: list[torch.Tensor], src: int = 0, chunk_mb: float = 64) -> None:
    """Broadcast many tensors from `src` with one collective per dtype and ~chunk_mb, instead of one per tensor."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in group + [None]:  # type: ignore[list-item]
            if t is None or (chunk and size + t.numel() * t.element_size() > chunk_mb * MB):
                if chunk:
                    flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                    comm.broadcast(flat, src)
                    offset = 0
                    with torch.no_grad():
                        for c in chunk:
                            c.copy_(flat[offset : offset + c.numel()].view_as(c))
                            offset += c.numel()
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += t.numel() * t.element_size()
